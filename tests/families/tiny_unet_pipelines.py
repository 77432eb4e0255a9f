"""Tiny randomly initialised ``StableDiffusionPipeline`` / ``StableDiffusionXLPipeline`` folders of the
real classes (no downloads): a 2-level UNet (channels 16 / 32), a 3-level VAE (32 px -> 4 x 8 x 8
latents), CLIP text encoders of hidden size 16 with the tiny CLIP tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.families.tiny_tokenizers import clip_tokenizer

SCALED_LINEAR = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, num_train_timesteps=1000)


def _clip(projection_dim: int | None = None, seed: int = 0):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    cfg = CLIPTextConfig(vocab_size=len(clip_tokenizer()), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1, projection_dim=projection_dim or 16)
    return CLIPTextModelWithProjection(cfg) if projection_dim else CLIPTextModel(cfg)


def _vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(1)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 16),
                         down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                         layers_per_block=1, norm_num_groups=4, sample_size=32, scaling_factor=0.5)


def _unet(cross_attention_dim: int, **xl):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(2)
    return UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32),
                                layers_per_block=1, norm_num_groups=8, attention_head_dim=8,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                                cross_attention_dim=cross_attention_dim, **xl)


def save_sd(path: Path, scheduler) -> Path:
    """A tiny ``StableDiffusionPipeline`` folder with ``scheduler`` (no safety checker)."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(vae=_vae(), text_encoder=_clip(), tokenizer=clip_tokenizer(), unet=_unet(16),
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(path)
    return Path(path)


def save_sdxl(path: Path, scheduler) -> Path:
    """A tiny ``StableDiffusionXLPipeline`` folder (``force_zeros_for_empty_prompt``, text_time added
    conditioning: 6 time ids x 8 + pooled 16 = 64 features) with ``scheduler``."""
    from diffusers import StableDiffusionXLPipeline

    unet = _unet(32, addition_embed_type="text_time", addition_time_embed_dim=8,
                 projection_class_embeddings_input_dim=6 * 8 + 16, use_linear_projection=True)
    pipe = StableDiffusionXLPipeline(vae=_vae(), text_encoder=_clip(seed=3), text_encoder_2=_clip(16, seed=4),
                                     tokenizer=clip_tokenizer(), tokenizer_2=clip_tokenizer(), unet=unet,
                                     scheduler=scheduler, force_zeros_for_empty_prompt=True, add_watermarker=False)
    pipe.save_pretrained(path)
    return Path(path)


def schedulers():
    """name -> scheduler: SD 1.5-style DDIM (epsilon), SDXL's Euler (leading, offset 1), and SD 2.x-style
    v-prediction DDIM with trailing spacing."""
    from diffusers import DDIMScheduler, EulerDiscreteScheduler

    return {
        "ddim_eps": DDIMScheduler(**SCALED_LINEAR, clip_sample=False, set_alpha_to_one=True, steps_offset=1),
        "euler_eps": EulerDiscreteScheduler(**SCALED_LINEAR, timestep_spacing="leading", steps_offset=1),
        "ddim_v": DDIMScheduler(**SCALED_LINEAR, clip_sample=False, set_alpha_to_one=True,
                                timestep_spacing="trailing", prediction_type="v_prediction", steps_offset=1),
    }
