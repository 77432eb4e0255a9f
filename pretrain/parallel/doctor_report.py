"""Options, verdicts and report files of ``posttrain doctor``; plain Python without torch (the measuring
under ``torch.distributed`` is :mod:`pretrain.parallel.doctor`), so the rules are testable on made-up
numbers and ``posttrain --help`` does not import torch.

Verdicts (each a dict ``{"kind", "ranks", "hosts", "reason"}`` in ``report["flagged"]``):

- ``wrong result``: the rank's burn-in hash differs from the majority's (more than half of the ranks);
  with no majority every rank is named. Also a result that is not finite or changes between rounds.
- ``straggler``: slower than ``straggler_ratio`` x the median over ranks in every burn-in round.
- ``slow rank`` / ``slow link`` / ``failing link``: see :func:`classify_links`.
- ``slow collective``: busbw below ``--min-busbw`` (only when given).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path


def _rank_seconds(text: str) -> tuple[int, float]:
    rank, sep, seconds = text.partition(":")
    if not sep or not rank.isdigit():
        raise argparse.ArgumentTypeError(f"expected RANK:SECONDS, e.g. 1:0.5, got {text!r}")
    return int(rank), _non_negative(seconds)


def _link_seconds(text: str) -> tuple[tuple[int, int], float]:
    link, sep, seconds = text.partition(":")
    a, dash, b = link.partition("-")
    if not sep or not dash or not a.isdigit() or not b.isdigit() or a == b:
        raise argparse.ArgumentTypeError(f"expected A-B:SECONDS with two different ranks, e.g. 0-3:0.2, got {text!r}")
    return (min(int(a), int(b)), max(int(a), int(b))), _non_negative(seconds)


def _number(low: float, strict: bool, kind=float):
    def parse(text: str):
        value = kind(text)
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse: "invalid float value: 'x'"
    return parse


_non_negative, _non_negative_int, _positive_int = _number(0, False), _number(0, False, int), _number(1, False, int)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The doctor's options on ``p`` (``None`` defaults are chosen per device type at run time)."""
    a = p.add_argument
    a("--size", type=_positive_int, help="burn-in matrix side (default 1024 on GPU, 256 on CPU)")
    a("--iters", type=_positive_int, help="matmuls per burn-in round (default 400 on GPU, 100 on CPU)")
    a("--rounds", type=_positive_int, default=3, help="burn-in rounds; a rank's time is its fastest (default 3)")
    a("--straggler-ratio", type=_number(1, True), default=1.5,
      help="flag a rank whose burn-in time exceeds this x the median over ranks (default 1.5)")
    a("--collective-mib", type=_number(0, True), help="all_reduce / all_gather size, MiB (default 64 GPU, 8 CPU)")
    a("--collective-iters", type=_positive_int, default=5, help="timed iterations per collective (default 5)")
    a("--min-busbw", type=_non_negative, metavar="GBPS", help="flag a collective below this busbw, GB/s "
      "(default: report only)")
    a("--p2p-mib", type=_number(0, True), help="send/recv size per direction, MiB (default 8 GPU, 2 CPU)")
    a("--p2p-iters", type=_positive_int, default=5, help="timed exchanges per pair; the fastest counts (default 5)")
    a("--p2p-timeout", type=_number(0, True), default=60.0, help="seconds before a transfer counts as failing")
    a("--slow-link-ratio", type=_number(1, True), default=3.0,
      help="flag a link whose time exceeds this x the typical link time (default 3.0)")
    a("--seed", type=int, default=0, help="burn-in seed (the same on every rank)")
    a("--out", default="doctor", help="folder rank 0 writes doctor.json, exclude.txt, exclude_ranks.txt to")
    t = p.add_argument_group("fault injection (to test the doctor itself; never active unless passed)")
    t.add_argument("--inject-wrong-result", type=_non_negative_int, metavar="RANK",
                   help="flip one bit of RANK's burn-in result before hashing")
    t.add_argument("--inject-slow-rank", type=_rank_seconds, metavar="RANK:SECONDS",
                   help="RANK sleeps SECONDS in each burn-in round")
    t.add_argument("--inject-slow-link", type=_link_seconds, metavar="A-B:SECONDS",
                   help="ranks A and B sleep SECONDS in each transfer between them")



