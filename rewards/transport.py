"""JSON over HTTP with bounded retries, an order-keeping thread pool, and the start-up check: the
transport of the ``remote`` and ``served`` rewards (stdlib ``urllib`` only).

Retried: connection errors (refused, reset, DNS), timeouts, HTTP 429 and 5xx, and a 2xx body that is
not JSON. Not retried: any other HTTP 4xx (a bad request, a wrong token or model name will not fix
itself): ``Rejected`` at once. Attempt k (0-based) that fails waits ``backoff_s * 2**k`` before the
next one; after ``1 + max_retries`` attempts the call raises ``RuntimeError`` naming the URL and the
last error. Every message is one line.

A reward built from a config (``checked_at_build``) asks its server once before anything else runs;
a server that is down, refuses the request or is not the expected kind raises ``RewardUnavailable``.
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_ENV_PROXY = urllib.request.build_opener()


class Aborted(Exception):
    """Raised inside a worker when another item of the same batch already failed."""


class Rejected(RuntimeError):
    """The server answered HTTP ``status`` (a 4xx other than 429), which a retry would not change."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class RewardUnavailable(ValueError):
    """A remote or served reward failed its start-up check: its server is down, keeps failing, refuses
    the request (e.g. a missing token or a wrong model name) or is not the expected server. One line
    naming the URL; a ``ValueError`` like the other reward-building errors, so ``posttrain`` prints it
    as one line and exits 1 before any rollout."""


def one_line(text: str, limit: int = 400) -> str:
    """``text`` with runs of whitespace (newlines included) collapsed to one space, cut at ``limit``
    characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _opener(url: str):
    """Loopback URLs bypass any ``http_proxy`` of the environment; other URLs honour it."""
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    return _NO_PROXY if loopback else _ENV_PROXY


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        body = e.read(500).decode("utf-8", "replace").strip()
    except Exception:  # the body is only a hint for the message
        body = ""
    return one_line(f"HTTP {e.code} {e.reason}" + (f": {body}" if body else ""))


def post_json(url: str, payload: dict, *, timeout_s: float, max_retries: int, backoff_s: float = 0.5,
              headers: dict | None = None, abort: threading.Event | None = None) -> dict:
    """POST ``payload`` as JSON to ``url`` and return the decoded JSON response.

    Raises ``Rejected`` (a ``RuntimeError``) at once on a non-retryable HTTP 4xx, ``RuntimeError``
    (naming ``url``, the attempt count and the last error) after ``1 + max_retries`` failed attempts;
    ``Aborted`` when ``abort`` is set (another request of the batch failed) before or between
    attempts."""
    return _request_json(url, json.dumps(payload, allow_nan=False).encode(), timeout_s=timeout_s,
                         max_retries=max_retries, backoff_s=backoff_s, headers=headers, abort=abort)


def get_json(url: str, *, timeout_s: float, max_retries: int, backoff_s: float = 0.5,
             headers: dict | None = None) -> dict:
    """GET ``url`` and return the decoded JSON response; retries and errors as ``post_json``."""
    return _request_json(url, None, timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s,
                         headers=headers)


def _request_json(url: str, data: bytes | None, *, timeout_s: float, max_retries: int, backoff_s: float,
                  headers: dict | None, abort: threading.Event | None = None):
    hdrs = {**({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
    opener, last = _opener(url), "no attempt made"
    for attempt in range(1 + max_retries):
        if abort is not None and abort.is_set():
            raise Aborted(url)
        try:
            req = urllib.request.Request(url, data=data, headers=hdrs, method="GET" if data is None else "POST")
            with opener.open(req, timeout=timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            last = _error_text(e)
            if e.code != 429 and 400 <= e.code < 500:
                raise Rejected(f"{url} rejected the request (not retried): {last}", e.code) from e
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
            last = one_line(f"{type(e).__name__}: {getattr(e, 'reason', None) or e}")
        if attempt < max_retries:
            delay = backoff_s * 2 ** attempt
            if abort is None:
                time.sleep(delay)
            elif abort.wait(delay):
                raise Aborted(url)
    raise RuntimeError(f"{url} failed after {1 + max_retries} attempt(s) (timeout {timeout_s} s each); "
                       f"last error: {last}")


def map_ordered(fn: Callable[[T, threading.Event], R], items: Sequence[T], max_concurrency: int) -> list[R]:
    """``[fn(item, abort) for item in items]`` with at most ``max_concurrency`` calls in flight; result
    ``i`` is ``fn(items[i])`` whatever order the calls finish in. On the first exception, ``abort`` is
    set, queued items are cancelled, and that exception is re-raised once running calls return."""
    abort = threading.Event()
    if max_concurrency <= 1 or len(items) <= 1:
        return [fn(item, abort) for item in items]
    results: list = [None] * len(items)
    with ThreadPoolExecutor(max_workers=min(max_concurrency, len(items))) as pool:
        futures = {pool.submit(fn, item, abort): i for i, item in enumerate(items)}
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in done if not f.cancelled() and f.exception() is not None]
        if failed:
            abort.set()
            pool.shutdown(wait=True, cancel_futures=True)
            first = min(failed, key=lambda f: futures[f])
            raise first.exception()
        for f, i in futures.items():
            results[i] = f.result()
    return results


def checked_at_build(cls):
    """A reward-registry factory for the client class ``cls``: ``cls(**params)`` then its ``check()``
    (one small request to the server), so a reward built from a config fails at start-up with one
    line (``RewardUnavailable``) instead of after the first rollout. The factory has the signature of
    ``cls``, so config validation checks parameter names without building anything; constructing
    ``cls`` directly does not check."""

    @functools.wraps(cls, updated=())
    def build(*args, **kwargs):
        reward = cls(*args, **kwargs)
        reward.check()
        return reward

    return build
