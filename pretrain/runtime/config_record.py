"""Each start of a run keeps its config: ``config.yaml`` for the first, ``config.resume-<N>.yaml`` for
the N-th resume, so a resumed run never overwrites what the checkpoints were trained with; the settings
a resume changed are logged (the ones it must not change are refused by the checkpoint's shape)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from omegaconf import OmegaConf

log = logging.getLogger(__name__)
_RESUME = re.compile(r"^config\.resume-(\d+)\.yaml$")
NOT_A_CHANGE = ("checkpoint.resume",)  # differs on every resume by definition


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def changed_keys(before: dict, after: dict) -> list[str]:
    """``"key: old -> new"`` for each dotted key whose value differs between two config trees (a key
    only one side has shows ``<absent>`` on the other), sorted by key."""
    a, b = _flat(before), _flat(after)
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in sorted(set(a) | set(b))
            if k not in NOT_A_CHANGE and a.get(k, "<absent>") != b.get(k, "<absent>")]


def record_config(cfg, run: str | Path, resume: bool) -> Path | None:
    """Write ``cfg`` (a config dataclass) into the run folder ``run``; returns the file written (None
    when nothing is written).

    A fresh run writes ``config.yaml`` (replacing one left by a run that never checkpointed). A resume
    of a run that has a ``config.yaml`` writes ``config.resume-<N>.yaml`` (N = 1, 2, ...) and logs the
    keys whose value differs from the previous start's. A non-resuming start in a folder that already
    holds checkpoints writes nothing (the runtime refuses it), so the existing config is kept."""
    run = Path(run)
    first = run / "config.yaml"
    checkpointed = any((run / "checkpoints").glob("step_*"))
    now = OmegaConf.to_container(OmegaConf.structured(cfg))
    if not first.is_file() or (not resume and not checkpointed):
        first.write_text(OmegaConf.to_yaml(now))
        return first
    if not resume:
        return None
    earlier = sorted((int(m.group(1)), p) for p in run.iterdir() if (m := _RESUME.match(p.name)))
    previous = earlier[-1][1] if earlier else first
    out = run / f"config.resume-{earlier[-1][0] + 1 if earlier else 1}.yaml"
    out.write_text(OmegaConf.to_yaml(now))
    changes = changed_keys(OmegaConf.to_container(OmegaConf.load(previous)), now)
    if changes:
        log.warning("resuming with settings changed since %s (this start's config: %s): %s", previous.name,
                    out.name, "; ".join(changes))
    return out
