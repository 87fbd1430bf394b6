"""Test hooks: die like ``kill -9`` at a named step of gc (``FEATBAKE_TEST_CRASH_AT``)."""

from __future__ import annotations

import os
import signal

CRASH_ENV = "FEATBAKE_TEST_CRASH_AT"


#: The steps at which ``FEATBAKE_TEST_CRASH_AT`` kills gc, in the order gc reaches them.
CRASH_POINTS = (
    "drop-root-renamed",
    "drop-root-committed",
    "rows-deleted",
    "shard-rows-deleted",
    "shard-file-unlinked",
    "compact-sealed",
    "compact-committed",
    "compacted-rows-deleted",
    "compacted-file-unlinked",
    "orphan-unlinked",
)


def crash_point(step: str) -> None:
    """Test hook: die here, like ``kill -9``, if ``FEATBAKE_TEST_CRASH_AT`` names this step."""
    if os.environ.get(CRASH_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)
