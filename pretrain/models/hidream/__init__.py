"""HiDream-I1 (``HiDreamImageTransformer2DModel``, a mixture-of-experts DiT): ``HiDreamImagePipeline`` folders
and their adapter (``pipeline.py``). No presets; no tensor, sequence or context parallel plan; expert parallelism
(``parallel.ep``: ``pretrain/parallel/expert.py``)."""

from pretrain.models.hidream.pipeline import HIDREAM_ATTENTION, PIPELINE, HiDreamAdapter, HiDreamPromptEncoder, load

__all__ = ["HIDREAM_ATTENTION", "PIPELINE", "HiDreamAdapter", "HiDreamPromptEncoder", "load"]
