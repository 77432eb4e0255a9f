"""Loss equality between two commits: ``python scripts/loss_compare.py REF [--head HEAD]``.

Checks out REF (and HEAD, default the working tree) into temporary git worktrees, runs the same tiny
runs in each (pretrain; GRPO with LoRA and with full fine-tuning; offline and online Diffusion-DPO;
midtraining; the forward-process losses NFT and DGPO; video pretrain and video GRPO), each through ``python -m posttrain`` in its own checkout, and prints
their per-step metrics side by side. Timings, throughput and memory are left out; every other metric
must be equal to the last bit. Exit 0 when all are identical, 1 otherwise (2 on a usage error).

In the spirit of torchtitan's ``scripts/loss_compare.py``: a refactor that claims to change nothing
shows it here. ``--allow KEY=REASON`` names a metric that changes on purpose (printed, not failed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_PREFIXES = ("time_", "samples_per_s", "peak_rss", "wall", "images_per_s", "pairs_per_s", "tflops", "mfu")

# (name, command, config, overrides, stage folder, needs): {pretrain}/{video_pretrain}/{pairs} are filled in.
RUNS = [
    ("pretrain", "pretrain", "configs/pretrain/emoji_tiny.yaml", ["train.steps=20", "eval.every=10"], "pretrain", None),
    ("grpo_lora", "grpo", "configs/grpo/emoji_tiny.yaml", ["train.steps=2"], "grpo", "pretrain"),
    ("grpo_full", "grpo", "configs/grpo/emoji_tiny.yaml", ["train.steps=2", "policy.lora_rank=0"], "grpo", "pretrain"),
    ("dpo_online", "dpo", "configs/dpo/emoji_tiny.yaml", ["train.steps=5"], "dpo", "pretrain"),
    ("dpo_offline", "dpo", "configs/dpo/emoji_tiny.yaml",
     ["source=offline", "offline.path={pairs}", "offline.heldout_fraction=0.25", "train.steps=4",
      "checkpoint.every=2"], "dpo", "pretrain"),
    ("midtrain", "midtrain", "configs/midtrain/emoji_tiny.yaml", [], "midtrain", "pretrain"),
    ("grpo_nft", "grpo", "configs/grpo/emoji_nft.yaml",
     ["data.limit=256", "rollout.num_inference_steps=6", "rollout.prompts_per_step=4", "rollout.group_size=4",
      "rollout.batch_size=16", "train.steps=2", "train.batch_size=8", "checkpoint.every=0", "eval.every=0",
      "eval.grid_prompts=8", "eval.num_inference_steps=6", "grpo.loss.timesteps_per_sample=2"], "grpo", "pretrain"),
    ("grpo_dgpo", "grpo", "configs/grpo/emoji_dgpo.yaml",
     ["data.limit=256", "rollout.num_inference_steps=6", "rollout.prompts_per_step=4", "rollout.group_size=4",
      "rollout.batch_size=16", "train.steps=2", "train.batch_size=8", "checkpoint.every=0", "eval.every=0",
      "eval.grid_prompts=8", "eval.num_inference_steps=6", "grpo.loss.timesteps_per_sample=2"], "grpo", "pretrain"),
    ("video_pretrain", "pretrain", "configs/pretrain/moving_emoji_tiny.yaml", [], "pretrain", None),
    ("video_grpo", "grpo", "configs/grpo/emoji_tiny.yaml",
     ["data.source=moving_emoji", "data.frames=4", "data.limit=32", "rewards.jpeg_compressibility=0",
      "rewards.motion_direction=1.0", "rewards.temporal_consistency=0.1", "train.steps=2", "train.batch_size=16"],
     "grpo", "video_pretrain"),
]


def write_pairs(path: Path, n: int = 32) -> Path:
    """A small Pick-a-Pic-schema parquet file (caption, jpg_0, jpg_1, label_0): a flat-colour image
    preferred over a noisy one, deterministic."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    captions = (ROOT / "configs/prompts/openmoji/train.txt").read_text().splitlines()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        flat = np.full((32, 32, 3), rng.integers(0, 256, 3), dtype=np.uint8)
        noisy = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        enc = []
        for arr in (flat, noisy):
            buf = io.BytesIO()
            Image.fromarray(arr).save(buf, format="JPEG", quality=90)
            enc.append(buf.getvalue())
        first = i % 2 == 0
        rows.append({"caption": captions[i % len(captions)], "jpg_0": enc[0] if first else enc[1],
                     "jpg_1": enc[1] if first else enc[0], "label_0": 1.0 if first else 0.0})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def checkout(ref: str | None, into: Path) -> Path:
    """A worktree of ``ref`` at ``into``; None = the working tree as it is (no copy)."""
    if ref is None:
        return ROOT
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(into), ref],
                   check=True, capture_output=True)
    return into


