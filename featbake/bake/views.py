"""Views: ``--views hflip`` bakes the flipped images' features beside the originals.

Random augmentation makes features non-reusable, but a horizontal flip is one fixed variant: its
features can be baked once like the original's (kohya's latent caches store a flipped copy for
the same reason). Each view is its own recipe (``ImageRecipe.hflip`` is a key field), so it is
one more build with its own root and keys; :class:`featbake.serve.views.ViewsDataset` serves
one view per item.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from featbake.bake.arguments import check_views
from featbake.bake.pipeline import build
from featbake.bake.report import BuildReport
from featbake.encode.hf import recipe_for_encoder
from featbake.image_recipe import View, view_steps
from featbake.recipe import Recipe


def build_views(
    data: str | os.PathLike[str],
    encoder: Any,
    *,
    recipe: Recipe | None = None,
    views: Sequence[View] = (View.ORIGINAL,),
    **options: Any,
) -> list[BuildReport]:
    """One :func:`featbake.bake.pipeline.build` per view, the original first.

    ``options`` are :func:`build`'s keywords. The second build finds every input's digest in
    the hash cache, so it costs the encoding (and the flip) only.

    Raises:
        ConfigError: a view other than the original for inputs that are not images.
        FeatbakeError: as :func:`build`.

    Example:
        >>> build_views("./images", "./dinov2-small", views=parse_views("hflip"))  # doctest: +SKIP
    """
    if tuple(views) == (View.ORIGINAL,):
        return [build(data, encoder, recipe=recipe, **options)]
    resolved = recipe_for_encoder(encoder, recipe or Recipe())
    check_views(views, resolved.source)
    steps = resolved.image_steps
    return [
        build(data, encoder, recipe=resolved.replace(image=view_steps(steps, v)), **options)
        for v in views
    ]