def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Every pair ``(a, b)``, ``a < b < n``, exactly once, as rounds of disjoint pairs (the circle method):
    ``n - 1`` rounds of ``n // 2`` pairs for even ``n``; for odd ``n``, ``n`` rounds in which one rank
    sits out (a bye). ``[]`` for ``n < 2``."""
    m = n + n % 2  # odd n: a phantom rank m - 1 = n; its partner has the bye
    order, rounds = list(range(m)), []
    for _ in range(m - 1):
        pairs = [(order[i], order[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(min(p), max(p)) for p in pairs if n not in p])
        order = [order[0], order[-1], *order[1:-1]]
    return rounds if n > 1 else []


def majority_hash(hashes: list[str]) -> tuple[str | None, list[int]]:
    """The hash that more than half of the ranks computed and the ranks (indices) that differ from it;
    ``(None, every rank)`` when no hash has a majority (e.g. two ranks that disagree)."""
    top, count = Counter(hashes).most_common(1)[0]
    if 2 * count <= len(hashes):
        return None, list(range(len(hashes)))
    return top, [r for r, h in enumerate(hashes) if h != top]


def median(values: list[float]) -> float:
    """The median of three or more values; of two, the smaller (with two ranks the faster is the
    reference: the mean of a straggler and a healthy rank would hide the straggler)."""
    return statistics.median(values) if len(values) > 2 else min(values)


def straggler_ratios(rounds_seconds: list[list[float]]) -> tuple[list[float], list[float]]:
    """``(each round's median over ranks, each rank's ratio)`` from ``rounds_seconds[rank][round]``
    (seconds): a rank's ratio is its smallest ``seconds / that round's median`` over the rounds, so a
    rank counts as slow only when it was slow in every round. Comparing within a round cancels what
    slows every rank at once (a loaded host, a shared CPU), which a rank's fastest time alone does not."""
    medians = [max(median(list(col)), 1e-12) for col in zip(*rounds_seconds)]
    return medians, [min(t / m for t, m in zip(row, medians)) for row in rounds_seconds]


