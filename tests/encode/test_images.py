"""Image decoding and the image transform, on image files the tests write (and real photos).

Every transform is checked against transformers' own PIL image processors run now on the same
decoded image: the pixel values must be identical, not close.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps, features

from featbake.bake.pipeline import build
from featbake.encode.images import IMAGE_EXTENSIONS, decode_image, to_mode, transform
from featbake.encode.sources import source_for
from featbake.errors import SourceError
from featbake.image_recipe import ColourMode, ImageRecipe, Interpolation, Resize, ResizeKind, Size
from featbake.recipe import Recipe
from tests.helpers import real_photos

transformers = pytest.importorskip("transformers")


def make_processor(kind: str, **kw: Any) -> Any:
    """transformers' PIL-backend processor (``...Pil`` in transformers 5, the class before)."""
    cls = getattr(transformers, f"{kind}ImageProcessorPil", None)
    return (cls or getattr(transformers, f"{kind}ImageProcessor"))(**kw)


def noise(height: int, width: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


PROCESSORS = {
    "vit": ("ViT", {"size": {"height": 32, "width": 48}}),
    "clip": ("CLIP", {"size": {"shortest_edge": 40}, "crop_size": {"height": 32, "width": 32}}),
    "bit-bilinear": (
        "Bit",
        {
            "size": {"shortest_edge": 36},
            "crop_size": {"height": 32, "width": 28},
            "resample": 2,
            "image_mean": [0.485, 0.456, 0.406],
            "image_std": [0.229, 0.224, 0.225],
        },
    ),
    "clip-crop-larger": (  # a crop larger than the resized image: zero padding
        "CLIP",
        {"size": {"shortest_edge": 24}, "crop_size": {"height": 32, "width": 32}},
    ),
    "vit-lanczos-no-normalise": (
        "ViT",
        {"size": {"height": 20, "width": 20}, "resample": 1, "do_normalize": False},
    ),
}


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_transform_equals_transformers_processor(name: str, tmp_path: Path) -> None:
    kind, kw = PROCESSORS[name]
    proc = make_processor(kind, **kw)
    proc.save_pretrained(tmp_path)
    steps = ImageRecipe.from_processor(proc.to_dict())
    images = [noise(h, w, seed) for seed, (h, w) in enumerate([(50, 70), (71, 33), (16, 17)])]
    images += [decode_image(p, steps) for p in real_photos()]
    for image in images:
        want = proc(images=image, return_tensors="pt")["pixel_values"][0]
        got = transform(image, steps)
        assert got.dtype == torch.float32 and torch.equal(got, want), (name, image.size)


def test_flipped_view_is_the_transform_of_the_mirrored_image() -> None:
    kind, kw = PROCESSORS["clip"]
    proc = make_processor(kind, **kw)
    steps = ImageRecipe.from_processor(proc.to_dict())
    image = noise(45, 67)  # odd margins: a flip after the crop would be off by a pixel
    mirrored = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    want = proc(images=mirrored, return_tensors="pt")["pixel_values"][0]
    assert torch.equal(transform(image, steps, hflip=True), want)


def test_no_antialias_resamples_as_torch_interpolate_does() -> None:
    image = noise(64, 96)
    steps = ImageRecipe(
        resize=Resize.exact(24, 40), interpolation=Interpolation.BICUBIC, antialias=False
    ).replace(crop=None, rescale=None, mean=None, std=None)
    x = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float()
    want = torch.nn.functional.interpolate(
        x, size=(24, 40), mode="bicubic", align_corners=False, antialias=False
    )
    want = want.round().clamp(0, 255)[0]
    assert torch.equal(transform(image, steps), want)
    assert not torch.equal(transform(image, steps.replace(antialias=True)), want)


# -- decoding ----------------------------------------------------------------------------------
def plain(**changes: Any) -> ImageRecipe:
    """No resize, crop or normalisation: the transform returns the decoded pixels (0..255)."""
    steps = ImageRecipe(resize=Resize(ResizeKind.NONE, 0, 0), crop=None, rescale=None)
    return steps.replace(mean=None, std=None, **changes)


def pixels(path: Path, **changes: Any) -> np.ndarray:
    """The decoded image as ``[H, W, C]`` values through the image source."""
    x = source_for(Recipe(source="image", image=plain(**changes))).load(path)
    return x.permute(1, 2, 0).numpy()


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    stored = np.zeros((20, 40, 3), np.uint8)
    stored[:, :20] = (255, 0, 0)  # left half red, right half blue, as the sensor stored it
    stored[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display"
    Image.fromarray(stored).save(tmp_path / "phone.jpg", exif=exif, quality=95)
    shown = pixels(tmp_path / "phone.jpg")
    assert shown.shape == (40, 20, 3)  # portrait once oriented
    assert shown[2, 10, 0] > 200 and shown[2, 10, 2] < 60  # red on top
    assert shown[-3, 10, 2] > 200 and shown[-3, 10, 0] < 60  # blue below
    assert pixels(tmp_path / "phone.jpg", exif=False).shape == (20, 40, 3)


def retyped_tag(jpeg: bytes, tag: int, to: int) -> bytes:
    """``jpeg`` with its EXIF entry for ``tag`` renumbered ``to`` (its type and value kept):
    a camera writing a tag with the wrong type."""
    data = bytearray(jpeg)
    tiff = data.find(b"Exif\x00\x00") + 6
    order = "little" if data[tiff : tiff + 2] == b"II" else "big"
    at = data.find(tag.to_bytes(2, order), tiff)
    data[at : at + 2] = to.to_bytes(2, order)
    return bytes(data)


def test_a_malformed_exif_tag_elsewhere_keeps_the_orientation(tmp_path: Path) -> None:
    """An ImageWidth tag holding text: Pillow's ``exif_transpose`` failed rewriting the EXIF
    block (``struct.error``: a dataset raised it bare, a build skipped the file for "required
    argument is not an integer"). The pixels are oriented as the sound file's are."""
    exif = Image.Exif()
    exif[0x0112], exif[0x010F] = 6, "Cam"  # orientation; Make, a text tag
    buf = io.BytesIO()
    noise(20, 24).save(buf, "JPEG", exif=exif.tobytes(), quality=95)
    (tmp_path / "sound.jpg").write_bytes(buf.getvalue())
    (tmp_path / "bad.jpg").write_bytes(retyped_tag(buf.getvalue(), 0x010F, 0x0100))
    assert Image.open(tmp_path / "bad.jpg").getexif()[0x0100] == "Cam"
    with Image.open(tmp_path / "sound.jpg") as sound:
        want = np.asarray(ImageOps.exif_transpose(sound).convert("RGB"))
    assert want.shape == (24, 20, 3)
    assert np.array_equal(pixels(tmp_path / "sound.jpg"), want)
    assert np.array_equal(pixels(tmp_path / "bad.jpg"), want)


def test_a_strip_whose_resize_is_a_bomb_is_refused(tmp_path: Path) -> None:
    """A 1 x 20,000 PNG (tens of KB) resized to a shortest edge of 256 is 256 x 5,120,000 before
    its crop: 13 GB of memory for one file. Refused in one line, before the resize."""
    noise(20_000, 1).save(tmp_path / "strip.png")
    source = source_for(Recipe(source="image"))
    with pytest.raises(SourceError, match=r"to 256x5120000 makes more than 89,478,485 pixels"):
        source.load(tmp_path / "strip.png")
    noise(2_000, 20).save(tmp_path / "wide.png")  # 256 x 25,600: resized as before
    assert source.load(tmp_path / "wide.png").shape == (3, 224, 224)


def test_colour_modes_are_converted(tmp_path: Path) -> None:
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg", quality=95)
    assert np.allclose(pixels(tmp_path / "cmyk.jpg")[4, 4], (255, 0, 0), atol=6)
    noise(9, 7, mode="L").save(tmp_path / "grey.png")
    grey = pixels(tmp_path / "grey.png")
    assert grey.shape == (9, 7, 3) and (grey[..., 0] == grey[..., 2]).all()
    assert np.array_equal(grey[..., 0], np.asarray(Image.open(tmp_path / "grey.png")))
    assert pixels(tmp_path / "grey.png", mode=ColourMode.GREY).shape == (9, 7, 1)
    Image.new("RGBA", (4, 4), (10, 20, 30, 0)).save(tmp_path / "clear.png")
    assert (pixels(tmp_path / "clear.png") == 255).all()  # transparency onto white
    palette = Image.new("P", (4, 4), 0)
    palette.putpalette([0, 0, 0] * 256)
    palette.save(tmp_path / "pal.png", transparency=0)
    assert (pixels(tmp_path / "pal.png") == 255).all()


def test_sixteen_bit_png_is_scaled_not_clipped(tmp_path: Path) -> None:
    wide = np.array([[0, 257 * 100, 65535, 300, 385]], np.uint16)
    Image.fromarray(wide).save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode.startswith("I")
    assert pixels(tmp_path / "deep.png")[0, :, 0].tolist() == [0, 100, 255, 1, 1]
    assert to_mode(Image.fromarray(wide), ColourMode.GREY).getpixel((3, 0)) == 1


def test_a_sixteen_bit_transparency_key_is_composited_onto_white(tmp_path: Path) -> None:
    """A 16-bit greyscale PNG's key (a 16-bit value) was dropped in the scaling to 8 bits and
    its pixels kept their grey, where an 8-bit file's keyed pixels are white. Only the exact
    16-bit value is keyed (its 8-bit neighbours are not)."""
    wide = np.array([[1000, 1001, 257 * 100, 1000]], np.uint16)
    Image.fromarray(wide).save(tmp_path / "key16.png", transparency=1000)
    assert Image.open(tmp_path / "key16.png").info["transparency"] == 1000
    assert pixels(tmp_path / "key16.png")[0, :, 0].tolist() == [255, 4, 100, 255]
    eight = np.array([[4, 5, 100, 4]], np.uint8)
    Image.fromarray(eight).save(tmp_path / "key8.png", transparency=4)
    assert pixels(tmp_path / "key8.png")[0, :, 0].tolist() == [255, 5, 100, 255]
    # A processor that does not composite, in greyscale: the key ignored, as an 8-bit file's.
    kept = dict(mode=ColourMode.GREY, composite=False)
    assert pixels(tmp_path / "key16.png", **kept)[0, :, 0].tolist() == [4, 4, 100, 4]
    assert pixels(tmp_path / "key8.png", **kept)[0, :, 0].tolist() == [4, 5, 100, 4]


@pytest.mark.parametrize("ext", [".png", ".webp", ".bmp", ".tiff"])
def test_lossless_formats_decode_to_their_pixels(ext: str, tmp_path: Path) -> None:
    if ext == ".webp" and not features.check("webp"):
        pytest.skip("this Pillow has no WebP")
    image = noise(13, 11)
    image.save(tmp_path / f"a{ext}", **({"lossless": True} if ext == ".webp" else {}))
    assert np.array_equal(pixels(tmp_path / f"a{ext}"), np.asarray(image))
    assert ext in IMAGE_EXTENSIONS


def write_bad_files(folder: Path) -> None:
    buf = io.BytesIO()
    noise(64, 64).save(buf, format="JPEG")
    (folder / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    (folder / "notes.jpg").write_text("not a picture\n")


def test_bad_files_raise_source_errors_with_the_reason(tmp_path: Path) -> None:
    write_bad_files(tmp_path)
    with pytest.raises(SourceError, match="truncated"):
        decode_image(tmp_path / "truncated.jpg", plain())
    with pytest.raises(SourceError, match="not an image"):
        decode_image(tmp_path / "notes.jpg", plain())
    with pytest.raises(SourceError, match="not found"):
        decode_image(tmp_path / "missing.png", plain())


def test_a_build_skips_bad_images_and_stores_the_rest(tmp_path: Path) -> None:
    data = tmp_path / "images"
    data.mkdir()
    noise(40, 50).save(data / "a.png")
    noise(50, 40, seed=1).convert("RGB").save(data / "b.jpg")
    write_bad_files(data)
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 8, 8), torch.nn.Flatten())
    steps = ImageRecipe(resize=Resize(ResizeKind.SHORTEST_EDGE, 36), crop=Size(32, 32))
    report = build(
        data,
        encoder,
        cache=tmp_path / "store",
        recipe=Recipe(source="image", image=steps),
        workers=0,
    )
    assert report.encoded == 2
    # image words, not audio's (issue 32 item 11: "the encoder takes no lengths")
    assert "images batched by shape" in report.batching_note, report.batching_note
    reasons = dict(report.failed)
    assert set(reasons) == {"notes.jpg", "truncated.jpg"}
    assert "not an image" in reasons["notes.jpg"] and "truncated" in reasons["truncated.jpg"]


def test_an_integer_tiff_of_unknown_range_is_refused_and_a_16_bit_one_scaled(
    tmp_path: Path,
) -> None:
    """Pillow opens an int32 (or uint32, or signed int16) TIFF as mode ``I``, as it opens a
    16-bit PNG on older Pillows: it was scaled as 16 bits (by 1/257), so pixels 0..255 became
    0..1 and the image was served nearly black. Its range is unknown: refused in one line, as
    a floating-point image is; an unsigned 16-bit TIFF is scaled as before."""
    values = np.arange(64, dtype=np.int64).reshape(8, 8) * 4
    Image.fromarray(values.astype(np.int32)).save(tmp_path / "wide.tif")
    assert Image.open(tmp_path / "wide.tif").mode == "I"
    with pytest.raises(SourceError, match="32-bit integer image has no known range"):
        decode_image(tmp_path / "wide.tif", plain())
    Image.fromarray((values * 257).astype(np.uint16)).save(tmp_path / "deep.tif")
    assert pixels(tmp_path / "deep.tif")[..., 0].tolist() == values.tolist()


@pytest.mark.parametrize("kind", ["ViT", "CLIP"])
@pytest.mark.parametrize("mode", ["YCbCr", "LAB"])
def test_a_ycbcr_or_lab_tiff_is_read_as_the_processor_reads_it(
    tmp_path: Path, kind: str, mode: str
) -> None:
    """ViT's processor does not convert to RGB: it reads a YCbCr or LAB TIFF's three bands
    as if they were RGB (``np.array``); CLIP's converts. featbake converted for both (ViT's
    pixels 1.1 off). The reference is the file opened by Pillow, as a user hands it over."""
    kw = {"size": {"height": 32, "width": 32}} if kind == "ViT" else {}
    proc = make_processor(kind, **kw)
    steps = ImageRecipe.from_processor(proc.to_dict())
    path = tmp_path / f"odd.{mode}.tiff"
    noise(40, 56, seed=2).convert(mode).save(path)
    with Image.open(path) as opened:
        want = proc(images=opened, return_tensors="pt")["pixel_values"][0]
    assert torch.equal(transform(decode_image(path, steps), steps), want)
