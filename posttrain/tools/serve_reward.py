"""`posttrain serve-reward CONFIG`: host configured rewards behind HTTP, so heavy reward models run on
another machine; `rewards/served.py` is the matching client.

CONFIG is a YAML file with a ``rewards:`` block in the training configs' form (other top-level keys are
ignored, so a GRPO config can be served as it is); it is built with ``rewards.base.CompositeReward``.

- ``POST /score`` ``{"images": [base64 PNG, ...], "prompts": [str, ...]}`` (same length, one image
  size per request) -> ``{"scores": [B], "raw": {name: [B]}}``: the weighted sum and each reward's raw
  score; NaN (and +-inf) is encoded as ``null``. Images are decoded to float32 [0, 1] RGB, so rewards
  see 8-bit-quantised images. A reward that raises -> 500. One batch is scored at a time (rewards
  need not be thread-safe); requests are read concurrently, ``Limits.max_inflight`` decoded at once.
- ``GET /health`` -> ``{"status": "ok", "rewards": {name: weight}}``.

Every refusal is a JSON ``{"error": "<what>: ..."}`` naming the header, field or sample, sent before
the work it prevents:

- 401: a token is configured and the request has no ``Authorization: Bearer <token>`` or a wrong one
  (compared in constant time); checked first, on every path.
- 411: no ``Content-Length`` (or a ``Transfer-Encoding``); 400: a negative, malformed or repeated one.
- 413: a ``Content-Length`` over ``Limits.max_body_bytes`` (the body is not read); an image whose
  ``width x height``, read from its PNG header, is over ``Limits.max_image_pixels``, or images whose
  sum is over ``Limits.max_request_pixels`` (nothing is decoded).
- 408: the body did not arrive within ``Limits.read_timeout_s``; 400: the connection ended before
  ``Content-Length`` bytes.
- 400: anything else a client must fix (not JSON, prompt count, not a PNG, mixed sizes).

Without a token the server listens on loopback addresses only (``ConfigError`` otherwise).
"""

from __future__ import annotations

import hmac
import io
import ipaddress
import json
import logging
import math
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import torch
import yaml

from pretrain.config import ConfigError
from rewards.base import CompositeReward
from rewards.png import b64_bytes
from rewards.served import TOKEN_ENV, read_token

log = logging.getLogger(__name__)
LINGER_S = 1.0  # after refusing a request whose body was not read, how long unread input is drained


@dataclass(frozen=True)
class Limits:
    """What one request may cost the server; each is checked before the work it bounds.

    Attributes:
        max_body_bytes: largest ``Content-Length`` accepted (bytes; 64 MiB); larger -> 413 unread.
        max_image_pixels: largest ``width x height`` of one image (pixels; 4096 x 4096 = 16,777,216),
            read from the PNG header before decoding; larger -> 413.
        max_request_pixels: largest sum of ``width x height`` over a request's images (pixels;
            67,108,864 = 4 images of 4096 x 4096); larger -> 413. A request decodes to float32
            ``[B, 3, H, W]``: at most 12 bytes x this (768 MiB).
        read_timeout_s: seconds within which the request line and headers (per read) and the whole
            body must arrive; 408 for a late body. A slow client holds only its own connection.
        max_inflight: requests decoded and scored at once (one is scored at a time); others wait with
            their body read. Decoded images stay under ``max_inflight x 12 B x max_request_pixels``
            (1.5 GiB by default); each body being read or waiting is at most ``max_body_bytes``.
    """

    max_body_bytes: int = 64 << 20
    max_image_pixels: int = 4096 * 4096
    max_request_pixels: int = 4 * 4096 * 4096
    read_timeout_s: float = 30.0
    max_inflight: int = 2

    def __post_init__(self):
        bad = [f.name for f in fields(self) if not getattr(self, f.name) > 0]
        if bad:
            raise ConfigError(f"serve-reward: {', '.join(bad)} must be > 0")


