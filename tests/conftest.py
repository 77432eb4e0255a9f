import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]


def require_extra(module: str, extra: str):
    """Import ``module`` of the optional extra ``extra`` (pyproject's ``[project.optional-dependencies]``).
    Under ``make test`` (``POSTTRAIN_REQUIRE_EXTRAS=1``, every extra installed) a missing one fails the
    test file, naming the extra; elsewhere (a user who installed a subset) the file is skipped, and
    pytest's summary (``-ra``) says which extra was missing."""
    try:
        return __import__(module)
    except ImportError as e:
        message = f"the '{extra}' extra is not installed ({module}: {e}); pip install -e '.[{extra}]'"
        if os.environ.get("POSTTRAIN_REQUIRE_EXTRAS") == "1":
            pytest.fail(message, pytrace=False)
        raise pytest.skip.Exception(message, allow_module_level=True)  # only a user's partial install


TIERS = ("core", "long")


def pytest_collection_modifyitems(config, items):
    """Every test belongs to a tier: its module's ``pytestmark = pytest.mark.core`` (``make test``) or
    ``pytest.mark.long`` (``make test-all`` only, the long end-to-end runs); a test marked ``long`` in a
    core module is long (``make test`` deselects ``-m "not long"``). A module that names no tier fails the collection, so no test drifts out of both."""
    missing = sorted({item.nodeid.split("::")[0] for item in items
                      if not any(item.get_closest_marker(t) for t in TIERS)})
    if missing:
        raise pytest.UsageError("tests without a tier (add `pytestmark = pytest.mark.core` or "
                                "`pytest.mark.long` to the module): " + ", ".join(missing))


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """One rendered-emoji / caption-embedding cache per test session."""
    d = os.environ.get("POSTTRAIN_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
    os.environ["POSTTRAIN_CACHE"] = d
    return Path(d)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of 4 logical CPUs for one test module (``ray`` extra), shut down after it
    unless it was already running; module-scoped so that tests outside Ray see no cluster."""
    import ray

    from posttrain.grpo.engines.ray_pool import start_ray

    started = start_ray(None, 4)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def minilm():
    from pretrain.text_encoder import MiniLMEncoder

    return MiniLMEncoder(max_length=24)


def tiny_config(run_dir, *overrides):
    """The tiny preset config with the run dir in ``run_dir`` and extra dotted overrides."""
    from pretrain.config import load_config
    from pretrain.trainer import PretrainConfig

    return load_config(PretrainConfig, ROOT / "configs/pretrain/emoji_tiny.yaml",
                       [f"run_dir={run_dir}", *overrides])


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory, _cache_dir):
    """A tiny pretrained model (20 steps, 16 px) exported once per session."""
    from pretrain.trainer import train

    run = tmp_path_factory.mktemp("tiny_pretrain")
    return train(tiny_config(run, "train.steps=20", "eval.every=0"))


def grpo_config(run_dir, export, *overrides):
    from posttrain.grpo.stage import GRPOConfig
    from pretrain.config import load_config

    return load_config(GRPOConfig, ROOT / "configs/grpo/emoji_tiny.yaml",
                       [f"run_dir={run_dir}", f"model.pretrained={export}", *overrides])


def dpo_config(run_dir, export, *overrides):
    from posttrain.dpo.stage import DPOConfig
    from pretrain.config import load_config

    return load_config(DPOConfig, ROOT / "configs/dpo/emoji_tiny.yaml",
                       [f"run_dir={run_dir}", f"model.pretrained={export}", *overrides])


def sampler_rollout(model, codec, prompts, prompt_idx, *, group, batch, sigmas, null, noise, scale, latent_shape,
                    device="cpu", seed=0, iteration=0, shared_initial_noise=False, **kw):
    """A :class:`rollout.sampler.Sampler` with these settings, rolled out over ``prompt_idx``."""
    from rollout.config import RolloutConfig
    from rollout.sampler import Sampler

    cfg = RolloutConfig(noise_level=noise, guidance_scale=scale, group_size=group, batch_size=batch,
                        shared_initial_noise=shared_initial_noise)
    return Sampler(cfg, sigmas, null).rollout(model, codec, prompts, list(prompt_idx), latent_shape=latent_shape,
                                              seed=seed, iteration=iteration, device=device, **kw)
