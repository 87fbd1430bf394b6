"""torchaudio's wav2vec2 / HuBERT / WavLM models as featbake import-path encoders.

torchaudio's ``Wav2Vec2Model.forward(waveforms, lengths) -> (features, out_lengths)`` *is*
featbake's lengths protocol, so these models batch padded and length-sorted as they are::

    # weights: convert a pretrained bundle once (needs the network that one time)
    python -c "import torchaudio; from safetensors.torch import save_file; \\
      save_file(torchaudio.pipelines.WAV2VEC2_BASE.get_model().state_dict(), 'w2v2.safetensors')"
    featbake build --encoder examples.encoders_torchaudio:wav2vec2_base \\
      --weights w2v2.safetensors --data ./audio --precision bf16 --device cuda

    # layers 3, 6 and 9 as parts layer3/layer6/layer9; the model stops after layer 9
    python -c "import torchaudio; from safetensors.torch import save_file; \\
      m = torchaudio.pipelines.WAV2VEC2_BASE.get_model(); \\
      save_file({f'model.{k}': v for k, v in m.state_dict().items()}, 'w2v2-layers.safetensors')"
    featbake build --encoder examples.encoders_torchaudio:wav2vec2_base_layers_3_6_9 \\
      --weights w2v2-layers.safetensors --data ./audio

Run from the repository root (or put this folder on PYTHONPATH). The factories build the
architecture from torchaudio's config functions; nothing is downloaded at build time. featbake's
own tests run these factories against a stand-in module with torchaudio's documented API
(torchaudio is not installed there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def wav2vec2_base() -> nn.Module:
    """torchaudio's wav2vec2-base architecture: 12 layers, 768 wide (weights from --weights)."""
    import torchaudio

    return torchaudio.models.wav2vec2_base()


def wavlm_base() -> nn.Module:
    """torchaudio's WavLM-base architecture (WAVLM_BASE_PLUS shares it)."""
    import torchaudio

    return torchaudio.models.wavlm_base()


class TorchaudioLayers(nn.Module):
    """Transformer layers of a torchaudio ``Wav2Vec2Model`` as parts ``layer1``..``layerK``.

    ``extract_features(..., num_layers=K)`` stops the encoder after layer K, and its list holds
    the output of layer ``i + 1`` at index ``i``, so ``layerK`` is layer K's output (the same
    numbering as Hugging Face's ``hidden_states[K]``).
    """

    def __init__(self, model: nn.Module, layers: Sequence[int]) -> None:
        super().__init__()
        if not layers or min(layers) < 1:
            raise ValueError(f"torchaudio layers count from 1, got {list(layers)}")
        self.model = model
        self.layers = tuple(sorted(set(layers)))

    def forward(
        self, waveforms: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        feats, out_lengths = self.model.extract_features(
            waveforms, lengths, num_layers=max(self.layers)
        )
        return {f"layer{k}": feats[k - 1] for k in self.layers}, out_lengths


def wav2vec2_base_layers_3_6_9() -> nn.Module:
    """Layers 3, 6 and 9 of wav2vec2-base, stored as three parts of one feature."""
    return TorchaudioLayers(wav2vec2_base(), (3, 6, 9))
