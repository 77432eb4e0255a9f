"""Rollout workers on Ray: a placement group of ``engine.workers`` bundles (``num_cpus`` /
``num_gpus`` each), one :class:`posttrain.grpo.engines.worker.RolloutWorker` actor per bundle, and a
dispatcher thread in the trainer's rank-0 process that hands each idle worker the next queued request
(with the newest weight packet when the worker's is older), fetches results as they finish, and
replaces a worker that died (its request is sent again; results are keyed by request id, so none is
lost or kept twice)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict, deque
from typing import Callable

from posttrain.grpo.engines.weight_sync import WeightPacket
from rollout.records import RolloutRequest, RolloutResult

log = logging.getLogger(__name__)


def start_ray(address: str | None, num_cpus: int) -> bool:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``), else start a local one with ``num_cpus``
    logical CPUs; returns True when this call started Ray (so :meth:`WorkerPool.close` shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    env = {k: v for k, v in os.environ.items() if k in ("HF_HUB_OFFLINE", "POSTTRAIN_CACHE", "TOKENIZERS_PARALLELISM",
                                                      "WANDB_MODE", "HF_HOME")}
    kw = dict(include_dashboard=False, configure_logging=False, log_to_driver=True, namespace="posttrain",
              runtime_env={"env_vars": env})
    if address:
        check_reachable(address)
        ray.init(address=address, **kw)
    else:
        ray.init(num_cpus=num_cpus, **kw)
    return True


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """``ConnectionError`` naming ``engine.ray_address`` / ``RAY_ADDRESS`` when a ``host:port`` address
    does not accept a connection (``ray.init`` would retry for minutes); other forms (``auto``,
    ``ray://...``) are left to Ray."""
    import socket

    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"engine.ray_address / RAY_ADDRESS {address!r}: no Ray cluster answers there ({e}); "
                              f"start one with `ray start --head` or leave both unset for a local cluster") from e


