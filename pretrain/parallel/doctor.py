"""``posttrain doctor``: a pre-flight health check of the ranks ``torchrun`` starts (gloo on CPU, NCCL on
GPUs; one plain process runs the single-rank checks). Every check is collective over all ranks; each
rank measures, one ``all_gather_object`` brings the numbers together, and every rank judges them with
:mod:`pretrain.parallel.doctor_report` (rank 0 prints the table and writes the files).

1. **Burn-in.** A float32 ``size x size`` matrix ``A`` (gain 2, a chaotic tanh network, so a one-off
   error grows instead of washing out) and a start ``X``, drawn on the CPU from a seeded
   ``torch.Generator`` and copied to the rank's device, then ``X = tanh(A @ X)`` ``iters`` times. The
   sha256 of the result's bytes must match the majority's: the same kernels on the same device type give
   bit-identical results, so a differing rank computes wrongly. A mixed fleet (different GPU models,
   CPUs with different vector units, CPU next to GPU) picks different kernels and is not comparable.
   Timed over ``rounds`` rounds (a barrier before each); a rank's time is its fastest round (robust to
   scheduler noise); a straggler is slower than ``--straggler-ratio`` x the median.
2. **Collectives.** ``all_reduce`` and ``all_gather`` of ``--collective-mib`` float32 (one warm-up, then
   timed iterations, the median per rank, the slowest rank's median counts): algbw and busbw with
   nccl-tests' conventions.
3. **Links.** Every pair of ranks exchanges ``--p2p-mib`` both ways (the lower rank sends first, then
   receives; the higher rank the reverse, so no deadlock), in rounds of disjoint pairs (the circle method:
   ``n - 1`` rounds of ``n / 2`` concurrent pairs, a bye for odd ``n``; a barrier between rounds), a warm-up
   then ``--p2p-iters`` timed round trips, the fastest as the lower rank measures it (a link counts as slow
   only when every exchange was slow: one scheduling hiccup on a loaded host is not a bad link). A transfer that raises
   or exceeds ``--p2p-timeout`` makes the pair failing. Naming the fault is a read of the all-pairs matrix,
   not an adaptive search: a rank whose every link is bad is named (its NIC / GPU), otherwise each bad link
   by its two ends (see ``classify_links``). A dead rank is not diagnosed here: the group's collectives
   then wait for the process group's timeout and ``torchrun`` reports the rank.
4. **Fault injection** (``--inject-*``) plants a wrong result, a straggler or a slow link, to test the
   doctor itself; never active unless passed.
"""

from __future__ import annotations

import hashlib
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pretrain.parallel.doctor_report import build_report, format_report, round_robin, write_report
from pretrain.parallel.launch import init_distributed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    if dist.is_initialized():
        dist.barrier()
    _sync(device)


