"""An Ollama HTTP API server for the tests (no Ollama binary can be installed here).

It speaks the real protocol: NDJSON streaming (chunked) of /api/generate and /api/chat,
non-streaming replies, /api/tags, /api/ps, /api/show and /api/version, Ollama's field names,
nanosecond durations, `{"error": …}` bodies with their HTTP status, and the deprecated
`context` token ids. Its default model (`WordModel`) is tiny and deterministic: one token
per character (id = code point), and the next word depends only on the text so far, so
continuing from a context gives the same words as generating in one go.

`LlamaModel` puts a real GGUF behind the same protocol (llama-cpp-python), to measure what
Ollama's semantics cost with real prompt evaluation: a `context` is detokenized and
evaluated again, with one slot whose prefix cache is reused as Ollama's runner does, and the
durations are measured. Run it as its own process (one per "machine"):

    python -m tests.fake_ollama --gguf FILE --model smollm2:135m [--port N] [--threads N]

With `logprobs: true` (Ollama 0.12.11's), each line's `logprobs` has an entry for its
word (WordModel: the word most likely, at log(0.5), the others after it); `old = True`
makes it an older Ollama that ignores the field.

Switches for failure tests: `delay_s` per streamed token, `status` (answer every request
with that HTTP error), `drop_after` (close the connection mid-stream after N chunks),
`error_after` (an `{"error": …}` line after N chunks). `disconnects` counts streams whose
client went away before the end (and sets `disconnected`); `requests` records every body.
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import os
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import llama_cpp

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


def word_logprobs(word: str, top: int) -> dict[str, Any]:
    """A word's entry in Ollama's `logprobs`: the word at log(0.5), and the `top` most
    likely (the word first, then the others in WORDS' order, each less likely)."""

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    others = [w for w in WORDS if w != word]
    alternatives = [entry(word, math.log(0.5))]
    alternatives += [entry(w, math.log(0.5 / len(WORDS)) - i / 10) for i, w in enumerate(others)]
    return {**entry(word, math.log(0.5)), "top_logprobs": alternatives[:top]}


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class Run:
    """One generation: `pieces` are made as they are read; `stats` holds Ollama's final
    fields (done_reason, counts, nanosecond durations, context) once they are all out."""

    pieces: Generator[str, None, None]
    stats: dict[str, Any] = field(default_factory=dict)


class Model(Protocol):
    template: str
    # The template's fill-in-the-middle branch (Ollama's `.Suffix`); "": none, and a request
    # with a suffix is refused as Ollama refuses it ("does not support insert").
    fim_template: str

    def detokenize(self, ids: list[int]) -> str: ...

    def render_chat(self, messages: list[dict[str, Any]]) -> str: ...

    def run(self, prompt: str, options: dict[str, Any]) -> Run: ...


def _limit(options: dict[str, Any], default: int) -> int:
    num_predict = options.get("num_predict", -1)
    return default if num_predict is None or num_predict < 0 else int(num_predict)


def _cut_at_stop(text: str, stops: list[str]) -> int | None:
    """Where the first stop string begins in text, if one is there."""
    found = [text.index(s) for s in stops if s and s in text]
    return min(found) if found else None


class WordModel:
    """Tiny and deterministic: one token per character, words chosen from the text so far;
    durations are 1 ms per token."""

    template = "<|user|>{{ .Prompt }}<|assistant|>"
    fim_template = "<|fim_prefix|>{{ .Prompt }}<|fim_suffix|>{{ .Suffix }}<|fim_middle|>"

    def detokenize(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        # A last assistant turn stays open: the model continues it (Ollama's chat prefill).
        if messages and messages[-1]["role"] == "assistant":
            *turns, last = messages
            return self.render_chat(turns) + str(last["content"])
        return "".join(f"<|{m['role']}|>{m['content']}" for m in messages) + "<|assistant|>"

    def run(self, prompt: str, options: dict[str, Any]) -> Run:
        stats: dict[str, Any] = {}
        return Run(self._words(prompt, options, _limit(options, 128), stats), stats)

    @staticmethod
    def _words(
        prompt: str, options: dict[str, Any], limit: int, stats: dict[str, Any]
    ) -> Generator[str, None, None]:
        stops = options.get("stop") or []
        words: list[str] = []
        done_reason = "length"
        text = prompt
        while len(words) < limit:
            word = next_word(text)
            sent = "".join(words)
            cut = _cut_at_stop(sent + word, stops)
            if cut is not None:
                tail = (sent + word)[len(sent) : cut]
                if tail:
                    words.append(tail)
                    yield tail
                done_reason = "stop"
                break
            words.append(word)
            text += word
            yield word
            if word == " clearer":  # this model's end of turn
                done_reason = "stop"
                break
        stats.update(
            done_reason=done_reason,
            prompt_eval_count=len(prompt),
            prompt_eval_duration=1_000_000 * len(prompt),
            eval_count=len(words),
            eval_duration=1_000_000 * len(words),
            context=[ord(c) for c in prompt + "".join(words)],
        )


class LlamaModel:
    """A real GGUF through llama-cpp-python, with Ollama's semantics: one slot (requests
    wait their turn), the prompt evaluated from the longest prefix the slot already holds,
    `context` = prompt tokens + generated tokens, measured nanosecond durations."""

    template = "<|im_start|>user\n{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n"
    fim_template = ""  # SmolLM2 has no FIM tokens

    def __init__(self, gguf: str, n_ctx: int = 4096, n_threads: int | None = None) -> None:
        threads = n_threads or os.cpu_count() or 1
        self.n_ctx = n_ctx
        self._llm = llama_cpp.Llama(
            model_path=gguf,
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self._slot = threading.Lock()

    def detokenize(self, ids: list[int]) -> str:
        return self._llm.detokenize(ids, special=True).decode("utf-8", "replace")

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        # A last assistant turn stays open: the model continues it (Ollama's chat prefill).
        if messages and messages[-1]["role"] == "assistant":
            *others, last = messages
            return self.render_chat(others) + str(last["content"])
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return turns + "<|im_start|>assistant\n"

    def run(self, prompt: str, options: dict[str, Any]) -> Run:
        stats: dict[str, Any] = {}
        return Run(self._generate(prompt, options, stats), stats)

    def _generate(
        self, prompt: str, options: dict[str, Any], stats: dict[str, Any]
    ) -> Generator[str, None, None]:
        llm = self._llm
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        if len(tokens) >= self.n_ctx:
            raise ValueError(f"prompt of {len(tokens)} tokens does not fit n_ctx {self.n_ctx}")
        limit = min(_limit(options, self.n_ctx), self.n_ctx - len(tokens))
        stops = options.get("stop") or []
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        made: list[int] = []
        text = ""
        done_reason = "length"
        with self._slot:
            if options.get("seed") is not None:
                llm.set_seed(int(options["seed"]))
            started = time.perf_counter_ns()
            first_at = started
            sampled = llm.generate(
                tokens,
                temp=float(options.get("temperature", 0.8)),
                top_p=float(options.get("top_p", 0.9)),
                top_k=int(options.get("top_k", 40)),
                reset=True,
            )
            try:
                while len(made) < limit:
                    token = next(sampled)
                    if not made:
                        first_at = time.perf_counter_ns()
                    if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
                        done_reason = "stop"
                        break
                    made.append(token)
                    piece = decoder.decode(llm.detokenize([token]))
                    cut = _cut_at_stop(text + piece, stops)
                    if cut is not None:
                        if cut > len(text):
                            yield (text + piece)[len(text) : cut]
                        done_reason = "stop"
                        break
                    text += piece
                    if piece:
                        yield piece
            finally:
                sampled.close()
            ended = time.perf_counter_ns()
        stats.update(
            done_reason=done_reason,
            prompt_eval_count=len(tokens),  # cached tokens count too, as in Ollama
            prompt_eval_duration=first_at - started,
            eval_count=len(made),
            eval_duration=max(ended - first_at, 1),
            context=tokens + made,
        )


class FakeOllama:
    def __init__(
        self,
        models: tuple[str, ...] = ("qwen3-coder:30b", "gpt-oss:120b"),
        model: Model | None = None,
        port: int = 0,
        takes_tools: bool = True,
        says_capabilities: bool = True,
    ) -> None:
        self.model: Model = model or WordModel()
        # Whether the model's template has a place for tools (Ollama's "tools" capability;
        # without it a request with tools is refused as Ollama refuses it), and whether
        # /api/show says what the model can do (Ollama before 0.6.4 did not).
        self.takes_tools = takes_tools
        self.says_capabilities = says_capabilities
        self._takes_tools = takes_tools  # what reset() goes back to
        self.digest = DIGEST  # another, as if the model were pulled again
        self.models = set(models)
        self.loaded: set[str] = set()
        self.delay_s = 0.0
        self.status = 0
        self.drop_after = -1
        self.error_after = -1
        self.old = False
        self.disconnects = 0
        self.disconnected = threading.Event()
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
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
        self.takes_tools, self.digest = self._takes_tools, DIGEST
        self.old = False
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
            return self._json(h, {"version": "0.12.6" if self.old else "0.13.0"})
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
        suffix = body.get("suffix") or ""
        if body.get("raw"):
            text = prompt
        elif suffix and not self.model.fim_template:
            message = f'"{body.get("model")}" does not support insert'
            return self._json(h, {"error": message}, 400)
        else:
            # As Ollama does: the detokenized context, then the new prompt in the template
            # (its fill-in-the-middle branch with a suffix).
            context = self.model.detokenize(body.get("context") or [])
            template = body.get("template") or (
                self.model.fim_template if suffix else self.model.template
            )
            text = context + template.replace("{{ .Prompt }}", prompt).replace(
                "{{ .Suffix }}", suffix
            )
        self._complete(h, body, text, chat=False)

    def _chat(self, h: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        if body.get("tools") and not self.takes_tools:
            message = f'"{body.get("model")}" does not support tools'
            return self._json(h, {"error": message}, 400)
        if body.get("tools"):
            return self._tool_calls(h, body, [t["function"] for t in body["tools"]])
        self._complete(h, body, self.model.render_chat(body.get("messages", [])), chat=True)

    def _tool_calls(
        self, h: BaseHTTPRequestHandler, body: dict[str, Any], functions: list[dict[str, Any]]
    ) -> None:
        """As Ollama answers a model that calls tools: here one call of each tool offered,
        in parallel, all whole in one message (arguments objects), then the final line,
        done_reason "stop"."""
        calls = []
        for function in functions:
            schema = function.get("parameters") or {}
            arguments = {
                name: _example(spec)
                for name, spec in (schema.get("properties") or {}).items()
                if name in (schema.get("required") or ())
            }
            calls.append({"function": {"name": function["name"], "arguments": arguments}})
        message = {"role": "assistant", "content": "", "tool_calls": calls}
        stats = {
            "done_reason": "stop",
            "total_duration": 10_000_000,
            "load_duration": 0,
            "prompt_eval_count": 12,
            "prompt_eval_duration": 5_000_000,
            "eval_count": 8,
            "eval_duration": 5_000_000,
        }
        last = {"model": body["model"], "created_at": now(), "done": True, **stats}
        if body.get("stream") is False:
            return self._json(h, {**last, "message": message})
        h.send_response(200)
        h.send_header("Content-Type", "application/x-ndjson")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        first = {"model": body["model"], "created_at": now(), "done": False}
        self._chunk(h, {**first, "message": message})
        self._chunk(h, {**last, "message": {"role": "assistant", "content": ""}})
        self._chunk(h, None)

    def _complete(
        self, h: BaseHTTPRequestHandler, body: dict[str, Any], prompt: str, chat: bool
    ) -> None:
        model = body["model"]
        self.loaded.add(model)
        started = time.perf_counter_ns()
        run = self.model.run(prompt, body.get("options") or {})
        top = self._top_logprobs(body)
        if body.get("stream") is False:
            words = list(run.pieces)
            final = self._final(model, run, started, chat)
            reply = (
                {**final, "message": {"role": "assistant", "content": "".join(words)}}
                if chat
                else {**final, "response": "".join(words)}
            )
            if top is not None:
                reply["logprobs"] = [word_logprobs(w, top) for w in words]
            return self._json(h, reply)
        self._stream(h, model, run, started, chat, top)

    def _top_logprobs(self, body: dict[str, Any]) -> int | None:
        """How many alternatives each word's entry lists, when the request asked for log
        probabilities (a WordModel's only; an older Ollama ignores the fields)."""
        if self.old or not body.get("logprobs") or not isinstance(self.model, WordModel):
            return None
        return int(body.get("top_logprobs") or 0)

    def _final(self, model: str, run: Run, started: int, chat: bool) -> dict[str, Any]:
        stats = dict(run.stats)
        context = stats.pop("context")
        final = {
            "model": model,
            "created_at": now(),
            "done": True,
            **stats,
            "total_duration": time.perf_counter_ns() - started + 5_000_000,
            "load_duration": 5_000_000,
        }
        if not chat:
            final["context"] = context
        return final

    def _stream(
        self,
        h: BaseHTTPRequestHandler,
        model: str,
        run: Run,
        started: int,
        chat: bool,
        top: int | None = None,
    ) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/x-ndjson")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        try:
            for i, word in enumerate(run.pieces):
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
                if top is not None:
                    part["logprobs"] = [word_logprobs(word, top)]
                self._chunk(h, part)
            final = self._final(model, run, started, chat)
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
        finally:
            run.pieces.close()  # stops the model's generation, as Ollama does

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
            "digest": self.digest,
            "details": self._details(),
        }

    def _ps_entry(self, model: str) -> dict[str, Any]:
        return {
            **self._model_entry(model),
            "expires_at": "2026-12-01T10:00:00.000000000Z",
            "size_vram": 18_556_700_761,
            "context_length": 4096,
        }

    @property
    def shown_template(self) -> str:
        """The model's template as /api/show gives it: with its fill-in-the-middle branch
        first, as in Ollama's Qwen coder templates."""
        fim, template = self.model.fim_template, self.model.template
        if not fim:
            return template
        return "{{- if .Suffix }}" + fim + "{{- else }}" + template + "{{- end }}"

    def _show(self, model: str) -> dict[str, Any]:
        """As Ollama shows qwen3-coder:30b: its GGUF's keys, and what its template allows
        (Ollama's Model.Capabilities: tools, and insert for a .Suffix branch)."""
        shown = {
            "modelfile": f"FROM {model}\n",
            "parameters": "temperature 0.7",
            "template": self.shown_template,
            "details": self._details(),
            "model_info": {
                "general.architecture": "qwen3moe",
                "general.parameter_count": 30_532_122_624,
                "qwen3moe.context_length": 262_144,
                "qwen3moe.embedding_length": 2_048,
            },
            "modified_at": "2026-10-01T10:00:00.000000000Z",
        }
        if self.says_capabilities:
            shown["capabilities"] = [
                "completion",
                *(["tools"] if self.takes_tools else []),
                *(["insert"] if self.model.fim_template else []),
            ]
        return shown


def _example(spec: dict[str, Any]) -> Any:
    """A value a schema allows, as a model would write one."""
    if spec.get("enum"):
        return spec["enum"][0]
    return {"integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}.get(
        spec.get("type", "string"), "x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="An Ollama HTTP API server over a GGUF file")
    parser.add_argument("--gguf", required=True, help="the model file (llama-cpp-python)")
    parser.add_argument("--model", action="append", required=True, help="tag(s) to serve")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--n-ctx", type=int, default=4096)
    args = parser.parse_args()
    model = LlamaModel(args.gguf, n_ctx=args.n_ctx, n_threads=args.threads)
    server = FakeOllama(models=tuple(args.model), model=model, port=args.port)
    print(f"listening on {server.url}", flush=True)
    server._thread.run()


if __name__ == "__main__":
    main()
