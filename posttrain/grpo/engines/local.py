"""``engine.name: local``: the colocated rollout. Every data-parallel rank samples its contiguous share
of the iteration's prompt groups with its :class:`rollout.actor.RolloutActor` (noise keyed by the global
sample index), scores each batch while the next one samples, and the rewards are all-gathered so every
rank holds all of them."""

from __future__ import annotations

import time

from posttrain.grpo.engines import RolloutBatch


class LocalEngine:
    """The colocated engine. ``cfg``: the run's :class:`posttrain.grpo.stage.GRPOConfig` (its
    ``rollout.prompts_per_step`` / ``group_size``); ``actor``: the rank's rollout actor; ``prompts``: the
    run's :class:`pretrain.data.sampler.EpochSampler` (every rank draws the same); ``ranks``: the
    :class:`posttrain.grpo.ranks.RankLayout`; ``scorer``: the :class:`rewards.scoring.AsyncScorer` each
    batch is submitted to. Other collaborators offered to every engine are ignored."""

    def __init__(self, *, cfg, actor, prompts, ranks, scorer, **_):
        self.ro, self.actor, self.prompts, self.ranks, self.scorer = cfg.rollout, actor, prompts, ranks, scorer

    def stateful(self) -> dict:
        return {}

    def collect(self, iteration: int) -> RolloutBatch:
        """Draw the iteration's prompts, sample and score this rank's share, gather the rewards."""
        ro, ranks, scorer = self.ro, self.ranks, self.scorer
        t0 = time.perf_counter()
        # every rank draws the same prompts and samples its share, noise keyed by global sample index
        picked = self.prompts.next(ro.prompts_per_step)
        mine, offset = ranks.prompt_share(picked, ro.group_size)
        traj = self.actor.rollout(mine, iteration=iteration, sample_offset=offset,
                                  on_batch=lambda b: scorer.submit(b.images, b.prompts, b.reward_metadata(iteration)))
        t1 = time.perf_counter()
        decode = self.actor.decode_seconds
        total, raw, group_ids = ranks.gather(*scorer.gather(), traj.group_ids)  # all ranks' samples
        return RolloutBatch(picked, traj, total, raw, group_ids,
                            {"time_rollout_s": t1 - t0 - decode, "time_decode_s": decode,
                             "time_reward_wait_s": scorer.wait_seconds, "time_gather_s": time.perf_counter() - t1})

    def trained(self, version: int) -> dict:
        """Called after each iteration's update (``version`` = iterations trained): nothing to sync."""
        return {}

    def close(self) -> None:
        pass
