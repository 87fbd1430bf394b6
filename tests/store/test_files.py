"""store.files: publish_file replaces a file whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from featbake.store.files import publish_file


def test_publish_file_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    final = tmp_path / "roots" / "r.json"
    publish_file(final, lambda tmp: tmp.write_text("old"), tmp_dir=tmp_path / "tmp")
    assert final.read_text() == "old"

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("ne")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        publish_file(final, half_then_fail, tmp_dir=tmp_path / "tmp")
    assert final.read_text() == "old"  # never half a file
    assert not list((tmp_path / "tmp").iterdir())  # no temporary left behind