def burn_in(device: torch.device, size: int, iters: int, rounds: int, seed: int = 0, flip_bit: bool = False,
            sleep_s: float = 0.0) -> dict:
    """Run the seeded matmul chain (float32 ``[size, size]``, ``iters`` steps) ``rounds`` times on
    ``device`` (a barrier before each round when a group is joined). ``flip_bit`` flips the lowest bit of
    the first element before hashing and ``sleep_s`` sleeps inside each timed round (fault injection).
    Returns ``{"hash": sha256 hex of the last round's result, "stable": every round hashed the same,
    "finite": bool, "seconds": the fastest round's wall time, "rounds_seconds": [each round]}``."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(size, size, generator=g) * (2.0 / size**0.5)).to(device)
    x0 = torch.randn(size, size, generator=g).to(device)
    hashes, times, finite = [], [], True
    for _ in range(rounds):
        _barrier(device)
        start = time.perf_counter()
        x = x0
        for _ in range(iters):
            x = torch.tanh(a @ x)
        _sync(device)
        time.sleep(sleep_s)
        times.append(time.perf_counter() - start)
        host = x.cpu()
        if flip_bit:
            host.view(torch.int32).view(-1)[0] ^= 1
        finite = finite and bool(torch.isfinite(host).all())
        hashes.append(hashlib.sha256(host.numpy().tobytes()).hexdigest())
    return {"hash": hashes[-1], "stable": len(set(hashes)) == 1, "finite": finite, "seconds": min(times),
            "rounds_seconds": times}


def collective_times(device: torch.device, numel: int, iters: int) -> dict[str, float]:
    """Median wall seconds on this rank of ``all_reduce`` of ``numel`` float32 and of ``all_gather`` whose
    output has ``numel`` float32 (``numel`` divisible by the world size), after one warm-up each."""
    n = dist.get_world_size()
    buf = torch.zeros(numel, device=device)  # zeros: repeated sums stay finite
    parts = list(torch.empty(numel, device=device).chunk(n))
    ops = {"all_reduce": lambda: dist.all_reduce(buf), "all_gather": lambda: dist.all_gather(parts, buf[: numel // n])}
    out = {}
    for name, op in ops.items():
        op()
        times = []
        for _ in range(iters):
            _barrier(device)
            start = time.perf_counter()
            op()
            _sync(device)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def _exchange(peer: int, first: bool, send: torch.Tensor, recv: torch.Tensor, timeout: timedelta) -> None:
    steps = [(dist.isend, send), (dist.irecv, recv)]
    for op, tensor in steps if first else steps[::-1]:
        op(tensor, peer).wait(timeout)  # raises when the transfer fails or exceeds the timeout


def pair_times(device: torch.device, numel: int, iters: int, timeout_s: float,
               slow_link: tuple[tuple[int, int], float] | None = None) -> dict:
    """Exchange ``numel`` float32 both ways with each peer of the round-robin schedule, in ``iters + 1``
    passes over the whole schedule (pass 0 warms up: NCCL connects a pair on first use), so each pair's
    samples are spread over the check's duration like every other pair's and a burst of load elsewhere
    does not land on one pair alone. ``slow_link`` ``((a, b), seconds)`` sleeps in each timed exchange of
    that pair on both ends (fault injection). Returns ``{(a, b): (fastest seconds | None, error | None)}``
    for this rank's pairs; a transfer that raises or times out gives ``(None, "ErrorType: message")`` and a
    line on stderr, and that pair is not tried again."""
    rank, schedule = dist.get_rank(), round_robin(dist.get_world_size())
    send, recv = torch.zeros(numel, device=device), torch.empty(numel, device=device)
    timeout, times, errors = timedelta(seconds=timeout_s), {}, {}
    for i in range(iters + 1):
        for pairs in schedule:
            _barrier(device)
            pair = next((p for p in pairs if rank in p), None)
            if pair is None or pair in errors:  # the bye, or a link that already failed
                continue
            peer = pair[1] if pair[0] == rank else pair[0]
            start = time.perf_counter()
            try:
                time.sleep(slow_link[1] if i and slow_link and slow_link[0] == pair else 0.0)
                _exchange(peer, rank < peer, send, recv, timeout)
                _sync(device)
            except Exception as e:  # noqa: BLE001 -- any backend error marks the link failing
                errors[pair] = f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0]
                print(f"doctor: rank {rank}: link {pair[0]}-{pair[1]} failing: {errors[pair]}", file=sys.stderr,
                      flush=True)
            if i:
                times.setdefault(pair, []).append(time.perf_counter() - start)
    return {p: (None, errors[p]) if p in errors else (min(ts), None) for p, ts in times.items()}


def _check_ranks(args, world: int) -> None:
    from pretrain.config import ConfigError

    planted = [("--inject-wrong-result", [args.inject_wrong_result] if args.inject_wrong_result is not None else [])]
    planted += [("--inject-slow-rank", [args.inject_slow_rank[0]] if args.inject_slow_rank else []),
                ("--inject-slow-link", list(args.inject_slow_link[0]) if args.inject_slow_link else [])]
    for option, ranks in planted:
        if any(r >= world for r in ranks):
            raise ConfigError(f"{option}: rank {max(ranks)} is not below the world size {world}")


def run_doctor(args) -> int:
    """Run every check on this rank (``args``: the options of :func:`doctor_report.add_arguments`), gather,
    judge; rank 0 prints the table and writes ``args.out``. Returns the exit code, the same on every rank:
    0 nothing flagged, 1 something flagged. ``ConfigError`` (exit 2) for an injected rank outside the
    world, checked before the group is joined."""
    start = time.perf_counter()
    _check_ranks(args, int(os.environ.get("WORLD_SIZE", "1")))
    device = init_distributed()
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    gpu = device.type == "cuda"
    size, iters = args.size or (1024 if gpu else 256), args.iters or (400 if gpu else 100)
    coll_numel = max(world, int((args.collective_mib or (64 if gpu else 8)) * 2**18) // world * world)
    p2p_numel = max(1, int((args.p2p_mib or (8 if gpu else 2)) * 2**18))
    slow_rank = args.inject_slow_rank if args.inject_slow_rank and args.inject_slow_rank[0] == rank else None
    try:
        row = {"rank": rank, "host": socket.gethostname(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
               "device": str(device),
               "burn_in": burn_in(device, size, iters, args.rounds, args.seed, args.inject_wrong_result == rank,
                                  slow_rank[1] if slow_rank else 0.0)}
        if world > 1:
            row["collectives"] = collective_times(device, coll_numel, args.collective_iters)
            row["pairs"] = pair_times(device, p2p_numel, args.p2p_iters, args.p2p_timeout, args.inject_slow_link)
        rows = [None] * world
        if dist.is_initialized():
            dist.all_gather_object(rows, row)
        else:
            rows = [row]
        settings = {"world": world, "backend": dist.get_backend() if dist.is_initialized() else None,
                    "size": size, "iters": iters, "rounds": args.rounds, "p2p_iters": args.p2p_iters,
                    "collective_bytes": {"all_reduce": coll_numel * 4, "all_gather": coll_numel * 4},
                    "p2p_bytes": p2p_numel * 4, "straggler_ratio": args.straggler_ratio,
                    "slow_link_ratio": args.slow_link_ratio, "min_busbw": args.min_busbw,
                    "p2p_timeout": args.p2p_timeout,
                    "injected": {k: v for k, v in (("wrong_result", args.inject_wrong_result),
                                                   ("slow_rank", args.inject_slow_rank),
                                                   ("slow_link", args.inject_slow_link)) if v is not None}}
        report = build_report(rows, settings)
        report["seconds"] = time.perf_counter() - start
        if rank == 0:
            paths = write_report(report, args.out)
            print(format_report(report) + f"\nreport: {paths['json']}  exclude: {paths['hosts']}", flush=True)
        if dist.is_initialized():
            dist.barrier()  # rank 0 has written before any rank exits (torchrun stops the rest on a non-zero exit)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return report["exit_code"]
