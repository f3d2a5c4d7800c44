"""An Ollama HTTP API server for the tests (no Ollama binary can be installed here).

It speaks the real protocol: NDJSON streaming (chunked) of /api/generate and /api/chat,
non-streaming replies, /api/tags, /api/ps, /api/show and /api/version, Ollama's field names,
nanosecond durations, `{"error": …}` bodies with their HTTP status, and the deprecated
`context` token ids. Its "model" is tiny and deterministic: one token per character
(id = code point), and the next word depends only on the text so far, so continuing from a
context gives the same words as generating in one go.

Switches for failure tests: `delay_s` per streamed token, `status` (answer every request
with that HTTP error), `drop_after` (close the connection mid-stream after N chunks),
`error_after` (an `{"error": …}` line after N chunks). `disconnects` counts streams whose
client went away before the end (and sets `disconnected`); `requests` records every body.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

WORDS = [
    " the",
    " code",
    " looks",
    " correct",
    " but",
    " tests",
    " are",
    " missing",
    " and",
    " names",
    " could",
    " be",
    " clearer",
]
DIGEST = "sha256:" + "c0ffee" * 10 + "abcd"


def next_word(text: str) -> str:
    return WORDS[sum(map(ord, text)) % len(WORDS)]


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class FakeOllama:
    def __init__(self, models: tuple[str, ...] = ("qwen3-coder:30b", "gpt-oss:120b")) -> None:
        self.models = set(models)
        self.loaded: set[str] = set()
        self.delay_s = 0.0
        self.status = 0
        self.drop_after = -1
        self.error_after = -1
        self.disconnects = 0
        self.disconnected = threading.Event()
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> FakeOllama:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        self.delay_s, self.status, self.drop_after, self.error_after = 0.0, 0, -1, -1
        self.requests.clear()
        self.disconnected.clear()

    def last(self, path: str) -> dict[str, Any]:
        return next(body for p, body in reversed(self.requests) if p == path)

    # -- the protocol ----------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                fake._route(self, self.path, {})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                fake._route(self, self.path, body)

        return Handler

    def _route(self, h: BaseHTTPRequestHandler, path: str, body: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append((path, body))
        if self.status:
            return self._json(h, {"error": f"fake failure {self.status}"}, self.status)
        if path == "/api/version":
            return self._json(h, {"version": "0.12.6"})
        if path == "/api/tags":
            return self._json(h, {"models": [self._model_entry(m) for m in sorted(self.models)]})
        if path == "/api/ps":
            return self._json(h, {"models": [self._ps_entry(m) for m in sorted(self.loaded)]})
        model = body.get("model", "")
        if model not in self.models:
            return self._json(h, {"error": f"model '{model}' not found"}, 404)
        if path == "/api/show":
            return self._json(h, self._show(model))
        if path == "/api/generate":
            return self._generate(h, body)
        if path == "/api/chat":
            return self._chat(h, body)
        return self._json(h, {"error": "404 page not found"}, 404)

    def _generate(self, h: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        prompt = body.get("prompt", "")
        if body.get("raw"):
            text = prompt
        else:
            context = "".join(chr(i) for i in body.get("context") or [])
            template = body.get("template") or "<|user|>{{ .Prompt }}<|assistant|>"
            text = context + template.replace("{{ .Prompt }}", prompt)
        self._complete(h, body, text, chat=False)

    def _chat(self, h: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        text = "".join(f"<|{m['role']}|>{m['content']}" for m in body.get("messages", []))
        self._complete(h, body, text + "<|assistant|>", chat=True)

    def _complete(
        self, h: BaseHTTPRequestHandler, body: dict[str, Any], prompt: str, chat: bool
    ) -> None:
        options = body.get("options") or {}
        num_predict = options.get("num_predict", -1)
        limit = 128 if num_predict is None or num_predict < 0 else num_predict
        stops = options.get("stop") or []
        model = body["model"]
        self.loaded.add(model)
        words: list[str] = []
        done_reason = "length"
        text = prompt
        while len(words) < limit:
            word = next_word(text)
            candidate = "".join(words) + word
            if any(s in candidate for s in stops):
                cut = min(candidate.index(s) for s in stops if s in candidate)
                tail = candidate[len("".join(words)) : cut]
                if tail:
                    words.append(tail)
                done_reason = "stop"
                break
            words.append(word)
            text += word
            if word == " clearer":  # this model's end of turn
                done_reason = "stop"
                break
        final = {
            "model": model,
            "created_at": now(),
            "done": True,
            "done_reason": done_reason,
            "total_duration": 1_000_000 * (len(prompt) + len(words)) + 5_000_000,
            "load_duration": 5_000_000,
            "prompt_eval_count": len(prompt),
            "prompt_eval_duration": 1_000_000 * len(prompt),
            "eval_count": len(words),
            "eval_duration": 1_000_000 * len(words),
        }
        if not chat:
            final["context"] = [ord(c) for c in prompt + "".join(words)]
        if body.get("stream") is False:
            content = "".join(words)
            reply = (
                {**final, "message": {"role": "assistant", "content": content}}
                if chat
                else {**final, "response": content}
            )
            return self._json(h, reply)
        self._stream(h, model, words, final, chat)

    def _stream(
        self,
        h: BaseHTTPRequestHandler,
        model: str,
        words: list[str],
        final: dict[str, Any],
        chat: bool,
    ) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/x-ndjson")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        try:
            for i, word in enumerate(words):
                if i == self.drop_after:
                    h.wfile.flush()
                    h.close_connection = True
                    h.connection.shutdown(2)
                    return
                if i == self.error_after:
                    self._chunk(h, {"error": "fake failure mid-stream"})
                    self._chunk(h, None)
                    return
                if self.delay_s:
                    time.sleep(self.delay_s)
                piece = {"role": "assistant", "content": word}
                part = {"model": model, "created_at": now(), "done": False}
                part.update({"message": piece} if chat else {"response": word})
                self._chunk(h, part)
            last = (
                {**final, "message": {"role": "assistant", "content": ""}}
                if chat
                else {**final, "response": ""}
            )
            self._chunk(h, last)
            self._chunk(h, None)
        except (BrokenPipeError, ConnectionResetError):
            with self._lock:
                self.disconnects += 1
            self.disconnected.set()

    @staticmethod
    def _chunk(h: BaseHTTPRequestHandler, obj: dict[str, Any] | None) -> None:
        data = b"" if obj is None else (json.dumps(obj) + "\n").encode()
        h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        h.wfile.flush()

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, obj: dict[str, Any], status: int = 200) -> None:
        data = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json; charset=utf-8")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    @staticmethod
    def _details() -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": "gguf",
            "family": "qwen3moe",
            "families": ["qwen3moe"],
            "parameter_size": "30.5B",
            "quantization_level": "Q4_K_M",
        }

    def _model_entry(self, model: str) -> dict[str, Any]:
        return {
            "name": model,
            "model": model,
            "modified_at": "2026-10-01T10:00:00.000000000Z",
            "size": 18_556_700_761,
            "digest": DIGEST,
            "details": self._details(),
        }

    def _ps_entry(self, model: str) -> dict[str, Any]:
        return {
            **self._model_entry(model),
            "expires_at": "2026-12-01T10:00:00.000000000Z",
            "size_vram": 18_556_700_761,
            "context_length": 4096,
        }

    def _show(self, model: str) -> dict[str, Any]:
        return {
            "modelfile": f"FROM {model}\n",
            "parameters": "temperature 0.7",
            "template": "<|user|>{{ .Prompt }}<|assistant|>",
            "details": self._details(),
            "model_info": {"general.architecture": "qwen3moe"},
            "capabilities": ["completion"],
            "modified_at": "2026-10-01T10:00:00.000000000Z",
        }
