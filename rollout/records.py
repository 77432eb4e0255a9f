"""Typed records exchanged between a trainer and rollout workers (:mod:`posttrain.grpo.engines`).

A request is one rollout batch: the prompts (indices into the training prompt set), the global sample
ids that key every random draw (:func:`rollout.noise.rollout_noise`), so a batch sampled by any worker
equals the one a colocated trainer samples, and the iteration whose seed and SDE window it uses. A
result carries the :class:`rollout.trajectory.Trajectory` (float32 latents, log-probs, sigmas and
timesteps in its settings, images in [0, 1]) and the policy version that sampled it."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.trajectory import Trajectory


@dataclass(frozen=True)
class RolloutRequest:
    """``request_id``: unique within a run (``(iteration, batch index)`` spelled ``"<it>:<b>"``);
    ``iteration``: the iteration the samples are for (keys the noise and the SDE window);
    ``prompt_ids``: one training-set index per sample; ``group_ids``: the prompt group of each sample
    within the iteration; ``sample_ids``: the global sample index of each (``group * group_size + g``)."""

    request_id: str
    iteration: int
    prompt_ids: tuple[int, ...]
    group_ids: tuple[int, ...]
    sample_ids: tuple[int, ...]

    def __post_init__(self):
        if not len(self.prompt_ids) == len(self.group_ids) == len(self.sample_ids) > 0:
            raise ValueError(f"RolloutRequest {self.request_id}: prompt_ids, group_ids and sample_ids must have "
                             f"the same non-zero length, got {len(self.prompt_ids)}, {len(self.group_ids)}, "
                             f"{len(self.sample_ids)}")


@dataclass
class RolloutResult:
    """What a worker returns for one :class:`RolloutRequest`: the ``trajectory`` (CPU tensors; its
    ``versions`` field set to ``policy_version`` for every sample), the version of the weights that
    sampled it (iterations trained when they were pushed), the worker's index and the seconds the
    sampling took (``rollout_s``, of which ``decode_s`` decoding)."""

    request_id: str
    iteration: int
    trajectory: Trajectory
    policy_version: int
    worker: int
    rollout_s: float
    decode_s: float
