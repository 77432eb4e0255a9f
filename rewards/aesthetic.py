"""``aesthetic``: the LAION aesthetic predictor ("improved-aesthetic-predictor", C. Schuhmann,
LAION 2022): an MLP over L2-normalised CLIP ViT-L/14 image embeddings, trained on SAC + LAION-Logos +
AVA ratings (1 - 10 scale). This is the DDPO aesthetic reward (Black et al. 2023)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rewards.base import register
from rewards.clip_common import LocalCLIP
from rewards.images import check_images, freeze


class AestheticMLP(nn.Module):
    """The improved-aesthetic-predictor head, layer for layer (so ``sac+logos+ava1-l14-linearMSE.pth``
    loads with its own keys ``layers.{0,2,4,6,7}.{weight,bias}``): Linear(d, 1024) - Dropout(0.2) -
    Linear(1024, 128) - Dropout(0.2) - Linear(128, 64) - Dropout(0.1) - Linear(64, 16) - Linear(16, 1),
    no activations (as released). ``d`` = 768 for ViT-L/14. float ``[B, d]`` -> ``[B, 1]``."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.input_size = input_size
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def load_aesthetic_mlp(path: str) -> AestheticMLP:
    """Read a state dict (``torch.save`` file, e.g. ``sac+logos+ava1-l14-linearMSE.pth``) into an
    ``AestheticMLP`` whose input size is taken from ``layers.0.weight``. ``FileNotFoundError`` for a
    missing file; ``ValueError`` naming the file when the keys or shapes do not match."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"aesthetic: weights file not found: {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if "layers.0.weight" not in state:
        raise ValueError(f"aesthetic: {path} is not an aesthetic-predictor state dict (no 'layers.0.weight'; "
                         f"keys: {sorted(state)[:6]})")
    mlp = AestheticMLP(state["layers.0.weight"].shape[1])
    try:
        mlp.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"aesthetic: {path} does not match the predictor's layers: {e}") from e
    return mlp


@register("aesthetic")
class Aesthetic:
    """score_i = MLP(e_i / |e_i|), e_i the CLIP image embedding of image i: float32 ``[B]``, roughly
    1 - 10 with the released weights (most generated images score 4 - 7). Prompts are ignored.

    Args: ``weights``: the MLP state dict file (``sac+logos+ava1-l14-linearMSE.pth``); ``clip_path``: a
    local ``CLIPModel`` folder of openai/clip-vit-large-patch14 (its ``preprocessor_config.json`` beside
    it, or in ``processor_path``); ``device``; ``dtype`` of the CLIP model. ``ValueError`` when the
    MLP's input size differs from the CLIP projection size, or for a wrong image shape."""

    def __init__(self, weights: str, clip_path: str, processor_path: str | None = None, device: str = "cpu",
                 dtype: str = "float32"):
        self.clip = LocalCLIP(clip_path, processor_path, device, dtype, text=False)
        self.mlp = freeze(load_aesthetic_mlp(weights), self.clip.device)
        dim = self.clip.model.config.projection_dim
        if dim != self.mlp.input_size:
            raise ValueError(f"aesthetic: the MLP in {weights} takes {self.mlp.input_size}-d embeddings but "
                             f"the CLIP in {clip_path} gives {dim}-d ones (ViT-L/14 gives 768)")

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str] | None = None,
                 metadata: dict | None = None) -> torch.Tensor:
        check_images(images, prompts, "aesthetic", need_prompts=False)
        emb = self.clip.image_embeds(images)
        return self.mlp(emb).squeeze(-1).float().cpu()
