"""Where a :class:`~featbake.serve.loader.FeatureLoader` stands in its epochs, to resume.

A state is small and plain: the epoch, how many of its batches were handed out, the seed, the
rank and world size, and a fingerprint of the options that shape the order. Every epoch's
batches are a pure function of those (:mod:`featbake.serve.sampling`), so a new loader with
the same arguments recomputes the epoch and skips what was handed out: nothing is read twice
or skipped, and the epochs after it are the uninterrupted loader's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from featbake.errors import ConfigError
from featbake.serve.sampling import Order

#: The keys of a state and their types.
STATE_KEYS = {
    "epoch": int,
    "position": int,
    "seed": int,
    "rank": int,
    "world_size": int,
    "fingerprint": str,
}


@dataclass
class Progress:
    """The epoch being read: its number, batches handed out so far, and how many it has."""

    epoch: int
    done: int
    total: int


@dataclass
class Resume:
    """The loader's resume state, kept on the training thread.

    Attributes:
        pending: (epoch, batches to skip) loaded and not started yet.
        current: the epoch being read (or the last one read).
    """

    pending: tuple[int, int] | None = None
    current: Progress | None = None

    def choose(self, epoch: int) -> None:
        """``set_epoch(epoch)``: a loaded position holds only for its own epoch."""
        if self.pending is not None and self.pending[0] != epoch:
            self.pending = None

    def start(self, epoch: int, total: int) -> int:
        """Epoch ``epoch`` (``total`` batches) starts: how many of its batches to skip."""
        skip = 0
        if self.pending is not None and self.pending[0] == epoch:
            skip = min(self.pending[1], total)
        self.pending = None
        self.current = Progress(epoch, skip, total)
        return skip

    def handed_out(self) -> None:
        """One more batch reached the training loop."""
        assert self.current is not None
        self.current.done += 1

    def where(self, next_epoch: int) -> tuple[int, int]:
        """(epoch, batches of it handed out) to save, ``next_epoch`` being the loader's next."""
        if self.pending is not None:
            return self.pending
        c = self.current
        if c is not None and c.epoch == next_epoch - 1 and c.done < c.total:
            return c.epoch, c.done
        return next_epoch, 0

    def load(self, order: Order, state: Any) -> tuple[Order, int]:
        """Take ``state``: the order with its seed, and the epoch to read next.

        Raises:
            ConfigError: not a state, another world size, or options that shape another order.
        """
        checked = _checked(state)
        if checked["world_size"] != order.world:
            raise ConfigError(
                f"this loader state was saved over {checked['world_size']} ranks and this run "
                f"has {order.world}: resume on {checked['world_size']} ranks (another world "
                "size splits every epoch differently), or start without load_state_dict"
            )
        order = dataclasses.replace(order, seed=checked["seed"])
        if order.fingerprint() != checked["fingerprint"]:
            raise ConfigError(
                "this loader state was saved with options that give another order (batch_size, "
                "batch_frames, shuffle, window, drop_last, even_batches, or a dataset of "
                "another length): make the loader with the arguments of the saved run"
            )
        self.pending = (checked["epoch"], checked["position"])
        self.current = None
        return order, checked["epoch"]


def _checked(state: Any) -> dict[str, Any]:
    """``state`` if it is a loader state (every key, of its type), else a ConfigError."""
    if not isinstance(state, dict):
        raise ConfigError(f"a loader state is a dict from state_dict(), got {type(state).__name__}")
    for key, kind in STATE_KEYS.items():
        value = state.get(key)
        if (
            not isinstance(value, kind)
            or isinstance(value, bool)
            or (isinstance(value, int) and value < 0)
        ):
            raise ConfigError(
                f"not a FeatureLoader state: {key!r} is {value!r}; pass what state_dict() returned"
            )
    return state