def bus_bandwidth(op: str, nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s (1e9 bytes/s), nccl-tests' conventions: algbw = ``nbytes`` / ``seconds``
    (``nbytes``: the all_reduce buffer, the all_gather output); busbw = algbw x 2(n-1)/n (all_reduce) or
    x (n-1)/n (all_gather). ``ValueError`` for another ``op``."""
    factors = {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world}
    if op not in factors:
        raise ValueError(f"bus_bandwidth: unknown collective {op!r} (one of {sorted(factors)})")
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * factors[op]


def classify_links(times: dict[tuple[int, int], float | None], world: int, ratio: float) -> dict:
    """Judge the pair times (seconds; ``None``: the transfer raised or timed out) of ``world`` ranks.

    The typical link time is the :func:`median` over ranks of each rank's median link time, not the
    median over all pairs: with 4 ranks one slow NIC touches half of all pairs and would drag that up.
    A link is ``slow`` above ``ratio`` x typical, ``failing`` when it has no time. Localisation (the
    "bisection"): the all-pairs matrix is read by rows; a rank whose every link (at least two, so
    ``world >= 3``) is slow or failing is named as the fault (its NIC, GPU or host), the other bad links
    by their two ends. It cannot tell which end of a lone bad link is at fault, and it assumes most
    ranks are healthy. Returns ``{"baseline", "ratios": {pair: ratio | None}, "status": {pair: "ok" |
    "slow" | "failing"}, "slow_ranks": [rank], "bad_links": [pair]}`` (bad links not on a slow rank)."""
    per_rank = [[t for p, t in times.items() if r in p and t is not None] for r in range(world)]
    typical = [median(ts) for ts in per_rank if ts]
    baseline = max(median(typical), 1e-12) if typical else None
    ratios = {p: (t / baseline if t is not None else None) for p, t in times.items()}
    status = {p: "failing" if q is None else "slow" if q > ratio else "ok" for p, q in ratios.items()}
    slow_ranks = [r for r in range(world) if world >= 3 and
                  all(s != "ok" for p, s in status.items() if r in p) and any(r in p for p in status)]
    bad = [p for p, s in status.items() if s != "ok" and not set(p) & set(slow_ranks)]
    return {"baseline": baseline, "ratios": ratios, "status": status, "slow_ranks": slow_ranks,
            "bad_links": sorted(bad)}


def _flag(kind: str, ranks, rows, reason: str) -> dict:
    ranks = sorted(ranks)
    return {"kind": kind, "ranks": ranks, "hosts": sorted({rows[r]["host"] for r in ranks}), "reason": reason}


def build_report(rows: list[dict], settings: dict) -> dict:
    """The report (JSON-serialisable) from every rank's measurements, in rank order: each row has
    ``rank, host, local_rank, device, burn_in {hash, stable, finite, seconds}`` and with more than one
    rank ``collectives {op: median seconds}`` and ``pairs {(a, b): (seconds | None, error | None)}``.
    ``settings`` carries the sizes, thresholds and ``world``; ``exit_code`` is 1 when anything is flagged."""
    n, flagged = len(rows), []
    burn = [r["burn_in"] for r in rows]
    majority, wrong = majority_hash([b["hash"] for b in burn])
    for r in wrong:
        flagged.append(_flag("wrong result", [r], rows, f"rank {r}: burn-in hash {burn[r]['hash'][:12]} differs from "
                             + (f"the majority's {majority[:12]}" if majority else "every other rank's (no majority)")))
    for r, b in enumerate(burn):
        if r not in wrong and not (b["stable"] and b["finite"]):
            flagged.append(_flag("wrong result", [r], rows, f"rank {r}: burn-in result "
                                 + ("not finite" if not b["finite"] else "changes between rounds")))
    medians, ratios = straggler_ratios([b["rounds_seconds"] for b in burn])
    for r, q in enumerate(ratios):
        if q > settings["straggler_ratio"]:
            flagged.append(_flag("straggler", [r], rows, f"rank {r}: burn-in {burn[r]['seconds']:.3f} s, >= {q:.2f} x "
                                 f"the median over ranks in each round (> {settings['straggler_ratio']})"))
    collectives, pairs, links = [], [], None
    if n > 1:
        for op in rows[0]["collectives"]:
            seconds = max(row["collectives"][op] for row in rows)  # the slowest rank's median
            nbytes = settings["collective_bytes"][op]
            algbw, busbw = bus_bandwidth(op, nbytes, seconds, n)
            collectives.append({"op": op, "mib": nbytes / 2**20, "seconds": seconds, "algbw_gbps": algbw,
                                "busbw_gbps": busbw})
            if settings.get("min_busbw") is not None and busbw < settings["min_busbw"]:
                flagged.append(_flag("slow collective", range(n), rows, f"{op}: busbw {busbw:.2f} GB/s < "
                                     f"--min-busbw {settings['min_busbw']}"))
        times, errors = {}, {}  # the lower rank times the round trip; an error on either end fails the pair
        for row in rows:
            for p, (seconds, error) in row["pairs"].items():
                times[p] = seconds if row["rank"] == p[0] else times.get(p)
                errors.update({p: error} if error else {})
        times.update(dict.fromkeys(errors))
        links = classify_links(times, n, settings["slow_link_ratio"])
        for r in links["slow_ranks"]:
            mine = sorted((p, links["ratios"][p]) for p in times if r in p)
            flagged.append(_flag("slow rank", [r], rows, f"rank {r}: all {len(mine)} links slow or failing (x "
                                 + ", ".join("fail" if q is None else f"{q:.1f}" for _, q in mine) + ")"))
        for p in links["bad_links"]:
            q = links["ratios"][p]
            flagged.append(_flag("failing link" if q is None else "slow link", p, rows, f"link {p[0]}-{p[1]}: " + (
                errors.get(p, "no time") if q is None else f"{times[p]:.4f} s = {q:.1f} x the typical "
                f"{links['baseline']:.4f} s (> {settings['slow_link_ratio']})")))
        nbytes = 2 * settings["p2p_bytes"]  # both directions
        pairs = [{"a": a, "b": b, "seconds": t, "gbps": nbytes / t / 1e9 if t else None,
                  "ratio": links["ratios"][(a, b)], "status": links["status"][(a, b)], "error": errors.get((a, b))}
                 for (a, b), t in sorted(times.items())]
    flags = {r: [f["kind"] for f in flagged if r in f["ranks"] and f["kind"] != "slow collective"] for r in range(n)}
    return {
        "world_size": n, "backend": settings.get("backend"), "device": rows[0]["device"],
        "ranks": [{"rank": r, "host": row["host"], "local_rank": row["local_rank"], "device": row["device"],
                   "hash": burn[r]["hash"][:12], "burn_in_seconds": burn[r]["seconds"], "ratio": ratios[r],
                   "rounds_seconds": burn[r]["rounds_seconds"],
                   "flags": flags[r]} for r, row in enumerate(rows)],
        "burn_in": {k: settings[k] for k in ("size", "iters", "rounds")} | {"round_medians_seconds": medians},
        "collectives": collectives,
        "links": {"mib": settings["p2p_bytes"] / 2**20, "iters": settings["p2p_iters"],
                  "typical_seconds": links and links["baseline"], "pairs": pairs,
                  "matrix_seconds": [[next((x["seconds"] for x in pairs if {x["a"], x["b"]} == {i, j}), None)
                                      for j in range(n)] for i in range(n)]},
        "flagged": flagged,
        "thresholds": {k: settings.get(k) for k in ("straggler_ratio", "slow_link_ratio", "min_busbw",
                                                     "p2p_timeout")},
        "injected": settings.get("injected", {}),
        "exit_code": 1 if flagged else 0,
    }


def write_report(report: dict, out: str | Path) -> dict[str, Path]:
    """Write ``doctor.json``, ``exclude.txt`` (the flagged ranks' hosts, comma-separated on one line, for
    ``srun --exclude``) and ``exclude_ranks.txt`` (the ranks, comma-separated) into ``out`` (created).
    Both ends of a bad link are listed; a slow collective alone excludes nothing. Returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    blamed = [f for f in report["flagged"] if f["kind"] != "slow collective"]
    paths = {"json": out / "doctor.json", "hosts": out / "exclude.txt", "ranks": out / "exclude_ranks.txt"}
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["hosts"].write_text(",".join(sorted({h for f in blamed for h in f["hosts"]})) + "\n")
    paths["ranks"].write_text(",".join(str(r) for r in sorted({r for f in blamed for r in f["ranks"]})) + "\n")
    return paths


def _table(title: str, headers: list[str], rows: list[list[str]]) -> str:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
        lines = [title] + ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in [headers, *rows]]
        return "\n".join(lines)
    table = Table(title=title, title_justify="left")
    for h in headers:
        table.add_column(h)
    for row in rows:
        table.add_row(*map(str, row))
    console = Console(width=120, force_terminal=False, color_system=None)
    with console.capture() as capture:
        console.print(table)
    return capture.get().rstrip()


