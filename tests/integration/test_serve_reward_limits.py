"""`posttrain serve-reward` under hostile and broken requests, and remote rewards checked at start-up.

Each hostile request gets its 4xx with a JSON error naming the problem, before the work it would
cost (a pixel bomb is refused from its PNG header: the server's peak RSS does not move); the token is
required and compared on every request; a server without a token listens on loopback only; a
`served` or `remote` reward whose server is dead fails when it is built, in one line naming the URL."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from benchmarks.serve_reward_load import b64, blank_png, exchange, http_request, score_body
from posttrain.tools.serve_reward import Limits, RewardServer, is_loopback
from pretrain.config import ConfigError
from rewards.base import CompositeReward
from rewards.png import encode_png_b64, quantise
from rewards.remote import RemoteJudge
from rewards.served import TOKEN_ENV, ServedReward
from rewards.transport import RewardUnavailable
from tests.integration.judge_server import JudgeServer
from tests.integration.test_served_rewards import WEIGHTS, serve_reward_process

pytestmark = pytest.mark.core

TOKEN = "s3cret-test-token"
LIMITS = Limits(max_body_bytes=256 << 10, max_image_pixels=64 * 64, max_request_pixels=3 * 64 * 64,
                read_timeout_s=0.5, max_inflight=2)
PROMPTS = [f"sample {i}" for i in range(3)]


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.rand(3, 3, 24, 24, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def server():
    """An in-process server with small ``LIMITS`` (0.5 s read timeout) and the token ``TOKEN``."""
    srv = RewardServer(CompositeReward(WEIGHTS), "127.0.0.1", 0, limits=LIMITS, token=TOKEN)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def no_env_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def _file(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def _dead_url() -> str:
    """A loopback URL nothing listens on (a port just bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _valid(images) -> bytes:
    return score_body(encode_png_b64(images), PROMPTS)


def test_content_length_problems_are_411_and_400_naming_the_header(server, images):
    body = _valid(images)
    assert exchange(server.url, http_request(body, token=TOKEN, length=None))[:2] == \
        (411, {"error": "Content-Length: required"})
    status, reply, _ = exchange(server.url, http_request(body, token=TOKEN, length="-5"))
    assert (status, reply) == (400, {"error": "Content-Length: '-5' is not a non-negative integer"})
    status, reply, _ = exchange(server.url, http_request(body, token=TOKEN, length="12abc"))
    assert status == 400 and reply["error"].startswith("Content-Length: '12abc'")


def test_oversize_body_is_413_before_it_is_read(server):
    n = LIMITS.max_body_bytes + 1
    t0 = time.monotonic()
    status, reply, _ = exchange(server.url, http_request(b"{}", token=TOKEN, length=str(n)))
    assert status == 413 and time.monotonic() - t0 < LIMITS.read_timeout_s  # answered from the header
    assert reply["error"] == f"body: Content-Length {n} bytes, more than the {LIMITS.max_body_bytes} allowed " \
                             "(serve-reward --max-body-mib)"
    big = json.dumps({"images": ["x" * n], "prompts": ["p"]}).encode()  # really sent: the client still reads the 413
    req = urllib.request.Request(server.url + "/score", data=big, headers={"Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 413 and json.loads(e.value.read())["error"].startswith(f"body: Content-Length {len(big)}")


def test_pixel_limits_are_413_from_the_png_header(server):
    status, reply, _ = exchange(server.url, http_request(score_body([encode_png_b64(torch.zeros(1, 3, 64, 65))[0]]),
                                                         token=TOKEN))
    assert (status, reply) == (413, {"error": "images[0]: 65x64 = 4160 pixels, more than the 4096 allowed per image "
                                              "(serve-reward --max-image-pixels)"})
    four = score_body(encode_png_b64(torch.zeros(4, 3, 60, 60)))
    status, reply, _ = exchange(server.url, http_request(four, token=TOKEN))
    assert (status, reply["error"]) == (413, "images: 4 images of 60x60 = 14400 pixels, more than the 12288 allowed "
                                             "per request (serve-reward --max-request-pixels); send fewer per request")
    bomb = score_body([b64(blank_png(20000, 20000))])
    status, reply, _ = exchange(server.url, http_request(bomb, token=TOKEN))
    assert status == 413 and reply["error"].startswith("images[0]: 20000x20000 = 400000000 pixels")


def test_short_body_is_408_after_the_read_timeout_and_the_server_keeps_serving(server, images):
    t0 = time.monotonic()
    status, reply, _ = exchange(server.url, http_request(b'{"images": [', token=TOKEN, length="1000"))
    elapsed = time.monotonic() - t0
    assert (status, reply) == (408, {"error": "body: 12 of its Content-Length 1000 bytes arrived within the 0.5 s "
                                              "read timeout"})
    assert LIMITS.read_timeout_s * 0.9 <= elapsed < LIMITS.read_timeout_s + 2
    status, reply, _ = exchange(server.url, http_request(b'{"images": [', token=TOKEN, length="1000"), half_close=True)
    assert (status, reply) == (400, {"error": "body: the connection ended after 12 of its Content-Length 1000 bytes"})
    t0 = time.monotonic()
    assert exchange(server.url, b"POST /score HTTP/1.1\r\nHost: x\r\n")[0] is None  # headers never end: dropped
    assert time.monotonic() - t0 < LIMITS.read_timeout_s + 2
    status, reply, _ = exchange(server.url, http_request(_valid(images), token=TOKEN))
    expected, _ = CompositeReward(WEIGHTS)(quantise(images), PROMPTS)
    assert status == 200 and torch.equal(torch.tensor(reply["scores"]), expected)


def test_token_is_required_on_every_request_and_the_right_one_scores(server, images, tmp_path, monkeypatch,
                                                                      no_env_token):
    body = _valid(images)
    status, reply, head = exchange(server.url, http_request(body, token=None))
    assert (status, reply) == (401, {"error": "Authorization: missing; send 'Authorization: Bearer <token>'"})
    assert "WWW-Authenticate: Bearer" in head
    assert exchange(server.url, http_request(body, token=TOKEN + "x"))[:2] == \
        (401, {"error": "Authorization: wrong token"})
    assert exchange(server.url, http_request(token=None, method="GET", path="/health", length=None))[0] == 401
    assert exchange(server.url, http_request(token=TOKEN, method="GET", path="/health", length=None))[:2] == \
        (200, {"status": "ok", "rewards": WEIGHTS})

    expected, raw = CompositeReward(WEIGHTS)(quantise(images), PROMPTS)
    token_file = _file(tmp_path, "token", TOKEN + "\n")
    got, _ = CompositeReward({"served": {"url": server.url, "token_file": token_file, "batch_size": 2}})(images, PROMPTS)
    assert torch.equal(got, expected) and len(set(got.tolist())) == 3
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    part = ServedReward(server.url, component="jpeg_incompressibility")(images, PROMPTS)
    assert torch.equal(part, raw["jpeg_incompressibility"])

    monkeypatch.setenv(TOKEN_ENV, "wrong")
    with pytest.raises(RewardUnavailable) as e:  # built from a config: checked before any scoring
        CompositeReward({"served": {"url": server.url}})
    msg = str(e.value)
    assert msg.startswith(f"served reward: start-up check failed: {server.url}/health rejected the request "
                          "(not retried): HTTP 401") and "Authorization: wrong token" in msg
    assert msg.endswith(f"set token_file or ${TOKEN_ENV} to the server's token") and "\n" not in msg


def test_without_a_token_only_loopback_is_served(tmp_path, capsys, no_env_token):
    from posttrain.cli import main

    cfg = _file(tmp_path, "serve.yaml", "rewards: {jpeg_compressibility: 1.0}\n")
    assert main(["serve-reward", cfg, "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == ("config error: serve-reward --host 0.0.0.0: not a loopback address, so a token is required; "
                   f"pass --token-file PATH or set ${TOKEN_ENV}\n")
    with pytest.raises(ConfigError, match="--host 0.0.0.0: not a loopback address"):
        RewardServer(CompositeReward(WEIGHTS), "0.0.0.0", 0)
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("no-such-host.invalid")
    assert main(["serve-reward", cfg, "--token-file", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert f"--token-file: token file {tmp_path / 'missing'}: cannot read it" in capsys.readouterr().err
    assert main(["serve-reward", cfg, "--token-file", _file(tmp_path, "empty", " \n"), "--port", "0"]) == 2
    assert "empty" in capsys.readouterr().err
    assert main(["serve-reward", cfg, "--read-timeout", "0", "--port", "0"]) == 2
    assert "read_timeout_s must be > 0" in capsys.readouterr().err


def test_cli_defaults_are_the_documented_limits():
    from posttrain.cli import build_parser

    a = build_parser().parse_args(["serve-reward", "cfg.yaml"])
    assert Limits() == Limits(max_body_bytes=64 << 20, max_image_pixels=16_777_216, max_request_pixels=67_108_864,
                              read_timeout_s=30.0, max_inflight=2)
    assert (int(a.max_body_mib * 2**20), a.max_image_pixels, a.max_request_pixels, a.read_timeout, a.max_inflight) == \
        (Limits().max_body_bytes, Limits().max_image_pixels, Limits().max_request_pixels, Limits().read_timeout_s,
         Limits().max_inflight)
    assert a.token_file is None and a.host == "127.0.0.1"


def _vm_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def test_pixel_bombs_do_not_raise_the_served_process_memory(tmp_path, images, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # the subprocess reads it as its token; the client sends it
    with serve_reward_process(tmp_path) as (proc, url):
        status, reply, _ = exchange(url, http_request(_valid(images), token=TOKEN))
        assert status == 200 and len(reply["scores"]) == 3  # warm: every import done
        before = _vm_kib(proc.pid, "VmHWM")
        bomb = b64(blank_png(20000, 20000))
        status, reply, _ = exchange(url, http_request(score_body([bomb]), token=TOKEN))
        assert (status, reply) == (413, {"error": "images[0]: 20000x20000 = 400000000 pixels, more than the "
                                                  "16777216 allowed per image (serve-reward --max-image-pixels)"})
        six = b64(blank_png(6000, 6000))
        body = score_body([six] * 4)
        assert len(body) < 30_000  # a ~24 kB request that would decode to 4 x 36 MP
        status, reply, _ = exchange(url, http_request(body, token=TOKEN))
        assert status == 413 and reply["error"].startswith("images[0]: 6000x6000 = 36000000 pixels")
        assert exchange(url, http_request(body, token=None))[0] == 401
        grown_mib = (_vm_kib(proc.pid, "VmHWM") - before) / 1024
        assert grown_mib < 32, f"peak RSS grew by {grown_mib:.0f} MiB"


def test_dead_or_wrong_remote_servers_fail_at_build_in_one_line(tmp_path, capsys, server, no_env_token):
    dead = _dead_url()
    t0 = time.monotonic()
    with pytest.raises(RewardUnavailable) as e:
        CompositeReward({"served": {"url": dead, "max_retries": 1, "backoff_s": 0.05}})
    assert time.monotonic() - t0 < 2
    assert str(e.value).startswith(f"served reward: start-up check failed: {dead}/health failed after 2 attempt(s)")
    assert "Connection refused" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(RewardUnavailable) as e:
        CompositeReward({"remote": {"base_url": dead + "/v1", "model": "m", "max_retries": 0}})
    assert str(e.value).startswith(f"remote reward: start-up check failed: {dead}/v1/chat/completions failed after "
                                   "1 attempt(s)") and "\n" not in str(e.value)
    with pytest.raises(RewardUnavailable, match=r"/health: serves \['jpeg_compressibility', 'jpeg_incompressibility'\], "
                                                r"not component 'aesthetic'"):
        CompositeReward({"served": {"url": server.url, "component": "aesthetic",
                                    "token_file": _file(tmp_path, "token", TOKEN)}})

    judge = JudgeServer()
    refusing = JudgeServer(status=404)
    try:
        reward = CompositeReward({"remote": {"base_url": judge.base_url, "model": "judge-vl"}})
        assert len(judge.bodies) == 1 and judge.bodies[0]["model"] == "judge-vl"  # the one start-up request
        assert isinstance(reward.models["remote"], RemoteJudge)
        with pytest.raises(RewardUnavailable, match=f"{refusing.base_url}/chat/completions rejected the request "
                                                    r"\(not retried\): HTTP 404"):
            CompositeReward({"remote": {"base_url": refusing.base_url, "model": "m"}})
    finally:
        judge.stop()
        refusing.stop()

    from posttrain.cli import main

    cfg = _file(tmp_path, "chain.yaml", json.dumps({"rewards": {"served": {"url": dead, "max_retries": 0}}}))
    assert main(["serve-reward", cfg, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"config error: {cfg}: key 'rewards': served reward: start-up "
                                                   f"check failed: {dead}/health failed after 1 attempt(s)")
