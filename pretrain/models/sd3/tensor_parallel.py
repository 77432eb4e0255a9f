"""The SD3 tensor-parallel plan (styles: :mod:`pretrain.parallel.tensor`), the same layout diffusers
gives FLUX's double-stream blocks (``FluxTransformer2DModel._tp_plan``; diffusers 0.42 ships none for
``SD3Transformer2DModel``): in every joint block, the image and text q / k / v projections colwise (each
TP rank computes heads ``[r H/tp, (r+1) H/tp)`` for both streams, the joint attention needs nothing
else), the two output projections rowwise; both MLPs colwise up, rowwise down; SD3.5's second
(image-only) attention ``attn2`` the same way. The q / k RMS norms (over one head's ``head_dim``, SD3.5)
keep their weight whole and get their gradient all-reduced (``head_norm``). The AdaLN modulation
projections (a third of a block's weights) are sharded with their per-sample outputs gathered
(``colwise_gather``); the embeddings stay replicated."""

SD3_TP_PLAN: dict[str, str] = {
    **{f"transformer_blocks.*.{attn}.{p}": "colwise" for attn in ("attn", "attn2")
       for p in ("to_q", "to_k", "to_v")},
    **{f"transformer_blocks.*.attn.{p}": "colwise" for p in ("add_q_proj", "add_k_proj", "add_v_proj")},
    "transformer_blocks.*.attn.to_out.0": "rowwise",
    "transformer_blocks.*.attn2.to_out.0": "rowwise",
    "transformer_blocks.*.attn.to_add_out": "rowwise",
    **{f"transformer_blocks.*.{ff}.net.0.proj": "colwise" for ff in ("ff", "ff_context")},
    **{f"transformer_blocks.*.{ff}.net.2": "rowwise" for ff in ("ff", "ff_context")},
    **{f"transformer_blocks.*.attn.{n}": "head_norm" for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")},
    **{f"transformer_blocks.*.attn2.{n}": "head_norm" for n in ("norm_q", "norm_k")},
    "transformer_blocks.*.norm1.linear": "colwise_gather",
    "transformer_blocks.*.norm1_context.linear": "colwise_gather",
    "norm_out.linear": "colwise_gather",
}
