"""``engine.name: ray``: rollout workers on Ray, driven by the trainer's rank 0.

Each iteration's samples are split into requests of ``rollout.batch_size`` (the colocated batches:
sample ids ``[b * batch_size, ...)``, noise keyed by them), queued to the workers of a
:class:`posttrain.grpo.engines.ray_pool.WorkerPool`, scored as each result arrives, and assembled in request
order; under ``torchrun`` rank 0 broadcasts the iteration and each rank keeps its share of the groups.
After each update the trainable weights the trainer would sample with (the policy's, or the old
policy's for a forward-process loss that samples with it) are published as a versioned packet (every
rank builds it: FSDP2 gathers are collectives; rank 0 puts it in Ray's object store).

How far sampling runs ahead (``engine.mode``): ``sync`` queues iteration k after the weights of k
iterations are published (on-policy: exactly the colocated samples); ``one_step_off`` queues k + 1
while k trains; ``async`` keeps ``max_staleness`` iterations queued ahead and idle workers take the
next request with the newest weights, so a sample's staleness (iterations trained when it is trained
minus when it was drawn) is at most ``max_staleness``. Prompts of queued iterations are checkpointed:
a resume queues them again (sampled then with the resumed weights).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from posttrain.grpo.engines import RolloutBatch
from posttrain.grpo.engines.weight_sync import WeightPacket
from posttrain.objectives.rollout_correction import staleness_stats
from rollout.records import RolloutRequest, RolloutResult
from rollout.trajectory import Trajectory

AHEAD = {"sync": lambda eng: 0, "one_step_off": lambda eng: 1, "async": lambda eng: eng.max_staleness}


def slow_workers() -> dict[int, float]:
    """``POSTTRAIN_SLOW_WORKER="i:seconds[,j:seconds]"``: extra seconds per request for those workers
    (tests and benchmarks)."""
    spec = os.environ.get("POSTTRAIN_SLOW_WORKER", "")
    return {int(w): float(s) for w, s in (item.split(":") for item in spec.split(",") if item)}


def iteration_requests(iteration: int, picked: list[int], group_size: int, batch_size: int) -> list[RolloutRequest]:
    """The requests of one iteration: its ``len(picked) * group_size`` samples in batches of ``batch_size``
    (sample ``p * group_size + g`` is prompt ``picked[p]``'s g-th, group ``p``), as the colocated
    :meth:`rollout.sampler.Sampler.rollout` batches them in one process."""
    n = len(picked) * group_size
    out = []
    for b, start in enumerate(range(0, n, batch_size)):
        ids = tuple(range(start, min(n, start + batch_size)))
        groups = tuple(i // group_size for i in ids)
        out.append(RolloutRequest(f"{iteration}:{b}", iteration, tuple(picked[g] for g in groups), groups, ids))
    return out


class RayEngine:
    """The Ray engine; every rank builds one, rank 0 owns the pool. Checkpointed: the prompts of queued
    iterations (a checkpoint of the local engine has none). ``cfg``: the run's
    :class:`posttrain.grpo.stage.GRPOConfig` (sent to the workers, which build their actors from it);
    ``perf``: the resolved speed options (the workers' too; ``reward_workers`` scoring threads);
    ``actor``: the rank's :class:`rollout.actor.RolloutActor` (the settings and device the results must
    match); ``prompts``: the run's :class:`pretrain.data.sampler.EpochSampler`; ``ranks``: the
    :class:`posttrain.grpo.ranks.RankLayout`; ``rewards``: the :class:`rewards.base.CompositeReward`;
    ``policy``: the trained :class:`posttrain.base.policy.Policy` (its weights are published);
    ``log``: writes a line to the run's log. Other collaborators offered to every engine are ignored."""

    state_optional = True

    def __init__(self, *, cfg, perf, actor, prompts, ranks, rewards, policy, log, **_):
        self.cfg, self.ro, self.eng, self.perf = cfg, cfg.rollout, cfg.engine, perf
        self.actor, self.prompts, self.ranks, self.rewards, self.policy, self.log = \
            actor, prompts, ranks, rewards, policy, log
        self.ahead = AHEAD[self.eng.mode](self.eng)
        self.picks: dict[int, list[int]] = {}  # queued iterations not trained yet -> their prompts
        self.queued: set[int] = set()
        self.pool, self.started, self.reward_actors, self.scored = None, False, [], 0
        self.scores: dict[str, Future | tuple] = {}
        workers = perf.reward_workers
        self.scoring = ThreadPoolExecutor(workers, thread_name_prefix="reward") if workers and ranks.is_main else None
        self.sync = {"weight_sync_bytes": 0, "weight_sync_tensors": 0, "weight_sync_s": 0.0}

    def stateful(self) -> dict:
        return {"rollout_engine": self}

    def state_dict(self) -> dict:
        return {"picks": {str(k): list(v) for k, v in self.picks.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.picks = {int(k): [int(i) for i in v] for k, v in state["picks"].items()}

    # -- setup -------------------------------------------------------------------------------
    def _start(self, version: int) -> None:
        from posttrain.grpo.engines.ray_pool import WorkerPool

        if self.ranks.is_main:
            cfg, perf, eng = self.cfg, self.perf, self.eng
            re = cfg.reward_engine
            extra = re.actors * re.num_cpus if re.engine == "ray" else 0.0
            self.pool = WorkerPool(eng, lambda i: (cfg, perf, True, i), self._score, slow_workers(), extra_cpus=extra)
            self.reward_actors = start_reward_actors(cfg.reward_engine, cfg.rewards)
            self.log(f"rollout engine: ray, {eng.workers} workers x (num_cpus={eng.num_cpus}, "
                     f"num_gpus={eng.num_gpus}), mode {eng.mode}, weight sync {eng.weight_sync}"
                     + (f" (max_staleness {self.ahead})" if eng.mode == "async" else ""))
        self.publish(version)

    def publish(self, version: int) -> None:
        """Every rank: build the weight packet of ``version`` (collective under FSDP2) from the weights the
        trainer would sample with (the actor's model: the old policy's, swapped in, for a loss that samples
        with them); rank 0 publishes it."""
        t0 = time.perf_counter()
        with self.actor.model():
            packet = WeightPacket.build(self.policy.model, version, self.policy.lora)
        if self.pool is not None:
            self.pool.publish(packet)
        self.sync = {"weight_sync_bytes": packet.nbytes, "weight_sync_tensors": len(packet.tensors),
                     "weight_sync_s": time.perf_counter() - t0}

    def _queue(self, iteration: int) -> None:
        """Every rank: make sure iterations up to ``iteration + ahead`` have prompts; rank 0 queues them."""
        ro = self.ro
        for it in range(iteration, iteration + self.ahead + 1):
            if it in self.queued:
                continue
            if it not in self.picks:  # restored picks (a resume) are queued again as they were
                self.picks[it] = self.prompts.next(ro.prompts_per_step)
            self.queued.add(it)
            if self.pool is not None:
                self.pool.submit(iteration_requests(it, self.picks[it], ro.group_size, ro.batch_size))

    def _score(self, result: RolloutResult, ref) -> None:  # dispatcher thread, as each result arrives
        if self.reward_actors:  # the actor reads the result from the object store itself
            actor = self.reward_actors[self.scored % len(self.reward_actors)]
            self.scored += 1
            self.scores[result.request_id] = actor.score.remote(ref)
            return
        t = result.trajectory
        args = (t.images, t.prompts, t.reward_metadata(result.iteration))
        self.scores[result.request_id] = (self.scoring.submit(self.rewards, *args) if self.scoring
                                          else args)

    # -- one iteration -----------------------------------------------------------------------
    def collect(self, iteration: int) -> RolloutBatch:
        """Every rank: the iteration's samples (this rank's share), and all rewards."""
        ranks, ro = self.ranks, self.ro
        if not self.started:
            self._start(iteration)
            self.started = True
        self._queue(iteration)
        picked = self.picks.pop(iteration)
        self.queued.discard(iteration)
        payload = self._gather(iteration, picked) if self.pool is not None else None
        if ranks.distributed:
            box = [payload]
            dist.broadcast_object_list(box, src=0)
            payload = box[0]
        full, total, raw, metrics = payload
        ranks.prompt_share(picked, ro.group_size)  # sets this rank's start / stop
        mine = full.select(torch.arange(ranks.start * ro.group_size, ranks.stop * ro.group_size)) \
            if ranks.distributed else full
        return RolloutBatch(picked, mine.to(self.actor.device), total, raw, full.group_ids.clone(),
                            {**metrics, **self.sync, **staleness_stats(full.versions, iteration)})

    def _gather(self, iteration: int, picked: list[int]):
        """Rank 0: wait for the iteration's results, check its sample ids, assemble and score them."""
        ro = self.ro
        requests = iteration_requests(iteration, picked, ro.group_size, ro.batch_size)
        t0 = time.perf_counter()
        results = self.pool.wait(iteration, [r.request_id for r in requests])
        t1 = time.perf_counter()
        check_sample_ids(iteration, results, len(picked) * ro.group_size)
        traj = Trajectory.cat([r.trajectory for r in results])
        settings = self.actor.settings(iteration)
        if not settings.same_as(traj.settings):
            raise RuntimeError(f"rollout iteration {iteration}: the workers sampled with other settings than the "
                               f"trainer's rollout: block (a worker built from another config?)")
        traj.settings = settings
        parts = []
        for r in requests:
            s = self.scores.pop(r.request_id)
            parts.append(s.result() if isinstance(s, Future) else self.rewards(*s) if isinstance(s, tuple)
                         else _ray_get(s))
        total = torch.cat([t for t, _ in parts])
        raw = {name: torch.cat([p[name] for _, p in parts]) for name in parts[0][1]}
        metrics = {"time_rollout_s": t1 - t0, "time_decode_s": 0.0, "time_reward_wait_s": time.perf_counter() - t1,
                   "rollout_worker_s": sum(r.rollout_s for r in results),
                   "rollout_decode_s": sum(r.decode_s for r in results),
                   "rollout_requests_per_worker": _per_worker(results, self.eng.workers),
                   "worker_restarts": len(self.pool.restarts)}
        return traj, total, raw, metrics

    def trained(self, version: int) -> dict:
        """Every rank, after the update: publish the weights of ``version`` (iterations trained)."""
        self.publish(version)
        return dict(self.sync)

    def close(self) -> None:
        if self.reward_actors:
            import ray

            for a in self.reward_actors:
                ray.kill(a, no_restart=True)
            self.reward_actors = []
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.scoring is not None:
            self.scoring.shutdown(wait=True)


def start_reward_actors(cfg, rewards: dict) -> list:
    """``reward_engine.actors`` :class:`posttrain.grpo.engines.reward_actor.RewardActor` actors (none for the
    local reward engine); Ray is already started by the worker pool."""
    if cfg.engine != "ray":
        return []
    import ray

    from posttrain.grpo.engines.reward_actor import RewardActor

    cls = ray.remote(RewardActor).options(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus)
    return [cls.remote(rewards, int(cfg.num_cpus) or 1) for _ in range(cfg.actors)]


def _ray_get(ref):
    import ray

    return ray.get(ref)


def _per_worker(results: list[RolloutResult], workers: int) -> str:
    counts = [0] * workers
    for r in results:
        counts[r.worker] += 1
    return ",".join(map(str, counts))


def check_sample_ids(iteration: int, results: list[RolloutResult], n: int) -> None:
    """``RuntimeError`` unless the results hold sample ids 0..n-1 exactly once each."""
    ids = torch.cat([r.trajectory.sample_ids for r in results]).tolist()
    if sorted(ids) != list(range(n)):
        seen: dict[int, int] = {}
        for i in ids:
            seen[i] = seen.get(i, 0) + 1
        missing = sorted(set(range(n)) - set(seen))
        twice = sorted(i for i, c in seen.items() if c > 1)
        raise RuntimeError(f"rollout iteration {iteration}: sample ids missing {missing[:10]} or repeated "
                           f"{twice[:10]} in the workers' results")
