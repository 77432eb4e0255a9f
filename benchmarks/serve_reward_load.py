"""Load test of `posttrain serve-reward`: ``--clients`` concurrent clients send ``--requests`` requests
each to a local server started with the CLI (a bearer token, ``--read-timeout 1``, the default limits
otherwise); every ``--hostile-every``-th request is hostile, cycling through the kinds in ``HOSTILE``
(no or wrong token, missing/negative/oversize Content-Length, pixel bombs, too many pixels per request,
a short body, not JSON).

Checks that every valid answer equals in-process scoring of the same quantised images and that every
hostile request got its 4xx; reports the counts, latencies and the server's RSS after warm-up and
at peak (``VmHWM`` from /proc: a bomb that were decoded would show there). Exits 1 on any failure.

    python benchmarks/serve_reward_load.py [--clients 8] [--requests 25] [--hostile-every 4]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import select
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rewards.base import CompositeReward  # noqa: E402
from rewards.png import encode_png_b64, quantise  # noqa: E402

WEIGHTS = {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.25}
TOKEN = "load-test-token"


def blank_png(width: int, height: int) -> bytes:
    """A valid all-black 1-bit greyscale PNG of ``width x height``, built one row at a time: a few kB
    that decode to ``width x height x 3`` bytes of RGB (a pixel bomb when the size is large)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row, z = b"\0" * (1 + (width + 7) // 8), zlib.compressobj(9)  # filter byte + packed bits
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # bit depth 1, greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def http_request(body: bytes = b"", *, token: str | None = TOKEN, length: str | None = "auto",
                 method: str = "POST", path: str = "/score") -> bytes:
    """Raw HTTP/1.1 request bytes; ``length`` ``"auto"`` sends ``len(body)``, ``None`` no header."""
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", "Content-Type: application/json"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    if length is not None:
        lines.append(f"Content-Length: {len(body) if length == 'auto' else length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def exchange(url: str, data: bytes, *, half_close: bool = False, timeout: float = 30.0):
    """Send ``data`` on a fresh connection and read until the server closes: ``(status, JSON body,
    headers text)``, or ``(None, None, "")`` when the connection ended without an answer."""
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        reply = b""
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(1 << 16):
                reply += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass
    if not reply:
        return None, None, ""
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body else None, head.decode("latin-1")


def score_body(pngs: list[str], prompts: list[str] | None = None) -> bytes:
    return json.dumps({"images": pngs, "prompts": prompts or [f"p{i}" for i in range(len(pngs))]}).encode()


def b64(png: bytes) -> str:
    return base64.b64encode(png).decode()


def hostile_requests() -> dict[str, tuple[int, bytes, bool]]:
    """Kind -> (expected status, request bytes, whether to half-close after sending)."""
    small = score_body(encode_png_b64(torch.rand(1, 3, 8, 8)))
    return {
        "no token": (401, http_request(small, token=None), False),
        "wrong token": (401, http_request(small, token="not-the-token"), False),
        "no Content-Length": (411, http_request(small, length=None), False),
        "negative Content-Length": (400, http_request(b"{}", length="-5"), False),
        "Content-Length over the body limit": (413, http_request(b"{}", length=str(65 << 20)), False),
        "20000x20000 pixel bomb": (413, http_request(score_body([b64(blank_png(20000, 20000))])), False),
        "4 x 6000x6000 1-bit PNGs": (413, http_request(score_body([b64(blank_png(6000, 6000))] * 4)), False),
        "5 x 4096x4096 in one request": (413, http_request(score_body([b64(blank_png(4096, 4096))] * 5)), False),
        "short body under a large Content-Length": (408, http_request(b'{"images": [', length="100000"), False),
        "body ends before its Content-Length": (400, http_request(b'{"images": [', length="100000"), True),
        "not JSON": (400, http_request(b"this is not json"), False),
    }


def start_server(workdir: Path):
    """``posttrain serve-reward`` in a subprocess -> (process, URL)."""
    cfg, token_file, log = workdir / "serve.yaml", workdir / "token", open(workdir / "serve.log", "w")
    cfg.write_text(json.dumps({"rewards": WEIGHTS}))
    token_file.write_text(TOKEN + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "serve-reward", str(cfg), "--port", "0",
                             "--token-file", str(token_file), "--read-timeout", "1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline, line = time.monotonic() + 120, ""
    while "serving rewards" not in line:
        if not select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))[0] or proc.poll() is not None:
            proc.kill()
            raise SystemExit(f"serve-reward did not start (rc {proc.poll()}); see {log.name}")
        line = proc.stdout.readline()
    return proc, line.split(" on ")[1].split()[0]


