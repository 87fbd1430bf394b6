"""The recipe holds exactly what changes the output, and equal options give equal fingerprints."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from featbake.errors import ConfigError
from featbake.recipe import RECIPE_VERSION, Recipe


def test_defaults_and_as_dict_for_audio() -> None:
    assert Recipe().as_dict() == {
        "version": RECIPE_VERSION,
        "source": "audio",
        "output": None,
        "dtype": "float32",
        "sample_rate": 16000,
        "mono": True,
        "max_seconds": None,
    }


def test_npy_recipe_leaves_audio_options_out() -> None:
    base = Recipe(source="npy")
    assert set(base.as_dict()) == {"version", "source", "output", "dtype"}
    # Audio-only options cannot split the keys of .npy inputs.
    assert base.replace(sample_rate=8000, max_seconds=3).fingerprint() == base.fingerprint()


@pytest.mark.parametrize(
    "change",
    [
        {"sample_rate": 8000},
        {"max_seconds": 2.5},
        {"output": "hidden"},
        {"dtype": "float16"},
        {"dtype": "bfloat16"},
        {"dtype": "int8"},
        {"dtype": "fp8"},
        {"mono": False},
        {"source": "npy"},
    ],
)
def test_each_option_changes_the_fingerprint(change: dict) -> None:
    assert Recipe().replace(**change).fingerprint() != Recipe().fingerprint()


def test_no_runtime_option_is_a_field() -> None:
    names = {f.name for f in dataclasses.fields(Recipe)}
    assert not names & {"batch_size", "workers", "device", "path", "cache", "shard_bytes"}


def test_equal_values_of_different_types_give_one_fingerprint() -> None:
    # The CLI passes --max-seconds as a float; a library caller may pass an int.
    assert Recipe(max_seconds=10).fingerprint() == Recipe(max_seconds=10.0).fingerprint()
    assert Recipe(sample_rate=16000.0).fingerprint() == Recipe(sample_rate=16000).fingerprint()
    assert Recipe(max_seconds=10).max_seconds == 10.0


def test_an_output_index_given_as_a_number_is_the_clis_and_other_types_are_refused() -> None:
    """A store built with ``--output 0`` (a tuple's first output) missed every item for a
    dataset given ``output=0``, saying ``output='0' in the store, 0 asked`` and to run the same
    build again; with ``on_miss="encode"`` the encoder "has no output 0". One recipe now."""
    assert Recipe(output=0).fingerprint() == Recipe(output="0").fingerprint()
    assert Recipe(output=0).output == "0" and Recipe(output=np.int64(1)).output == "1"
    for bad in (1.5, True, -1, ["a"]):
        with pytest.raises(ConfigError, match="output must name one output"):
            Recipe(output=bad)


def test_fingerprint_is_sha256_of_canonical_json() -> None:
    import hashlib

    r = Recipe(max_seconds=1.5, dtype="float16")
    text = json.dumps(r.as_dict(), sort_keys=True, separators=(",", ":"))
    assert r.fingerprint() == hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"dtype": "int4"}, "--dtype float16"),
        ({"source": "video"}, "audio, npy"),
        ({"sample_rate": 0}, "--sample-rate"),
        ({"sample_rate": 16000.5}, "--sample-rate"),
        ({"max_seconds": -1}, "--max-seconds"),
        ({"sample_rate": 1_000_000_000}, "--sample-rate"),  # ~10 GB per decoded clip
        ({"sample_rate": True}, "--sample-rate"),
        ({"max_seconds": float("nan")}, "--max-seconds"),
        ({"max_seconds": float("inf")}, "--max-seconds"),
        ({"max_seconds": 1e-5}, "--max-seconds 1e-05 keeps no sample at 16,000 Hz"),
    ],
)
def test_bad_options_raise_config_error_naming_the_option(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-")):
        Recipe(**kwargs)


def test_a_crop_of_one_sample_is_kept() -> None:
    assert Recipe(max_seconds=1 / 16000).max_seconds == 1 / 16000
    with pytest.raises(ConfigError, match="keeps no sample at 8,000 Hz"):
        Recipe(sample_rate=8000, max_seconds=1 / 16000)  # half a sample: the crop keeps none


def test_torch_dtype() -> None:
    assert Recipe(dtype="bfloat16").torch_dtype is torch.bfloat16
    assert Recipe(dtype="bfloat16").encode_dtype is torch.bfloat16
    assert Recipe(dtype="bfloat16").scheme is None


@pytest.mark.parametrize(("dtype", "packed"), [("int8", torch.int8), ("fp8", torch.uint8)])
def test_quantised_dtypes_encode_in_float32_and_store_packed(
    dtype: str, packed: torch.dtype
) -> None:
    r = Recipe(dtype=dtype)
    assert r.torch_dtype is packed and r.encode_dtype is torch.float32
    assert r.scheme is not None and r.scheme.value == dtype


def test_every_stored_dtype_has_its_own_key() -> None:
    """Keys differ per dtype; the float ones keep the keys they had before int8 and fp8."""
    keys = {
        d: Recipe(dtype=d).fingerprint() for d in ("float32", "float16", "bfloat16", "int8", "fp8")
    }
    assert len(set(keys.values())) == len(keys)
    assert Recipe(dtype="int8").as_dict()["dtype"] == "int8"
    # The float keys as main computed them before int8 and fp8 existed (existing stores).
    assert keys["float32"].startswith("b735bda34f0b0e58")
    assert keys["float16"].startswith("8b6f2722fa0eabfc")
    assert keys["bfloat16"].startswith("19d9f3844886178c")


def test_new_options_leave_default_keys_unchanged() -> None:
    # precision, layers and normalize join the key only when set: a store baked before they
    # existed is still found. The fields of a default recipe are exactly the old ones.
    assert set(Recipe().as_dict()) == {
        "version",
        "source",
        "output",
        "dtype",
        "sample_rate",
        "mono",
        "max_seconds",
    }
    assert Recipe(precision="fp32", layers=None, normalize=False).fingerprint() == (
        Recipe().fingerprint()
    )


@pytest.mark.parametrize(
    "change",
    [{"precision": "bf16"}, {"precision": "fp16"}, {"layers": (6,)}, {"normalize": True}],
)
def test_new_options_change_the_fingerprint_when_set(change: dict) -> None:
    assert Recipe().replace(**change).fingerprint() != Recipe().fingerprint()


def test_layers_are_normalised_and_checked() -> None:
    assert Recipe(layers=(12, 0, 6, 6)).layers == (0, 6, 12)
    assert Recipe(layers=(12, 0, 6)).fingerprint() == Recipe(layers=[0, 6, 12]).fingerprint()
    assert Recipe(layers=(0, 6)).fingerprint() != Recipe(layers=(0, 6, 12)).fingerprint()
    for bad in [(), (-1,), ("6",), (True,)]:
        with pytest.raises(ConfigError, match="layers"):
            Recipe(layers=bad)
    with pytest.raises(ConfigError, match="precision"):
        Recipe(precision="fp8")


@pytest.mark.parametrize(
    "change",
    [
        {"max_seconds": True},
        {"max_seconds": False},
        {"max_seconds": "10"},
        {"max_seconds": float("nan")},
        {"max_seconds": float("-inf")},
        {"max_seconds": -1},
        {"sample_rate": True},
        {"sample_rate": -16000},
        {"mono": 2},
        {"mono": "yes"},
        {"normalize": 1},
    ],
)
def test_bools_strings_and_non_finite_numbers_are_refused(change: dict) -> None:
    """Recipe(max_seconds=True) was accepted as a 1 s crop under a key of its own."""
    with pytest.raises(ConfigError, match="must be"):
        Recipe(**change)


def test_equal_numbers_of_any_type_give_one_key() -> None:
    import numpy as np

    want = Recipe(max_seconds=10.0).fingerprint()
    assert Recipe(max_seconds=10).fingerprint() == want
    assert Recipe(max_seconds=np.float32(10)).fingerprint() == want
