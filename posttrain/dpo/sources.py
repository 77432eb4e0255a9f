"""Where Diffusion-DPO's preference pairs come from: the ``source:`` of a DPO config, one registered
class each (:data:`PAIR_SOURCES`).

``offline``: a local Pick-a-Pic-schema dataset (:func:`posttrain.dpo.data.load_preference_pairs`),
split by caption into train and held-out pairs; the held-out implicit accuracy is its evaluation.
``online``: pairs from the current policy (Wallace et al. 2023's data, made on-policy): every
``online.resample_every`` steps, K ODE samples per prompt scored by ``rewards``, best vs worst above
``online.margin`` (:func:`posttrain.dpo.data.online_pairs`); under torchrun each data-parallel rank
samples and scores its share of the prompts and the pairs are gathered.

A source is built before any model loads (an online source builds its rewards first, so a reward
server that does not answer fails the run early), :meth:`PairSource.start` after the stage is set up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.dpo.data import PairSet, load_preference_pairs, online_pairs
from pretrain.data.sampler import EpochSampler
from pretrain.registry import Registry

if TYPE_CHECKING:
    from posttrain.dpo.stage import DPOConfig

#: ``source`` names -> pair source classes.
PAIR_SOURCES = Registry("pair source", key="source")


class PairSource:
    """The pairs a DPO run trains on. ``rewards``: what scores samples (None: the pairs come scored)."""

    rewards = None

    @classmethod
    def check(cls, cfg: "DPOConfig") -> None:
        """``ValueError`` naming the key when ``cfg`` cannot feed this source (at config load)."""

    def __init__(self, cfg: "DPOConfig", ranks=None):
        """``ranks``: the run's :class:`pretrain.parallel.job.JobRanks` (None: one process); a layout the
        source cannot split is a ``ConfigError`` naming the key, before any model loads."""
        self.cfg, self.seed, self.ranks = cfg, cfg.train.seed, ranks

    def start(self, stage, prompts: EpochSampler) -> dict:
        """Set up on the loaded stage (:class:`posttrain.base.stage.PolicyStage`) and the run's prompt
        sampler; returns the source's state to checkpoint, by key."""
        return {}

    def pairs(self, step: int, model, autocast, log) -> tuple[PairSet, EpochSampler, dict]:
        """(the pairs step ``step`` trains on, their sampler, metrics of making them); ``model`` the
        module to sample with, ``autocast`` the runtime's context, ``log`` a line writer."""
        raise NotImplementedError

    def heldout(self, policy) -> dict | None:
        """The source's held-out metrics of ``policy`` (:class:`posttrain.base.policy.Policy`), None when
        it has no evaluation."""
        return None


@PAIR_SOURCES.register("offline")
class OfflineSource(PairSource):
    """Pairs read from ``offline.path``; the pairs sampler is checkpointed as ``pairs``."""

    @classmethod
    def check(cls, cfg: "DPOConfig") -> None:
        if not cfg.offline.path:
            raise ValueError("offline.path: required when source is 'offline'")

    def start(self, stage, prompts: EpochSampler) -> dict:
        self.stage = stage
        self.train_pairs, self.held_pairs = offline_pairs(self.cfg, stage.encoder, stage.meta["image_size"])
        self.sampler = EpochSampler(len(self.train_pairs), self.seed)
        return {"pairs": self.sampler}

    def pairs(self, step: int, model, autocast, log) -> tuple[PairSet, EpochSampler, dict]:
        return self.train_pairs, self.sampler, {}

    def heldout(self, policy) -> dict:
        """``heldout_implicit_acc`` of the held-out pairs ({} when ``offline.heldout_fraction`` is 0)."""
        from posttrain.dpo.step import implicit_accuracy

        if self.held_pairs is None:
            return {}
        st = self.stage
        return {"heldout_implicit_acc": implicit_accuracy(policy, st.codec, self.held_pairs, self.cfg.dpo, st.null,
                                                          seed=self.seed, device=st.device)}


