"""Input bytes kept from hashing for decoding: a first build reads each input once.

A first build hashed every input (for its key) and later decoded it from the file again: two
reads of the data (issue 31 item 3). The bytes read for the digest are kept here, within a
budget, and the decoder takes them (:class:`featbake.bake.decode.HeldSource`) instead of
opening the file again. They are exactly the bytes the key was made from, so no file changed
since can be stored under an old key; inputs past the budget are read twice, as before.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection

from featbake.keys import sha256_file, sha256_hex

#: Bytes of inputs kept between hashing and decoding at most (inputs past it are read again).
HELD_BYTES = 256 << 20


class HeldBytes:
    """path -> the bytes hashed for its key, up to ``budget`` bytes in all (thread-safe).

    Example:
        >>> held = HeldBytes(budget=1 << 20)
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.bin"
        >>> _ = p.write_bytes(b"abc")
        >>> held.digest(str(p))[:8], held.take(str(p)), held.take(str(p))
        ('ba7816bf', b'abc', None)
    """

    def __init__(self, budget: int | None = None) -> None:
        self.budget = HELD_BYTES if budget is None else budget
        self.size = 0
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def digest(self, path: str) -> str:
        """SHA-256 of the file at ``path``, its bytes kept when they fit in the budget.

        Raises:
            OSError: the file cannot be read.
        """
        size = os.stat(path).st_size
        with self._lock:
            fits = self.size + size <= self.budget
            if fits:
                self.size += size  # reserved before reading: threads hash in parallel
        if not fits:
            return sha256_file(path)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            with self._lock:
                self.size -= size
            raise
        with self._lock:
            self.size += len(data) - size  # the file may have grown or shrunk since the stat
            self._data[path] = data
        return sha256_hex(data)

    def take(self, path: str) -> bytes | None:
        """The bytes kept for ``path`` (given once, then dropped), or None."""
        with self._lock:
            data = self._data.pop(path, None)
            if data is not None:
                self.size -= len(data)
            return data

    def keep_only(self, paths: Collection[str]) -> None:
        """Drop what was kept for inputs not in ``paths`` (stored already: never decoded)."""
        with self._lock:
            for path in [p for p in self._data if p not in paths]:
                self.size -= len(self._data.pop(path))

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.size = 0
