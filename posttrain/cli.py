"""The `posttrain` command: train a stage (`posttrain pretrain|grpo|dpo|midtrain CONFIG [key=value ...]`), chain
stages (`posttrain pipeline CONFIG`), race algorithms on equal wall-clock (`posttrain sweep CONFIG`),
sample (`posttrain sample MODEL ...`), evaluate (`posttrain eval MODEL [MODEL ...]`), serve rewards
over HTTP (`posttrain serve-reward CONFIG`), train a small reward model, learned_clip or the learned_judge
stand-in (`posttrain train-reward CONFIG [key=value ...]`), write a run's report with plots (`posttrain
report RUN_DIR`), curate a dataset by reward scores and near-duplicates (`posttrain curate CONFIG
[key=value ...]`), check a cluster's ranks before a job (`torchrun --nproc_per_node N -m posttrain doctor
[options]`: wrong results, stragglers, slow or failing links; exit 1 when anything is flagged).

Exit codes: 0 success, 2 config/usage error (message names the file and key), 1 run failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path


KEYS = Path(__file__).with_name("config_keys.json")  # the stage schemas' key trees (pretrain.config_keys)


def _stage(args) -> int:
    from pretrain.config_keys import check_keys

    check_keys(KEYS, args.command, args.config, args.overrides)  # a typo in a key: answered before torch loads
    from posttrain.stages import load_stage_config

    stage, cfg = load_stage_config(args.command, args.config, args.overrides)
    if stage.has_checkpoints() and _resuming(args.resume, [Path(cfg.run_dir) / args.command / "checkpoints"]):
        cfg.checkpoint.resume = True
    out = stage.train_fn()(cfg)
    if _rank() == 0:  # under torchrun every rank returns; rank 0 wrote the export
        print(f"{'reward model' if stage.writes == 'reward' else 'export'}: {out}")
    folder = Path(cfg.run_dir or "") / args.command
    if stage.writes != "reward" and (folder / "metrics.jsonl").is_file():  # a training stage: its curves
        from posttrain.eval.report import report_after_run

        report_after_run(folder)
    return 0


def _resuming(resume: str | None, folders: list[Path]) -> bool:
    """Whether to resume: ``--resume`` needs a complete checkpoint in one of ``folders`` (``ConfigError``,
    exit 2, naming them when there is none); ``--resume=auto`` starts fresh then (and says so); a
    torchrun restart counts as auto (the first attempt may have died before its first checkpoint)."""
    if resume is None:
        return False
    from pretrain.config import ConfigError
    from pretrain.runtime.checkpoint import CheckpointManager

    if any(CheckpointManager(f).steps() for f in folders):
        return True
    where = ", ".join(str(f) for f in folders) + ("" if any(f.parent.parent.is_dir() for f in folders)
                                                   else " (the run_dir does not exist)")
    if resume == "auto" or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        if _rank() == 0:
            print(f"--resume=auto: no checkpoint in {where}; starting a new run", file=sys.stderr)
        return False
    raise ConfigError(f"--resume: no checkpoint to resume from in {where}; drop --resume to start a new run, "
                      f"or pass --resume=auto to start one when there is nothing to resume")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _pipeline(args) -> int:
    from posttrain.pipeline import PipelineConfig, run_pipeline
    from pretrain.config import load_config

    cfg = load_config(PipelineConfig, args.config, args.overrides)
    folders = [Path(cfg.run_dir) / s.command / "checkpoints" for s in cfg.stages]
    result = run_pipeline(cfg, resume=_resuming(args.resume, folders))
    print("exports: " + ", ".join(result["exports"]))
    return 0


def _sweep(args) -> int:
    from posttrain.tools.sweep import SweepConfig, run_sweep
    from pretrain.config import load_config

    print(f"report: {run_sweep(load_config(SweepConfig, args.config, args.overrides))}")
    return 0


def _reward_params(path: str | None) -> dict:
    """``--reward-params FILE``: a YAML mapping {reward name: {parameter: value}}; ``ConfigError`` naming
    the flag and the file when it is missing or not such a mapping."""
    from pretrain.config import ConfigError

    if path is None:
        return {}
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--reward-params: cannot read '{path}': {e}") from e
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ConfigError(f"--reward-params: '{path}' must map reward names to parameter mappings")
    return data


def _eval(args) -> int:
    from posttrain.eval.evaluate import EvalConfig, eval_data, evaluate
    from pretrain.runtime.runtime import resolve_device

    from pretrain.config import ConfigError, validate

    try:
        cfg = EvalConfig(rewards=args.rewards, prompts=args.prompts, num_prompts=args.num_prompts,
                         samples_per_prompt=args.samples_per_prompt, seed=args.seed,
                         num_inference_steps=args.steps, guidance_scale=args.guidance_scale,
                         reward_params=_reward_params(args.reward_params), mark=args.mark,
                         guard_samples=args.guard_samples, grid_prompts=args.grid_prompts, data=list(args.data))
        validate(cfg, "--")
        data = eval_data(args.models[0], cfg.data)
    except ValueError as e:
        raise ConfigError(f"command line: {e}") from e
    out = args.out or str(Path(args.models[-1]).parent / "eval")
    print(evaluate(args.models, cfg, out, device=resolve_device(args.device), data=data)["table"])
    return 0


def _read_images(paths: list[str], count: int, height: int, width: int):
    """``--images``: one file per prompt (or one for every prompt) as float32 ``[count, 3, height, width]``
    in [0, 1], read as an editing folder's sources are (:func:`pretrain.data.folder.read_rgb`: on white,
    resized to the sampling size). ``ConfigError`` naming ``--images`` and the file for a wrong count, a
    missing file or one PIL cannot read."""
    import torch
    from PIL import Image, UnidentifiedImageError

    from pretrain.config import ConfigError
    from pretrain.data.folder import read_rgb

    if len(paths) not in (1, count):
        raise ConfigError(f"--images: {len(paths)} files for {count} prompts; give one per prompt, or one for all")
    out = []
    for path in paths:
        try:
            rgb = read_rgb(path, width, height)
        except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as e:
            raise ConfigError(f"--images: cannot read '{path}': {e}") from e
        out.append(torch.from_numpy(rgb.copy()).permute(2, 0, 1).float() / 255.0)
    images = torch.stack(out)
    return images.expand(count, -1, -1, -1) if len(paths) == 1 else images


def _sample(args) -> int:
    import torch

    from pretrain.backbone import ConditioningError
    from pretrain.codec import encode_conditions
    from pretrain.config import ConfigError
    from pretrain.export import load_exported
    from pretrain.runtime.runtime import resolve_device
    from pretrain.sampling import initial_noise, sample_latents, save_grid
    from pretrain.text_encoder import PromptEmbeds

    device = resolve_device(args.device)
    model, encoder, codec, meta = load_exported(args.model, device=str(device))
    height, width = args.height or meta["image_size"], args.width or meta["image_size"]
    sources = None
    if args.images:
        if not model.takes_images:
            raise ConfigError(f"--images: {args.model} takes no conditioning images ({type(model).__name__})")
        sources = _read_images(args.images, len(args.prompts), height, width).to(device)
    s = meta["sampling"]
    steps = args.steps if args.steps is not None else s["num_inference_steps"]
    scale = args.guidance_scale if args.guidance_scale is not None else s["guidance_scale"]
    embeds, null = encoder.encode(args.prompts), encoder.encode([""])
    if sources is not None:  # an edit's source or a first frame, as the training data's prompts carry them
        with torch.no_grad():
            conditions = encode_conditions(codec, sources)
            reads = getattr(encoder, "reads_images", False)  # Qwen-Image-Edit reads the source with the text
            text = encoder.encode_with_images(args.prompts, sources) if reads else embeds
        embeds = PromptEmbeds(text.tokens, text.pooled, conditions, text.negative)
    noise = initial_noise(len(args.prompts), codec.latent_shape(height, width), args.seed, device=device)
    try:
        with torch.no_grad():
            latents = sample_latents(model, embeds.to(device), null.to(device), noise, steps, scale, s["shift"])
    except ConditioningError as e:  # the family's check of the conditioning input against the model
        if sources is not None:
            raise ConfigError(f"--images: {e}") from e
        raise ConfigError(f"{e} (an editing or image-to-video export: give each prompt its source with "
                          f"--images)") from e
    out = args.out or Path(args.model).resolve().parent / "samples" / f"sample_seed{args.seed}.png"
    print(f"grid: {shown_path(save_grid(codec.decode(latents), args.prompts, out, sources=sources))}")
    return 0


def shown_path(path: str | Path) -> str:
    """``path`` as printed: relative to the working folder when inside it, else absolute; never ``..``."""
    path = Path(path).resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def _serve_reward(args) -> int:
    from posttrain.tools.serve_reward import Limits, serve

    limits = Limits(max_body_bytes=int(args.max_body_mib * 2**20), max_image_pixels=args.max_image_pixels,
                    max_request_pixels=args.max_request_pixels, read_timeout_s=args.read_timeout,
                    max_inflight=args.max_inflight)
    try:
        serve(args.config, args.host, args.port, limits=limits, token_file=args.token_file)
    except OSError as e:  # e.g. the port is in use
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _report(args) -> int:
    from posttrain.eval.report import write_report

    out = write_report(args.run_dir)
    print(f"report: {out['report']}")
    for png in out["pngs"]:
        print(f"plot: {png}")
    return 0


def _doctor(args) -> int:
    from pretrain.parallel.doctor import run_doctor

    return run_doctor(args)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


DESCRIPTION = ("Pretrain flow-matching image and video models, post-train them with RL (GRPO-family, DDPO) and "
               "preference optimization (Diffusion-DPO), then sample, evaluate, report and curate, from YAML "
               "configs. Exit codes: 0 success, 2 config/usage error (the message names the file and key), 1 run "
               "failure.")
RESUME_AUTO = "--resume=auto"
RANK0_PRINT_GRACE_S = 3.0  # seconds a rank other than 0 waits before exiting on a config error


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posttrain", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)
    from posttrain.stages import STAGES

    for name in [*STAGES, "pipeline"]:
        line = STAGES[name].help if name in STAGES else "chain stages, then evaluate"
        st = sub.add_parser(name, help=line + " from a YAML config")
        st.add_argument("config")
        st.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10")
        if name not in STAGES or STAGES[name].writes == "export":  # data and reward stages have no checkpoints
            st.add_argument("--resume", action="store_const", const="yes", default=None,
                            help="continue from the latest complete checkpoint; exit 2 when there is none. "
                            f"{RESUME_AUTO}: continue if there is one, else start a new run")
            st.add_argument("--resume-auto", dest="resume", action="store_const", const="auto", help=argparse.SUPPRESS)
        st.set_defaults(func=_pipeline if name == "pipeline" else _stage, resume=None)
    sw = sub.add_parser("sweep", help="race algorithms on equal wall-clock with held-out probes; report + plots")
    sw.add_argument("config", help="sweep YAML (configs/sweep/*.yaml)")
    sw.add_argument("overrides", nargs="*", help="dotted overrides, e.g. seeds=[0] run_tasks=[jpeg]")
    sw.set_defaults(func=_sweep)
    smp = sub.add_parser("sample", help="ODE-sample an exported model into a PNG grid")
    smp.add_argument("model", help="export folder written by `posttrain pretrain`")
    smp.add_argument("--prompts", nargs="+", required=True)
    smp.add_argument("--seed", type=int, default=0)
    smp.add_argument("--steps", type=_positive, default=None)
    smp.add_argument("--guidance-scale", type=float, default=None)
    smp.add_argument("--height", type=_positive, default=None, help="pixels (default: the export's image size); "
                     "a model trained with data.buckets samples at each bucket's size")
    smp.add_argument("--width", type=_positive, default=None, help="pixels (default: the export's image size)")
    smp.add_argument("--images", nargs="+", default=None, metavar="PATH",
                     help="an editing or image-to-video export's conditioning images: one per prompt, or one for "
                     "all (resized to the sampling size); the grid shows each beside its output")
    smp.add_argument("--device", default="auto")
    smp.add_argument("--out", default=None)
    smp.set_defaults(func=_sample)
    ev = sub.add_parser("eval", help="paired ODE evaluation of export folders (same seeds for every model)")
    ev.add_argument("models", nargs="+")
    ev.add_argument("--rewards", nargs="+", default=["jpeg_compressibility"],
                    help="reward names; NAME@PATH passes path=PATH, e.g. learned_clip@runs/reward/learned_clip_b/model")
    ev.add_argument("--prompts", default="heldout", help="heldout, train, or a file with one prompt per line")
    ev.add_argument("--num-prompts", type=_positive, default=128)
    ev.add_argument("--samples-per-prompt", type=_positive, default=1)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--steps", type=_positive, default=20)
    ev.add_argument("--guidance-scale", type=float, default=4.0)
    ev.add_argument("--reward-params", default=None,
                    help="a YAML file {NAME: {param: value}} of reward parameters (a judge's base_url, seed, ...)")
    ev.add_argument("--data", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="overrides of the first model's recorded data config, e.g. heldout_per_category=256")
    ev.add_argument("--mark", default=None, metavar="REWARD",
                    help="one of --rewards: grid cells where it is >= 0.5 get a green frame (pass), others red")
    ev.add_argument("--guard-samples", type=_non_negative, default=256,
                    help="held-out images for the flow-matching-loss guard row (0: none)")
    ev.add_argument("--grid-prompts", type=_positive, default=32, help="prompts shown in each model's grid")
    ev.add_argument("--device", default="auto")
    ev.add_argument("--out", default=None)
    ev.set_defaults(func=_eval)
    sr = sub.add_parser("serve-reward", help="host the rewards of a YAML config over HTTP (POST /score, GET /health)")
    sr.add_argument("config", help="YAML file with a rewards: block")
    sr.add_argument("--host", default="127.0.0.1")
    sr.add_argument("--port", type=int, default=8100, help="0 picks a free port (printed at start)")
    sr.add_argument("--token-file", default=None, help="file holding the bearer token every request must send "
                    "(default: $POSTTRAIN_REWARD_TOKEN); required unless --host is a loopback address")
    sr.add_argument("--max-body-mib", type=float, default=64.0, help="largest request body, MiB (default %(default)s)")
    sr.add_argument("--max-image-pixels", type=_positive, default=4096 * 4096,
                    help="largest width x height per image (default %(default)s)")
    sr.add_argument("--max-request-pixels", type=_positive, default=4 * 4096 * 4096,
                    help="largest total width x height per request (default %(default)s)")
    sr.add_argument("--read-timeout", type=float, default=30.0,
                    help="seconds for headers and body to arrive (default %(default)s)")
    sr.add_argument("--max-inflight", type=_positive, default=2,
                    help="requests decoded and scored at once (default %(default)s)")
    sr.set_defaults(func=_serve_reward)
    rp = sub.add_parser("report", help="report.md with PNG curves of every stage, the evaluation and its grids "
                        "side by side")
    rp.add_argument("run_dir", help="a pipeline run folder (stage subfolders, eval/) or one stage's folder")
    rp.set_defaults(func=_report)
    from pretrain.parallel.doctor_report import add_arguments as doctor_arguments

    dr = sub.add_parser("doctor", help="pre-flight check of the ranks under torchrun: burn-in hashes and times, "
                        "collective and pairwise bandwidth; a table, doctor.json and exclude lists")
    doctor_arguments(dr)
    dr.set_defaults(func=_doctor)
    return p


def main(argv: list[str] | None = None) -> int:
    from pretrain.config import ConfigError  # light (omegaconf, yaml): torch loads with the command's modules

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(["--resume-auto" if a == RESUME_AUTO else a for a in argv])
    try:
        return args.func(args)
    except ConfigError as e:  # every rank exits 2 under torchrun; rank 0 alone prints it
        if _rank() == 0:
            print(f"config error: {e}", file=sys.stderr)
        _record_for_torchrun(f"config error: {e}")  # every rank: the launcher names whichever failed first
        if _rank() != 0:  # the launcher stops every rank when the first exits: let rank 0 print first
            time.sleep(RANK0_PRINT_GRACE_S)
        return 2
    except Exception as e:
        if not _run_failure(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run_failure(e: Exception) -> bool:
    """Whether ``e`` is a run failure the CLI reports in one line (exit 1) rather than with a traceback.
    Its classes are looked up among the modules already loaded (an error of a module that never loaded
    cannot have been raised), so that the CLI imports no torch of its own."""
    names = {"pretrain.data.folder": "DatasetError", "pretrain.runtime.checkpoint": "CheckpointError",
             "pretrain.runtime.guard": "RunStopped"}
    kinds = (FileNotFoundError, ValueError, *(getattr(sys.modules[m], n) for m, n in names.items() if m in sys.modules))
    return isinstance(e, kinds)


def _record_for_torchrun(message: str) -> None:
    """Under torchrun, write ``message`` to this rank's error file, so the launcher's failure summary
    shows it (instead of "To enable traceback see ...") beside the rank's exit code."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                     "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
