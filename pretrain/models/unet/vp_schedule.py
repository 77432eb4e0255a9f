"""Flow coordinates for variance-preserving (DDPM-type) models: Stable Diffusion 1.x / 2.x, SDXL.

A VP model (Ho et al. 2020) is trained on x_t = alpha_t x0 + s_t eps with
alpha_t = sqrt(alphas_cumprod[t]) and s_t = sqrt(1 - alphas_cumprod[t]), so alpha_t^2 + s_t^2 = 1.
Divide by (alpha_t + s_t):

    y = x_t / (alpha_t + s_t),   sigma = s_t / (alpha_t + s_t)   =>   y = (1 - sigma) x0 + sigma eps,

which is this project's flow-matching state (sigma in [0, 1]). Conversely, with
n(sigma) = sqrt((1 - sigma)^2 + sigma^2): alpha = (1 - sigma) / n, s = sigma / n, alpha + s = 1 / n, so
x_t = y / n(sigma). The Karras/VE noise level of the Euler scheduler is sigma_ve = s / alpha
= sigma / (1 - sigma), and its state x_ve = x_t / alpha gives y = x_ve / (1 + sigma_ve).

Velocity. From the model's prediction at (x_t, t), x0_hat and eps_hat satisfy x_t = alpha x0_hat + s eps_hat,
so y = (1 - sigma) x0_hat + sigma eps_hat and v = eps_hat - x0_hat is, per prediction type
(diffusers' ``prediction_type``):

- ``epsilon``: x0_hat = (x_t - s eps_hat) / alpha, hence v = (eps_hat - y) / (1 - sigma);
- ``v_prediction`` (Salimans & Ho 2022, v_d = alpha eps - s x0): x0_hat = alpha x_t - s v_d,
  eps_hat = s x_t + alpha v_d, hence v = (s - alpha) x_t + (alpha + s) v_d = ((2 sigma - 1) y / n + v_d) / n;
- ``sample``: v = (y - x0_hat) / sigma.

v is affine in the prediction at fixed x_t, so classifier-free guidance on v equals guidance on eps.
With ``error_space: noise`` in Diffusion-DPO, eps - eps_hat = (1 - sigma)(v - v_hat) exactly.

Samplers. DDIM with eta = 0 (Song et al. 2021) steps x_t -> alpha' x0_hat + s' eps_hat; in flow
coordinates y' = (1 - sigma') x0_hat + sigma' eps_hat = y + (sigma' - sigma)(eps_hat - x0_hat): exactly
an Euler step. The Euler discrete scheduler (Karras et al. 2022) steps
x_ve' = x_ve + (sigma_ve' - sigma_ve) eps_hat = x0_hat + sigma_ve' eps_hat, and dividing by
(1 + sigma_ve') gives the same y'. So the flow Euler ODE sampler over :meth:`VPSchedule.sigmas`
reproduces both pipelines step for step (up to float rounding).

Timesteps. The model's timestep for a sigma inverts the scheduler's monotone table
sigma_ve(t) = sqrt((1 - alphas_cumprod[t]) / alphas_cumprod[t]), t = 0 .. T-1, by linear interpolation
(in log sigma_ve for Karras / exponential / beta Euler schedules, as the scheduler's ``_sigma_to_t``):
exact at the integer timesteps DDIM and Euler walk; values within 1e-3 of an integer (float32 rounding
of sigma) are snapped to it.

Supported schedulers: ``DDIMScheduler`` (``set_alpha_to_one`` True, no sample clipping or
thresholding, and a timestep spacing whose steps land on the next listed timestep: "leading", or
"trailing" when num_train_timesteps is a multiple of the step count) and ``EulerDiscreteScheduler``
(discrete timesteps, final sigma zero, linear interpolation). Anything else raises ``ValueError``;
PNDM / DPM-Solver / other folders can be sampled with DDIM or Euler through the family's ``scheduler``
option (:mod:`pretrain.models.unet.pipeline`).
"""

from __future__ import annotations

import torch

SUPPORTED = ("DDIMScheduler", "EulerDiscreteScheduler")
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
_LOG_SIGMA_OPTIONS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")


def check_scheduler(scheduler) -> None:
    """Raise ``ValueError`` (naming the scheduler class and the offending setting) unless ``scheduler``
    is one whose deterministic steps are Euler steps in flow coordinates (see the module docstring)."""
    name, cfg = type(scheduler).__name__, scheduler.config
    if name not in SUPPORTED:
        raise ValueError(f"scheduler {name} is not supported by the UNet family (supported: {', '.join(SUPPORTED)}); "
                         f"set model.options.scheduler to 'ddim' or 'euler' to sample with that scheduler built from "
                         f"this folder's scheduler config")
    if cfg.prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"{name}: prediction_type '{cfg.prediction_type}' is not one of {PREDICTION_TYPES}")
    bad = []
    if name == "DDIMScheduler":
        if not cfg.set_alpha_to_one:
            bad.append("set_alpha_to_one=False (the last step would end at alphas_cumprod[0], not at sigma 0; "
                       "model.options.scheduler=ddim rebuilds it with set_alpha_to_one=True)")
        if cfg.clip_sample or cfg.thresholding:
            bad.append("clip_sample/thresholding (a clipped x0 is not an Euler step)")
    else:
        if cfg.timestep_type != "discrete":
            bad.append(f"timestep_type={cfg.timestep_type}")
        if cfg.final_sigmas_type != "zero":
            bad.append(f"final_sigmas_type={cfg.final_sigmas_type} (the schedule must end at sigma 0)")
        if cfg.interpolation_type != "linear":
            bad.append(f"interpolation_type={cfg.interpolation_type} (its sigmas do not match its timesteps)")
    if bad:
        raise ValueError(f"{name}: unsupported setting(s): {'; '.join(bad)}")


