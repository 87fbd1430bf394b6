"""store.layout: names checked before they become paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from featbake.errors import StoreCorrupt
from featbake.store.layout import Layout, checked_root_name, is_shard_name


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