def format_report(report: dict) -> str:
    """The short table printed by rank 0: ranks (hash, burn-in, slowest link), collectives, flagged."""
    worst = {}
    for x in report["links"]["pairs"]:
        for r, peer in ((x["a"], x["b"]), (x["b"], x["a"])):
            key = float("inf") if x["ratio"] is None else x["ratio"]
            if key >= worst.get(r, (-1, None))[0]:
                worst[r] = (key, peer)
    rows = [[r["rank"], r["host"], r["hash"], f"{r['burn_in_seconds']:.3f}", f"{r['ratio']:.2f}",
             "-" if r["rank"] not in worst else f"{worst[r['rank']][1]} x{worst[r['rank']][0]:.1f}",
             ", ".join(r["flags"]) or "ok"] for r in report["ranks"]]
    parts = [_table(f"posttrain doctor: {report['world_size']} ranks, {report['backend'] or 'no group'}, "
                    f"{report['device']}", ["rank", "host", "hash", "burn-in s", "x median", "slowest link",
                                            "flags"], rows)]
    if report["collectives"]:
        parts.append(_table("collectives", ["op", "MiB", "seconds", "algbw GB/s", "busbw GB/s"], [
            [c["op"], f"{c['mib']:g}", f"{c['seconds']:.4f}", f"{c['algbw_gbps']:.2f}", f"{c['busbw_gbps']:.2f}"]
            for c in report["collectives"]]))
    parts += [f"FLAGGED {f['kind']}: {f['reason']} (hosts {', '.join(f['hosts'])})" for f in report["flagged"]]
    parts.append(f"verdict: {len(report['flagged'])} flagged; exit {report['exit_code']}")
    return "\n".join(parts)