class WorkerPool:
    """Rank 0's handle on the rollout workers of ``eng`` (the ``engine:`` block,
    :class:`posttrain.grpo.engines.config.RolloutEngineConfig`). ``make_args(index)`` gives a worker's constructor
    arguments; ``on_result(result, ref)`` runs in the dispatcher thread for every new result and its
    object ref (e.g. to start scoring it). ``max_restarts``: dead workers replaced over the run before the pool gives up
    (``RuntimeError``). ``timeout_s``: how long the placement group may take to fit. ``extra_cpus``:
    logical CPUs a local cluster needs beyond the workers' (reward actors)."""

    def __init__(self, eng, make_args: Callable[[int], tuple], on_result: Callable[[RolloutResult, object], None],
                 delays: dict[int, float] | None = None, *, max_restarts: int | None = None, timeout_s: float = 300,
                 extra_cpus: float = 0.0):
        import ray
        from ray.util.placement_group import placement_group

        from posttrain.grpo.engines.worker import RolloutWorker

        need = int(eng.workers * max(eng.num_cpus, 1) + extra_cpus + 0.999)
        self.started_ray = start_ray(eng.ray_address, max(os.cpu_count() or 1, need))
        bundle = {"CPU": eng.num_cpus, **({"GPU": eng.num_gpus} if eng.num_gpus else {})}
        self.pg = placement_group([dict(bundle) for _ in range(eng.workers)], strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            raise RuntimeError(f"engine.workers={eng.workers} x (num_cpus={eng.num_cpus}, num_gpus={eng.num_gpus}) "
                               f"does not fit the Ray cluster's free resources ({ray.available_resources()}) within "
                               f"{timeout_s:.0f} s")
        self.eng, self.make_args, self.on_result, self.delays = eng, make_args, on_result, delays or {}
        self.cls = ray.remote(RolloutWorker)
        self.actors = [self._spawn(i) for i in range(eng.workers)]
        self.held = [-1] * eng.workers  # the weights version each worker holds (or was sent)
        self.busy: dict = {}  # object ref -> (worker, request)
        self.queue: deque[RolloutRequest] = deque()
        self.results: dict[int, dict[str, RolloutResult]] = defaultdict(dict)
        self.latest: tuple[int, object] | None = None  # (version, object ref of the packet)
        self.error: BaseException | None = None
        self.restarts, self.max_restarts = [], 2 * eng.workers if max_restarts is None else max_restarts
        self.duplicates = 0
        self.collective, self.group, self.generation, self.synced = eng.weight_sync == "collective", None, 0, -1
        if self.collective:
            self._form_group()
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="rollout-dispatch", daemon=True)
        self.thread.start()

    def _spawn(self, index: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index)
        return self.cls.options(num_cpus=self.eng.num_cpus, num_gpus=self.eng.num_gpus, scheduling_strategy=strategy,
                                max_restarts=0).remote(*self.make_args(index), self.delays.get(index, 0.0))

    def _form_group(self) -> None:
        """``engine.weight_sync: collective``: the trainer (rank 0) and every worker form a new
        generation of the weight group (gloo, or nccl for GPU workers)."""
        import ray
        import torch

        from posttrain.grpo.engines.weight_sync import WeightGroup

        world = len(self.actors) + 1
        backend = "nccl" if self.eng.num_gpus and torch.cuda.is_available() else "gloo"
        if self.group is None:
            self.host = ray.util.get_node_ip_address()
            self.store, self.port = WeightGroup.host_store(self.host, world)
        self.generation += 1
        joins = [a.join_weights.remote(self.host, self.port, i + 1, world, backend, self.generation)
                 for i, a in enumerate(self.actors)]
        self.group = WeightGroup(self.host, self.port, 0, world, backend, self.generation, store=self.store)
        ray.get(joins)
        self.synced = -1  # every worker receives the next push

    def _sync_collective(self, packet: WeightPacket) -> None:
        """Broadcast ``packet`` to every (idle) worker at once; a worker that died is replaced, the group
        formed again and the push repeated."""
        import ray
        from ray.exceptions import RayActorError

        from posttrain.grpo.engines.weight_sync import WeightGroup

        refs = [a.receive.remote(WeightGroup.meta(packet)) for a in self.actors]
        sent: BaseException | None = None
        try:
            self.group.broadcast(packet)
        except Exception as e:  # noqa: BLE001 - a member died mid-broadcast: the workers' refs say which
            sent = e
        try:
            ray.get(refs)
            if sent is not None:
                raise sent
        except RayActorError as e:
            dead = [w for w, r in enumerate(refs) if not _alive(r)]
            with self.cond:
                self.restarts += [(w, f"weights {packet.version}", time.time()) for w in dead]
                if len(self.restarts) > self.max_restarts:
                    self.error = RuntimeError(f"rollout workers {dead} died receiving weights {packet.version}; "
                                              f"{len(self.restarts)} have died in this run: {e}")
                    self.cond.notify_all()
                    return
            for w in dead:
                self.actors[w] = self._spawn(w)
            self._form_group()
            return
        except BaseException as e:  # noqa: BLE001 - a refused packet, a broken group: stops the run
            with self.cond:
                self.error = e
                self.cond.notify_all()
            return
        self.synced = packet.version

    # -- trainer side --------------------------------------------------------------------------
    def publish(self, packet: WeightPacket) -> None:
        """Make ``packet`` the weights every later request is sampled with (put in the object store once;
        with the collective path, broadcast when the workers are next idle)."""
        import ray

        ref = packet if self.collective else ray.put(packet)
        with self.cond:
            self.latest = (packet.version, ref)
            self.cond.notify_all()

    def submit(self, requests: list[RolloutRequest]) -> None:
        """Queue ``requests``; idle workers take them in order."""
        with self.cond:
            self.queue.extend(requests)
            self.cond.notify_all()

    def wait(self, iteration: int, request_ids: list[str], timeout_s: float | None = None) -> list[RolloutResult]:
        """Block until every request of ``iteration`` has a result; returns them in ``request_ids``
        order. Raises the first worker error (a sampling exception, a bad weight packet, more dead
        workers than ``max_restarts``)."""
        def done():
            return self.error is not None or all(r in self.results[iteration] for r in request_ids)

        with self.cond:
            if not self.cond.wait_for(done, timeout=timeout_s):
                raise TimeoutError(f"rollout iteration {iteration}: no result within {timeout_s} s")
            if self.error is not None:
                raise self.error
            got = self.results.pop(iteration)
        return [got[r] for r in request_ids]

    def kill(self, index: int) -> None:
        """Kill worker ``index`` (``ray.kill``): for fault-injection tests; the pool replaces it."""
        import ray

        ray.kill(self.actors[index], no_restart=True)

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout=30)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)
        if self.started_ray:
            ray.shutdown()

    # -- dispatcher thread -----------------------------------------------------------------------
    def _dispatch(self) -> None:  # under the lock
        idle = [w for w in range(len(self.actors)) if w not in {v[0] for v in self.busy.values()}]
        for w in idle:
            if not self.queue or self.latest is None:
                return
            request = self.queue.popleft()
            version, ref = self.latest
            packet = ref if self.held[w] != version and not self.collective else None
            self.held[w] = version
            self.busy[self.actors[w].sample.remote(request, packet)] = (w, request)

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - never leave the trainer waiting on a dead thread
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _serve(self) -> None:
        import ray

        while True:
            with self.cond:
                if self.closed:
                    return
                push = None
                if self.collective and self.latest is not None and self.latest[0] != self.synced:
                    push = self.latest[1] if not self.busy and self.error is None else None
                elif self.error is None:
                    self._dispatch()
                refs = list(self.busy)
            if push is not None:  # every worker is idle: broadcast, then dispatch again
                self._sync_collective(push)
                continue
            with self.cond:
                if not refs:
                    self.cond.wait(timeout=0.1)
                    continue
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.05)
            for ref in ready:
                self._finish(ref)

    def _finish(self, ref) -> None:
        import ray
        from ray.exceptions import RayActorError

        with self.cond:
            w, request = self.busy.pop(ref)
        try:
            result = ray.get(ref)
        except RayActorError as e:  # the worker died: replace it, send its request again
            with self.cond:
                self.restarts.append((w, request.request_id, time.time()))
                if len(self.restarts) > self.max_restarts:
                    self.error = RuntimeError(f"rollout worker {w} died while sampling {request.request_id} and "
                                              f"{len(self.restarts)} workers have died in this run (more than "
                                              f"{self.max_restarts}); last: {e}")
                else:
                    log.warning("rollout worker %d died while sampling %s; replacing it and sending the request again",
                                w, request.request_id)
                    self.actors[w] = self._spawn(w)
                    self.held[w] = -1
                    self.queue.appendleft(request)
                self.cond.notify_all()
            if self.collective and self.error is None:
                self._form_group()
            return
        except BaseException as e:  # noqa: BLE001 - surfaced to the trainer by wait()
            with self.cond:
                self.error = e  # a RayTaskError is also an instance of the exception the worker raised
                self.cond.notify_all()
            return
        with self.cond:
            if request.request_id in self.results[request.iteration]:
                self.duplicates += 1
                return
        self.on_result(result, ref)
        with self.cond:
            self.results[request.iteration][request.request_id] = result
            self.cond.notify_all()


def _alive(ref) -> bool:
    """False when the actor task behind ``ref`` ended with its actor's death."""
    import ray
    from ray.exceptions import RayActorError

    try:
        ray.get(ref, timeout=60)
    except RayActorError:
        return False
    except Exception:  # noqa: BLE001 - another error is not a death
        return True
    return True
