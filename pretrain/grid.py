"""A labelled grid of images as one PIL image: the cell layout the PNG grids (:func:`pretrain.sampling.save_grid`)
and the animated video grids (:func:`pretrain.animation.save_animation`) share."""

from __future__ import annotations

import torch


PASS_RGB, FAIL_RGB = (0, 170, 0), (220, 0, 0)


def grid_image(images: torch.Tensor, captions: list[str], cols: int = 8, scale: int = 3,
               marks: list[bool | None] | None = None, span: int = 1):
    """A PIL RGB image: images float ``[N, 3, H, W]`` in [0, 1] in ``cols`` columns, each cell
    upscaled ``scale`` x (nearest) with its caption underneath. ``marks``: per image True (a green
    frame, pass), False (a red frame, fail) or None (no frame), drawn inside the cell. ``span``: cells per
    caption (e.g. 2 for an edit's source and output side by side): ``captions`` has one entry per ``span``
    consecutive images, written under the group's first cell across the group's width; ``cols`` is rounded
    down to a multiple of it. ``ValueError`` when N is not ``span`` x the number of captions."""
    from PIL import Image, ImageDraw

    n, _, h, w = images.shape
    if span < 1 or n != span * len(captions):
        raise ValueError(f"grid_image: {n} images for {len(captions)} captions of {span} cell(s) each")
    cols = max(span, min(cols, n) // span * span)
    rows = (n + cols - 1) // cols
    cw, ch, label = w * scale, h * scale, 12
    grid = Image.new("RGB", (cols * cw, rows * (ch + label)), "white")
    draw = ImageDraw.Draw(grid)
    arr = (images.clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()
    max_chars = max(4, span * cw // 6)
    for i in range(n):
        r, c = divmod(i, cols)
        cell = Image.fromarray(arr[i]).resize((cw, ch), Image.NEAREST)
        grid.paste(cell, (c * cw, r * (ch + label)))
        if marks is not None and marks[i] is not None:
            x0, y0 = c * cw, r * (ch + label)
            draw.rectangle([x0, y0, x0 + cw - 1, y0 + ch - 1], outline=PASS_RGB if marks[i] else FAIL_RGB,
                           width=max(1, scale // 2 + 1))
        if i % span:
            continue
        caption = captions[i // span]
        text = caption if len(caption) <= max_chars else caption[: max_chars - 1] + "…"
        draw.text((c * cw + 2, r * (ch + label) + ch), text, fill=(0, 0, 0))
    return grid


def edit_cells(images: torch.Tensor, captions: list[str], marks: list[bool | None] | None,
               sources: torch.Tensor | None) -> tuple[torch.Tensor, list[str], list[bool | None] | None, int]:
    """What a grid shows of N samples (images float ``[N, 3, H, W]`` or videos ``[N, F, 3, H, W]`` in
    [0, 1], one per caption): (cells, captions, marks, span) for :func:`grid_image` or
    :func:`pretrain.sampling.save_grid`. With conditioning images (``sources``: float ``[>= N, 3, h, w]`` in
    [0, 1], row i the source of sample i; resized to the samples' size where it differs, and held still
    for every frame of a video) each edit takes two cells, the source then the output, captioned together
    with the instruction (the caption after its last "; ", the whole caption without one) and framed on
    the output only; without (None), the samples themselves, one cell each."""
    if sources is None:
        return images, captions, marks, 1
    n = len(captions)
    src = sources[:n].to(images)
    if src.shape[-2:] != images.shape[-2:]:
        src = torch.nn.functional.interpolate(src, size=tuple(images.shape[-2:]), mode="bilinear",
                                              antialias=True, align_corners=False).clamp(0, 1)
    if images.ndim == 5:
        src = src[:, None].expand(-1, images.shape[1], -1, -1, -1)
    cells = torch.stack([src, images], 1).flatten(0, 1)
    paired = None if marks is None else [m for mark in marks for m in (None, mark)]
    return cells, [c.rpartition("; ")[2] for c in captions], paired, 2
