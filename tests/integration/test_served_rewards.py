"""Rewards over HTTP on 127.0.0.1: `posttrain serve-reward` in a subprocess with the `served` client,
and the `remote` chat-completions client against a local judge (tests/integration/judge_server.py).
Scores must equal in-process scoring of the same 8-bit-quantised images, stay with their sample
whatever order requests finish in, and a dead server must fail loudly after bounded retries."""

from __future__ import annotations

import json
import logging
import math
import select
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest
import torch

from posttrain.tools.serve_reward import RewardServer
from rewards.base import CompositeReward
from rewards.jpeg import JpegIncompressibility
from rewards.png import encode_png_b64, quantise
from rewards.remote import RemoteJudge
from rewards.served import ServedReward
from tests.conftest import ROOT
from tests.integration.judge_server import JudgeServer

pytestmark = pytest.mark.core

WEIGHTS = {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.25}
B = 8


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    """8 images whose JPEG sizes all differ (noise grows with the index), off the uint8 grid."""
    g = torch.Generator().manual_seed(0)
    base = torch.rand(1, 3, 24, 24, generator=g)
    noise = torch.rand(B, 3, 24, 24, generator=g)
    amount = torch.linspace(0.05, 1.0, B).view(B, 1, 1, 1)
    return ((1 - amount) * base + amount * noise).clamp(0, 1)


PROMPTS = [f"sample {i}" for i in range(B)]


