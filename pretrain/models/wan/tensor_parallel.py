"""The Wan tensor-parallel plan (styles: :mod:`pretrain.parallel.tensor`; diffusers 0.42 ships none for
``WanTransformer3DModel``): in every block, self- and cross-attention q / k / v colwise (the image-to-video
``add_k_proj`` / ``add_v_proj`` too), their output projections rowwise, the MLP colwise up, rowwise down.
Wan's q / k norm is an RMSNorm over all heads' features (``qk_norm="rms_norm_across_heads"``): on the
colwise q / k it becomes ``norm_across_heads`` (weight sharded, the mean square summed over the TP ranks).
The timestep projection to the six modulation vectors (``condition_embedder.time_proj``, ``D`` -> ``6 D``)
is sharded with its per-sample output gathered (``colwise_gather``); each block's modulation table, the
norms between sub-layers and the embeddings stay replicated."""

WAN_TP_PLAN: dict[str, str] = {
    **{f"blocks.*.{attn}.{p}": "colwise" for attn in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v")},
    **{f"blocks.*.attn2.{p}": "colwise" for p in ("add_k_proj", "add_v_proj")},
    **{f"blocks.*.{attn}.to_out.0": "rowwise" for attn in ("attn1", "attn2")},
    **{f"blocks.*.{attn}.{n}": "norm_across_heads" for attn in ("attn1", "attn2") for n in ("norm_q", "norm_k")},
    "blocks.*.attn2.norm_added_k": "norm_across_heads",
    "blocks.*.ffn.net.0.proj": "colwise",
    "blocks.*.ffn.net.2": "rowwise",
    "condition_embedder.time_proj": "colwise_gather",
}
