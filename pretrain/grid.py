"""A labelled grid of images as one PIL image: the cell layout the PNG grids (:func:`pretrain.sampling.save_grid`)
and the animated video grids (:func:`pretrain.animation.save_animation`) share."""

from __future__ import annotations

import torch


PASS_RGB, FAIL_RGB = (0, 170, 0), (220, 0, 0)


def grid_image(images: torch.Tensor, captions: list[str], cols: int = 8, scale: int = 3,
               marks: list[bool | None] | None = None):
    """A PIL RGB image: images float ``[N, 3, H, W]`` in [0, 1] in ``cols`` columns, each cell
    upscaled ``scale`` x (nearest) with its caption underneath. ``marks``: per image True (a green
    frame, pass), False (a red frame, fail) or None (no frame), drawn inside the cell."""
    from PIL import Image, ImageDraw

    n, _, h, w = images.shape
    cols = min(cols, n)
    rows = (n + cols - 1) // cols
    cw, ch, label = w * scale, h * scale, 12
    grid = Image.new("RGB", (cols * cw, rows * (ch + label)), "white")
    draw = ImageDraw.Draw(grid)
    arr = (images.clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()
    max_chars = max(4, cw // 6)
    for i in range(n):
        r, c = divmod(i, cols)
        cell = Image.fromarray(arr[i]).resize((cw, ch), Image.NEAREST)
        grid.paste(cell, (c * cw, r * (ch + label)))
        if marks is not None and marks[i] is not None:
            x0, y0 = c * cw, r * (ch + label)
            draw.rectangle([x0, y0, x0 + cw - 1, y0 + ch - 1], outline=PASS_RGB if marks[i] else FAIL_RGB,
                           width=max(1, scale // 2 + 1))
        text = captions[i] if len(captions[i]) <= max_chars else captions[i][: max_chars - 1] + "…"
        draw.text((c * cw + 2, r * (ch + label) + ch), text, fill=(0, 0, 0))
    return grid
