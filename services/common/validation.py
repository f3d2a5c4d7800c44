"""Checks on requests, shared by the router and the nodes, with field-named messages."""

from __future__ import annotations

import math
import re

from disagg_mesh.server.common.config.topology import SchemaLimits
from disagg_mesh.server.common.errors import InvalidArgument, NotFound
from disagg_mesh.server.common.structured.response_format import (
    DEFAULT_LIMITS,
    FIELD,
    checked,
    schema_text,
)
from disagg_mesh.server.common.structured.response_format import check as check_response_format
from disagg_mesh.server.common.types import Prompt, Sampling

MAX_PROMPT_BYTES = 4 * 1024 * 1024
MAX_STOP_STRINGS = 8
# OpenAI documents no limit; a bias sampler of this many entries costs nothing to speak of.
MAX_LOGIT_BIASES = 1024
# The largest value of an int32 field of SamplingParams (top_k, repeat_last_n, a logit_bias
# token id): a larger one from a door is refused naming its field.
INT32_MAX = 2**31 - 1
# OpenAI's top_logprobs limit.
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
# Where a door names a tool's parameters schema ({i}: the tool's place).
TOOL_PARAMETERS_FIELD = "sampling.tools.definitions[{i}].parameters_json_schema"


# A prompt longer than the context: how a node says so, and how a door tells it (OpenAI's
# context_length_exceeded).
PROMPT_TOO_LONG = re.compile(r": (\d+) tokens; a context of (\d+) must hold it and ")


# Why a model cannot fill in the middle (a suffix), as a node and the router say it.
NO_FIM_TOKENS = (
    "no fill-in-the-middle tokens in its vocabulary (such as <|fim_prefix|>, <|fim_suffix|>, "
    "<|fim_middle|>); leave suffix out, or use a coder model that has them"
)


def prompt_too_long(tokens: int, n_ctx: int, note: str = "") -> InvalidArgument:
    return InvalidArgument(
        "prompt",
        f"{tokens} tokens; a context of {n_ctx} must hold it and at least one generated token"
        + (f" ({note})" if note else ""),
    )


def validate_prompt(prompt: Prompt) -> None:
    if prompt.text and prompt.messages:
        raise InvalidArgument("prompt", "set either prompt or messages, not both")
    if prompt.suffix and prompt.messages:
        raise InvalidArgument(
            "suffix",
            "fills in the middle of prompt text: send the text before the gap as the "
            "prompt, not chat messages",
        )
    if not prompt.text and not prompt.messages and not prompt.suffix:
        raise InvalidArgument("prompt", "must not be empty (set prompt or messages)")
    size = (
        len(prompt.text.encode())
        + len(prompt.suffix.encode())
        + sum(len(m.content.encode()) for m in prompt.messages)
    )
    if size > MAX_PROMPT_BYTES:
        raise InvalidArgument("prompt", f"is {size} bytes; the limit is {MAX_PROMPT_BYTES} bytes")
    calls: set[str] = set()
    for i, turn in enumerate(prompt.messages):
        if turn.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"messages[{i}].role",
                f"must be one of {', '.join(sorted(CHAT_ROLES))}, got {turn.role!r}",
            )
        if turn.tool_calls and turn.role != "assistant":
            raise InvalidArgument(f"messages[{i}].tool_calls", "only an assistant turn has calls")
        calls.update(c.id for c in turn.tool_calls)
        if turn.role != "tool":
            continue
        if not calls:
            raise InvalidArgument(
                f"messages[{i}]", "a tool result with no assistant tool call before it"
            )
        if turn.tool_call_id and turn.tool_call_id not in calls:
            raise InvalidArgument(
                f"messages[{i}].tool_call_id",
                f"{turn.tool_call_id!r} answers no earlier assistant tool call "
                f"({', '.join(sorted(calls))})",
            )


async def check_format(
    sampling: Sampling,
    limits: SchemaLimits,
    field: str = FIELD,
    tools_field: str = TOOL_PARAMETERS_FIELD,
) -> None:
    """The response format's schema, and each tool's parameters schema (the arguments may be
    held to it), checked off the event loop within limits' time budget (validate_sampling
    then finds it checked)."""
    if sampling.response_format is not None:
        await checked(sampling.response_format, field, limits)
    for i, tool in enumerate(sampling.tools.tools if sampling.tools is not None else ()):
        if tool.parameters:
            where = tools_field.format(i=i)
            await checked(schema_text(tool.parameters, where, limits), where, limits)


