"""`posttrain serve-reward CONFIG`: host configured rewards behind HTTP, so heavy reward models run on
another machine; `rewards/served.py` is the matching client.

CONFIG is a YAML file with a ``rewards:`` block in the training configs' form (other top-level keys are
ignored, so a GRPO config can be served as it is); it is built with ``rewards.base.CompositeReward``.

- ``POST /score`` ``{"images": [base64 PNG, ...], "prompts": [str, ...]}`` (same length, one image
  size per request) -> ``{"scores": [B], "raw": {name: [B]}}``: the weighted sum and each reward's raw
  score; NaN (and +-inf) is encoded as ``null``. Images are decoded to float32 [0, 1] RGB, so rewards
  see 8-bit-quantised images. A malformed request -> 400 ``{"error": "<field/sample>: ..."}``; a
  reward that raises -> 500. One batch is scored at a time (rewards need not be thread-safe);
  requests are read and decoded concurrently.
- ``GET /health`` -> ``{"status": "ok", "rewards": {name: weight}}``.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import yaml

from pretrain.config import ConfigError
from rewards.base import CompositeReward
from rewards.png import decode_png_b64

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 30


class BadRequest(ValueError):
    """A request the client must fix (HTTP 400); the message names the field or sample."""


def load_reward(config: str | Path) -> CompositeReward:
    """Build the ``rewards:`` block of the YAML file ``config``; ``ConfigError`` naming the file (and
    the key) when it is missing, unreadable, has no ``rewards`` mapping, or names an unknown reward."""
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from e
    block = doc.get("rewards") if isinstance(doc, dict) else None
    if not isinstance(block, dict) or not block:
        raise ConfigError(f"{path}: key 'rewards': expected a mapping such as {{jpeg_compressibility: 1.0}}")
    try:
        return CompositeReward(block)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: key 'rewards': {e}") from e


def encode_scores(values: torch.Tensor) -> list[float | None]:
    """float ``[B]`` -> a JSON-safe list: finite values as floats, NaN/inf as ``None``."""
    return [v if math.isfinite(v) else None for v in values.double().tolist()]


def parse_request(body: bytes) -> tuple[torch.Tensor, list[str]]:
    """A ``/score`` body -> (float32 ``[B, 3, H, W]`` in [0, 1], ``B`` prompts); ``BadRequest``
    naming the field or sample otherwise."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"body: not JSON ({e})") from e
    if not isinstance(req, dict):
        raise BadRequest("body: expected a JSON object with 'images' and 'prompts'")
    images, prompts = req.get("images"), req.get("prompts")
    if not isinstance(images, list) or not images:
        raise BadRequest("images: expected a non-empty list of base64 PNG strings")
    if not isinstance(prompts, list) or len(prompts) != len(images):
        got = f"{len(prompts)} prompts" if isinstance(prompts, list) else "no list"
        raise BadRequest(f"prompts: expected a list of {len(images)} strings (one per image), got {got}")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise BadRequest(f"prompts[{i}]: expected a string, got {type(p).__name__}")
    decoded = []
    for i, data in enumerate(images):
        try:
            img = decode_png_b64(data, f"images[{i}]")
        except ValueError as e:
            raise BadRequest(str(e)) from e
        if decoded and img.shape != decoded[0].shape:
            raise BadRequest(f"images[{i}]: size {tuple(img.shape[1:])} differs from images[0] "
                             f"{tuple(decoded[0].shape[1:])}; send one size per request")
        decoded.append(img)
    return torch.stack(decoded), prompts


class _Handler(BaseHTTPRequestHandler):
    server: "RewardServer"

    def _reply(self, code: int, payload: dict) -> None:
        data = json.dumps(payload, allow_nan=False).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.split("?")[0].rstrip("/") == "/health":
            self._reply(200, {"status": "ok", "rewards": self.server.weights})
        else:
            self._reply(404, {"error": f"{self.path}: not found; use POST /score or GET /health"})

    def do_POST(self):
        if self.path.split("?")[0].rstrip("/") != "/score":
            return self._reply(404, {"error": f"{self.path}: not found; use POST /score or GET /health"})
        try:
            n = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return self._reply(411, {"error": "Content-Length: required"})
        if n > MAX_BODY_BYTES:
            return self._reply(413, {"error": f"body: {n} bytes, more than the {MAX_BODY_BYTES} allowed"})
        try:
            images, prompts = parse_request(self.rfile.read(n))
        except BadRequest as e:
            return self._reply(400, {"error": str(e)})
        try:
            t0 = time.perf_counter()
            with self.server.lock:
                scores, raw = self.server.reward(images, prompts)
            log.info("scored %d images in %.3f s", len(prompts), time.perf_counter() - t0)
        except Exception as e:  # any reward failure goes back to the client, the server keeps serving
            log.exception("reward failed")
            return self._reply(500, {"error": f"reward failed: {type(e).__name__}: {e}"})
        self._reply(200, {"scores": encode_scores(scores), "raw": {k: encode_scores(v) for k, v in raw.items()}})

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)


class RewardServer(ThreadingHTTPServer):
    """A threading HTTP server scoring with ``reward(images, prompts) -> (scores [B], {name: [B]})``
    (a ``CompositeReward`` or anything with that signature and a ``weights`` dict)."""

    daemon_threads = True

    def __init__(self, reward, host: str = "127.0.0.1", port: int = 0):
        super().__init__((host, port), _Handler)
        self.reward, self.lock = reward, threading.Lock()
        self.weights = dict(getattr(reward, "weights", {}))

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def serve(config: str | Path, host: str = "127.0.0.1", port: int = 8100) -> None:
    """Build the rewards of ``config`` and serve them until interrupted; prints the URL (with the real
    port when ``port`` is 0) once listening."""
    reward = load_reward(config)
    try:
        server = RewardServer(reward, host, port)
    except OSError as e:
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    print(f"serving rewards {server.weights} on {server.url} (POST /score, GET /health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
