"""Helpers to drive streaming calls in tests."""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from disagg_mesh.proto.v1 import decode_pb2, prefill_pb2, router_pb2, types_pb2
from disagg_mesh.server.common.engines.llama_cpp.sampling import end_tokens


@dataclass
class Collected:
    text: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    deltas: int = 0
    # Token ids in each delta, in order.
    delta_tokens: list[int] = field(default_factory=list)
    summary: Any = None
    # Pieces of tool calls (types_pb2.ToolCallDelta), in order.
    tool_calls: list[Any] = field(default_factory=list)
    # Each token's types_pb2.TokenLogprob (SamplingParams.logprobs), in order.
    logprobs: list[Any] = field(default_factory=list)
    first_delta_at: float = 0.0
    summary_at: float = 0.0


@dataclass
class StreamedCall:
    id: str
    name: str
    arguments: str = ""


def streamed_calls(chunks: Iterable[Any]) -> tuple[list[StreamedCall], str | None]:
    """An OpenAI chat stream's tool calls (the `openai` client's chunks), put together as
    OpenAI sends them: a call's first piece has the next index, its id, type "function" and
    its whole name, its other pieces parts of its arguments; and the finish reason."""
    calls: list[StreamedCall] = []
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for piece in chunk.choices[0].delta.tool_calls or []:
            assert piece.function is not None
            if piece.id is not None:  # a call's first piece
                assert piece.index == len(calls) and piece.type == "function", piece
                calls.append(StreamedCall(piece.id, piece.function.name or ""))
            else:
                assert not piece.function.name, piece  # the name came whole, first
            calls[piece.index].arguments += piece.function.arguments or ""
    return calls, finish


async def collect(call: AsyncIterable[Any]) -> Collected:
    """Read a Generate stream (router or decode) to its end."""
    out = Collected()
    async for reply in call:
        if reply.HasField("delta"):
            if not out.deltas:
                out.first_delta_at = time.perf_counter()
            out.deltas += 1
            out.delta_tokens.append(len(reply.delta.token_ids))
            out.text += reply.delta.text
            out.reasoning += reply.delta.reasoning
            out.token_ids.extend(reply.delta.token_ids)
            out.tool_calls.extend(reply.delta.tool_calls)
            out.logprobs.extend(reply.delta.logprobs)
        else:
            assert out.summary is None, "two summaries"
            out.summary = reply.summary
            out.summary_at = time.perf_counter()
    assert out.summary is not None, "stream ended without a summary"
    return out


def greedy(max_tokens: int, **extra: Any) -> types_pb2.SamplingParams:
    return types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


def request(
    model: str, prompt: str, max_tokens: int = 16, **extra: Any
) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        model=model, prompt=prompt, sampling=greedy(max_tokens, **extra)
    )


def kv_request(
    model: str, prefill_address: str, reply: prefill_pb2.PrefillResponse, **overrides: Any
) -> decode_pb2.DecodeServiceGenerateRequest:
    """A decode node's request for the state a Prefill reply describes (4 greedy tokens,
    never ended by an end token); overrides replace KvSource fields. Written as a router of
    the earlier version writes it: the flat fields, no `reference` (read all the same)."""
    fields: dict[str, Any] = dict(
        prefill_address=prefill_address,
        kv_handle=reply.kv_handle,
        first_token_id=reply.first_token_id,
        prompt_tokens=reply.prompt_tokens,
        fingerprint=reply.fingerprint,
        kv_size_bytes=reply.kv_size_bytes,
    )
    fields.update(overrides)
    return decode_pb2.DecodeServiceGenerateRequest(
        model=model, kv=decode_pb2.KvSource(**fields), sampling=greedy(4, ignore_eos=True)
    )


def end_token_suppressor(llm: llama_cpp.Llama) -> llama_cpp.LogitsProcessorList:
    """A logits processor giving every end-of-generation token a -inf logit: ignore_eos as
    the mesh applies it (a -inf bias before the greedy pick), for llama-cpp-python."""
    ends = list(end_tokens(llm._model.vocab, llm.n_vocab()))

    def suppress(_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.single]) -> Any:
        scores[ends] = -np.inf
        return scores

    return llama_cpp.LogitsProcessorList([suppress])


