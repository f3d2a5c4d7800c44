"""End to end through router -> prefill -> KV -> decode, against single-process llama.cpp."""

from __future__ import annotations

from typing import Any

import llama_cpp
import pytest

from disagg_mesh.proto.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    types_pb2,
)
from tests.conftest import Mesh
from tests.streams import (
    collect,
    greedy,
    late_word,
    reference_logprobs,
    reference_tokens,
    request,
    shaped_reference_tokens,
)

SHORT_PROMPT = "def fibonacci(n):"


def long_prompt(llm: llama_cpp.Llama, tokens: int = 1000) -> str:
    """A varied ~`tokens`-token prompt: a student's code file to review."""
    lines = ["Review the following student submission and list its bugs.", ""]
    i = 0
    while len(llm.tokenize("\n".join(lines).encode(), special=True)) < tokens:
        lines.append(f"def step_{i}(values, factor={i % 7}):")
        lines.append(f"    # scale every value by {i} and drop those under {i * 3}")
        lines.append(f"    return [v * factor for v in values if v > {i * 3}]")
        i += 1
    return "\n".join(lines)


@pytest.mark.parametrize("max_tokens", [48])
async def test_short_prompt_is_token_identical_to_single_process(
    router: router_pb2_grpc.RouterServiceAsyncStub, reference_llm: llama_cpp.Llama, max_tokens: int
) -> None:
    expected = reference_tokens(reference_llm, SHORT_PROMPT, max_tokens)
    got = await collect(router.Generate(request("qwen3-coder:30b", SHORT_PROMPT, max_tokens)))
    assert got.token_ids == expected
    assert got.text == reference_llm.detokenize(expected).decode()
    s = got.summary
    assert s.method == router_pb2.ROUTE_METHOD_DISAGGREGATED
    assert s.kv_transfer == types_pb2.KV_TRANSFER_STATE
    assert s.completion_tokens == len(expected)
    assert s.prompt_tokens == len(reference_llm.tokenize(SHORT_PROMPT.encode(), special=True))


async def test_long_prompt_is_token_identical_and_moves_real_kv(
    router: router_pb2_grpc.RouterServiceAsyncStub, reference_llm: llama_cpp.Llama
) -> None:
    prompt = long_prompt(reference_llm)
    n_prompt = len(reference_llm.tokenize(prompt.encode(), special=True))
    assert 1000 <= n_prompt < 1100
    expected = reference_tokens(reference_llm, prompt, 32)
    got = await collect(router.Generate(request("gpt-oss:120b", prompt, 32), timeout=120))
    assert got.token_ids == expected
    s = got.summary
    assert s.prompt_tokens == n_prompt
    # Real KV state: ~23 KB per prompt token for SmolLM2-135M, moved prefill -> decode.
    assert s.kv_transfer_bytes > 15_000 * n_prompt
    assert s.kv_transfer_duration.ToNanoseconds() > 0
    assert s.prefill_node == "prefill-gpt-oss" and s.decode_node == "decode-gpt-oss"
    # The decode node did not evaluate the prompt again: it only loaded the state.
    assert s.kv_load_duration.ToNanoseconds() < s.prefill_duration.ToNanoseconds()


