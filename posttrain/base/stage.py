"""What every post-training stage shares: start from an export with a seeded policy, write grids,
and finish with the LoRA adapter and a merged export."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from posttrain.base.policy import Policy
from pretrain.data.dataset import EncodedSet, attach_codec, build_datasets
from pretrain.evaluation import write_grid
from pretrain.models.pipelines import export_pipeline, save_pipeline_lora
from pretrain.export import ExportMeta, export_model, load_exported, require_export
from pretrain.parallel.job import JobRanks
from pretrain.runtime.config_record import record_config
from pretrain.runtime.host import configure_host
from pretrain.runtime.runtime import resolve_device
from pretrain.seeding import seed_for
from pretrain.text_encoder import PromptEmbeds


@dataclass
class PolicyStage:
    """A stage's run folder ``<run_dir>/<name>/``, device, the loaded export (``model``, ``encoder``,
    ``codec``, ``meta``), its train / held-out data at the export's resolution, the empty-prompt
    embedding ``null`` and the ``policy`` (LoRA or full, initialised from (seed, "init"))."""

    run: Path
    device: torch.device
    model: torch.nn.Module
    encoder: object
    codec: object
    meta: dict
    train_set: EncodedSet
    held: EncodedSet
    null: PromptEmbeds
    policy: Policy

    @classmethod
    def setup(cls, cfg, name: str) -> "PolicyStage":
        """From a stage config with ``run_dir``, ``model``, ``data``, ``policy`` and ``train`` fields
        (the config is recorded by :meth:`record`, after the runtime's start). Raises ``ConfigError`` if ``model.pretrained`` is not an export folder."""
        require_export(cfg.model.pretrained)
        device = resolve_device(cfg.train.device)
        configure_host(cfg.train, device)
        run = Path(cfg.run_dir) / name
        run.mkdir(parents=True, exist_ok=True)
        model, encoder, codec, meta = load_exported(cfg.model.pretrained, device=str(device),
                                                    options=cfg.model.options)
        train_set, held = build_datasets(replace(cfg.data, size=meta["image_size"]), encoder)
        attach_codec(codec, train_set, held, encoder=encoder)
        null = encoder.encode([""]).to(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_for(cfg.train.seed, "init"))
            policy = Policy(model, cfg.policy)
        return cls(run, device, model, encoder, codec, meta, train_set, held, null, policy)

    def record(self, cfg) -> None:
        """Keep this start's config in the run folder (:func:`record_config`); called once the runtime
        has started (resumed or not), so that a refused start writes nothing. One writer under torchrun."""
        if not dist.is_initialized() or dist.get_rank() == 0:
            record_config(cfg, self.run, cfg.checkpoint.resume)

    def grid(self, model, eval_cfg, seed: int, shift: float, name: str) -> Path:
        """Held-out grid (``eval_cfg.grid_prompts``, ODE steps and guidance) into ``samples/name``."""
        return write_grid(model, self.codec, self.held, self.null, num_prompts=eval_cfg.grid_prompts, seed=seed,
                          num_inference_steps=eval_cfg.num_inference_steps, guidance_scale=eval_cfg.guidance_scale,
                          shift=shift, device=self.device, path=self.run / "samples" / name)

    def finish(self, final: torch.nn.Module) -> Path:
        """Write ``lora/`` (adapter) and ``export/`` (LoRA merged) from ``final``; returns the export.
        A model family's run exports a whole diffusers pipeline folder and the LoRA in its pipeline's
        ``load_lora_weights`` format (:mod:`pretrain.models.pipelines`)."""
        m = self.meta
        if "family" in m:
            if self.policy.lora:
                save_pipeline_lora(final.transformer, m, self.run / "lora")
            return export_pipeline(self.policy.merged_transformer(final), m, self.run / "export")
        self.policy.save_adapter(self.run / "lora", final)
        return export_model(self.policy.merged_transformer(final), self.run / "export", ExportMeta.from_json(m))


@dataclass
class StageRanks(JobRanks):
    """:class:`JobRanks` with a post-training stage's collective outputs (GRPO and DPO share them)."""

    def grid(self, st: PolicyStage, model: torch.nn.Module, eval_cfg, seed: int, shift: float, name: str) -> Path:
        """``st.grid`` on every rank (the sharded forwards are collectives); only rank 0's file is kept.
        Returns rank 0's path."""
        return self.write_on_main(lambda run: replace(st, run=run).grid(model, eval_cfg, seed, shift, name), st.run)

    def export(self, st: PolicyStage, final: torch.nn.Module) -> Path:
        """``st.finish`` (``lora/`` + merged ``export/``) of ``final``; when sharded, from a rank-0
        unsharded copy (collective), other ranks wait. Returns the export folder on every rank."""
        return self.export_on_main(st.finish, final, st.run / "export")