class BadRequest(ValueError):
    """A request the client must fix: answered HTTP ``status`` (400 unless given) with
    ``{"error": message}``; the message names the header, field or sample."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def load_reward(config: str | Path) -> CompositeReward:
    """Build the ``rewards:`` block of the YAML file ``config``; ``ConfigError`` naming the file (and
    the key) when it is missing, unreadable, has no ``rewards`` mapping, names an unknown reward, or a
    reward fails to build (e.g. a ``served`` reward whose server does not answer)."""
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


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(raw: bytes) -> tuple[int, int]:
    """``(width, height)`` from a PNG's IHDR chunk (bytes 16-24; nothing is decompressed);
    ``ValueError`` when ``raw`` does not start with the PNG signature and an IHDR chunk."""
    if len(raw) < 24 or raw[:8] != PNG_SIGNATURE or raw[12:16] != b"IHDR":
        raise ValueError("no PNG signature and IHDR header")
    return struct.unpack(">II", raw[16:24])


def read_png_header(data, where: str, max_pixels: int) -> tuple[bytes, tuple[int, int]]:
    """A base64 PNG string (a ``data:...;base64,`` prefix is accepted) -> (the PNG bytes, its
    ``(width, height)`` from the header). ``BadRequest`` naming ``where``: 400 when ``data`` is not a
    string, not base64 or not a PNG; 413 when ``width x height`` is over ``max_pixels``."""
    try:
        raw = b64_bytes(data, where)
    except ValueError as e:
        raise BadRequest(str(e)) from e
    try:
        w, h = png_size(raw)
    except ValueError as e:
        raise BadRequest(f"{where}: not a base64-encoded PNG ({e})") from e
    if w * h > max_pixels:
        raise BadRequest(f"{where}: {w}x{h} = {w * h} pixels, more than the {max_pixels} allowed per image "
                         f"(serve-reward --max-image-pixels)", 413)
    return raw, (w, h)


def decode_png(raw: bytes, size: tuple[int, int], where: str) -> np.ndarray:
    """PNG bytes whose header said ``size`` -> uint8 ``[H, W, 3]`` RGB. ``BadRequest`` naming ``where``:
    400 when Pillow cannot read it as a PNG of that size, 413 when Pillow's own decompression-bomb
    limit (``PIL.Image.MAX_IMAGE_PIXELS``, which ``serve`` sets to the per-image limit) refuses it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw), formats=["PNG"]) as im:
            if im.size != size:
                raise ValueError(f"size {im.size} differs from its IHDR {size}")
            return np.array(im.convert("RGB"))
    except Image.DecompressionBombError as e:
        raise BadRequest(f"{where}: {e}", 413) from e
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise BadRequest(f"{where}: not a base64-encoded PNG ({e})") from e