def reference_tokens(
    llm: llama_cpp.Llama, prompt: str | list[int], max_tokens: int, ignore_eos: bool = False
) -> list[int]:
    """Greedy generation in this process, as one would without the mesh, from the prompt's
    text or its token ids (ignore_eos: no end token is ever picked, as with
    SamplingParams.ignore_eos)."""
    tokens: list[int] = []
    llm.reset()  # type: ignore[no-untyped-call]  # n_tokens = 0: no prefix of an earlier call is reused
    prompt_tokens = (
        prompt if isinstance(prompt, list) else llm.tokenize(prompt.encode(), True, True)
    )
    processor = end_token_suppressor(llm) if ignore_eos else None
    for token in llm.generate(prompt_tokens, temp=0.0, reset=True, logits_processor=processor):
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token) or len(tokens) >= max_tokens:
            break
        tokens.append(token)
    return tokens


def shaped_reference_tokens(
    llm: llama_cpp.Llama,
    prompt: str,
    max_tokens: int,
    penalties: tuple[float, float, float] | None = None,
    biases: dict[int, float] | None = None,
    ignore_eos: bool = False,
) -> list[int]:
    """Greedy generation in this process with the logits shaped first: `biases` added to
    their tokens' logits, end tokens at -inf (ignore_eos), then repetition penalties
    (repeat, frequency, presence) as llama-server applies them: a penalties sampler told of
    the prompt's tokens before the first pick (the server accepts them all; the window keeps
    the last 64), then of every token picked."""
    llm.reset()  # type: ignore[no-untyped-call]
    prompt_tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    ends = list(end_tokens(llm._model.vocab, llm.n_vocab())) if ignore_eos else []
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if penalties is not None:
        llama_cpp.llama_sampler_chain_add(
            chain, llama_cpp.llama_sampler_init_penalties(llm.n_vocab(), 64, *penalties)
        )
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    try:
        for token in prompt_tokens:
            llama_cpp.llama_sampler_accept(chain, token)
        tokens: list[int] = []
        llm.eval(prompt_tokens)
        while len(tokens) < max_tokens:
            logits = np.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)
            )
            for token, bias in (biases or {}).items():
                logits[token] += bias  # in the context's own buffer, which the chain reads
            logits[ends] = -np.inf
            token = int(llama_cpp.llama_sampler_sample(chain, llm._ctx.ctx, -1))  # accepts it
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
                break
            tokens.append(token)
            llm.eval([token])
        return tokens
    finally:
        llama_cpp.llama_sampler_free(chain)


def reference_logprobs(
    llm: llama_cpp.Llama, prompt: str, tokens: list[int], top: int
) -> list[tuple[float, list[int]]]:
    """Each of `tokens`' log probability after the prompt and the tokens before it (the
    softmax of the raw logits), with the `top` most likely ids at its place."""
    llm.reset()  # type: ignore[no-untyped-call]
    llm.eval(llm.tokenize(prompt.encode(), add_bos=True, special=True))
    out = []
    for token in tokens:
        logits = np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)
        ).astype(np.float64)
        logs = logits - logits.max()
        logs -= np.log(np.exp(logs).sum())
        out.append((float(logs[token]), [int(t) for t in np.argsort(-logs, kind="stable")[:top]]))
        llm.eval([token])
    return out


def late_word(texts: list[str], after: int) -> str:
    """A stop string from this machine's own answer (greedy text differs between CPUs): the
    first piece's text, from piece `after` on, that the text before it does not hold."""
    for i in range(after, len(texts)):
        word = texts[i].strip()
        if word and word not in "".join(texts[:i]):
            return word
    raise AssertionError(f"no new word after piece {after} of {texts}")


# Raw prompts a small model tends to continue at length; prompt_running picks among them.
RUNNING_PROMPTS = (
    "Count to one thousand: 1, 2, 3, 4, 5,",
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\narr =",
)


def prompt_running(llm: llama_cpp.Llama, tokens: int) -> str:
    """A raw prompt whose greedy answer runs at least `tokens` tokens before any end token,
    on this machine: greedy continuations differ between CPUs, so a test that cannot set
    ignore_eos (Ollama's API has no such option) picks its prompt here, in the same run,
    against the single-process reference."""
    for prompt in RUNNING_PROMPTS:
        if len(reference_tokens(llm, prompt, tokens)) == tokens:
            return prompt
    raise AssertionError(f"no prompt of {RUNNING_PROMPTS} runs {tokens} tokens on this machine")
