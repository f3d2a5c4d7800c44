"""A batch's input: OpenAI's batch file format, one request per line.

    {"custom_id": "alice-code", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "qwen3-coder:30b", "messages": [...], "max_tokens": 400}}

`url` is one of ENDPOINTS: OpenAI's chat and text completions, Ollama's chat and generate.
The body is what that endpoint takes, every option included; an answer is one whole body,
so `stream` must be left out or false (Ollama's default, true, is turned off here).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate")
OLLAMA_ENDPOINTS = ("/api/chat", "/api/generate")


@dataclass(frozen=True)
class BatchRequest:
    """One line of a batch: `line` is its number in the file (1-based; 0 from code)."""

    custom_id: str
    url: str
    body: Mapping[str, Any]
    method: str = "POST"
    line: int = 0

    @property
    def model(self) -> str:
        return str(self.body.get("model", ""))

    def where(self) -> str:
        """How an error names this request: its line, else its custom_id."""
        return f"line {self.line}" if self.line else f"custom_id {self.custom_id!r}"

    def http_body(self) -> dict[str, Any]:
        """The body as sent: Ollama's endpoints stream unless told not to."""
        body = dict(self.body)
        if self.url in OLLAMA_ENDPOINTS:
            body.setdefault("stream", False)
        return body

    def prompt_key(self) -> str:
        """The prompt's text as the model reads it, in order (system, turns): requests
        whose keys share a long start share a prompt prefix the prefix cache can reuse."""
        body = self.body
        parts: list[str] = []
        if isinstance(body.get("system"), str):
            parts.append(body["system"])
        messages = body.get("messages")
        for m in messages if isinstance(messages, list) else ():
            if isinstance(m, Mapping):
                content = m.get("content")
                if isinstance(content, list):  # OpenAI's content parts
                    content = "".join(
                        str(p.get("text", "")) for p in content if isinstance(p, Mapping)
                    )
                parts.append(f"{m.get('role', '')}: {content or ''}")
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt = "".join(p for p in prompt if isinstance(p, str))
        if isinstance(prompt, str):
            parts.append(prompt)
        return "\n".join(parts)


@dataclass
class BatchInputError(Exception):
    """Lines that cannot run, each as "line N: what is wrong"; nothing was started."""

    problems: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        shown = self.problems[:20]
        more = len(self.problems) - len(shown)
        return "\n".join(shown + ([f"... and {more} more"] if more > 0 else []))


def read_requests(path: Path) -> list[BatchRequest]:
    """Every request of a JSONL file, or BatchInputError listing every bad line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchInputError([f"{path}: {exc}"]) from None
    return parse_lines(text.splitlines())


def parse_lines(lines: Iterable[str]) -> list[BatchRequest]:
    """Requests from JSONL lines (blank lines skipped); BatchInputError names each bad one
    by its line number."""
    requests: list[BatchRequest] = []
    problems: list[tuple[int, str]] = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            problems.append((number, f"line {number}: not valid JSON: {exc}"))
            continue
        try:
            requests.append(to_request(obj, number))
        except ValueError as exc:
            problems.append((number, f"line {number}: {exc}"))
    problems += duplicates(requests)
    if problems:
        raise BatchInputError([p for _, p in sorted(problems)])
    if not requests:
        raise BatchInputError(["the batch has no requests"])
    return requests


def to_request(obj: object, line: int = 0) -> BatchRequest:
    """A BatchRequest from one line's object (or a dict given in code); ValueError naming
    the field that is wrong."""
    if isinstance(obj, BatchRequest):
        return obj
    if not isinstance(obj, Mapping):
        raise ValueError(f"must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}: a line has custom_id, method, url, body")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError(f"custom_id: must be a non-empty string, got {custom_id!r}")
    method = obj.get("method", "POST")
    if method != "POST":
        raise ValueError(f'method: must be "POST", got {method!r}')
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise ValueError(f"url: must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, Mapping):
        raise ValueError(f"body: must be a JSON object, got {body!r}")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise ValueError(f"body.model: must be a non-empty string, got {body.get('model')!r}")
    if body.get("stream") not in (None, False):
        raise ValueError("body.stream: a batch answers with whole bodies: leave it out or false")
    return BatchRequest(custom_id=custom_id, url=str(url), body=dict(body), line=line)


def requests_from(items: Iterable[BatchRequest | Mapping[str, Any]]) -> list[BatchRequest]:
    """Requests given in code (BatchRequest, or dicts shaped as the file's lines);
    BatchInputError names each bad one by its place in the list."""
    requests: list[BatchRequest] = []
    problems: list[str] = []
    for i, item in enumerate(items):
        try:
            requests.append(to_request(item))
        except ValueError as exc:
            problems.append(f"request {i}: {exc}")
    problems += [p for _, p in duplicates(requests)]
    if problems:
        raise BatchInputError(problems)
    return requests


def duplicates(requests: Iterable[BatchRequest]) -> list[tuple[int, str]]:
    """A problem (and its line) for each custom_id seen before."""
    first: dict[str, BatchRequest] = {}
    problems = []
    for r in requests:
        if r.custom_id in first:
            problems.append(
                (
                    r.line,
                    f"{r.where()}: custom_id {r.custom_id!r} is already used on "
                    f"{first[r.custom_id].where()}",
                )
            )
        else:
            first[r.custom_id] = r
    return problems
