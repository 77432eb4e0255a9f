"""Metrics: ``metrics.jsonl`` (one JSON object per step), a tqdm progress bar, optional wandb."""

from __future__ import annotations

import json
import math
import secrets
import string
from pathlib import Path

from tqdm.auto import tqdm

from pretrain.runtime.config import WandbConfig


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible as strings
    return v


class MetricsLogger:
    """Append-only JSONL writer. A fresh run (``start_step`` 0) starts the file anew; on resume from
    ``start_step``, records after it (written by the interrupted run past its last checkpoint) and any
    torn line are dropped, so the file reads as one run; a wandb run is continued under its id
    (``wandb_run_id``), not started anew."""

    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int = 0, wandb: WandbConfig | None = None,
                 config: dict | None = None, show_keys: tuple[str, ...] = ("loss",), enabled: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled, self.show_keys = enabled, show_keys
        self._wandb, self._last_media = None, None
        if not enabled:
            return
        keep = []
        if start_step > 0 and self.path.exists():  # resume: keep what the checkpoint covers
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line torn by a kill mid-write
                    continue
                if rec.get("step", 0) <= start_step:
                    keep.append(line)
        self.path.write_text("".join(k + "\n" for k in keep))
        self._file = self.path.open("a")
        self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, mininterval=1.0)
        if wandb is not None and wandb.mode != "disabled":
            from pretrain.extras import require

            wandb_lib = require("wandb", f"wandb.mode: {wandb.mode}")
            self._wandb = wandb_lib.init(project=wandb.project, name=wandb.name, mode=wandb.mode,
                                         dir=str(run_dir), config=config, resume="allow",
                                         id=self._wandb_id(start_step > 0))

    def _wandb_id(self, resume: bool) -> str:
        """The wandb run id kept in ``<run_dir>/wandb_run_id``: a resumed run reuses it, so its curves
        continue the interrupted run's (its re-run steps equal the logged ones: resume is bitwise); a
        fresh run draws a new one."""
        path = self.path.parent / "wandb_run_id"
        if resume and path.is_file():
            return path.read_text().strip()
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # wandb's form
        path.write_text(run_id + "\n")
        return run_id

    def open_ended(self) -> None:
        """The progress bar counts steps without a total (and so shows no ETA): for a run that a budget,
        not ``train.steps``, ends (a sweep's)."""
        if self.enabled:
            self.bar.total = None
            self.bar.refresh()

    def log(self, step: int, metrics: dict, advance: bool = True) -> None:
        if not self.enabled:
            return
        rec = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if advance:
            self.bar.update(1)
        shown = {k: f"{metrics[k]:.4g}" for k in self.show_keys if isinstance(metrics.get(k), (int, float))}
        if shown:
            self.bar.set_postfix(shown, refresh=False)

    def log_media(self, step: int, grid: str | Path) -> None:
        """Mirror a sample grid to wandb at ``step`` (``samples/grid``, an image) and, when an MP4 of the
        clips lies beside it (video grids, :func:`pretrain.sampling.save_grid`), the clips too
        (``samples/video``). Nothing without wandb, nor for the grid logged last; the files stay in the run
        directory either way, so a failure here is reported and does not stop the run."""
        if not self.enabled or self._wandb is None or self._last_media == (step, str(grid)):
            return
        import wandb as wandb_lib

        grid = Path(grid)
        try:
            media = {"samples/grid": wandb_lib.Image(str(grid), caption=grid.name)}
            if grid.with_suffix(".mp4").exists():
                media["samples/video"] = wandb_lib.Video(str(grid.with_suffix(".mp4")), caption=grid.stem,
                                                         format="mp4")
            self._wandb.log(media, step=step)
            self._last_media = (step, str(grid))
        except Exception as err:  # noqa: BLE001 - media mirroring must never cost a run its export
            self.write(f"wandb: could not log {grid}: {type(err).__name__}: {err}")

    def write(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text)

    def close(self, exit_code: int = 0) -> None:
        """End the progress bar, the file and the wandb run (marked failed with a non-zero
        ``exit_code``); a second call does nothing."""
        if not self.enabled or self._file.closed:
            return
        self.bar.close()
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=exit_code)


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a ``metrics.jsonl``."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