def parse_request(body: bytes | bytearray, limits: Limits = Limits()) -> tuple[torch.Tensor, list[str]]:
    """A ``/score`` body -> (float32 ``[B, 3, H, W]`` in [0, 1], ``B`` prompts). Every image's size is
    read from its PNG header and checked against ``limits`` before any image is decoded; the images
    are then decoded one by one into one preallocated tensor. ``BadRequest`` naming the field or
    sample otherwise (413 for a pixel limit, else 400)."""
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
    pngs = []
    for i, data in enumerate(images):
        raw, size = read_png_header(data, f"images[{i}]", limits.max_image_pixels)
        if pngs and size != pngs[0][1]:
            raise BadRequest(f"images[{i}]: size {size[::-1]} differs from images[0] {pngs[0][1][::-1]}; "
                             f"send one size per request")
        pngs.append((raw, size))
    (w, h), n = pngs[0][1], len(pngs)
    if n * w * h > limits.max_request_pixels:
        raise BadRequest(f"images: {n} images of {w}x{h} = {n * w * h} pixels, more than the "
                         f"{limits.max_request_pixels} allowed per request (serve-reward --max-request-pixels); "
                         f"send fewer per request", 413)
    out = torch.empty(n, 3, h, w)
    for i, (raw, size) in enumerate(pngs):
        rgb = decode_png(raw, size, f"images[{i}]")
        out[i].copy_(torch.from_numpy(rgb).permute(2, 0, 1)).div_(255.0)
    return out, prompts


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address (127.0.0.0/8, ::1);
    ``""``, ``0.0.0.0`` and ``::`` (all interfaces) and unresolvable names are not."""
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_bind(host: str, token: str | None) -> None:
    """``ConfigError`` when ``host`` is not a loopback address and no token is set: without one,
    anyone who can reach the port could use (and exhaust) the reward models."""
    if token is None and not is_loopback(host):
        raise ConfigError(f"serve-reward --host {host or '(all interfaces)'}: not a loopback address, so a "
                          f"token is required; pass --token-file PATH or set ${TOKEN_ENV}")


class _Handler(BaseHTTPRequestHandler):
    server: "RewardServer"

    def setup(self):
        self.timeout = self.server.limits.read_timeout_s  # socket timeout: request line, headers, each body read
        super().setup()

    def _reply(self, code: int, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload, allow_nan=False).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if code >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _refuse_unread(self, e: BadRequest) -> None:
        """Answer ``e`` to a request whose body was not read, then drain what the client still sends
        (for at most ``LINGER_S``) so that it reads the answer rather than a connection reset."""
        extra = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        self._reply(e.status, {"error": str(e)}, extra)
        try:
            self.connection.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + LINGER_S
            while (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                if not self.rfile.read1(1 << 16):
                    break
        except OSError:  # the client closed or reset: nothing left to drain
            pass

    def _check_token(self) -> None:
        token = self.server.token
        if token is None:
            return
        scheme, _, value = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise BadRequest("Authorization: missing; send 'Authorization: Bearer <token>'", 401)
        if not hmac.compare_digest(value.strip().encode(), token.encode()):
            raise BadRequest("Authorization: wrong token", 401)

    def _content_length(self) -> int:
        if "Transfer-Encoding" in self.headers:
            raise BadRequest("Transfer-Encoding: not supported; send the body with a Content-Length", 411)
        values = self.headers.get_all("Content-Length") or []
        if not values:
            raise BadRequest("Content-Length: required", 411)
        if len({v.strip() for v in values}) > 1:
            raise BadRequest(f"Content-Length: {len(values)} different values")
        text = values[0].strip()
        if not re.fullmatch(r"[0-9]{1,30}", text):
            raise BadRequest(f"Content-Length: {text[:40]!r} is not a non-negative integer")
        n, limit = int(text), self.server.limits.max_body_bytes
        if n > limit:
            raise BadRequest(f"body: Content-Length {n} bytes, more than the {limit} allowed "
                             "(serve-reward --max-body-mib)", 413)
        return n

    def _read_body(self, n: int) -> bytearray:
        """Exactly ``n`` bytes; ``BadRequest`` 408 when they have not all arrived within the read
        timeout, 400 when the connection ends first."""
        timeout = self.server.limits.read_timeout_s
        deadline, buf = time.monotonic() + timeout, bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(left)
                chunk = self.rfile.read1(min(n - len(buf), 1 << 20))
            except TimeoutError:
                raise BadRequest(f"body: {len(buf)} of its Content-Length {n} bytes arrived within the "
                                 f"{timeout:g} s read timeout", 408) from None
            if not chunk:
                raise BadRequest(f"body: the connection ended after {len(buf)} of its Content-Length {n} bytes")
            buf += chunk
        self.connection.settimeout(timeout)
        return buf

    def _route(self) -> str:
        return self.path.split("?")[0].rstrip("/")

    def do_GET(self):
        try:
            self._check_token()
        except BadRequest as e:
            return self._refuse_unread(e)
        if self._route() == "/health":
            self._reply(200, {"status": "ok", "rewards": self.server.weights})
        else:
            self._reply(404, {"error": f"{self.path}: not found; use POST /score or GET /health"})

    def do_POST(self):
        try:
            self._check_token()
            if self._route() != "/score":
                raise BadRequest(f"{self.path}: not found; use POST /score or GET /health", 404)
            n = self._content_length()
        except BadRequest as e:
            return self._refuse_unread(e)
        try:
            body = self._read_body(n)
        except BadRequest as e:
            return self._reply(e.status, {"error": str(e)})
        with self.server.slots:
            try:
                images, prompts = parse_request(body, self.server.limits)
            except BadRequest as e:
                return self._reply(e.status, {"error": str(e)})
            del body
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
    (a ``CompositeReward`` or anything with that signature and a ``weights`` dict), within ``limits``.
    ``token``: the bearer token every request must carry; ``None`` allows none and is refused
    (``ConfigError``, before binding) unless ``host`` is a loopback address."""

    daemon_threads = True

    def __init__(self, reward, host: str = "127.0.0.1", port: int = 0, *, limits: Limits = Limits(),
                 token: str | None = None):
        check_bind(host, token)
        super().__init__((host, port), _Handler)
        self.reward, self.lock = reward, threading.Lock()
        self.limits, self.token = limits, token
        self.slots = threading.BoundedSemaphore(limits.max_inflight)
        self.weights = dict(getattr(reward, "weights", {}))

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def serve(config: str | Path, host: str = "127.0.0.1", port: int = 8100, *, limits: Limits = Limits(),
          token_file: str | Path | None = None) -> None:
    """Build the rewards of ``config`` and serve them within ``limits`` until interrupted; prints the
    URL (with the real port when ``port`` is 0) once listening. The token is the text of
    ``token_file``, else ``$POSTTRAIN_REWARD_TOKEN``. ``ConfigError`` (before the rewards are built)
    for an unreadable or empty token file, or a non-loopback ``host`` without a token; ``OSError``
    when the address cannot be bound. Sets Pillow's ``Image.MAX_IMAGE_PIXELS`` to
    ``limits.max_image_pixels``."""
    from PIL import Image

    try:
        token = read_token(token_file)
    except ValueError as e:
        raise ConfigError(f"serve-reward --token-file: {e}") from e
    check_bind(host, token)
    reward = load_reward(config)
    Image.MAX_IMAGE_PIXELS = limits.max_image_pixels
    try:
        server = RewardServer(reward, host, port, limits=limits, token=token)
    except OSError as e:
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    auth = "bearer token required" if token else "no token: loopback only"
    print(f"serving rewards {server.weights} on {server.url} (POST /score, GET /health; {auth})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