def run_all(tree: Path, out: Path, pairs: Path, cache: str) -> dict[str, list[dict]]:
    """Every run of ``RUNS`` in checkout ``tree`` with outputs under ``out``; {name: metrics records}."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "POSTTRAIN_CACHE": cache, "TOKENIZERS_PARALLELISM": "false"}
    results: dict[str, list[dict]] = {}
    for name, command, config, overrides, stage, needs in RUNS:
        run_dir = out / name
        filled = [o.format(pairs=pairs) for o in overrides]
        if needs:
            filled.append(f"model.pretrained={out / needs / 'pretrain' / 'export'}")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "posttrain", command, config, f"run_dir={run_dir}", *filled],
                              cwd=tree, env=env, capture_output=True, text=True)
        print(f"  {name}: exit {proc.returncode} in {time.perf_counter() - t0:.0f} s", flush=True)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            results[name] = []
            continue
        path = run_dir / stage / "metrics.jsonl"
        results[name] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return results


def compared(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not k.startswith(SKIP_PREFIXES)}


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and type(a) is type(b)


SHOWN = ("loss", "reward_mean", "kl", "heldout_loss", "heldout_implicit_acc", "grad_norm")


def compare(ref: dict[str, list[dict]], head: dict[str, list[dict]], allow: dict[str, str]) -> bool:
    """Print each run's records side by side (a few headline metrics; every differing one in full);
    True when every compared value is identical."""
    ok = True
    for name, *_ in RUNS:
        a, b = ref.get(name, []), head.get(name, [])
        print(f"\n== {name}: {len(a)} records at REF, {len(b)} at HEAD")
        if not a or not b or len(a) != len(b):
            print("   MISMATCH: record counts differ or a run failed")
            ok = False
            continue
        for ra, rb in zip(a, b):
            ra, rb = compared(ra), compared(rb)
            keys = sorted(set(ra) | set(rb))
            bad = [k for k in keys if not same(ra.get(k, "<absent>"), rb.get(k, "<absent>"))]
            shown = "  ".join(f"{k} {ra[k]:.10g}" for k in SHOWN if k in ra and isinstance(ra[k], float))
            print(f"   step {ra.get('step', '?'):>3}: {len(keys) - len(bad)}/{len(keys)} metrics equal  {shown}")
            for key in bad:
                allowed = key in allow
                ok = ok and allowed
                print(f"   {'~' if allowed else 'X'} {key}: REF {ra.get(key, '<absent>')!r}  HEAD {rb.get(key, '<absent>')!r}"
                      + (f"  ({allow[key]})" if allowed else ""))
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ref", help="the commit to compare against (e.g. main~3 or a hash)")
    p.add_argument("--head", default=None, help="the commit compared; default the working tree as it is")
    p.add_argument("--allow", action="append", default=[], metavar="KEY=REASON",
                   help="a metric that changes on purpose, with the reason (repeatable)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folders (their path is printed)")
    args = p.parse_args(argv)
    allow = {}
    for item in args.allow:
        if "=" not in item:
            p.error(f"--allow {item!r}: expected KEY=REASON")
        k, v = item.split("=", 1)
        allow[k] = v
    work = Path(tempfile.mkdtemp(prefix="loss_compare_"))
    cache = os.environ.get("POSTTRAIN_CACHE") or str(work / "cache")
    pairs = write_pairs(work / "pairs.parquet")
    trees = []
    try:
        results = {}
        for label, ref in (("REF", args.ref), ("HEAD", args.head)):
            tree = checkout(ref, work / label.lower())
            if tree != ROOT:
                trees.append(tree)
            rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip()
            dirty = tree == ROOT and subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"],
                                                    capture_output=True, text=True).stdout.strip()
            print(f"{label}: {ref or 'working tree'} ({rev}{', with uncommitted changes' if dirty else ''})", flush=True)
            results[label] = run_all(tree, work / f"runs_{label.lower()}", pairs, cache)
        ok = compare(results["REF"], results["HEAD"], allow)
    finally:
        for tree in trees:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
        if args.keep:
            print(f"kept: {work}")
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    print("\nidentical" if ok else "\nDIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
