"""What a build's driver and its engines' workers agree on, without torch: the engine protocol's
number (:func:`check_protocol`) and a worker's error carried back (:class:`CarriedError`).

bake/pipeline.py (the engines' driver and workers) imports these from here, as does a Ray hashing
task (bake/ray_hashing.py), whose worker process imports no torch: this module must not either
(tests/bake/test_ray_tasks.py checks it in a fresh process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from featbake.errors import ConfigError, FeatbakeError

#: What a build's driver and its engine's workers exchange (bake/pipeline.py's
#: :class:`EngineJob`, :class:`WorkItem`, :class:`PartResult`'s JSON; the Ray hashing tasks'
#: arguments and results), numbered: one more each time it changes. A Ray cluster's nodes each
#: run the featbake installed there, so a node not yet upgraded meets a driver that was; each
#: side checks the number it is sent (:func:`check_protocol`) and says so in one line rather
#: than misreading the other. 1: what featbake sent before the number was (nothing: read as 1).
#: 3: the hashing tasks' function and their results' classes are pickled from
#: bake/ray_hashing.py and this module (bake/ray_engine.py and bake/pipeline.py in 2). 4: a
#: result names the keys its worker stored padded and whether a padding check failed there, and
#: a job may ask its items encoded again alone (``redo``).
ENGINE_PROTOCOL = 4


def check_protocol(theirs: object, who: str) -> None:
    """Refuse what ``who`` (the build's driver, a worker) sent under another engine protocol.

    Raises:
        ConfigError: ``theirs`` is not :data:`ENGINE_PROTOCOL`.
    """
    if theirs != ENGINE_PROTOCOL:
        raise ConfigError(
            f"{who} runs another featbake than this node (engine protocol {theirs}, this "
            f"node's {ENGINE_PROTOCOL}): install the same featbake on every node of the "
            "cluster, then run the build again"
        )


@dataclass(frozen=True)
class CarriedError:
    """A :class:`FeatbakeError` a worker raised, carried back to the driver (an engine's own
    wrapping of a worker's exception may keep only its traceback's text): its class's name
    and its one line, raised again there as its own class (:meth:`raise_again`)."""

    kind: str
    message: str

    @classmethod
    def of(cls, e: FeatbakeError) -> CarriedError:
        return cls(type(e).__name__, str(e))

    def raise_again(self) -> NoReturn:
        """Raise the error as its own class (FeatbakeError if none is called ``kind``)."""
        raise error_class(self.kind)(self.message)


def error_class(name: str) -> type[FeatbakeError]:
    """The :class:`FeatbakeError` subclass called ``name`` (FeatbakeError itself if none is)."""
    stack: list[type[FeatbakeError]] = [FeatbakeError]
    while stack:
        kind = stack.pop()
        if kind.__name__ == name:
            return kind
        stack += kind.__subclasses__()
    return FeatbakeError
