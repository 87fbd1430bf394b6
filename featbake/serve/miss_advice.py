"""What a refused miss tells the user: which option differs from what the store holds (pure).

A ``CacheMiss`` used to say "not in the store for this encoder and recipe" and suggest a build
without ``--dtype`` or ``--cache``: a dataset asking ``dtype="float16"`` of a float32 bake was
left to guess. The store's roots say how each folder was built; comparing their recipes with
the dataset's names the field, and the suggested command carries every option that matters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from featbake.recipe import Recipe

#: Recipe field -> the `featbake build` option that sets it (mono is --mono/--no-mono).
CLI_OPTION = {
    "source": "--source",
    "sample_rate": "--sample-rate",
    "max_seconds": "--max-seconds",
    "output": "--output",
    "dtype": "--dtype",
    "precision": "--precision",
    "layers": "--layers",
}


@dataclass(frozen=True)
class StoredBuild:
    """How the store built a folder: the encoder as named and its recipe (from its root)."""

    encoder_label: str
    recipe: Mapping[str, Any]


def recipe_differences(asked: Mapping[str, Any], stored: Mapping[str, Any]) -> list[str]:
    """``field=stored (asked value)`` for each recipe field that differs, by field name.

    Example:
        >>> recipe_differences({"dtype": "float16"}, {"dtype": "float32"})
        ["dtype='float32' in the store, 'float16' asked"]
    """
    fields = sorted((set(asked) | set(stored)) - {"version"})
    return [
        f"{f}={stored.get(f)!r} in the store, {asked.get(f)!r} asked"
        for f in fields
        if asked.get(f) != stored.get(f)
    ]


def build_options(recipe: Mapping[str, Any]) -> list[str]:
    """The `featbake build` options that reproduce ``recipe`` (defaults left out).

    Example:
        >>> build_options({**Recipe().as_dict(), "dtype": "float16", "mono": False})
        ['--dtype float16', '--no-mono']
    """
    default = Recipe().as_dict()
    out = []
    for field, option in CLI_OPTION.items():
        value = recipe.get(field)
        if value is None or value == default.get(field):
            continue
        shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        out.append(f"{option} {shown}")
    if recipe.get("mono") is False:
        out.append("--no-mono")
    return out


def miss_message(
    path: str,
    store: str,
    encoder: str,
    data: str,
    asked: Mapping[str, Any],
    builds: Sequence[StoredBuild],
) -> str:
    """The CacheMiss text: what is missing, what the store holds instead, and the command."""
    head = f"{path} is not in the store {store} for this encoder and recipe"
    same_encoder = [b for b in builds if b.encoder_label == encoder]
    if same_encoder:
        diffs = recipe_differences(asked, same_encoder[0].recipe)
        if diffs:
            head += f"; the store built {data} with other options: {'; '.join(diffs)}"
    elif builds:
        others = ", ".join(sorted({b.encoder_label for b in builds}))
        head += f"; the store built {data} with another encoder ({others}), not {encoder}"
    command = " ".join(
        ["featbake build --encoder", encoder, "--data", data, "--cache", store,
         *build_options(asked)]
    )  # fmt: skip
    return (
        f"{head}. Run `{command}`, pass the store's options to the dataset, or use on_miss='encode'"
    )


def flat_recipe(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """``recipe`` with its nested steps flattened: ``{"image": {"crop": ...}}`` gives
    ``image.crop``, so a difference names the one step that differs.

    Example:
        >>> flat_recipe({"dtype": "float32", "image": {"crop": [224, 224]}})
        {'dtype': 'float32', 'image.crop': [224, 224]}
    """
    out: dict[str, Any] = {}
    for field, value in recipe.items():
        if isinstance(value, Mapping):
            out.update({f"{field}.{k}": v for k, v in value.items() if k != "version"})
        else:
            out[field] = value
    return out


def copied_not_encoded(asked: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """True when ``asked`` differs from ``stored`` only by naming one ``output`` of a
    whole-output build: its misses are copied from the store, not encoded (serve/derived.py)."""
    differs = {f for f in set(asked) | set(stored) if asked.get(f) != stored.get(f)}
    return differs == {"output"} and stored.get("output") is None


def live_encoding_warning(
    data: str,
    missing: int,
    total: int,
    encoder: str,
    asked: Mapping[str, Any],
    builds: Sequence[StoredBuild],
) -> str | None:
    """The warning for a dataset about to encode ``missing`` items live while the store holds
    the same data from the same encoder under other options (issue 32 item 2: a recipe that
    differed from the build's encoded everything again, in silence); None when there is no
    such build, or when its misses are copied from it instead.

    Example:
        >>> built = StoredBuild("enc", {"dtype": "float32", "image": {"crop": [224, 224]}})
        >>> live_encoding_warning(
        ...     "imgs", 2, 2, "enc", {"dtype": "float32", "image": {"crop": [196, 196]}}, [built]
        ... )  # doctest: +ELLIPSIS
        "featbake: 2 of 2 items of imgs ... other options: image.crop=[224, 224] in the store..."
    """
    same = [b for b in builds if b.encoder_label == encoder and dict(b.recipe) != dict(asked)]
    if not missing or not same or copied_not_encoded(asked, same[0].recipe):
        return None
    diffs = recipe_differences(flat_recipe(asked), flat_recipe(same[0].recipe))
    return (
        f"featbake: {missing} of {total} items of {data} are not in the store for this recipe "
        f"and will be encoded live on first read, although the store built {data} with this "
        f"encoder under other options: {'; '.join(diffs)}. Pass the store's options to the "
        "dataset to read what it holds, or build this recipe once with `featbake build`"
    )
