"""store.layout's primitives: names checked before they become paths, and publish_file."""

from __future__ import annotations

from pathlib import Path

import pytest

from featbake.errors import StoreCorrupt
from featbake.store.layout import Layout, checked_root_name, is_shard_name, publish_file


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


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "ab" * 31, "AB" * 32, "ab" * 32 + "/x", "", "g" * 64]
)
def test_only_sixty_four_hex_digits_name_a_shard(name: str, tmp_path: Path) -> None:
    assert not is_shard_name(name)
    with pytest.raises(StoreCorrupt, match="not a shard name"):
        Layout(tmp_path).shard_path(name)
    assert is_shard_name("0f" * 32)


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "..", ""])
def test_a_root_name_is_one_path_component(name: str) -> None:
    with pytest.raises(StoreCorrupt, match="not a root name"):
        checked_root_name(name)
    assert checked_root_name("r-3f1c9a0e12ab") == "r-3f1c9a0e12ab"