@PAIR_SOURCES.register("online")
class OnlineSource(PairSource):
    """Pairs sampled from the policy every ``online.resample_every`` steps and scored by ``rewards``
    (built here, before any model loads)."""

    @classmethod
    def check(cls, cfg: "DPOConfig") -> None:
        from rewards.base import check_reward_weights

        check_reward_weights(cfg.rewards)
        for key, value in (("checkpoint.every", cfg.checkpoint.every), ("train.steps", cfg.train.steps)):
            if value % cfg.online.resample_every:
                raise ValueError(f"{key}: must be a multiple of online.resample_every (pairs are re-sampled "
                                 f"from the model at round boundaries, which is what a resume reproduces)")

    def __init__(self, cfg: "DPOConfig", ranks=None):
        from rewards.base import CompositeReward

        super().__init__(cfg, ranks)
        if ranks is not None:
            ranks.require_divisible("online.prompts_per_round", cfg.online.prompts_per_round,
                                    "each data-parallel rank samples and scores its share of a round's prompts")
        self.rewards = CompositeReward(cfg.rewards)
        self.current: tuple[PairSet, EpochSampler] | None = None

    def start(self, stage, prompts: EpochSampler) -> dict:
        self.stage, self.prompts = stage, prompts
        return {}

    def pairs(self, step: int, model, autocast, log) -> tuple[PairSet, EpochSampler, dict]:
        """A new round at round boundaries (and on the first step of a run or a resume)."""
        on, metrics = self.cfg.online, {}
        if self.current is None or step % on.resample_every == 0:
            metrics = self.resample(step, model, autocast, log)
            metrics["samples"] = on.prompts_per_round * on.samples_per_prompt  # drawn this step
        return (*self.current, metrics)

    def resample(self, step: int, model, autocast, log) -> dict:
        """A new round of pairs from ``model``; keeps the previous round when no prompt has a reward gap
        above ``online.margin`` (``ValueError`` when there is none)."""
        st, on = self.stage, self.cfg.online
        model.eval()
        with autocast():
            fresh, metrics = online_pairs(model, st.codec, st.train_set, self.prompts.next(on.prompts_per_round),
                                          online=on, reward_fn=self.rewards, null=st.null,
                                          shift=st.meta["sampling"]["shift"], seed=self.seed,
                                          round_=step // on.resample_every, device=st.device, ranks=self.ranks)
        if fresh is not None:
            self.current = (fresh, EpochSampler(len(fresh), self.seed + step))
        elif self.current is None:
            raise ValueError(f"step {step}: no prompt had a reward gap above online.margin={on.margin}")
        else:
            log(f"step {step}: no reward gap above online.margin={on.margin} in this round "
                f"(all samples scored alike); keeping the previous round's pairs")
        return metrics


def offline_pairs(cfg: "DPOConfig", encoder, size: int) -> tuple[PairSet, PairSet | None]:
    """Train / held-out split of the offline pairs by a hash of the caption (pairs sharing a caption
    stay on one side); held-out is None when ``offline.heldout_fraction`` is 0. ``ValueError`` naming
    ``offline.heldout_fraction`` when it leaves no training pair."""
    from pretrain.data.emoji import is_heldout

    w, lo, caps, pref, _ = load_preference_pairs(cfg.offline.path, size, cfg.offline.ties, cfg.offline.limit)
    pairs = PairSet(w.float() / 255, lo.float() / 255, caps, encoder.encode(caps), pref)
    held = [is_heldout(c, cfg.offline.heldout_fraction) for c in caps]
    train = [i for i, h in enumerate(held) if not h]
    if not train:
        raise ValueError(f"offline.heldout_fraction={cfg.offline.heldout_fraction} leaves no training pair")
    held_idx = [i for i, h in enumerate(held) if h]
    return pairs.select(train), (pairs.select(held_idx) if held_idx else None)