def _bcast(sigma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return sigma.reshape(sigma.shape + (1,) * (x.ndim - sigma.ndim))


def flow_velocity(pred: torch.Tensor, y: torch.Tensor, sigma: torch.Tensor, prediction_type: str) -> torch.Tensor:
    """The flow velocity v = eps_hat - x0_hat (float32, shape of ``y``) from a VP model's prediction
    ``pred`` at the flow state ``y`` [B, ...] and ``sigma`` [B] (formulas in the module docstring).
    Divisions are guarded at sigma = 1 (epsilon) and sigma = 0 (sample) by a 1e-6 floor.
    Raises ``ValueError`` for an unknown ``prediction_type``."""
    pred, y, s = pred.float(), y.float(), _bcast(sigma.float(), y)
    if prediction_type == "epsilon":
        return (pred - y) / (1 - s).clamp_min(1e-6)
    if prediction_type == "v_prediction":
        n = ((1 - s).square() + s.square()).sqrt()
        return ((2 * s - 1) * y / n + pred) / n
    if prediction_type == "sample":
        return (y - pred) / s.clamp_min(1e-6)
    raise ValueError(f"prediction_type '{prediction_type}' is not one of {PREDICTION_TYPES}")


def vp_state(y: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The VP model input x_t = y / sqrt((1 - sigma)^2 + sigma^2) for the flow state ``y`` [B, ...]."""
    s = _bcast(sigma.to(y.dtype), y)
    return y / ((1 - s).square() + s.square()).sqrt()


class VPSchedule:
    """Flow-coordinate view of a diffusers ``DDIMScheduler`` / ``EulerDiscreteScheduler`` (checked with
    :func:`check_scheduler`, which raises ``ValueError`` otherwise)."""

    def __init__(self, scheduler):
        check_scheduler(scheduler)
        self.scheduler = scheduler
        self.euler = type(scheduler).__name__ == "EulerDiscreteScheduler"
        self.prediction_type = scheduler.config.prediction_type
        ac = scheduler.alphas_cumprod.double()
        self.ve_table = ((1 - ac) / ac).sqrt()  # [T], increasing in t
        self.log_interp = self.euler and any(getattr(scheduler.config, k, False) for k in _LOG_SIGMA_OPTIONS)

    def _fresh(self, num_inference_steps: int):
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        sch = type(self.scheduler).from_config(self.scheduler.config)
        sch.set_timesteps(num_inference_steps)
        return sch

    def sigmas(self, num_inference_steps: int) -> torch.Tensor:
        """The flow sigmas float32 ``[n + 1]`` of the scheduler's n steps, last entry 0: Euler's own
        sigma_ve list, or DDIM's alphas_cumprod at its timesteps, as sigma_ve / (1 + sigma_ve).
        Raises ``ValueError`` for a DDIM spacing whose step (t - T // n) misses the next timestep."""
        sch = self._fresh(num_inference_steps)
        if self.euler:
            ve = sch.sigmas[:-1].double()
        else:
            ts = sch.timesteps.long()
            prev = ts - sch.config.num_train_timesteps // num_inference_steps
            if not (torch.equal(prev[:-1], ts[1:]) and prev[-1] < 0):
                raise ValueError(f"DDIMScheduler with timestep_spacing={sch.config.timestep_spacing!r} and "
                                 f"{num_inference_steps} steps steps from t to t - {sch.config.num_train_timesteps // num_inference_steps}, "
                                 f"not to its next timestep ({ts.tolist()}): not an Euler walk; use 'leading' spacing")
            ve = self.ve_table[ts]
        sig = ve / (1 + ve)
        return torch.cat([sig, sig.new_zeros(1)]).float()

    def train_sigmas(self) -> torch.Tensor:
        """The flow sigma of every training timestep t = 0 .. T - 1, float32 ``[T]``, increasing:
        sigma_ve(t) / (1 + sigma_ve(t)) (:meth:`timestep` maps each back to t exactly)."""
        return (self.ve_table / (1 + self.ve_table)).float()

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The model timestep float32 ``[B]`` (in [0, T - 1]) for flow sigmas ``sigma`` [B] (interpolated
        in the sigma_ve table, see the module docstring)."""
        s = sigma.detach().double()
        ve = s / (1 - s)
        table = self.ve_table.to(s.device)
        if self.log_interp:
            ve, table = ve.log(), table.log()
        hi = torch.searchsorted(table, ve).clamp(1, len(table) - 1)
        lo_v, hi_v = table[hi - 1], table[hi]
        t = ((hi - 1) + (ve - lo_v) / (hi_v - lo_v)).clamp(0, len(table) - 1)
        r = t.round()
        return torch.where((t - r).abs() < 1e-3, r, t).float()

    def initial_scale(self, sigma0: float) -> float:
        """Factor from unit noise to the first flow state: the pipeline's first latent is
        ``noise * init_noise_sigma`` in its scheduler's coordinates (VP for DDIM with
        init_noise_sigma 1; VE for Euler with sqrt(sigma_ve^2 + 1), or sigma_ve for "linspace" /
        "trailing" spacing), and y0 = x_ve0 / (1 + sigma_ve0)."""
        ve = sigma0 / (1 - sigma0)
        spacing = self.scheduler.config.timestep_spacing
        x_ve = ve if self.euler and spacing in ("linspace", "trailing") else (ve * ve + 1) ** 0.5
        return x_ve / (1 + ve)