def rss_mib(pid: int) -> dict[str, float]:
    """``VmRSS`` and ``VmHWM`` (peak) of process ``pid`` in MiB, from /proc."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def valid_request(seed: int) -> tuple[bytes, torch.Tensor]:
    """A request of 4 random 32x32 images and the scores in-process scoring gives their quantised copies."""
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    prompts = [f"sample {seed}.{i}" for i in range(4)]
    expected, _ = CompositeReward(WEIGHTS)(quantise(images), prompts)
    return http_request(score_body(encode_png_b64(images), prompts)), expected


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=25, help="per client")
    ap.add_argument("--hostile-every", type=int, default=4, help="every k-th request of a client is hostile")
    a = ap.parse_args()
    hostile = hostile_requests()
    kinds = list(hostile)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(Path(tmp))
        try:
            body, expected = valid_request(-1)
            status, reply, _ = exchange(url, body)
            assert status == 200 and torch.equal(torch.tensor(reply["scores"]), expected), (status, reply)
            warm = rss_mib(proc.pid)
            lock, results = threading.Lock(), []

            def client(c: int) -> None:
                for r in range(a.requests):
                    k = c * a.requests + r
                    if (r + 1) % a.hostile_every == 0:
                        kind = kinds[(k // a.hostile_every) % len(kinds)]
                        want, data, half = hostile[kind]
                        t0 = time.perf_counter()
                        status, reply, _ = exchange(url, data, half_close=half)
                        ok = status == want and isinstance(reply, dict) and "error" in reply
                    else:
                        kind, (data, expected) = "valid", valid_request(k)
                        t0 = time.perf_counter()
                        status, reply, _ = exchange(url, data)
                        ok = status == 200 and torch.equal(torch.tensor(reply["scores"], dtype=torch.float32),
                                                           expected)
                    with lock:
                        results.append((kind, status, ok, time.perf_counter() - t0))

            t0 = time.perf_counter()
            threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            peak = rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(10)
    valid = [r for r in results if r[0] == "valid"]
    bad = [r for r in results if r[0] != "valid"]
    lat = sorted(r[3] * 1000 for r in valid)
    codes = Counter(r[1] for r in bad)
    print(f"serve-reward load: {a.clients} concurrent clients x {a.requests} requests = {len(results)} "
          f"({len(valid)} valid, {len(bad)} hostile) in {wall:.1f} s")
    print(f"valid: {sum(r[2] for r in valid)}/{len(valid)} answered 200 with the in-process scores; latency "
          f"p50 {statistics.median(lat):.0f} ms, p95 {lat[int(0.95 * (len(lat) - 1))]:.0f} ms")
    print(f"hostile: {sum(r[2] for r in bad)}/{len(bad)} refused with the expected status; 4xx answers: "
          f"{sum(n for c, n in codes.items() if c and 400 <= c < 500)} ("
          + ", ".join(f"{c}: {n}" for c, n in sorted(codes.items(), key=lambda x: x[0] or 0)) + ")")
    for kind in kinds:
        rows = [r for r in bad if r[0] == kind]
        if rows:
            print(f"  {kind}: {len(rows)} x HTTP {sorted({r[1] for r in rows}, key=lambda s: s or 0)}, "
                  f"expected {hostile[kind][0]}, max {max(r[3] for r in rows) * 1000:.0f} ms")
    print(f"server RSS: {warm['VmRSS']:.0f} MiB after warm-up, peak (VmHWM) {peak['VmHWM']:.0f} MiB "
          f"(+{peak['VmHWM'] - warm['VmRSS']:.0f} MiB under load)")
    failed = [r for r in results if not r[2]]
    if failed:
        print(f"FAILED: {len(failed)} request(s), first: {failed[0]}")
        sys.exit(1)


if __name__ == "__main__":
    main()
