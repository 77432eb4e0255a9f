"""The two schedules a folder's ``FlowMatchEulerDiscreteScheduler`` can walk (``model.options.schedule``).

- ``pipeline`` (default): what the pipeline walks, ``scheduler.set_timesteps(num_inference_steps)``.
  With a fixed shift (``use_dynamic_shifting`` false, e.g. SD3 / SD3.5's shift 3) diffusers builds
  that schedule from the scheduler's already-shifted ``sigma_min`` and shifts it again
  (diffusers#13243): at shift 3 and 10 steps the last nonzero sigma is shift(shift(1/1000)) = 1/112
  (0.008929) instead of shift(1/1000) = 1/334 (0.002994), and the sigmas before it move slightly
  (the one before it 0.2780 instead of 0.2745).
- ``single_shift``: the shift applied once, as the scheduler's training-time sigmas are:
  shift(linspace(1, 1/num_train_timesteps, n)) then 0, with shift(s) = shift * s / (1 + (shift - 1) s)
  (Esser et al. 2024, arXiv 2403.03206, eq. 23; or the dynamic shift at ``mu``). It is the same
  scheduler's ``set_timesteps(sigmas=linspace(1, 1/num_train_timesteps, n))``, what the pipeline
  walks when called with those ``sigmas``. With dynamic shifting the two agree (the scheduler keeps
  an unshifted ``sigma_min`` then).
"""

from __future__ import annotations

import numpy as np

#: ``model.options.schedule`` -> the unshifted sigmas passed to ``set_timesteps`` (None: its own).
SCHEDULES = {
    "pipeline": lambda config, n: None,
    "single_shift": lambda config, n: np.linspace(1.0, 1.0 / config.get("num_train_timesteps", 1000), n),
}


def checked_schedule(options: dict) -> str:
    """``options["schedule"]``, default "pipeline"; ``ValueError`` naming ``model.options.schedule`` for
    another value."""
    schedule = options.get("schedule", "pipeline")
    if schedule not in SCHEDULES:
        raise ValueError(f"model.options.schedule: '{schedule}' is not one of {list(SCHEDULES)}")
    return schedule


def set_flow_timesteps(scheduler, num_inference_steps: int, schedule: str, mu: float | None = None) -> None:
    """``scheduler.set_timesteps`` (a ``FlowMatchEulerDiscreteScheduler``, on the CPU) for ``schedule``
    (a key of :data:`SCHEDULES`); ``mu`` the dynamic shift where the scheduler uses one. Afterwards
    ``scheduler.sigmas`` is float32 ``[num_inference_steps + 1]`` ending in 0."""
    sigmas = SCHEDULES[schedule](dict(scheduler.config), num_inference_steps)
    scheduler.set_timesteps(num_inference_steps, device="cpu", sigmas=sigmas, mu=mu)


def resolution_mu(config: dict, image_seq_len: int, num_inference_steps: int) -> float:
    """FLUX.1's and Qwen-Image's dynamic shift: ``calculate_shift`` of the image sequence length between
    the scheduler config's base and max (``num_inference_steps`` unused)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return calculate_shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                           config.get("base_shift", 0.5), config.get("max_shift", 1.15))


def dynamic_shift_sigmas(scheduler_class, config: dict, image_seq_len: int, num_inference_steps: int,
                         shift: float | None = None, mu_of=resolution_mu, base=None):
    """The schedule of FLUX-style pipelines (``FluxPipeline``, ``QwenImagePipeline``,
    ``Flux2KleinPipeline``), float32 ``[n + 1]`` ending in 0: ``np.linspace(1, 1/n, n)`` through a fresh
    copy of the folder's scheduler ``set_timesteps(sigmas=..., mu=mu_of(config, image_seq_len, n))`` (its
    own sigmas when it has ``use_flow_sigmas``; ``mu_of`` the pipeline's rule, :func:`resolution_mu` by
    default; ``base(n)`` replaces the linspace, as Z-Image's float32 one does). A not-None ``shift``
    replaces the dynamic shift by that fixed shift. Raises ``ValueError`` for ``num_inference_steps < 1``."""
    import torch
    from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    n, cfg = num_inference_steps, dict(config)
    sigmas = None if cfg.get("use_flow_sigmas") else base(n) if base else np.linspace(1.0, 1 / n, n)
    if shift is None:
        scheduler = scheduler_class.from_config(cfg)
        retrieve_timesteps(scheduler, n, "cpu", sigmas=sigmas, mu=mu_of(cfg, image_seq_len, n))
    else:
        scheduler = scheduler_class.from_config(cfg, shift=float(shift), use_dynamic_shifting=False)
        retrieve_timesteps(scheduler, n, "cpu", sigmas=sigmas)
    return scheduler.sigmas.to(torch.float32).cpu()
