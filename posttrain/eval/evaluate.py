"""Paired before/after evaluation.

Every model samples the same prompts with the deterministic ODE sampler, the same step count and the
same per-prompt seeds; for each reward we report each model's mean and, against the first model, the
mean paired difference with its standard error clustered by prompt (per-prompt mean differences,
SE = sd / sqrt(#prompts)). A guard metric sits beside the rewards: the held-out flow-matching loss on
real images (of the objective the export was pretrained with, ``objective`` in its ``posttrain.json``:
the noise-space loss for an epsilon-prediction UNet preset), which rises when a model wins a reward by
drifting off the data (e.g. blank images).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pretrain.codec import decode_conditions
from pretrain.config import load_section, require_positive

from pretrain.data.dataset import DataConfig, attach_codec, build_datasets
from pretrain.evaluation import heldout_loss
from pretrain.export import META, load_exported
from pretrain.objective import FlowConfig
from pretrain.sampling import initial_noise, sample_latents, save_grid
from rewards.base import build_reward, check_reward_weights, groupwise_rewards

GRID_COLS = 8  # columns of the per-model grids (eval.json records it for the run report)
SECRET_PARAMS = ("api_key", "token", "password", "Authorization")  # reward parameters eval.json records as "<redacted>"


@dataclass
class EvalConfig:
    """``prompts``: "heldout", "train" or a text file (one prompt per line); ``num_prompts`` of them
    (evenly spaced); ``samples_per_prompt`` seeds each; ODE ``num_inference_steps`` and
    ``guidance_scale``; ``guard_samples`` held-out images for the flow-matching-loss guard (0 = off).
    ``rewards``: entries ``NAME`` or ``NAME@PATH`` (see ``parse_eval_reward``); a reward with a
    ``categories(prompts)`` method (e.g. ``shapes_strict``) also gets one row per category.
    ``reward_params``: parameters per reward name, passed to its factory with ``NAME@PATH``'s path (e.g.
    ``{remote: {base_url: ..., model: ..., seed: 3, temperature: 1.0}}``); ``eval.json`` records each
    reward's parameters, and a judge's request settings (:meth:`rewards.remote.RemoteJudge.settings`).
    ``mark``: one of ``rewards`` whose value >= 0.5 frames a grid cell green (pass), else red (fail);
    None: no frames. ``data``: ``KEY=VALUE`` overrides of the data config the evaluation reads (a
    pipeline's first stage's, or with ``posttrain eval --data`` the first export's recorded one), e.g.
    ``heldout_per_category=517`` to evaluate on more of a shapes set's held-out edits or compositions than
    the training listed."""

    rewards: list[str] = field(default_factory=lambda: ["jpeg_compressibility"])
    prompts: str = "heldout"
    num_prompts: int = 128
    samples_per_prompt: int = 1
    seed: int = 0
    num_inference_steps: int = 20
    guidance_scale: float = 4.0
    guard_samples: int = 256
    grid_prompts: int = 32
    batch_size: int = 64
    mark: str | None = None
    reward_params: dict[str, dict] = field(default_factory=dict)
    data: list[str] = field(default_factory=list)

    def validate(self, prefix: str = "") -> None:
        data_overrides(self.data, f"{prefix}data")
        if self.mark is not None and self.mark not in self.rewards:
            raise ValueError(f"{prefix}mark: '{self.mark}' is not one of {prefix}rewards {self.rewards}")
        names = [parse_eval_reward(entry, f"{prefix}rewards")[0] for entry in self.rewards]
        for entry in self.rewards:  # an unknown reward name first, before the parameters blamed for it
            name, params = self.reward(entry, prefix)
            check_reward_weights({name: {"weight": 1.0, **params}}, f"{prefix}rewards")
        for name in self.reward_params:
            if name not in names:
                raise ValueError(f"{prefix}reward_params: '{name}' is not one of {prefix}rewards {self.rewards}")
        require_positive(self, prefix, "num_prompts", "samples_per_prompt", "num_inference_steps", "batch_size")
        grouped = groupwise_rewards({name: 1.0 for name in names}, f"{prefix}rewards")
        if grouped and self.samples_per_prompt < 2:
            raise ValueError(f"{prefix}samples_per_prompt: {grouped} compare the samples of a prompt with each other; "
                             f"set samples_per_prompt >= 2 (each prompt's samples form its group)")

    def reward(self, entry: str, prefix: str = "") -> tuple[str, dict]:
        """An entry of ``rewards`` -> (name, its parameters: ``reward_params[name]`` and ``NAME@PATH``'s path)."""
        name, params = parse_eval_reward(entry, f"{prefix}rewards")
        return name, {**dict(self.reward_params.get(name) or {}), **params}


def redacted(params):
    """``params`` (nested dicts and lists) with the values of keys named in :data:`SECRET_PARAMS` replaced by
    ``"<redacted>"`` and ``user:password@`` removed from URLs, for records written to disk."""
    if isinstance(params, dict):
        return {k: "<redacted>" if k in SECRET_PARAMS else redacted(v) for k, v in params.items()}
    if isinstance(params, (list, tuple)):
        return [redacted(v) for v in params]
    if isinstance(params, str) and "://" in params and "@" in params.split("://", 1)[1].split("/", 1)[0]:
        scheme, rest = params.split("://", 1)
        return f"{scheme}://<redacted>@{rest.split('@', 1)[1]}"
    return params


def parse_eval_reward(entry: str, key: str = "rewards") -> tuple[str, dict]:
    """An eval reward entry -> (reward name, parameters): ``NAME`` takes no parameters; ``NAME@PATH``
    passes ``path=PATH`` (a reward loading a model folder, e.g.
    ``learned_clip@runs/reward/learned_clip_b/model``). ``ValueError`` naming ``key`` for an empty part."""
    name, sep, path = entry.partition("@")
    if not name or (sep and not path):
        raise ValueError(f"{key}: '{entry}' must be NAME or NAME@PATH")
    return name, ({"path": path} if sep else {})


def paired_stats(base: torch.Tensor, other: torch.Tensor, clusters: list[str] | None = None
                 ) -> tuple[float, float, int]:
    """``base``/``other``: float ``[P, K]`` (prompt x sample). Returns (mean paired difference over the
    rows, its standard error clustered by prompt, clusters used); rows with any NaN are dropped.
    ``clusters``: a key per row (e.g. its prompt text); rows sharing a key form one cluster, and the SE
    is the cluster-robust one, ``sqrt(G / (G - 1) * sum_g (S_g - n_g * mean)^2) / N`` over the G clusters
    of ``n_g`` rows summing to ``S_g`` (Cameron & Miller 2015, eq. 11 with the G / (G - 1) factor); with
    one row per cluster (the default) it is ``sd / sqrt(N)``."""
    diff = (other.float() - base.float()).mean(1).double()
    keep = torch.isfinite(diff)
    diff = diff[keep]
    n = diff.numel()
    if n == 0:
        return float("nan"), float("nan"), 0
    keys = [c for c, k in zip(clusters, keep.tolist()) if k] if clusters is not None else list(range(n))
    ids = {c: i for i, c in enumerate(dict.fromkeys(keys))}
    g = len(ids)
    mean = diff.mean()
    if g < 2:
        return float(mean), float("nan"), g
    idx = torch.tensor([ids[c] for c in keys], dtype=torch.long)
    resid = torch.zeros(g, dtype=torch.float64).index_add_(0, idx, diff - mean)
    return float(mean), float(torch.sqrt(g / (g - 1) * (resid ** 2).sum()) / n), g


@torch.no_grad()
def paired_samples(model, codec, embeds, null, cfg: EvalConfig, *, image_size: int, shift: float | None, device
                   ) -> torch.Tensor:
    """ODE samples of P prompts (``embeds`` ``[P, ...]``) x ``cfg.samples_per_prompt`` seeds, float32
    ``[K * P, 3, H, W]`` in [0, 1] on the CPU, sample-major: the seed of (prompt i, sample j) is the
    global index j * P + i, so every model evaluated with ``cfg`` sees the same initial noise."""
    k, p = cfg.samples_per_prompt, embeds.tokens.shape[0]
    images = []
    bar = tqdm(total=k * p, desc="sampling", unit="img", leave=False, dynamic_ncols=True,
               disable=k * p <= cfg.batch_size)
    for j in range(k):
        noise = initial_noise(p * (j + 1), codec.latent_shape(image_size, image_size), cfg.seed, device=device)[j * p:]
        for s in range(0, p, cfg.batch_size):
            sl = slice(s, min(p, s + cfg.batch_size))
            lat = sample_latents(model, embeds[sl].to(device), null, noise[sl], cfg.num_inference_steps,
                                 cfg.guidance_scale, shift)
            images.append(codec.decode(lat).cpu())
            bar.update(sl.stop - sl.start)
    bar.close()
    return torch.cat(images)


def reward_metadata(codec, embeds, k: int, batch_size: int = 32) -> dict | None:
    """The ``metadata`` the rewards get with :func:`paired_samples`' ``k * P`` images: ``source_images``
    (float32 ``[K * P, 3, H, W]`` in [0, 1] on the CPU, each prompt's conditioning image decoded by
    ``codec`` ``batch_size`` at a time, sample-major as the images are) when the prompts carry them, else
    None."""
    if embeds.images is None:
        return None
    images = embeds.images
    sources = torch.cat([decode_conditions(codec, images[s:s + batch_size]).cpu().float()
                         for s in range(0, len(images), batch_size)])
    return {"source_images": sources.repeat(k, 1, 1, 1)}


def eval_prompts(cfg: EvalConfig, held, train) -> tuple[list[str], list[int] | None]:
    """``cfg.num_prompts`` prompts evenly spaced over ``cfg.prompts`` (heldout, train or a file), and their
    rows in that set (None for a file: its prompts take the first row with their text, for an editing
    set its source image); ``FileNotFoundError`` naming ``--prompts`` for a missing file."""
    if cfg.prompts == "train" and not hasattr(train, "captions"):  # a sharded set is read lazily
        raise ValueError("--prompts: 'train' cannot list the captions of a sharded or cached set; use heldout or "
                         "a file")
    if cfg.prompts in ("heldout", "train"):
        pool = held.captions if cfg.prompts == "heldout" else train.captions
    else:
        path = Path(cfg.prompts)
        if not path.is_file():
            raise FileNotFoundError(f"--prompts: '{cfg.prompts}' is neither heldout/train nor a prompt file")
        pool = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    from pretrain.evaluation import spread_indices

    rows = spread_indices(len(pool), cfg.num_prompts)
    return [pool[i] for i in rows], (list(rows) if cfg.prompts in ("heldout", "train") else None)


def data_overrides(items: list[str], key: str = "--data") -> dict:
    """``KEY=VALUE`` items (values read as YAML) as a mapping of :class:`DataConfig` fields. ``ValueError``
    naming ``key`` and the item for a malformed item, an unknown field, a value that is not YAML, or
    ``size`` (each model samples at its export's image size)."""
    import yaml

    fields = set(DataConfig.__dataclass_fields__)
    values = {}
    for item in items:
        name, sep, raw = str(item).partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"{key}: '{item}' must look like key=value (e.g. heldout_per_category=256)")
        if name == "size":
            raise ValueError(f"{key}: '{item}': each model samples at its export's image size; size cannot be set")
        if name not in fields:
            raise ValueError(f"{key}.{name}: not a field of the data config ('{item}'; e.g. heldout_per_category)")
        try:
            values[name] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ValueError(f"{key}: '{item}': the value is not YAML: {str(e).splitlines()[0]}") from e
    return values


def with_data_overrides(data: DataConfig, items: list[str], key: str) -> DataConfig:
    """``data`` with ``items`` (:func:`data_overrides`) applied, validated as a data block."""
    return load_section(DataConfig, {**asdict(data), **data_overrides(items, key)}, key) if items else data


def eval_data(model: str | Path, overrides: list[str]) -> DataConfig | None:
    """The data config recorded in export ``model``'s ``posttrain.json`` (the defaults where it records
    none) with ``overrides`` (``KEY=VALUE`` items, values read as YAML) applied, e.g.
    ``heldout_per_category=256`` to evaluate on more of the held-out edits or compositions of a shapes set
    than pretraining listed (its training rows do not depend on it: :func:`pretrain.data.builtin.load_shapes`,
    :func:`pretrain.data.builtin.load_shapes_edit`). None without overrides (each model's own data).
    ``ValueError`` naming ``--data`` and the item or field for a malformed item or an unknown field."""
    if not overrides:
        return None
    recorded = Path(model) / META  # a diffusers pipeline folder records none: the defaults, as evaluate's
    try:
        values = dict(json.loads(recorded.read_text()).get("data", {})) if recorded.is_file() else {}
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"--data: cannot read the data config recorded in '{recorded}': {e}") from e
    return load_section(DataConfig, {**values, **data_overrides(overrides)}, "--data")


