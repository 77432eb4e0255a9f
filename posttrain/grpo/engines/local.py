"""``rollout.engine: local``: the colocated rollout. Every data-parallel rank samples its contiguous share
of the iteration's prompt groups (noise keyed by the global sample index), scores each batch while the
next one samples, and the rewards are all-gathered so every rank holds all of them."""

from __future__ import annotations

import time

from posttrain.grpo.engines import RolloutBatch
from posttrain.grpo.perf import records_uncond
from pretrain.runtime.precision import Precision
from rollout.timed_codec import TimedCodec


class LocalEngine:
    """The colocated engine of a :class:`posttrain.grpo.stage.GRPORun` (samples with ``run.sampling_model()``)."""

    def __init__(self, run):
        self.run = run

    def stateful(self) -> dict:
        return {}

    def collect(self, iteration: int) -> RolloutBatch:
        """Draw the iteration's prompts, sample and score this rank's share, gather the rewards."""
        run = self.run
        cfg, ro, st = run.cfg, run.cfg.rollout, run.st
        t0 = time.perf_counter()
        model, codec = run.sampling_model().eval(), TimedCodec(st.codec)
        st.model.eval()
        # every rank draws the same prompts and samples its share, noise keyed by global sample index
        picked = run.prompts.next(ro.prompts_per_step)
        mine, offset = run.ranks.prompt_share(picked, ro.group_size)
        precision = ro.precision or cfg.train.precision
        with Precision(precision, st.device).autocast():  # default: the update's, so the ratio starts at 1
            traj = run.sampler.rollout(
                model, codec, st.train_set, mine, latent_shape=run.latent_shape, seed=run.seed, iteration=iteration,
                device=st.device, sample_offset=offset,
                on_batch=lambda b: run.scorer.submit(b.images, b.prompts, {"sample_ids": b.sample_ids}),
                record_uncond=records_uncond(run.perf, cfg.grpo.detach_uncond, ro.guidance_scale)
                and precision == cfg.train.precision)  # reused in training only when computed alike
        t1 = time.perf_counter()
        total, raw, group_ids = run.ranks.gather(*run.scorer.gather(), traj.group_ids)  # all ranks' samples
        return RolloutBatch(picked, traj, total, raw, group_ids,
                            {"time_rollout_s": t1 - t0 - codec.seconds, "time_decode_s": codec.seconds,
                             "time_reward_wait_s": run.scorer.wait_seconds, "time_gather_s": time.perf_counter() - t1})

    def trained(self, version: int) -> dict:
        """Called after each iteration's update (``version`` = iterations trained): nothing to sync."""
        return {}

    def close(self) -> None:
        pass
