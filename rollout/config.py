"""The ``rollout:`` block: what the sampler draws with, and how many samples an iteration draws."""

from __future__ import annotations

from dataclasses import dataclass, field

from pretrain.config import require_positive
from rollout.window import WindowConfig


@dataclass
class RolloutConfig:
    """Sampler settings, recorded on every Trajectory and read back when log-probs are recomputed:

    - ``step``: the step type (:mod:`rollout.steps`; ``sde`` = Flow-GRPO's SDE, Liu et al. 2025,
      arXiv 2505.05470, eq. 9-10; ``cps`` = Coefficients-Preserving Sampling, Wang et al. 2025,
      arXiv 2509.05952, ``noise_level`` in (0, 1], flow_grpo uses 0.8);
    - ``num_inference_steps`` (Flow-GRPO trains with 10) and ``shift`` of the sigma schedule (None =
      the export's sampling shift);
    - ``noise_level`` (0.7; 0 would be the ODE: no log-prob, nothing to train);
    - ``guidance_scale`` (CFG) and ``negative_prompt`` (the unconditional branch's prompt; "" = the
      empty prompt);
    - ``shared_initial_noise``: every sample of a prompt group starts from the same initial noise
      (DanceGRPO, Xue et al. 2025, arXiv 2505.07818), so rewards within a group differ only through
      the SDE noise the log-probs credit;
    - which transitions are trained: ``timestep_fraction`` of them, ``timestep_selection`` "first"
      (Flow-GRPO: 0.99 of 10 trains 9) or "random" (one random subset per iteration, DanceGRPO);
    - ``step: ode``: deterministic, no log-probs (:mod:`rollout.ode`): every transition is taken by
      ``ode_solver`` (``noise_level``, ``sde_window`` and the trained-transition keys do not apply),
      for the forward-process losses (``nft``, ``awm``, ``dgpo``);
    - ``sde_window`` (:class:`rollout.window.WindowConfig`): which transitions are stochastic. With a
      window, only its transitions are stochastic and trained (``timestep_fraction`` does not apply,
      ``timestep_selection: random`` is refused); the others take the deterministic step;
    - ``ode_solver`` (:mod:`rollout.ode_solver`): the deterministic step of the transitions after the
      window: ``euler`` (the step type at noise level 0, the default) or ``dpmpp_2m`` (DPM-Solver++(2M),
      MixGRPO-Flash, Li et al. 2025, arXiv 2507.21802). Transitions before and inside the window do not
      change, nor do their log-probs. Refused without an ``sde_window`` (every transition is then
      stochastic: there is nothing for it to solve).

    Batch: ``prompts_per_step`` x ``group_size`` samples per iteration, sampled ``batch_size`` at a time.

    ``precision``: the autocast the rollout samples in (fp32 / bf16 / fp16; None = ``train.precision``);
    a rollout in another precision than training records log-probs the update does not reproduce,
    which ``grpo.old_log_prob: recompute`` absorbs. Where the samples are drawn (the rollout engine,
    Ray workers) is the trainer's ``engine:`` block, not recorded on trajectories."""

    step: str = "sde"
    num_inference_steps: int = 10
    noise_level: float = 0.7
    guidance_scale: float = 4.0
    negative_prompt: str = ""
    shift: float | None = None
    prompts_per_step: int = 8
    group_size: int = 8
    batch_size: int = 32
    timestep_fraction: float = 0.99
    timestep_selection: str = "first"
    shared_initial_noise: bool = False
    sde_window: WindowConfig = field(default_factory=WindowConfig)
    ode_solver: str = "euler"
    precision: str | None = None

    def validate(self, prefix: str = "") -> None:
        from rollout.ode_solver import get_ode_solver
        from rollout.steps import get_step

        step = get_step(self.step, f"{prefix}step")
        require_positive(self, prefix, "num_inference_steps", "prompts_per_step", "batch_size")
        if self.group_size < 2:
            raise ValueError(f"{prefix}group_size: must be >= 2 (group advantages of one sample are 0)")
        if self.shift is not None and self.shift <= 0:
            raise ValueError(f"{prefix}shift: must be > 0 (or null for the export's), got {self.shift}")
        get_ode_solver(self.ode_solver, f"{prefix}ode_solver")
        if self.precision not in (None, "fp32", "bf16", "fp16"):
            raise ValueError(f"{prefix}precision: '{self.precision}' is not one of fp32, bf16, fp16 (or null: "
                             f"train.precision)")
        if getattr(step, "deterministic", False):  # every transition is taken by ode_solver: nothing stochastic
            if self.sde_window.size:
                raise ValueError(f"{prefix}sde_window: step '{self.step}' is deterministic: no transition is "
                                 f"stochastic (set sde_window.size 0, or use step sde / cps / ddim)")
            return
        limit = getattr(step, "noise_level_max", None)
        if limit is not None and self.noise_level > limit:
            raise ValueError(f"{prefix}noise_level: step '{self.step}' takes at most {limit}, got {self.noise_level}")
        if self.noise_level <= 0:
            raise ValueError(f"{prefix}noise_level: must be > 0 (0 is the deterministic ODE: no log-prob, "
                             f"nothing to train)")
        if not 0.0 < self.timestep_fraction <= 1.0:
            raise ValueError(f"{prefix}timestep_fraction: must be in (0, 1], got {self.timestep_fraction}")
        if self.timestep_selection not in ("first", "random"):
            raise ValueError(f"{prefix}timestep_selection: '{self.timestep_selection}' is not one of first, random")
        self.sde_window.check(self.num_inference_steps, f"{prefix}sde_window.")
        if not self.sde_window.size and self.ode_solver != "euler":
            raise ValueError(f"{prefix}ode_solver: '{self.ode_solver}' takes the transitions after an sde_window; "
                             f"without one (sde_window.size 0) every transition is stochastic")
        if self.sde_window.size and self.timestep_selection != "first":
            raise ValueError(f"{prefix}timestep_selection: with an sde_window the window's transitions are "
                             f"trained; '{self.timestep_selection}' does not apply")
