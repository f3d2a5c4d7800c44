"""A workload's requests as the simulation reads them: the prompt a router would build and
the answer's length, from a `disagg batch` line (chat messages, or a prompt's text)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg_mesh.batch import BatchRequest
from disagg_mesh.server.common.types import ChatTurn, Prompt, Sampling


@dataclass(frozen=True)
class Work:
    custom_id: str
    model: str
    prompt: Prompt
    sampling: Sampling


def _text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI's content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content or "")


def work(request: BatchRequest, max_tokens_limit: int) -> Work:
    body = request.body
    messages = body.get("messages")
    if isinstance(messages, list):
        turns = tuple(
            ChatTurn(str(m.get("role", "user")), _text(m.get("content")))
            for m in messages
            if isinstance(m, Mapping)
        )
        prompt = Prompt(messages=turns)
    else:
        prompt = Prompt(text=_text(body.get("prompt")))
    given = body.get("options")
    options: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
    asked = body.get("max_completion_tokens", body.get("max_tokens", options.get("num_predict")))
    max_tokens = asked if isinstance(asked, int) and asked > 0 else max_tokens_limit
    ignore_eos = bool(body.get("ignore_eos", options.get("ignore_eos", False)))
    return Work(
        request.custom_id,
        request.model,
        prompt,
        Sampling(max_tokens=min(max_tokens, max_tokens_limit), ignore_eos=ignore_eos),
    )
