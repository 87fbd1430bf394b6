"""ViewsDataset: serve one baked view of each image (original or flipped), chosen at random.

``featbake build --views hflip`` stores the flipped images' features beside the originals
(:mod:`featbake.bake.views`); this dataset pairs the two stores' items and serves, per item and
epoch, one of them, so a probe trained on cached features keeps the most common augmentation.
The choice is a pure function of ``(seed, epoch, index)``: the same in every DataLoader worker,
reproducible from the seed, and different each epoch once :meth:`ViewsDataset.set_epoch` is
called (as with ``DistributedSampler``). The epoch lives in a shared-memory tensor, so persistent
DataLoader workers (``persistent_workers=True``), which hold their own copy of the dataset from
the first epoch on, read the epoch the main process set.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from featbake.errors import ConfigError
from featbake.image_recipe import View, view_steps
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.units import parse_bytes

#: ``views=`` choices: one view at random per item, the original only, or both as a dict.
VIEW_MODES = ("random", "original", "all")


def picks_flipped(seed: int, epoch: int, index: int) -> bool:
    """Whether item ``index`` serves its flipped view in ``epoch`` (a fair, seeded coin).

    Example:
        >>> picks_flipped(0, 0, 7) == picks_flipped(0, 0, 7)
        True
    """
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=1).digest()
    return bool(digest[0] & 1)


def flipped_positions(original: Sequence[str], flipped: Sequence[str]) -> list[int]:
    """Where each of the original view's items (by id, in its order) is among the flipped
    view's: the two views' datasets list their items apart (each its own root's manifest, less
    what its own build could not decode), so position ``i`` of one need not be item ``i`` of
    the other.

    Raises:
        ConfigError: an item of the original view is no item of the flipped view.

    Example:
        >>> flipped_positions(["a.jpg", "c.jpg"], ["a.jpg", "b.jpg", "c.jpg"])
        [0, 2]
    """
    at = {name: j for j, name in enumerate(flipped)}
    missing = [name for name in original if name not in at]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(
            f"{missing[0]!r}{more} is an item of the original view but not of the flipped one "
            "(its build could not decode it, or left it out); rebuild both views with "
            "`featbake build --views hflip`"
        )
    return [at[name] for name in original]


class ViewsDataset(Dataset):
    """Items of a build with ``--views hflip``: the original's or the flipped image's features.

    Args:
        data, encoder: as :class:`CachedFeatureDataset`.
        views: ``"random"`` (one view per item, a seeded coin per item and epoch),
            ``"original"`` or ``"all"`` (``{"original": ..., "hflip": ...}`` per item).
        seed: the coin's seed.
        recipe: the original's recipe (an image recipe, or a vision folder's by default).
        **options: any other :class:`CachedFeatureDataset` keyword, for both views
            (``ram_cache`` is the budget of both: each view's dataset takes half of it).

    Raises:
        ConfigError: an unknown ``views``, or a recipe that is not an image recipe.

    Example:
        >>> ds = ViewsDataset("./images", "./dinov2-small", seed=0)  # doctest: +SKIP
        >>> ds.set_epoch(1)  # doctest: +SKIP
        >>> x = ds[0]  # doctest: +SKIP
    """

    def __init__(
        self,
        data: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        encoder: Any,
        *,
        views: str = "random",
        seed: int = 0,
        recipe: Recipe | None = None,
        **options: Any,
    ) -> None:
        if views not in VIEW_MODES:
            raise ConfigError(f"views must be one of {', '.join(VIEW_MODES)}, got {views!r}")
        self.views = views
        self.seed = seed
        # Shared memory, not an int: a persistent worker's copy of the dataset sees set_epoch.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        if views != "original" and options.get("ram_cache"):  # the budget of both views
            options["ram_cache"] = parse_bytes(options["ram_cache"]) // 2
        self.original = CachedFeatureDataset(data, encoder, recipe=recipe, **options)
        if self.original.recipe.source != "image":
            raise ConfigError(
                "ViewsDataset serves image views; the recipe's source is "
                f"{self.original.recipe.source} (use a vision folder or Recipe(source='image'))"
            )
        steps = view_steps(self.original.recipe.image_steps, View.HFLIP)
        flipped = self.original.recipe.replace(image=steps)
        self.flipped = CachedFeatureDataset(data, encoder, recipe=flipped, **options)
        # None: the two list the same items in the same order (one digest each, no id read).
        self._flipped_at: list[int] | None = None
        if self.flipped.items_digest() != self.original.items_digest():
            self._flipped_at = flipped_positions(
                [self.original.item_id(i) for i in range(len(self.original))],
                [self.flipped.item_id(j) for j in range(len(self.flipped))],
            )

    @property
    def epoch(self) -> int:
        """The epoch whose coins are drawn (the same in the main process and every worker)."""
        return int(self._epoch)

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Draw new coins: call at the start of each epoch (in the main process, before the
        epoch's ``iter(loader)``); workers started before, persistent ones included, follow."""
        self._epoch.fill_(int(epoch))

    def __len__(self) -> int:
        return len(self.original)

    def path(self, i: int) -> str:
        """The absolute path of item ``i``'s image."""
        return self.original.path(i)

    def view(self, i: int) -> View:
        """The view item ``i`` serves this epoch (with ``views="random"``)."""
        if self.views == "original" or not picks_flipped(self.seed, self.epoch, i):
            return View.ORIGINAL
        return View.HFLIP

    @property
    def revalidate(self) -> bool:
        """Whether each read checks the item's file (``revalidate=True``, both views)."""
        return self.original.revalidate

    def identity(self, i: int) -> tuple[int, str]:
        """What item ``i`` serves this epoch, equal in every epoch that serves the same view
        (a cache of items by index keys by it: ``DevicePrefetcher(device_cache=...)``)."""
        return i, "all" if self.views == "all" else self.view(i).value

    def items_digest(self) -> str:
        """A digest of the items its positions name: the images (its original dataset's
        :meth:`~CachedFeatureDataset.items_digest`), the views and the seed; a loader's state
        carries it, so a state part way through an epoch is not resumed over other images
        (see :func:`featbake.serve.loader.items_of`)."""
        text = f"views\0{self.views}\0{self.seed}\0{self.original.items_digest()}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _flipped(self, i: int) -> Any:
        """Item ``i``'s flipped view: the flipped dataset's item of the same id."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} items")
        i %= len(self)
        return self.flipped[i if self._flipped_at is None else self._flipped_at[i]]

    def __getitem__(self, i: int) -> Any:
        if self.views == "all":
            return {View.ORIGINAL.value: self.original[i], View.HFLIP.value: self._flipped(i)}
        return self._flipped(i) if self.view(i) is View.HFLIP else self.original[i]
