"""The built-in parts of the post-training algorithms (each file registers its parts on import);
:mod:`posttrain.parts.registry` says how to add one."""

from posttrain.parts import all_samples, group_advantage, ppo_clip_kl  # noqa: F401
