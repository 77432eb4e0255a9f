"""Qwen-Image-Edit pipeline folders (diffusers ``QwenImageEditPipeline``; Qwen team 2025, arXiv 2508.02324,
Sec. 5 "image editing"): the Qwen-Image transformer, VAE and scheduler, with the edit's source image read
twice, as the pipeline reads it:

- by the text encoder: Qwen2.5-VL sees the source (through the folder's ``Qwen2VLProcessor``) inside the
  edit template with the instruction, so a prompt's states depend on its image; the negative prompt is
  encoded with the same image, so each row carries its own unconditional embedding
  (``PromptEmbeds.negative``). :class:`QwenImageEditPromptEncoder` ``encode_with_images``;
- by the transformer: the source's VAE latents, packed as the noisy latents are, follow them in the
  image sequence with their own ``img_shapes`` entry; the velocity is read from the first tokens
  (:class:`pretrain.models.qwenimage.pipeline.QwenImageAdapter` with ``takes_images``).

The pipeline resizes every source to about 1024 x 1024 pixels at its aspect ratio (``calculate_dimensions``,
multiples of 32) before both reads, whatever the output size: so does :func:`condition_image`, at
``model.options.condition_area`` (default the pipeline's 1024 * 1024; a smaller area trains faster on
small images, and equals the pipeline only at the default). Sources
arrive as float ``[B, 3, H, W]`` in [0, 1] and are rounded to 8-bit images first (the pipeline takes PIL
images). A prompt has no states without its image: ``encode`` (what datasets and the empty prompt call)
gives a one-token zero placeholder, every conditioned row is encoded with its image when its set hands it
out (:meth:`pretrain.data.dataset.EncodedSet.prompt_rows`), and the adapter refuses prompts without a
source image.
"""

from __future__ import annotations

import torch

from pretrain.models.qwenimage.pipeline import QwenImageCodec, QwenImagePromptEncoder
from pretrain.text_encoder import PromptEmbeds

PIPELINE = "QwenImageEditPipeline"
#: The area the pipeline resizes every source image to (pixels), at the source's aspect ratio.
CONDITION_AREA = 1024 * 1024


def condition_image(processor, image: torch.Tensor, area: int = CONDITION_AREA):
    """One source image float ``[3, H, W]`` in [0, 1] as the PIL image the pipeline reads: rounded to 8
    bits, resized by the pipeline's ``VaeImageProcessor`` (``processor``) to ``calculate_dimensions(area,
    W / H)`` (``area`` in pixels; the pipeline's is 1024 * 1024). Returns ``(PIL image, (height, width))``."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
    from PIL import Image

    if image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"Qwen-Image-Edit: a source image {tuple(image.shape)}; expected [3, H, W] in [0, 1]")
    pixels = (image.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    width, height, _ = calculate_dimensions(area, image.shape[2] / image.shape[1])
    return processor.resize(Image.fromarray(pixels), height, width), (height, width)


class QwenImageEditCodec(QwenImageCodec):
    """:class:`QwenImageCodec` whose ``encode_conditions`` (:func:`pretrain.codec.encode_conditions`) gives
    the pipeline's source latents: images float ``[B, 3, H, W]`` in [0, 1] -> float32 ``[B, C, h', w']``,
    each image resized by :func:`condition_image` (h' = 1024 / 8 for a square source) and encoded as
    ``QwenImageEditPipeline._encode_vae_image`` does (posterior mode, per-channel normalisation). Decoded
    (:func:`pretrain.codec.decode_conditions`, the codec's ``decode``), the sources come back at that size. ``area``: see :func:`condition_image`."""

    def __init__(self, vae: torch.nn.Module, area: int = CONDITION_AREA):
        from diffusers.image_processor import VaeImageProcessor

        super().__init__(vae)
        self.processor, self.area = VaeImageProcessor(vae_scale_factor=self.downsample * 2), int(area)

    @torch.no_grad()
    def encode_conditions(self, images: torch.Tensor) -> torch.Tensor:
        resized = [condition_image(self.processor, image, self.area)[0] for image in images]
        pixels = self.processor.numpy_to_pt(self.processor.pil_to_numpy(resized)).to(self.vae.device)
        return self.encode(pixels)


class QwenImageEditPromptEncoder(QwenImagePromptEncoder):
    """``QwenImageEditPipeline.encode_prompt``. ``encode(prompts)``: placeholders, zeros ``[B, 1, D]`` and
    ``[B, 0]`` (the edit template has an image slot; the pipeline cannot encode a prompt without its
    image). ``encode_with_images(prompts, images)``: each
    prompt with its source image (float ``[B, 3, H, W]`` in [0, 1], resized by :func:`condition_image` to
    ``area``)
    -> ``PromptEmbeds(tokens [B, max_sequence_length, D], pooled [B, 0], negative=...)``, the negative being
    ``negative_prompt`` ("", the family's empty prompt) with the same image; float32 on the CPU, each
    row's states then zeros. ``ValueError`` naming ``model.options.max_sequence_length`` when a prompt's
    states with its image's tokens do not fit."""

    name = "qwenimage_edit"
    reads_images = True

    def __init__(self, pipe, path, max_sequence_length: int, dtype: str, device: str, negative_prompt: str = "",
                 area: int = CONDITION_AREA):
        from diffusers.image_processor import VaeImageProcessor

        super().__init__(pipe, path, max_sequence_length, dtype, device)
        self.processor = VaeImageProcessor(vae_scale_factor=pipe.vae_scale_factor * 2)
        self.negative_prompt, self.area = negative_prompt, int(area)

    def encode(self, prompts: list[str], batch_size: int = 16) -> PromptEmbeds:
        return PromptEmbeds(torch.zeros(len(prompts), 1, self.dim), torch.zeros(len(prompts), 0))

    def _padded(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.max_sequence_length:
            raise ValueError(f"model.options.max_sequence_length: {self.max_sequence_length} tokens, but a prompt with "
                             f"its source image takes {tokens.shape[1]}; raise it")
        padded = tokens.new_zeros(tokens.shape[0], self.max_sequence_length, tokens.shape[2])
        padded[:, :tokens.shape[1]] = tokens
        return padded.float().cpu()

    @torch.no_grad()
    def encode_with_images(self, prompts: list[str], images: torch.Tensor) -> PromptEmbeds:
        if len(prompts) != len(images):
            raise ValueError(f"Qwen-Image-Edit: {len(prompts)} prompts for {len(images)} source images")
        rows, negatives = [], []
        for prompt, image in zip(prompts, images):
            pil, _ = condition_image(self.processor, image, self.area)
            for text, out in ((prompt, rows), (self.negative_prompt, negatives)):
                tokens, _ = self.pipe.encode_prompt([text], image=pil, device=self.device)
                out.append(self._padded(tokens))
        tokens, negative = torch.cat(rows), torch.cat(negatives)
        empty = tokens.new_zeros(len(prompts), 0)
        return PromptEmbeds(tokens, empty, None, PromptEmbeds(negative, empty))