@torch.no_grad()
def evaluate(models: list[str], cfg: EvalConfig, out_dir: str | Path, device="cpu",
             data: DataConfig | None = None) -> dict:
    """Evaluate export folders ``models`` on ``data`` (default: the data each model was trained on, recorded
    in its export, else the OpenMoji set; the prompts are listed from the first model's); writes
    ``report.md``, one grid per model and ``eval.json`` (models, sampling settings, every prompt and its row
    in the set, null for a prompt file, the grid prompts, columns and cells per prompt: 2 for edits, source
    and output) to ``out_dir``. Returns
    {"prompts", "rewards": {name: [K x P tensors per model]}, "guard": [...], "grids": [...], "settings", "table"}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reward_fns, reward_record = {}, {}
    for entry in cfg.rewards:
        name, params = cfg.reward(entry)
        reward_fns[entry] = build_reward(name, **params)
        settings = getattr(reward_fns[entry], "settings", None)
        reward_record[entry] = {"name": name, "params": redacted(params),
                                **({"request": redacted(settings())} if callable(settings) else {})}
    results = {"models": models, "rewards": {n: [] for n in cfg.rewards}, "guard": [], "grids": []}
    prompts = rows = clusters = None
    phases = ("load", "sample", "score") + (("guard",) if cfg.guard_samples else ())
    bar = tqdm(total=len(models) * len(phases), desc="eval", dynamic_ncols=True)
    for m_i, path in enumerate(models):
        bar.set_postfix_str(f"model {m_i}: loading")
        model, encoder, codec, meta = load_exported(path, device=str(device))
        model.eval()
        default = DataConfig(**meta["data"]) if "data" in meta else DataConfig()  # the pretraining data
        train, held = build_datasets(replace(data or default, size=meta["image_size"]), encoder)
        attach_codec(codec, train, held, encoder=encoder)
        pool = train if cfg.prompts == "train" else held
        if prompts is None:
            prompts, rows = eval_prompts(cfg, held, train)
            # an editing set may repeat an instruction over several sources: each row is its own prompt
            clusters = ([f"{p} [row {r}]" for p, r in zip(prompts, rows)]
                        if rows is not None and getattr(pool, "conditions", None) is not None else prompts)
        null = encoder.encode([""]).to(device)
        embeds = pool.prompt_embeds(prompts, encoder, rows)
        k, p = cfg.samples_per_prompt, len(prompts)
        bar.update()
        bar.set_postfix_str(f"model {m_i}: sampling {k * p} images")
        images = paired_samples(model, codec, embeds, null, cfg, image_size=meta["image_size"],
                                shift=meta["sampling"]["shift"], device=device)
        bar.update()
        bar.set_postfix_str(f"model {m_i}: scoring")
        metadata = reward_metadata(codec, embeds, k, cfg.batch_size)
        for name, fn in reward_fns.items():
            results["rewards"][name].append(fn(images, prompts * k, metadata).float().view(k, p).T)
        bar.update()
        grid_n = min(cfg.grid_prompts, p)
        marks = None
        if cfg.mark:
            marks = (results["rewards"][cfg.mark][-1].T.reshape(-1)[:grid_n] >= 0.5).tolist()
        sources = metadata["source_images"] if metadata else None
        results["grids"].append(str(save_grid(images[:grid_n], prompts[:grid_n], out_dir / f"grid_model{m_i}.png",
                                              cols=GRID_COLS, marks=marks, sources=sources)))
        guard = float("nan")
        if cfg.guard_samples:
            bar.set_postfix_str(f"model {m_i}: guard loss")
            flow = FlowConfig(objective=meta.get("objective", "rectified_flow"))  # the export's own loss
            guard = heldout_loss(model, codec, held, null, flow, seed=cfg.seed,
                                 num_samples=cfg.guard_samples, device=device)
            bar.update()
        results["guard"].append(guard)
    bar.close()
    results["prompts"], results["clusters"] = prompts, clusters
    results["categories"] = {entry: fn.categories(prompts) for entry, fn in reward_fns.items()
                             if callable(getattr(fn, "categories", None))}
    results["settings"] = {"sampler": "ODE", "num_inference_steps": cfg.num_inference_steps,
                           "guidance_scale": cfg.guidance_scale, "seed": cfg.seed,
                           "samples_per_prompt": cfg.samples_per_prompt, "prompts": cfg.prompts,
                           **({"data": asdict(data)} if data is not None else {})}  # the caller's
    results["table"] = report_table(results)
    (out_dir / "report.md").write_text(results["table"] + "\n")
    grid_n = min(cfg.grid_prompts, len(prompts))
    (out_dir / "eval.json").write_text(json.dumps(
        {"models": models, "settings": results["settings"], "rewards": reward_record, "prompts": prompts,
         "rows": rows, "grids": results["grids"],
         "grid_prompts": prompts[:grid_n], "grid_cols": GRID_COLS, "grid_span": 1 if sources is None else 2},
        indent=1) + "\n")
    return results


def z_text(diff: float, se: float) -> str:
    """The z of a paired difference as the table prints it: ``+2.3``; ``n/a`` when it is undefined (no
    prompt, or one: no SE); with an SE of 0 (every prompt's difference equal, e.g. identical models or a
    reward that cannot move), ``n/a (SE 0, no difference)`` or ``+inf (SE 0)``."""
    if not (math.isfinite(diff) and math.isfinite(se)):
        return "n/a"
    if se == 0:
        return "n/a (SE 0, no difference)" if diff == 0 else f"{'+' if diff > 0 else '-'}inf (SE 0)"
    return f"{diff / se:+.1f}"


def _row(label: str, per_model: list[torch.Tensor], prompts: list[str] | None) -> str:
    row = f"| {label} | " + " | ".join(f"{float(r.nanmean()):.4f}" for r in per_model)
    for other in per_model[1:]:
        d, se, _ = paired_stats(per_model[0], other, prompts)
        row += f" | {d:+.4f} ({se:.4f}) | {z_text(d, se)}"
    return row + " |"


def report_table(results: dict) -> str:
    """Markdown table: per reward, each model's mean and (vs model 0) paired diff +/- SE (clustered by
    ``results["clusters"]``, else by prompt text: an editing set's rows are clustered by row, since one
    instruction may edit several sources) and z; a reward with categories (``results["categories"]``) adds
    a row per category, with its count of distinct clusters ("prompts", or "edits" where rows are clustered
    by row)."""
    models = results["models"]
    head = "| metric | " + " | ".join(f"model {i}" for i in range(len(models)))
    head += "".join(f" | model {i} - model 0 (SE) | z" for i in range(1, len(models))) + " |"
    lines = [head, "|" + "---|" * (1 + len(models) + 2 * (len(models) - 1))]
    keys = results.get("clusters") or results.get("prompts")
    unit = "prompts" if keys == results.get("prompts") else "edits"
    for name, per_model in results["rewards"].items():
        lines.append(_row(f"{name} (mean)", per_model, keys))
        cats = results.get("categories", {}).get(name)
        for cat in dict.fromkeys(cats or []):
            rows = [i for i, c in enumerate(cats) if c == cat]
            lines.append(_row(f"{name}: {cat} ({len(set(keys[i] for i in rows))} {unit})",
                              [r[rows] for r in per_model], [keys[i] for i in rows]))
    guard = results["guard"]
    row = "| guard: held-out flow-matching loss | " + " | ".join(f"{g:.4f}" for g in guard)
    row += "".join(f" | {g - guard[0]:+.4f} | " for g in guard[1:])
    lines.append(row + " |")
    lines.append("")
    lines += [f"model {i}: {m}" for i, m in enumerate(models)]
    lines.append(f"prompts: {len(results['prompts'])} (same ODE seeds for every model)")
    if "settings" in results:
        s = results["settings"]
        lines.append(f"sampling: {s['sampler']}, {s['num_inference_steps']} steps, guidance {s['guidance_scale']}, "
                     f"seed {s['seed']} (sample j of prompt i: noise j * P + i), {s['samples_per_prompt']} "
                     f"sample(s) per prompt, prompts from {s['prompts']}")
        if "data" in s:
            d = s["data"]
            lines.append(f"data (set by the caller: --data, or a pipeline's first stage with eval.data; eval.json "
                         f"has it whole): "
                         f"source {d['source']}, heldout_fraction {d['heldout_fraction']}, heldout_per_category "
                         f"{d['heldout_per_category']}")
    lines += [f"grid model {i}: {g}" for i, g in enumerate(results["grids"])]
    return "\n".join(lines)
