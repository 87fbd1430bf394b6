"""Flip views: ``--views hflip`` bakes the mirrored images; ViewsDataset serves one per item.

Each view is checked against transformers' processor + model on the image (or its mirror) now.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from featbake.bake.views import build_views
from featbake.encode.images import decode_image
from featbake.errors import ConfigError
from featbake.image_recipe import View, parse_views
from featbake.recipe import Recipe
from featbake.serve.views import ViewsDataset, picks_flipped
from featbake.testing import write_audio_folder, write_image_folder
from tests.conftest import invoke
from tests.helpers import rel_error

transformers = pytest.importorskip("transformers")


def test_the_coin_is_seeded_fair_and_new_each_epoch() -> None:
    flips = [picks_flipped(0, 0, i) for i in range(2000)]
    assert 900 < sum(flips) < 1100
    assert flips == [picks_flipped(0, 0, i) for i in range(2000)]
    assert flips != [picks_flipped(0, 1, i) for i in range(2000)]
    assert flips != [picks_flipped(1, 0, i) for i in range(2000)]


def test_views_parse() -> None:
    assert parse_views(None) == (View.ORIGINAL,)
    assert parse_views("hflip") == (View.ORIGINAL, View.HFLIP)
    assert parse_views("hflip,hflip") == (View.ORIGINAL, View.HFLIP)
    with pytest.raises(ConfigError, match="--views takes hflip"):
        parse_views("vflip")


def _clip_folder(folder: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.CLIPVisionConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
    )
    transformers.CLIPVisionModel(config).eval().save_pretrained(folder)
    proc = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    proc(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def test_flipped_views_are_baked_and_served_as_transformers_computes_them(tmp_path: Path) -> None:
    images = tmp_path / "images"
    write_image_folder(images, 6, size=(37, 53), seed=3)  # odd margins around the crop
    folder = _clip_folder(tmp_path / "clip")
    store = tmp_path / "s"
    res = invoke(
        "build", "-e", folder, "-d", images, "--cache", store, "--views", "hflip", "--json"
    )
    assert res.returncode == 0, res.stderr
    reports = json.loads(res.stdout)
    assert [r["encoded"] for r in reports] == [6, 6] and reports[0]["root"] != reports[1]["root"]
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    proc = transformers.AutoImageProcessor.from_pretrained(str(folder))

    def want(image: Image.Image) -> torch.Tensor:
        with torch.inference_mode():
            return model(**proc(images=image, return_tensors="pt")).pooler_output[0]

    both = ViewsDataset(images, folder, cache=store, views="all", on_miss="error")
    for i in range(len(both)):
        image = decode_image(both.path(i), both.original.recipe.image_steps)
        item = both[i]
        assert rel_error(item["original"]["pooled"], want(image)) < 1e-5
        mirrored = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        assert rel_error(item["hflip"]["pooled"], want(mirrored)) < 1e-5
    coin = ViewsDataset(images, folder, cache=store, seed=4, on_miss="error")
    picks = []
    for epoch in range(4):
        coin.set_epoch(epoch)
        picks.append([coin.view(i) for i in range(len(coin))])
        for i in range(len(coin)):
            assert torch.equal(coin[i]["pooled"], both[i][coin.view(i).value]["pooled"])
    assert {v for epoch in picks for v in epoch} == {View.ORIGINAL, View.HFLIP}
    assert len({tuple(p) for p in picks}) > 1  # new coins each epoch
    plain = ViewsDataset(images, folder, cache=store, views="original", on_miss="error")
    assert all(plain.view(i) is View.ORIGINAL for i in range(len(plain)))


def _flipped(tmp_path: Path) -> tuple[ViewsDataset, ViewsDataset]:
    """Six images under ``images/``, baked with their flipped view by a tiny CLIP (``clip/``)
    into the store ``s/``: a dataset serving both views of each, and one flipping a coin
    (seed 4) per image and epoch."""
    images, folder, store = tmp_path / "images", _clip_folder(tmp_path / "clip"), tmp_path / "s"
    write_image_folder(images, 6, size=(37, 53), seed=3)
    build_views(images, folder, cache=store, views=parse_views("hflip"), workers=0)
    both = ViewsDataset(images, folder, cache=store, views="all", on_miss="error")
    coin = ViewsDataset(images, folder, cache=store, seed=4, on_miss="error")
    return both, coin


def test_persistent_workers_serve_the_views_of_the_epoch_set(tmp_path: Path) -> None:
    """``set_epoch`` reaches DataLoader workers that live across epochs (old main: every epoch
    of a persistent worker served epoch 0's views)."""
    both, coin = _flipped(tmp_path)
    loader = DataLoader(coin, batch_size=3, num_workers=2, persistent_workers=True)
    epochs = range(4)
    views = [[View.HFLIP if picks_flipped(4, e, i) else View.ORIGINAL for i in range(6)]
             for e in epochs]  # fmt: skip
    assert views[0] != views[1] and views[0] != views[2]  # these coins change the views
    for epoch in epochs:
        coin.set_epoch(epoch)
        served = torch.cat([batch["pooled"] for batch in loader])
        for i in range(len(coin)):
            want = both[i][views[epoch][i].value]["pooled"]
            assert torch.equal(served[i], want), (epoch, i)
    assert loader._iterator is not None and loader._iterator._workers[0].is_alive()


def test_views_need_image_inputs(tmp_path: Path, encoder_file: Path) -> None:
    write_audio_folder(tmp_path / "audio", 2, seconds=0.3)
    with pytest.raises(ConfigError, match="applies to image inputs"):
        build_views(tmp_path / "audio", encoder_file, views=parse_views("hflip"))
    with pytest.raises(ConfigError, match="views must be one of"):
        ViewsDataset(tmp_path / "audio", encoder_file, views="sometimes")
    write_image_folder(tmp_path / "images", 2)
    res = invoke("build", "-e", encoder_file, "-d", tmp_path / "audio", "--views", "hflip")
    assert res.returncode == 2 and "applies to image inputs" in res.stderr
    assert Recipe(source="image").image_steps.hflip is False


def test_a_device_cache_serves_each_epochs_views(tmp_path: Path) -> None:
    """``DevicePrefetcher(device_cache=...)`` keyed items by index, so a ViewsDataset's items
    kept the views of the epoch they were first read in; it keys by
    :meth:`ViewsDataset.identity` (the index and the view this epoch) now."""
    from featbake.serve.prefetch import DevicePrefetcher

    both, coin = _flipped(tmp_path)
    loader = DataLoader(coin, batch_size=3, collate_fn=list)
    tier = DevicePrefetcher(loader, device="cpu", device_cache="16MiB")
    for epoch in range(4):
        coin.set_epoch(epoch)
        served = [item for batch in tier for item in batch]
        for i, item in enumerate(served):
            want = both[i][coin.view(i).value]["pooled"]
            assert torch.equal(item["pooled"], want), (epoch, i)
    info = tier.stats().device_cache
    assert info is not None and info.hits > 0
    images, folder, store = tmp_path / "images", tmp_path / "clip", tmp_path / "s"
    checked = ViewsDataset(images, folder, cache=store, seed=4, on_miss="error", revalidate=True)
    with pytest.raises(ConfigError, match="revalidate=True"):  # its tier would keep old images
        DevicePrefetcher(DataLoader(checked, batch_size=3, collate_fn=list), device_cache="1MiB")


def test_views_mixed_with_another_set_draw_new_coins_each_epoch(tmp_path: Path) -> None:
    """A ViewsDataset inside a MixedDataset read by FeatureLoader: the loader tells the mixture
    the epoch, and the mixture (before: nobody) tells the ViewsDataset, whose coins so change
    each epoch. Before, every epoch served epoch 0's views."""
    from featbake import FeatureLoader
    from featbake.serve.mixing import MixedDataset

    both, coin = _flipped(tmp_path)
    mixed = MixedDataset([coin], seed=1)
    loader = FeatureLoader(mixed, batch_size=3, shuffle=False, collate_fn=list, seed=0)
    served_views = set()
    for epoch in range(4):
        items = [item for batch in loader for item in batch]
        for i, item in enumerate(items):
            j = mixed.plan.epoch(epoch)[i][1]
            view = View.HFLIP if picks_flipped(4, epoch, j) else View.ORIGINAL
            served_views.add((j, view))
            assert torch.equal(item["pooled"], both[j][view.value]["pooled"]), (epoch, i)
    assert len(served_views) > len(coin)  # some item served both views over the epochs


def test_a_state_part_way_through_an_epoch_of_views_is_not_resumed_over_other_images(
    tmp_path: Path,
) -> None:
    """A ViewsDataset had no items digest, so a loader's state over it (or over a mixture
    holding one) was resumed part way through an epoch over other images, one read twice and
    one never. It carries its images' digest now: such a state is refused in one line, and
    taken at the epoch's start or over the same images."""
    import json
    import shutil

    from featbake import FeatureLoader

    images = tmp_path / "images"
    write_image_folder(images, 6, size=(37, 53), seed=3)
    folder = _clip_folder(tmp_path / "clip")
    store = tmp_path / "s"

    def loader() -> FeatureLoader:
        build_views(images, folder, cache=store, views=parse_views("hflip"), workers=0)
        coin = ViewsDataset(images, folder, cache=store, seed=4, on_miss="error")
        return FeatureLoader(coin, batch_size=2, collate_fn=list, seed=0)

    first = loader()
    next(iter(first))
    state = json.loads(json.dumps(first.state_dict()))
    loader().load_state_dict(state)  # the same images
    write_image_folder(tmp_path / "more", 1, size=(41, 29), seed=9)
    sorted(images.rglob("*.jpg"))[0].unlink()
    shutil.copyfile(next((tmp_path / "more").rglob("*.jpg")), images / "zz_new.jpg")
    changed = loader()
    with pytest.raises(ConfigError, match="other items than this dataset's") as refused:
        changed.load_state_dict(state)
    assert "\n" not in str(refused.value)
    changed.load_state_dict({**state, "position": 0, "resumed": []})  # the epoch from its start


def test_each_image_is_served_its_own_flipped_view_when_the_views_list_other_items(
    tmp_path: Path,
) -> None:
    """The two views' datasets list their items apart (each its root's manifest, less what
    its build could not decode): an image deleted, then the originals rebuilt alone, left the
    flipped root naming it. Before, items were paired by position, so from the deleted image
    on each was served the mirror of the image before it (3 of 5 wrong); now by id."""
    images, folder, store = tmp_path / "images", _clip_folder(tmp_path / "clip"), tmp_path / "s"
    write_image_folder(images, 6, size=(37, 53), seed=3)
    build_views(images, folder, cache=store, views=parse_views("hflip"), workers=0)
    sorted(images.iterdir())[2].unlink()
    build_views(images, folder, cache=store, views=parse_views(None), workers=0)
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    proc = transformers.AutoImageProcessor.from_pretrained(str(folder))
    both = ViewsDataset(images, folder, cache=store, views="all", on_miss="error")
    assert len(both) == 5 and len(both.flipped) == 6  # the flipped root still names it
    for i in range(len(both)):
        image = decode_image(both.path(i), both.original.recipe.image_steps)
        mirrored = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        with torch.inference_mode():
            want = model(**proc(images=mirrored, return_tensors="pt")).pooler_output[0]
        assert rel_error(both[i]["hflip"]["pooled"], want) < 1e-5, both.path(i)
    coin = ViewsDataset(images, folder, cache=store, seed=4, on_miss="error", ram_cache="1MiB")
    for i in range(len(coin)):
        assert torch.equal(coin[i]["pooled"], both[i][coin.view(i).value]["pooled"])
    # the RAM tier's budget is both views' (it was 1 MiB each)
    assert coin.original._ram_total + coin.flipped._ram_total == 1 << 20
    assert torch.equal(both[-1]["hflip"]["pooled"], both[4]["hflip"]["pooled"])
    with pytest.raises(IndexError):
        both[-6]  # past the first item: not another image's view
    # batch_frames over a mixture holding views: said was "not stored yet", which they were
    from featbake import FeatureLoader, MixedDataset

    with pytest.raises(ConfigError, match=r"or their dataset does not say its lengths"):
        list(FeatureLoader(MixedDataset([coin, coin.original]), batch_frames=100))