# A prompt of more than 64 tokens (the penalties' default window) that invites repetition.
COUNTING = "Count to one hundred: " + ", ".join(str(i) for i in range(1, 41)) + ","
PENALTIES = {"repeat_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.5}


async def test_repetition_penalties_count_the_prompt_as_llama_server_does(
    router: router_pb2_grpc.RouterServiceAsyncStub,
    prefill_qwen: prefill_pb2_grpc.PrefillServiceAsyncStub,
    decode_qwen: decode_pb2_grpc.DecodeServiceAsyncStub,
    reference_llm: llama_cpp.Llama,
) -> None:
    """Repetition penalties count the prompt's last 64 tokens and the answer, as
    llama-server's: the disaggregated answer (the decode node told of those tokens by the
    prefill node, in its KV reference) and a decode node's alone equal a single process's
    with the same penalties; repeat_last_n = 0 turns them off."""
    tokens = reference_llm.tokenize(COUNTING.encode(), add_bos=True, special=True)
    assert len(tokens) > 64
    plain = reference_tokens(reference_llm, COUNTING, 24)
    expected = shaped_reference_tokens(reference_llm, COUNTING, 24, (1.5, 0.5, 0.5))
    assert expected != plain  # the penalties change this answer
    # First on the decode node alone, then disaggregated: each evaluates the prompt from its
    # start (the second's decode node adds the state's positions after the prefix it now
    # holds), as the reference does. A prompt evaluated after a cache hit is cut into other
    # pieces, whose numbers may differ (docs/prefix-cache.md).
    alone = await collect(
        decode_qwen.Generate(
            decode_pb2.DecodeServiceGenerateRequest(
                model="qwen3-coder:30b", prompt=COUNTING, sampling=greedy(24, **PENALTIES)
            )
        )
    )
    assert alone.token_ids == expected
    got = await collect(router.Generate(request("qwen3-coder:30b", COUNTING, 24, **PENALTIES)))
    assert got.token_ids == expected
    assert got.summary.method == router_pb2.ROUTE_METHOD_DISAGGREGATED
    off = await collect(
        router.Generate(request("qwen3-coder:30b", COUNTING, 24, repeat_last_n=0, **PENALTIES))
    )
    assert off.token_ids == plain
    # What the prefill node hands on: the window's prompt tokens, only when penalized.
    for sampling, window in ((greedy(4, **PENALTIES), tokens[-64:]), (greedy(4), [])):
        reply = await prefill_qwen.Prefill(
            prefill_pb2.PrefillRequest(model="qwen3-coder:30b", prompt=COUNTING, sampling=sampling)
        )
        assert list(reply.reference.penalty_token_ids) == window


async def test_logprobs_are_the_models_own_the_first_from_the_prefill_node(
    router: router_pb2_grpc.RouterServiceAsyncStub, reference_llm: llama_cpp.Llama
) -> None:
    """SamplingParams.logprobs: each delta carries its tokens' log probabilities and the
    most likely tokens at their places, as a single process's softmax of the same logits
    gives them (the first token's computed on the prefill node, handed on with the KV
    state); without it, none."""
    prompt = "A haiku about the autumn moon:"
    expected = reference_tokens(reference_llm, prompt, 8, ignore_eos=True)
    reference = reference_logprobs(reference_llm, prompt, expected, 3)
    asked = request("qwen3-coder:30b", prompt, 8, ignore_eos=True, logprobs=3)
    got = await collect(router.Generate(asked))
    assert got.summary.method == router_pb2.ROUTE_METHOD_DISAGGREGATED
    assert got.token_ids == expected
    assert [lp.chosen.token_id for lp in got.logprobs] == expected
    for lp, (logprob, top) in zip(got.logprobs, reference, strict=True):
        assert lp.chosen.logprob == pytest.approx(logprob, abs=1e-4)
        assert [c.token_id for c in lp.top] == top
        assert lp.top[0].logprob == pytest.approx(lp.chosen.logprob)  # greedy: the likeliest
        assert lp.chosen.piece == reference_llm.detokenize([lp.chosen.token_id])
    plain = await collect(router.Generate(request("qwen3-coder:30b", SHORT_PROMPT, 4)))
    assert plain.token_ids and not plain.logprobs


async def test_first_delta_arrives_before_generation_ends(
    router: router_pb2_grpc.RouterServiceAsyncStub,
) -> None:
    got = await collect(
        router.Generate(request("qwen3-coder:30b", "Count from one to fifty:", 96, ignore_eos=True))
    )
    assert got.deltas > 10
    # Tokens stream as they are made: the first arrives well before the summary.
    assert got.summary_at - got.first_delta_at > 0.2
    s = got.summary
    assert 0 < s.time_to_first_token.ToNanoseconds() < s.total_duration.ToNanoseconds()
    assert s.decode_tokens_per_second > 0 and s.prefill_tokens_per_second > 0


async def test_decode_only_route_generates_whole_on_the_decode_node(
    router: router_pb2_grpc.RouterServiceAsyncStub, reference_llm: llama_cpp.Llama
) -> None:
    expected = reference_tokens(reference_llm, SHORT_PROMPT, 24)
    got = await collect(router.Generate(request("test/decode-only", SHORT_PROMPT, 24)))
    assert got.token_ids == expected
    s = got.summary
    assert s.method == router_pb2.ROUTE_METHOD_DECODE_ONLY
    assert s.kv_transfer == types_pb2.KV_TRANSFER_NONE
    assert s.prefill_node == "" and s.kv_transfer_bytes == 0


async def test_chat_messages_use_the_models_template(
    router: router_pb2_grpc.RouterServiceAsyncStub, reference_llm: llama_cpp.Llama
) -> None:
    messages = [types_pb2.ChatMessage(role="user", content="What is 2 + 2?")]
    got = await collect(
        router.Generate(
            router_pb2.GenerateRequest(
                model="qwen3-coder:30b", messages=messages, sampling=greedy(16)
            )
        )
    )
    reference_llm.reset()  # type: ignore[no-untyped-call]
    expected: Any = reference_llm.create_chat_completion(
        messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=16, temperature=0.0
    )
    assert got.text == expected["choices"][0]["message"]["content"]


async def test_stop_strings_end_the_text_before_them(
    router: router_pb2_grpc.RouterServiceAsyncStub, reference_llm: llama_cpp.Llama
) -> None:
    ids = reference_tokens(reference_llm, SHORT_PROMPT, 48, ignore_eos=True)
    full = reference_llm.detokenize(ids).decode(errors="replace")
    # A stop string from this machine's own answer, first seen from its 30th token on.
    pieces = [reference_llm.detokenize([t]).decode(errors="replace") for t in ids]
    stop = late_word(pieces, 30)
    assert stop in full
    got = await collect(
        router.Generate(
            request("qwen3-coder:30b", SHORT_PROMPT, 48, stop=[stop], ignore_eos=True, logprobs=1)
        )
    )
    assert got.text == full[: full.index(stop)]
    assert got.summary.finish_reason == types_pb2.FINISH_REASON_STOP
    # Log probabilities for the tokens whose text begins before the stop string, not for
    # those that are only the stop string's (llama-server leaves those out too).
    cut = reference_llm.detokenize(ids).index(stop.encode())
    before = [t for i, t in enumerate(ids) if len(reference_llm.detokenize(ids[:i])) < cut]
    assert [lp.chosen.token_id for lp in got.logprobs] == before
    assert len(got.token_ids) > len(before)  # the stop string's tokens were generated


async def test_max_tokens_ends_with_length(router: router_pb2_grpc.RouterServiceAsyncStub) -> None:
    got = await collect(
        router.Generate(request("qwen3-coder:30b", SHORT_PROMPT, 5, ignore_eos=True))
    )
    assert got.summary.completion_tokens == 5 == len(got.token_ids)
    assert got.summary.finish_reason == types_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize("model", ["qwen3-coder:30b", "test/decode-only"])
async def test_ignore_eos_runs_to_max_tokens_with_the_same_tokens_until_the_end(
    router: router_pb2_grpc.RouterServiceAsyncStub, model: str
) -> None:
    """ignore_eos suppresses end tokens and nothing else: up to where the usual answer ended,
    the same tokens; then on to max_tokens, through the prefill node's first token and the
    decode node's."""

    def chat(ignore_eos: bool) -> router_pb2.GenerateRequest:
        return router_pb2.GenerateRequest(
            model=model,
            messages=[types_pb2.ChatMessage(role="user", content="Say hi.")],
            sampling=greedy(64, ignore_eos=ignore_eos),
        )

    usual = await collect(router.Generate(chat(False)))
    forced = await collect(router.Generate(chat(True)))
    assert forced.summary.completion_tokens == 64 == len(forced.token_ids)
    assert forced.summary.finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert forced.token_ids[: len(usual.token_ids)] == usual.token_ids
    assert forced.text.startswith(usual.text)


async def test_decode_node_pulls_kv_directly_from_the_prefill_node(
    prefill_qwen: prefill_pb2_grpc.PrefillServiceAsyncStub,
    decode_qwen: decode_pb2_grpc.DecodeServiceAsyncStub,
    reference_llm: llama_cpp.Llama,
    mesh: Mesh,
) -> None:
    """The two stages by hand, without the router: what the router does, step by step."""
    reply = await prefill_qwen.Prefill(
        prefill_pb2.PrefillRequest(
            model="qwen3-coder:30b", prompt=SHORT_PROMPT, sampling=greedy(8, ignore_eos=True)
        )
    )
    assert reply.kv_size_bytes > 0 and reply.kv_handle
    got = await collect(
        decode_qwen.Generate(
            decode_pb2.DecodeServiceGenerateRequest(
                model="qwen3-coder:30b",
                kv=decode_pb2.KvSource(
                    prefill_address=mesh.address("prefill-qwen"), reference=reply.reference
                ),
                sampling=greedy(8, ignore_eos=True),
            )
        )
    )
    assert got.token_ids == reference_tokens(reference_llm, SHORT_PROMPT, 8, ignore_eos=True)
    assert got.token_ids[0] == reply.first_token_id
    assert got.summary.kv_fetch_bytes == reply.kv_size_bytes


@pytest.mark.parametrize("model", ["qwen3-coder:30b", "test/decode-only"])
async def test_a_stream_interval_sends_fewer_deltas_with_the_same_tokens(
    router: router_pb2_grpc.RouterServiceAsyncStub, reference_llm: llama_cpp.Llama, model: str
) -> None:
    """sampling.stream_interval_tokens: the first token at once, then deltas of at least
    that many tokens (the last holds the rest), the same tokens and text as token by token."""
    expected = reference_tokens(reference_llm, SHORT_PROMPT, 40, ignore_eos=True)
    got = await collect(
        router.Generate(request(model, SHORT_PROMPT, 40, ignore_eos=True, stream_interval_tokens=8))
    )
    sizes = got.delta_tokens
    assert got.token_ids == expected
    assert got.text == reference_llm.detokenize(expected).decode()
    assert sizes[0] == 1 and all(n >= 8 for n in sizes[1:-1]) and 1 <= sizes[-1]
    assert sum(sizes) == 40 and len(sizes) <= 1 + -(-39 // 8)  # 1, then deltas of 8
    assert got.summary.completion_tokens == 40
    assert got.summary.time_to_first_token.ToNanoseconds() > 0
