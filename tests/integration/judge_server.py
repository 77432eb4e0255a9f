"""A tiny OpenAI-compatible chat-completions server on 127.0.0.1 for the ``remote`` reward's tests:
it decodes the PNG in each request and answers ``"Score: <JPEG size in kB>"`` (the real
``jpeg_incompressibility`` scorer), after a per-request delay, so completion order differs from
request order."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rewards.jpeg import jpeg_size_kb
from rewards.png import decode_png_b64


class JudgeServer(ThreadingHTTPServer):
    """``delay(judging_text) -> seconds`` before answering; ``answer(text, score) -> str`` overrides
    the reply text; ``top_logprobs(text, score) -> [(token, logprob), ...] | None`` gives the first answer
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
        image = decode_png_b64(next(p for p in parts if p["type"] == "image_url")["image_url"]["url"])
        text = next(p for p in parts if p["type"] == "text")["text"]
        score = float(jpeg_size_kb(image[None])[0])
        time.sleep(self.server.delay(text))
        answer = self.server.answer(text, score) if self.server.answer else f"Score: {score!r}"
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
