"""s3prl upstreams (SUPERB's models) as featbake import-path encoders, every hidden layer.

``S3PRLUpstream(name)(wavs, wavs_len) -> (all_hs, all_hs_len)`` returns a list of hidden states
(index 0: the input to the first transformer layer, index k: layer k's output) with their
lengths; :class:`S3PRLLayers` turns that into featbake's lengths protocol, storing each layer as
a part (``layer0``..``layerN``), what a SUPERB-style weighted-sum probe reads::

    featbake build --encoder examples.encoders_s3prl:hubert_base --data ./audio --device cuda

``S3PRLUpstream("hubert")`` fetches its checkpoint the first time (s3prl's own cache). Some
upstreams are not exact under padding; featbake's exactness guard re-runs items alone on the
first batches and falls back to exact-shape batching if they differ. featbake's own tests run
these factories against a stand-in with s3prl's documented API (s3prl is not installed there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class S3PRLLayers(nn.Module):
    """An s3prl upstream behind ``forward(wavs, lengths) -> ({"layerK": ...}, out_lengths)``."""

    def __init__(self, upstream: nn.Module, layers: Sequence[int] | None = None) -> None:
        super().__init__()
        self.upstream = upstream
        self.layers = tuple(sorted(set(layers))) if layers is not None else None

    def forward(
        self, wavs: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        all_hs, all_hs_len = self.upstream(wavs, lengths)
        keep = self.layers if self.layers is not None else range(len(all_hs))
        return {f"layer{k}": all_hs[k] for k in keep}, all_hs_len[0]


def hubert_base() -> nn.Module:
    """s3prl's HuBERT-base upstream, all 13 hidden states."""
    from s3prl.nn import S3PRLUpstream

    return S3PRLLayers(S3PRLUpstream("hubert"))


def wavlm_base_plus() -> nn.Module:
    """s3prl's WavLM-base+ upstream, all 13 hidden states."""
    from s3prl.nn import S3PRLUpstream

    return S3PRLLayers(S3PRLUpstream("wavlm_base_plus"))