@contextmanager
def serve_reward_process(tmp_path, weights=WEIGHTS):
    """`python -m posttrain.cli serve-reward cfg --port 0` -> (process, base URL read from its start line)."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(json.dumps({"rewards": weights, "run_dir": "ignored"}))  # JSON is YAML
    err = open(tmp_path / "serve.stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "serve-reward", str(cfg), "--port", "0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        deadline, line = time.monotonic() + 60, ""
        while "serving rewards" not in line:
            ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
            line = proc.stdout.readline() if ready else ""
            if not ready or (not line and proc.poll() is not None):
                err.seek(0)
                pytest.fail(f"serve-reward did not start (rc {proc.poll()}): {err.read()[-2000:]}")
        yield proc, line.split(" on ")[1].split()[0]
    finally:
        proc.terminate()
        proc.wait(10)
        err.close()


class _Served:
    """One serve-reward subprocess for the module, restarted if a test killed it."""

    def __init__(self, tmp_path):
        self.tmp_path, self.ctx, self.proc, self.url = tmp_path, None, None, None

    def get(self):
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self.ctx = serve_reward_process(self.tmp_path)
            self.proc, self.url = self.ctx.__enter__()
        return self.proc, self.url

    def close(self):
        if self.ctx is not None:
            self.ctx.__exit__(None, None, None)
            self.ctx = None


@pytest.fixture(scope="module")
def _served(tmp_path_factory):
    state = _Served(tmp_path_factory.mktemp("serve"))
    yield state
    state.close()


@pytest.fixture
def served(_served):
    """(process, base URL) of a running `posttrain serve-reward` subprocess serving ``WEIGHTS``."""
    return _served.get()


@pytest.fixture
def served_url(served):
    return served[1]


def _post(url: str, payload: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_served_subprocess_matches_in_process_scoring_of_quantised_images(served_url, images):
    assert not torch.equal(quantise(images), images)  # the quantisation is real, so the check means something
    expected, raw = CompositeReward(WEIGHTS)(quantise(images), PROMPTS)
    got = ServedReward(served_url, batch_size=3, max_concurrency=2)(images, PROMPTS)  # 3 + 3 + 2
    assert got.dtype == torch.float32 and got.shape == (B,)
    assert torch.equal(got, expected)
    assert len(set(got.tolist())) == B  # distinct per sample, so a swap would show
    part = ServedReward(served_url, component="jpeg_incompressibility", batch_size=8)(images, PROMPTS)
    assert torch.equal(part, raw["jpeg_incompressibility"])
    by_config, _ = CompositeReward({"served": {"weight": 2.0, "url": served_url, "batch_size": 5}})(images, PROMPTS)
    assert torch.equal(by_config, 2 * expected)  # built by name from a `rewards:` spec, as a training config does
    with urllib.request.urlopen(served_url + "/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok", "rewards": WEIGHTS}


def test_serve_reward_rejects_bad_requests_naming_the_field(served_url, images):
    pngs = encode_png_b64(images[:4])
    code, body = _post(served_url + "/score", {"images": pngs[:2] + ["bm90IGEgcG5n"] + pngs[3:], "prompts": PROMPTS[:4]})
    assert code == 400 and body["error"].startswith("images[2]: not a base64-encoded PNG")
    code, body = _post(served_url + "/score", {"images": pngs, "prompts": PROMPTS[:3]})
    assert code == 400 and "prompts: expected a list of 4 strings" in body["error"]
    code, body = _post(served_url + "/score", {"images": pngs + encode_png_b64(images[:1, :, :8, :8]),
                                               "prompts": PROMPTS[:5]})
    assert code == 400 and body["error"].startswith("images[4]: size (8, 8) differs")
    with pytest.raises(RuntimeError, match="rejected the request .not retried.: HTTP 400"):
        ServedReward(served_url, max_retries=3)(images[:2], ["a", 3])


def test_serve_reward_config_errors_exit_2_naming_file_and_key(tmp_path, capsys):
    from posttrain.cli import main

    cfg = tmp_path / "bad.yaml"
    cfg.write_text("reward: {jpeg_compressibility: 1.0}\n")
    assert main(["serve-reward", str(cfg), "--port", "0"]) == 2
    assert f"{cfg}: key 'rewards': expected a mapping" in capsys.readouterr().err
    cfg.write_text("rewards: {no_such_reward: 1.0}\n")
    assert main(["serve-reward", str(cfg), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}: key 'rewards'" in err and "no_such_reward" in err


class _SlowReward:
    """Scores = mean brightness x 255; sleeps longest for the first samples; NaN for sample 5. Records
    the completion order (by sample index, recovered from the brightness)."""

    weights = {"brightness": 1.0}

    def __init__(self, delays):
        self.delays, self.done = delays, []

    def __call__(self, images, prompts):
        index = int(prompts[0].split()[-1])
        time.sleep(self.delays[index])
        self.done.append(index)
        s = images.mean(dim=(1, 2, 3)) * 255
        s[[p == "sample 5" for p in prompts]] = math.nan
        return s, {"brightness": s}


def test_served_client_keeps_sample_order_and_nan_whatever_the_completion_order():
    levels = torch.arange(B, dtype=torch.float32) * 20 / 255
    images = levels.view(B, 1, 1, 1).expand(B, 3, 4, 4).contiguous()
    reward = _SlowReward(delays=[0.04 * (B - i) for i in range(B)])
    server = RewardServer(reward, "127.0.0.1", 0)
    server.lock = _NoLock()  # let the requests overlap so they finish in reverse order
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        got = ServedReward(server.url, batch_size=1, max_concurrency=B)(images, PROMPTS)
    finally:
        server.shutdown()
        server.server_close()
    assert reward.done != sorted(reward.done)
    expected = torch.arange(B, dtype=torch.float32) * 20
    expected[5] = math.nan
    torch.testing.assert_close(got, expected, equal_nan=True)


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_served_client_fails_clearly_after_the_server_is_killed(served, images):
    proc, url = served
    client = ServedReward(url, max_retries=2, backoff_s=0.1, timeout_s=5)
    assert torch.isfinite(client(images[:2], PROMPTS[:2])).all()
    proc.terminate()
    proc.wait(10)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        client(images[:2], PROMPTS[:2])
    elapsed = time.monotonic() - t0
    assert f"{url}/score failed after 3 attempt(s)" in str(e.value) and "last error: URLError" in str(e.value)
    assert 0.3 <= elapsed < 3.0  # backoffs 0.1 + 0.2, then no more attempts


@pytest.fixture
def judge():
    servers = []

    def start(**kw):
        servers.append(JudgeServer(**kw))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def test_remote_judge_scores_equal_in_process_in_any_completion_order(judge, images, monkeypatch):
    delays = [0.1 * k for k in torch.randperm(B, generator=torch.Generator().manual_seed(1)).tolist()]
    server = judge(delay=lambda text: delays[int(text.split("'")[1].split()[-1])])
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-local")
    reward = RemoteJudge(server.base_url, model="judge-vl", prompt_template="Rate '{prompt}'. {braces} kept",
                         max_concurrency=B, api_key_env="TEST_JUDGE_KEY")
    got = reward(images, PROMPTS)
    expected = JpegIncompressibility()(quantise(images))
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    order = [int(t.split("'")[1].split()[-1]) for t in server.completed]
    assert sorted(order) == list(range(B)) and order != list(range(B))  # finished out of order
    assert order == sorted(range(B), key=lambda i: delays[i])
    body = server.bodies[0]
    assert body["model"] == "judge-vl" and body["temperature"] == 0.0
    assert body["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert {b["messages"][0]["content"][1]["text"] for b in server.bodies} == {f"Rate '{p}'. {{braces}} kept" for p in PROMPTS}
    assert all(h["Authorization"] == "Bearer sk-local" for h in server.headers)


def test_remote_unparsable_answer_is_nan_for_that_sample_only(judge, images, caplog):
    server = judge(answer=lambda text, score: "I cannot judge this." if "sample 3" in text else f"Score: {score!r}")
    reward = RemoteJudge(server.base_url, model="m", max_concurrency=4)
    with caplog.at_level(logging.WARNING, logger="rewards.remote"):
        got = reward(images, PROMPTS)
    expected = JpegIncompressibility()(quantise(images))
    assert math.isnan(got[3]) and torch.equal(torch.cat([got[:3], got[4:]]), torch.cat([expected[:3], expected[4:]]))
    assert reward.unparsed_total == 1
    assert "1/8 answers" in caplog.text and "sample 3" in caplog.text and "I cannot judge this." in caplog.text


def test_remote_score_parsing_and_range_mapping():
    r = RemoteJudge("http://127.0.0.1:1/v1", model="m", score_range=[1, 10])
    assert r.parse("Reasoning... Score: 5.5") == 0.5
    assert r.parse("score= 1e1") == 1.0 and r.parse("Score: 12") == 1.0 and r.parse("Score: -3") == 0.0
    assert math.isnan(r.parse("7 out of 10")) and math.isnan(r.parse(None))
    assert RemoteJudge("http://h/v1", model="m", score_pattern=r"\d+").parse("about 7 of 10") == 7.0


def test_remote_server_errors_fail_after_bounded_retries(judge, images):
    server = judge(status=503)
    reward = RemoteJudge(server.base_url, model="m", max_concurrency=1, max_retries=2, backoff_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        reward(images[:3], PROMPTS[:3])
    assert time.monotonic() - t0 < 2.0
    assert f"{server.base_url}/chat/completions failed after 3 attempt(s)" in str(e.value)
    assert "HTTP 503" in str(e.value) and "judge unavailable" in str(e.value)
    assert len(server.bodies) == 3  # 1 + max_retries for sample 0; samples 1, 2 never sent
    rejected = judge(status=400)
    with pytest.raises(RuntimeError, match="rejected the request .not retried.: HTTP 400"):
        RemoteJudge(rejected.base_url, model="m", max_retries=5)(images[:2], PROMPTS[:2])
    assert len(rejected.bodies) <= 2  # one attempt per request at most, never retried


def test_remote_killed_server_is_a_clear_error(judge, images):
    server = judge()
    reward = RemoteJudge(server.base_url, model="m", max_retries=2, backoff_s=0.1, timeout_s=5)
    assert torch.isfinite(reward(images[:2], PROMPTS[:2])).all()
    server.stop()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"{server.base_url}/chat/completions failed after 3 attempt"):
        reward(images[:2], PROMPTS[:2])
    assert 0.3 <= time.monotonic() - t0 < 3.0


def test_remote_yes_prob_and_expected_score_from_logprobs_by_hand(judge, images, caplog):
    """P(yes) = (p(" Yes") + p("yes")) / (that + p("No")) over the top log-probs; the expected score
    sum v p(v) / sum p(v) over the score tokens present; a reply without them is NaN and counted."""
    ln = math.log
    yes_no = [(" Yes", ln(0.6)), ("yes", ln(0.1)), ("No", ln(0.2)), ("Maybe", ln(0.1))]
    scores = [("7", ln(0.5)), (" 8", ln(0.3)), ("x", ln(0.2))]

    def top(text, score):
        if "sample 2" in text:
            return None  # a reply without log-probs
        return yes_no if "yes or no" in text else scores

    server = judge(top_logprobs=top, answer=lambda text, score: "Yes")
    r = RemoteJudge(server.base_url, model="m", scoring="yes_prob", prompt_template="{prompt}: yes or no?",
                    top_logprobs=5)
    with caplog.at_level(logging.WARNING, logger="rewards.remote"):
        got = r(images[:4], PROMPTS[:4])
    assert got[[0, 1, 3]].tolist() == pytest.approx([0.7 / 0.9] * 3, rel=1e-6)
    assert math.isnan(got[2]) and r.missing_logprobs_total == 1 and "sample 2" in caplog.text
    assert server.bodies[0]["logprobs"] is True and server.bodies[0]["top_logprobs"] == 5
    r = RemoteJudge(server.base_url, model="m", scoring="expected_score", score_range=[0, 10])
    got = r(images[:2], ["sample 0", "sample 1"])
    assert got.tolist() == pytest.approx([(7 * 0.5 + 8 * 0.3) / 0.8 / 10] * 2, rel=1e-6)
    none = judge(top_logprobs=lambda text, score: [("maybe", 0.0)])  # none of the tokens: NaN, not a guess
    assert torch.isnan(RemoteJudge(none.base_url, model="m", scoring="yes_prob")(images[:1], PROMPTS[:1])).all()


def test_remote_per_request_seeds_follow_iteration_and_sample_index(judge, images):
    from pretrain.seeding import seed_for

    server = judge()
    r = RemoteJudge(server.base_url, model="m", seed=7, max_concurrency=1, temperature=1.0)
    r(images[:3], PROMPTS[:3], {"sample_ids": torch.tensor([4, 5, 6]), "iteration": 2})
    sent = [b["seed"] for b in server.bodies]
    assert sent == [seed_for(7, 2, i) % (1 << 31) for i in (4, 5, 6)] and len(set(sent)) == 3
    r(images[:1], PROMPTS[:1], {"sample_ids": torch.tensor([4]), "iteration": 3})
    assert server.bodies[-1]["seed"] not in sent  # another iteration, another seed
    RemoteJudge(server.base_url, model="m")(images[:1], PROMPTS[:1])
    assert "seed" not in server.bodies[-1] and "logprobs" not in server.bodies[-1]  # off by default
    with pytest.raises(ValueError, match="scoring must be one of text, yes_prob, expected_score"):
        RemoteJudge(server.base_url, model="m", scoring="logits")
