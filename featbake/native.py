"""The optional compiled kernels (``featbake/kernels.c``) and the switch that turns them off.

``setup.py`` builds ``featbake.kernels`` where a C compiler is present; without one, or with
``FEATBAKE_NATIVE=0`` in the environment, :func:`kernels` is None and every caller takes its
pure-Python path, which gives the same bytes (the tests run both and compare them). What the
kernels buy, measured on the 2-CPU development machine (loaded, so not final): a ``[200, 768]``
int8 item dequantised to float16 in ~8 us against ~75-90 us for the chunked torch path (fp8:
~20 us against ~270 us), and a batch's preads, checksums, dequantising and padding in one call
that holds the GIL once, where the Python path took it again for every row.

Example:
    >>> with fallback():
    ...     kernels() is None
    True
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType

try:
    import featbake.kernels as _compiled
except ImportError:  # built without a C compiler: the pure-Python paths
    _compiled = None  # type: ignore[assignment]

#: The kernels in use (None: the pure-Python paths), read by every caller at each call.
_state: dict[str, ModuleType | None] = {
    "kernels": None if os.environ.get("FEATBAKE_NATIVE", "1") == "0" else _compiled
}


def kernels() -> ModuleType | None:
    """The compiled kernels, or None where they were not built or are turned off."""
    return _state["kernels"]


def built() -> bool:
    """Whether this install has the compiled kernels (whether or not they are turned off)."""
    return _compiled is not None


@contextlib.contextmanager
def fallback() -> Iterator[None]:
    """Within this block every caller takes the pure-Python path (for tests and benchmarks)."""
    was = _state["kernels"]
    _state["kernels"] = None
    try:
        yield
    finally:
        _state["kernels"] = was