def validate_sampling(
    sampling: Sampling, max_tokens_limit: int, schema_limits: SchemaLimits = DEFAULT_LIMITS
) -> None:
    if not 1 <= sampling.max_tokens <= max_tokens_limit:
        raise InvalidArgument(
            "sampling.max_tokens",
            f"must be between 1 and {max_tokens_limit}, got {sampling.max_tokens}",
        )
    if not 0.0 <= sampling.temperature < math.inf:  # also rejects NaN
        raise InvalidArgument(
            "sampling.temperature", f"must be a finite number >= 0, got {sampling.temperature}"
        )
    if not 0.0 < sampling.top_p <= 1.0:
        raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {sampling.top_p}")
    if not -1 <= sampling.top_k <= INT32_MAX:  # vLLM's -1, as 0: no limit
        raise InvalidArgument(
            "sampling.top_k",
            f"must be in 0..{INT32_MAX}, or -1 (0 and -1: no limit), got {sampling.top_k}",
        )
    if not 0.0 <= sampling.min_p <= 1.0:
        raise InvalidArgument("sampling.min_p", f"must be in [0, 1], got {sampling.min_p}")
    if not 0.0 < sampling.repeat_penalty < math.inf:
        raise InvalidArgument(
            "sampling.repeat_penalty",
            f"must be a finite number > 0 (1: no penalty), got {sampling.repeat_penalty}",
        )
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(sampling, name)
        if not -2.0 <= value <= 2.0:
            raise InvalidArgument(f"sampling.{name}", f"must be in [-2, 2], got {value}")
    if len(sampling.logit_bias) > MAX_LOGIT_BIASES:
        raise InvalidArgument(
            "sampling.logit_bias",
            f"at most {MAX_LOGIT_BIASES} tokens, got {len(sampling.logit_bias)}",
        )
    for token, bias in sampling.logit_bias:
        if not 0 <= token <= INT32_MAX or not -100.0 <= bias <= 100.0:
            raise InvalidArgument(
                "sampling.logit_bias",
                f"token ids must be in 0..{INT32_MAX} and biases in [-100, 100], got "
                f"{token}: {bias}",
            )
    if sampling.logprobs is not None and not 0 <= sampling.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(
            "sampling.logprobs",
            f"must be in 0..{MAX_TOP_LOGPROBS} (the most likely tokens returned beside each "
            f"token's), got {sampling.logprobs}",
        )
    if not -1 <= sampling.repeat_last_n <= INT32_MAX:
        raise InvalidArgument(
            "sampling.repeat_last_n",
            f"must be in 0..{INT32_MAX}, or -1 (the whole context), got {sampling.repeat_last_n}",
        )
    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(
            "sampling.stop", f"at most {MAX_STOP_STRINGS} strings, got {len(sampling.stop)}"
        )
    if sampling.stream_interval_tokens < 1:
        raise InvalidArgument(
            "sampling.stream_interval_tokens",
            f"must be >= 0 (0: every token), got {sampling.stream_interval_tokens}",
        )
    if any(not s for s in sampling.stop):
        raise InvalidArgument("sampling.stop", "stop strings must not be empty")
    if sampling.tools is not None and sampling.tools.choice != "none":
        for name, value in (
            ("response_format", sampling.response_format),
            ("sampling.ignore_eos", sampling.ignore_eos),
        ):
            if value:
                raise InvalidArgument(
                    name,
                    "cannot be combined with tools: the answer is the model's calls or its "
                    'text (tool_choice "none" leaves the tools out)',
                )
    if sampling.response_format is not None:
        if sampling.ignore_eos:
            raise InvalidArgument(
                "sampling.ignore_eos",
                "cannot be combined with response_format: the answer must end when its JSON does",
            )
        check_response_format(sampling.response_format, FIELD, schema_limits)


def check_served(model: str, node_name: str, served: list[str]) -> None:
    """A node answers only for the logical models the topology routes to it."""
    if model not in served:
        raise NotFound(
            f"model {model!r} is not served by node {node_name} (it serves {', '.join(served)})"
        )
