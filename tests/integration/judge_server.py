"""A tiny OpenAI-compatible chat-completions server on 127.0.0.1 for the ``remote`` reward's tests:
it decodes the PNG in each request and answers ``"Score: <JPEG size in kB>"`` (the real
``jpeg_incompressibility`` scorer), after a per-request delay, so completion order differs from
request order. A request with several images is a comparison (``pairwise_remote``): two images are
answered ``1`` / ``2`` (the larger JPEG wins) or ``tie`` (equal sizes); more are answered with their
numbers, largest first."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rewards.jpeg import jpeg_size_kb
from rewards.png import decode_png_b64


class JudgeServer(ThreadingHTTPServer):
    """``delay(judging_text) -> seconds`` before answering; ``answer(text, score) -> str`` overrides
    the reply text (``score``: the JPEG size in kB, or the list of sizes of a comparison's images); ``top_logprobs(text, score) -> [(token, logprob), ...] | None`` gives the first answer
    token's top log-probs when a request asks for ``logprobs`` (None: a reply without them);
    ``status`` != 200 answers every request with that HTTP error. Records every
    request body (``bodies``), its headers (``headers``) and the prompts in completion order
    (``completed``)."""

    daemon_threads = True

    def __init__(self, delay=lambda text: 0.0, answer=None, status: int = 200, top_logprobs=None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.delay, self.answer, self.status, self.top_logprobs = delay, answer, status, top_logprobs
        self.bodies, self.headers, self.completed = [], [], []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def stop(self) -> None:
        """Stop answering and close the port (idempotent)."""
        if self.thread.is_alive():
            self.shutdown()
            self.server_close()


def compare(sizes: list[float]) -> str:
    """The fake judge's comparison: the larger JPEG is better ("1", "2" or "tie" for two images; the
    image numbers largest first, ties in display order, for more)."""
    if len(sizes) == 2:
        return "1" if sizes[0] > sizes[1] else "2" if sizes[1] > sizes[0] else "tie"
    return " ".join(str(i + 1) for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]))


class _Handler(BaseHTTPRequestHandler):
    server: JudgeServer

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            index = len(self.server.bodies)
            self.server.bodies.append(body)
            self.server.headers.append(dict(self.headers))
        if self.server.status != 200 or self.path != "/v1/chat/completions":
            return self._reply(self.server.status if self.path == "/v1/chat/completions" else 404,
                               {"error": {"message": "judge unavailable"}})
        parts = body["messages"][-1]["content"]
        images = [decode_png_b64(p["image_url"]["url"]) for p in parts if p["type"] == "image_url"]
        text = next(p for p in parts if p["type"] == "text")["text"]
        sizes = [float(jpeg_size_kb(image[None])[0]) for image in images]
        score = sizes[0] if len(sizes) == 1 else sizes
        time.sleep(self.server.delay(text))
        answer = self.server.answer(text, score) if self.server.answer else (
            f"Score: {score!r}" if len(sizes) == 1 else compare(sizes))
        with self.server.lock:
            self.server.completed.append(text)
        choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer}}
        top = self.server.top_logprobs(text, score) if body.get("logprobs") and self.server.top_logprobs else None
        if top is not None:
            top = top[:body.get("top_logprobs", len(top))]
            choice["logprobs"] = {"content": [{"token": top[0][0], "logprob": top[0][1],
                                               "top_logprobs": [{"token": t, "logprob": lp} for t, lp in top]}]}
        self._reply(200, {"id": f"chatcmpl-{index}", "object": "chat.completion", "model": body["model"],
                          "choices": [choice]})

    def _reply(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
