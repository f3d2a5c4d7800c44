"""The router's HTTP front doors, through the real client libraries: `ollama` (Client and
AsyncClient) and `openai`, against the session's mesh of real nodes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import grpc
import httpx
import llama_cpp
import ollama
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from disagg_mesh import AsyncMeshClient, GenerateCall
from disagg_mesh.errors import InvalidRequest
from disagg_mesh.proto.v1 import node_pb2, node_pb2_grpc
from disagg_mesh.server.common.models.files import resolve_model_path
from disagg_mesh.server.common.types import parameter_size
from disagg_mesh.server.router.http.origins import BrowserOrigins, local_host
from tests.conftest import (
    MODEL,
    N_CTX,
    ROOT,
    Mesh,
    engine_node,
    route,
    router_node,
    running_mesh,
)
from tests.streams import (
    prompt_running,
    reference_logprobs,
    reference_tokens,
    shaped_reference_tokens,
)

QWEN = "qwen3-coder:30b"
PROMPT = "The three primary colors are"


def http_url(mesh: Mesh) -> str:
    router = mesh.topology.router
    return f"http://{router.host}:{router.http_port}"


# -- Ollama ------------------------------------------------------------------------------------


def test_ollama_generate_raw_matches_one_process(
    mesh: Mesh, reference_llm: llama_cpp.Llama
) -> None:
    client = ollama.Client(host=http_url(mesh))
    got = client.generate(
        model=QWEN, prompt=PROMPT, raw=True, options={"temperature": 0, "num_predict": 16}
    )
    expected = reference_tokens(reference_llm, PROMPT, 16)
    assert got.response == reference_llm.detokenize(expected).decode()
    # How long the greedy answer runs is this machine's, as the reference's.
    assert got.done and got.done_reason == ("length" if len(expected) == 16 else "stop")
    assert got.eval_count == len(expected) and got.prompt_eval_count == len(
        reference_llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
    )
    assert got.total_duration and got.total_duration > (got.eval_duration or 0) > 0
    raw = got.model_dump()
    assert raw["model"] == QWEN


def test_ollama_generate_streams_ndjson_with_our_metrics(
    mesh: Mesh, reference_llm: llama_cpp.Llama
) -> None:
    client = ollama.Client(host=http_url(mesh))
    prompt = prompt_running(reference_llm, 12)
    pieces = list(
        client.generate(
            model=QWEN,
            prompt=prompt,
            raw=True,
            stream=True,
            options={"temperature": 0, "num_predict": 12},
        )
    )
    assert len(pieces) > 2 and all(not p.done for p in pieces[:-1]) and pieces[-1].done
    streamed = "".join(p.response or "" for p in pieces)
    whole = client.generate(
        model=QWEN, prompt=prompt, raw=True, options={"temperature": 0, "num_predict": 12}
    )
    assert streamed == whole.response
    # Our metrics ride along as an extra field (the client ignores it; raw JSON has it).
    line = httpx.post(
        f"{http_url(mesh)}/api/generate",
        json={
            "model": QWEN,
            "prompt": PROMPT,
            "raw": True,
            "stream": False,
            "options": {"temperature": 0, "num_predict": 4},
        },
        timeout=60,
    ).json()
    assert line["disagg"]["method"] == "disaggregated"
    assert line["disagg"]["kv_transfer"] == "state" and line["disagg"]["kv_transfer_bytes"] > 0
    assert line["disagg"]["prefill_node"] == "prefill-qwen"


async def test_ollama_chat_async_and_templated_generate_agree(mesh: Mesh) -> None:
    client = ollama.AsyncClient(host=http_url(mesh))
    question = "Name one prime number."
    chat = await client.chat(
        model=QWEN,
        messages=[{"role": "user", "content": question}],
        options={"temperature": 0, "num_predict": 24},
    )
    assert chat.message.role == "assistant" and chat.message.content
    # /api/generate without raw applies the chat template to the prompt, as Ollama does.
    generated = await client.generate(
        model=QWEN, prompt=question, options={"temperature": 0, "num_predict": 24}
    )
    assert generated.response == chat.message.content
    streamed = [
        part
        async for part in await client.chat(
            model=QWEN,
            messages=[{"role": "user", "content": question}],
            stream=True,
            options={"temperature": 0, "num_predict": 24},
        )
    ]
    assert "".join(p.message.content or "" for p in streamed) == chat.message.content
    assert streamed[-1].done and streamed[-1].eval_count == chat.eval_count


async def test_a_final_assistant_message_is_continued_on_both_doors(mesh: Mesh) -> None:
    """As llama-server and Ollama do: given the first words of its own greedy answer as a
    last assistant message, the model goes on with the rest of that answer (greedy text
    depends only on the tokens before), and the reply holds only what follows them."""
    question = [{"role": "user", "content": "Name one prime number and say why."}]
    client = ollama.AsyncClient(host=http_url(mesh))
    options = {"temperature": 0, "num_predict": 24}
    whole = (await client.chat(model=QWEN, messages=question, options=options)).message.content
    assert whole and " " in whole.strip()
    start = whole[: whole.index(" ", len(whole) // 3)]  # whole words, so tokens alike
    began = [*question, {"role": "assistant", "content": start}]
    rest = (await client.chat(model=QWEN, messages=began, options=options)).message.content
    assert rest
    assert (start + rest).startswith(whole) or whole.startswith(start + rest)
    opening: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": question[0]["content"]},
        {"role": "assistant", "content": start},
    ]
    create = openai_client(mesh).chat.completions.create
    opened = await asyncio.to_thread(
        lambda: create(model=QWEN, messages=opening, max_tokens=24, temperature=0)
    )
    assert opened.choices[0].message.content == rest


@pytest.mark.parametrize(
    ("count", "written"),
    [
        (134_515_008, "134.52M"),
        (20_000_000_000, "20B"),
        (30_532_122_624, "30.5B"),
        (116_829_156_672, "116.8B"),
        (7_000_000, "7M"),
        (1_500, "2K"),
        (999, "999"),
    ],
)
def test_parameter_sizes_are_written_as_ollama_writes_them(count: int, written: str) -> None:
    """Ollama's format.HumanNumber: B with one decimal, M with two, none when whole."""
    assert parameter_size(count) == written


def test_ollama_list_show_ps_version(mesh: Mesh, reference_llm: llama_cpp.Llama) -> None:
    """The logical models as Ollama lists and shows one: the nodes' model file (its family,
    size and quantization as Ollama writes them, as llama.cpp reads the file), what it can
    do ("thinking" only for a model that reasons: test_harmony.py), the route; think or a
    reasoning effort for a model that does not reason is a 400 naming it, as Ollama's."""
    client = ollama.Client(host=http_url(mesh))
    listed = {m.model: m for m in client.list().models}
    assert {QWEN, "gpt-oss:120b"} <= set(listed)
    parameters = llama_cpp.llama_model_n_params(reference_llm.model)
    assert reference_llm.metadata["general.file_type"] == "3"  # llama.cpp's MOSTLY_Q4_1
    want = ("llama", ["llama"], parameter_size(parameters), "Q4_1")
    for model in (listed[QWEN], client.show(QWEN)):
        assert model.details is not None
        d = model.details
        assert (d.family, d.families, d.parameter_size, d.quantization_level) == want
    assert parameter_size(parameters) == "134.52M"  # as Ollama's format.HumanNumber
    assert listed[QWEN].size == resolve_model_path(MODEL, ROOT).stat().st_size
    shown = client.show(QWEN)
    assert "prefill-qwen" in (shown.modelfile or "")
    assert shown.capabilities == ["completion", "tools"]
    assert shown.modelinfo is not None
    assert shown.modelinfo["general.parameter_count"] == parameters
    trained = llama_cpp.llama_model_n_ctx_train(reference_llm.model)
    assert shown.modelinfo["llama.context_length"] == trained
    assert "num_ctx 4096" in (shown.parameters or "")
    # The template as Ollama shows one: how /api/generate's prompt is framed (here the chat
    # template's rendering of a user turn, with or without a system one), and no .Suffix
    # branch, which editors' plugins look for to learn that a model fills in the middle.
    template = shown.template or ""
    assert ".Suffix" not in template and template.startswith("{{ if .System }}"), template
    alone = template.split("{{ else }}")[1].removesuffix("{{ end }}")
    framed = alone.replace("{{ .Prompt }}", "hi").encode()
    answer = client.generate(model=QWEN, prompt="hi", options={"num_predict": 1})
    tokens = reference_llm.tokenize(framed, add_bos=False, special=True)
    assert answer.prompt_eval_count == len(tokens)
    for think in (True, "low"):
        with pytest.raises(ollama.ResponseError) as refused:
            client.chat(model=QWEN, messages=[{"role": "user", "content": "hi"}], think=think)
        assert refused.value.status_code == 400
        assert refused.value.error.startswith("think: 'qwen3-coder:30b' does not support thinking")
    with pytest.raises(ollama.ResponseError, match="does not support thinking"):
        client.generate(model=QWEN, prompt="hi", think=True)
    hi = [{"role": "user", "content": "hi"}]
    assert client.chat(model=QWEN, messages=hi, think=False, options={"num_predict": 1}).done
    with pytest.raises(openai.BadRequestError) as no_effort:
        openai_client(mesh).chat.completions.create(
            model=QWEN, messages=[{"role": "user", "content": "hi"}], reasoning_effort="low"
        )
    assert no_effort.value.body["param"] == "reasoning_effort"  # type: ignore[index]
    running = {m.model: m for m in client.ps().models}
    # The model's bytes, none of them on a GPU here (`ollama ps`: "100% CPU").
    assert (running[QWEN].size, running[QWEN].size_vram) == (listed[QWEN].size, 0)
    # The Ollama release whose API the door follows: VS Code's Copilot Chat, for one,
    # refuses an Ollama before 0.6.4 (its MINIMUM_OLLAMA_VERSION, compared part by part).
    said = httpx.get(f"{http_url(mesh)}/api/version").json()
    assert tuple(int(p) for p in said["version"].split(".")) >= (0, 6, 4), said
    assert said["disagg_mesh"]
    assert httpx.head(f"{http_url(mesh)}/api/version").status_code == 200


def test_ollama_errors_have_ollamas_statuses(mesh: Mesh) -> None:
    client = ollama.Client(host=http_url(mesh))
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="no-such-model", prompt="hi")
    assert info.value.status_code == 404 and "no-such-model" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.show("no-such-model")
    assert info.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model=QWEN, prompt="hi", options={"temperature": -1})
    assert info.value.status_code == 400 and info.value.error.startswith("options.temperature:")
    with pytest.raises(ollama.ResponseError) as info:  # -1 is Ollama's own default: random
        client.generate(model=QWEN, prompt="hi", options={"seed": -2, "num_predict": 1})
    assert info.value.status_code == 400 and info.value.error.startswith("options.seed:")
    assert client.generate(model=QWEN, prompt="hi", options={"seed": -1, "num_predict": 1}).done
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model=QWEN, prompt="hi", options={"num_ctx": 100_000})
    assert info.value.status_code == 400 and "options.num_ctx" in info.value.error
    bad = httpx.post(f"{http_url(mesh)}/api/generate", content=b"{not json", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"].startswith("body: is not valid JSON")
    # A body over the door's limit: HTTP's 413, in the API's own JSON (aiohttp's is text).
    huge = {"model": QWEN, "prompt": "word " * (4 << 20)}
    big = httpx.post(f"{http_url(mesh)}/api/generate", json=huge, timeout=60)
    assert big.status_code == 413, big.text
    assert big.json()["error"] == "body: is over the 16 MiB a request may have"
    images = httpx.post(
        f"{http_url(mesh)}/api/generate",
        json={"model": QWEN, "prompt": "hi", "images": ["aGk="]},
        timeout=10,
    )
    assert images.status_code == 400 and images.json()["error"].startswith("images:")


def test_ollama_without_a_prompt_loads(mesh: Mesh) -> None:
    got = ollama.Client(host=http_url(mesh)).generate(model=QWEN)
    assert got.done and got.done_reason == "load" and got.response == ""


def test_keep_alive_is_read_as_ollama_reads_it(mesh: Mesh) -> None:
    """Seconds (the ollama client's keep_alive=0, which `ollama stop` sends, arrives as 0.0;
    negative: for ever) or a Go duration string; anything else is a 400 naming the field.
    The nodes keep their models loaded whatever it says."""
    client = ollama.Client(host=http_url(mesh))
    unload = client.generate(model=QWEN, prompt="", keep_alive=0)
    assert unload.done and unload.done_reason == "load"
    one: dict[str, Any] = {"num_predict": 1}
    for keep_alive in (-1, 300, 2.5, "10m", "1h30m", "-1s", "0"):
        got = client.chat(
            model=QWEN,
            messages=[{"role": "user", "content": "Hi"}],
            keep_alive=keep_alive,
            options=one,
        )
        assert got.done and got.eval_count == 1, keep_alive
    wrong: list[Any] = ["10", "-1", "5 minutes", True, [], {"m": 5}]
    for path in ("/api/generate", "/api/chat"):
        for value in wrong:
            body = {"model": QWEN, "prompt": "Hi", "stream": False, "keep_alive": value}
            reply = httpx.post(f"{http_url(mesh)}{path}", json=body, timeout=30)
            assert reply.status_code == 400, (path, value, reply.text)
            assert reply.json()["error"].startswith("keep_alive: must be a number of seconds")


# -- OpenAI ------------------------------------------------------------------------------------


def openai_client(mesh: Mesh, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http_url(mesh)}/v1", api_key=key, max_retries=0)


def test_openai_completions_match_one_process(mesh: Mesh, reference_llm: llama_cpp.Llama) -> None:
    # ignore_eos, vLLM's extra parameter: 16 tokens on any CPU, the reference's too.
    got = openai_client(mesh).completions.create(
        model=QWEN, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = reference_tokens(reference_llm, PROMPT, 16, ignore_eos=True)
    assert got.choices[0].text == reference_llm.detokenize(expected).decode()
    assert got.choices[0].finish_reason == "length"
    assert got.usage is not None and got.usage.completion_tokens == 16
    assert got.usage.total_tokens == got.usage.prompt_tokens + 16


async def test_top_k_and_min_p_of_1_sample_the_most_likely_token_on_every_door(
    mesh: Mesh, reference_llm: llama_cpp.Llama
) -> None:
    """At a high temperature, top_k = 1 (or min_p = 1) leaves one candidate: the greedy
    text, whatever the seed; on gRPC, both HTTP doors, and the Ollama door's options."""
    greedy = reference_llm.detokenize(reference_tokens(reference_llm, PROMPT, 16, True)).decode()
    client = openai_client(mesh)
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        got = await asyncio.to_thread(
            client.completions.create,
            model=QWEN,
            prompt=PROMPT,
            max_tokens=16,
            temperature=1.5,
            extra_body={"ignore_eos": True, **extra},
        )
        assert got.choices[0].text == greedy, extra
    async with AsyncMeshClient(mesh.router_address) as grpc_client:
        call = GenerateCall(
            QWEN, PROMPT, max_tokens=16, temperature=1.5, ignore_eos=True, top_k=1, seed=3
        )
        assert (await grpc_client.generate(call)).text == greedy
    running = prompt_running(reference_llm, 16)
    alone = reference_llm.detokenize(reference_tokens(reference_llm, running, 16)).decode()
    ollama_got = await ollama.AsyncClient(host=http_url(mesh)).generate(
        model=QWEN,
        prompt=running,
        raw=True,
        options={"temperature": 1.5, "top_k": 1, "num_predict": 16},
    )
    assert ollama_got.response == alone
    for options, field in (({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p")):
        with pytest.raises(ollama.ResponseError) as info:
            await ollama.AsyncClient(host=http_url(mesh)).generate(
                model=QWEN, prompt="hi", options=options
            )
        assert info.value.status_code == 400 and f"options.{field}:" in info.value.error


async def test_repetition_penalties_on_both_doors(
    mesh: Mesh, reference_llm: llama_cpp.Llama
) -> None:
    """OpenAI's frequency_penalty and presence_penalty (with vLLM's repetition_penalty) and
    Ollama's options of the same names give a single process's penalized greedy answer (as
    llama-server applies them); out of range, 400 naming the field as the door's request
    has it (options.top_p; top_p, repetition_penalty), a seed below -1 (random) too. Each
    door its own prompt, evaluated from its start on every node, as the reference does."""

    def penalized(prompt: str) -> str:
        tokens = shaped_reference_tokens(reference_llm, prompt, 16, (1.5, 0.5, 0.5))
        return reference_llm.detokenize(tokens).decode()

    evens = "The even numbers: " + ", ".join(str(i) for i in range(2, 82, 2)) + ","
    odds = "The odd numbers: " + ", ".join(str(i) for i in range(1, 81, 2)) + ","
    got = await asyncio.to_thread(
        openai_client(mesh).completions.create,
        model=QWEN,
        prompt=evens,
        max_tokens=16,
        temperature=0,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        extra_body={"repetition_penalty": 1.5},
    )
    assert got.choices[0].text == penalized(evens)
    client = ollama.AsyncClient(host=http_url(mesh))
    options = {"repeat_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.5}
    ollama_got = await client.generate(
        model=QWEN,
        prompt=odds,
        raw=True,
        options={"temperature": 0, "num_predict": 16, **options},
    )
    assert ollama_got.response == penalized(odds)
    for bad, field in (
        ({"repeat_penalty": 0}, "repeat_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repeat_last_n": -2}, "repeat_last_n"),
        ({"repeat_last_n": 2**63}, "repeat_last_n"),  # beyond int32: named, not a 500
        ({"top_k": 2**63}, "top_k"),
    ):
        with pytest.raises(ollama.ResponseError) as info:
            await client.generate(model=QWEN, prompt="hi", options=bad)
        assert info.value.status_code == 400
        assert info.value.error.startswith(f"options.{field}:"), info.value.error
    # Each field named as OpenAI's request (or vLLM's extra one) has it, not as gRPC's.
    for extra, field in (
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"top_p": 2}, "top_p"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"top_k": -2}}, "top_k"),
        ({"seed": -7}, "seed"),  # -1: random, as llama-server and Ollama read it
    ):
        create: Any = openai_client(mesh).completions.create
        with pytest.raises(openai.BadRequestError) as refused:
            await asyncio.to_thread(create, model=QWEN, prompt="hi", **extra)
        assert refused.value.body["param"] == field, refused.value.body  # type: ignore[index]
        message = refused.value.body["message"]  # type: ignore[index]
        assert message.startswith(f"{field}:"), message
    random = await asyncio.to_thread(
        openai_client(mesh).completions.create, model=QWEN, prompt="hi", max_tokens=1, seed=-1
    )
    assert random.choices[0].finish_reason == "length"


async def test_logit_bias_on_the_openai_door_and_grpc(
    mesh: Mesh, reference_llm: llama_cpp.Llama
) -> None:
    """OpenAI's logit_bias (token id -> bias added to its logit, as llama-server's): a ban on
    the greedy answer's first token and a lift of another give a single process's answer
    with the same biases, on the OpenAI door and gRPC (each its own prompt, evaluated from
    its start). A key not a token id, an id outside the vocabulary, a bias outside [-100,
    100]: 400 naming the field."""
    answers = []
    for prompt in ("The four seasons of the year are", "The planets of the solar system are"):
        greedy = reference_tokens(reference_llm, prompt, 16, True)
        lifted = next(t for t in greedy[2:] if t != greedy[0])
        biases = {greedy[0]: -100.0, lifted: 3.0}
        expected = shaped_reference_tokens(
            reference_llm, prompt, 16, biases=biases, ignore_eos=True
        )
        assert expected[0] != greedy[0]
        answers.append((prompt, biases, reference_llm.detokenize(expected).decode()))
    (prompt, biases, want), (grpc_prompt, grpc_biases, grpc_want) = answers
    client = openai_client(mesh)
    got = await asyncio.to_thread(
        client.completions.create,
        model=QWEN,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        logit_bias={str(t): int(b) for t, b in biases.items()},
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == want
    async with AsyncMeshClient(mesh.router_address) as grpc_client:
        call = GenerateCall(
            QWEN, grpc_prompt, max_tokens=16, temperature=0, ignore_eos=True, logit_bias=grpc_biases
        )
        assert (await grpc_client.generate(call)).text == grpc_want
    for bad, field in (
        ({"the": 1}, "logit_bias"),
        ({"99999999": 1}, "logit_bias"),
        ({"5": 101}, "logit_bias"),
        ({str(2**63): 1}, "logit_bias"),  # beyond int32: named, not a 500
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await asyncio.to_thread(
                client.completions.create, model=QWEN, prompt="hi", max_tokens=2, logit_bias=bad
            )
        assert refused.value.body["param"] == field, refused.value.body  # type: ignore[index]


async def test_logprobs_on_both_doors(mesh: Mesh, reference_llm: llama_cpp.Llama) -> None:
    """Completions' logprobs, chat's logprobs and top_logprobs, Ollama's logprobs and
    top_logprobs: each token's text (joined, the answer), bytes, log probability (a single
    process's) and the most likely tokens at its place. Refused, naming the field: more than
    20, top_logprobs without logprobs."""
    client = openai_client(mesh)
    prompt = "The capital cities of Europe include"
    expected = reference_tokens(reference_llm, prompt, 8, True)
    reference = reference_logprobs(reference_llm, prompt, expected, 2)
    got = await asyncio.to_thread(
        client.completions.create,
        model=QWEN,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    scores = got.choices[0].logprobs
    assert scores is not None and scores.tokens and scores.token_logprobs is not None
    assert "".join(scores.tokens) == got.choices[0].text
    assert scores.token_logprobs == pytest.approx([r[0] for r in reference], abs=1e-4)
    assert scores.text_offset == [len("".join(scores.tokens[:i])) for i in range(8)]
    assert scores.top_logprobs and all(0 < len(top) <= 2 for top in scores.top_logprobs)
    hi: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three fruits."}]
    stream = await asyncio.to_thread(
        client.chat.completions.create,
        model=QWEN,
        messages=hi,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    content, entries = "", []
    for chunk in stream:
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                entries += chunk.choices[0].logprobs.content
    assert entries and "".join(e.token for e in entries) == content
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in entries)
    colors: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three colors."}]
    whole = await asyncio.to_thread(
        client.chat.completions.create,
        model=QWEN,
        messages=colors,
        max_tokens=8,
        temperature=0,
        logprobs=True,
    )
    listed = whole.choices[0].logprobs
    assert listed is not None and listed.content
    assert "".join(e.token for e in listed.content) == whole.choices[0].message.content
    assert all(e.top_logprobs == [] and e.logprob <= 0 for e in listed.content)
    assert whole.usage is not None and len(listed.content) == whole.usage.completion_tokens
    ollama_got = await ollama.AsyncClient(host=http_url(mesh)).generate(
        model=QWEN,
        prompt="The largest oceans are",
        raw=True,
        options={"temperature": 0, "num_predict": 8},
        logprobs=True,
        top_logprobs=2,
    )
    assert ollama_got.logprobs and "".join(e.token for e in ollama_got.logprobs) == (
        ollama_got.response
    )
    assert all(len(e.top_logprobs or []) == 2 for e in ollama_got.logprobs)
    refused_asks: list[tuple[dict[str, object], str]] = [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ]
    for extra, field in refused_asks:
        with pytest.raises(openai.BadRequestError) as refused:
            await asyncio.to_thread(
                client.chat.completions.create,
                model=QWEN,
                messages=hi,
                max_tokens=2,
                extra_body=extra,
            )
        assert refused.value.body["param"] == field, refused.value.body  # type: ignore[index]


def test_n_choices_each_its_own_generation(mesh: Mesh) -> None:
    """n: as many choices, each its own generation (a seeded request's choice i samples with
    the request's seed + i, so the choices differ), the prompt counted once in the usage;
    streamed, each chunk names its choice and each choice ends with its own finish; over
    16: 400 naming n."""
    client = openai_client(mesh)
    fruit: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name a fruit."}]

    def ask(**extra: Any) -> Any:
        return client.chat.completions.create(
            model=QWEN,
            messages=fruit,
            max_tokens=8,
            temperature=1.0,
            extra_body={"ignore_eos": True},
            **extra,
        )

    whole = ask(n=3, seed=11)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    alone = [ask(seed=11 + i) for i in range(3)]
    texts = [c.message.content for c in whole.choices]
    assert texts == [a.choices[0].message.content for a in alone]
    assert len(set(texts)) > 1  # three seeds, not one answer three times
    assert whole.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert whole.usage.completion_tokens == 3 * 8
    assert all("disagg" in (c.model_extra or {}) for c in whole.choices)
    streamed, finishes = ["", "", ""], [None, None, None]
    for chunk in ask(n=3, seed=11, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert streamed == texts and finishes == ["length"] * 3
    with pytest.raises(openai.BadRequestError) as refused:
        ask(n=17)
    assert refused.value.body["param"] == "n", refused.value.body  # type: ignore[index]
    for stream in (False, True):  # every choice fails before any text: the error's status
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="no/such", messages=fruit, n=2, stream=stream)


def test_completions_take_a_list_of_prompts(mesh: Mesh, reference_llm: llama_cpp.Llama) -> None:
    """/v1/completions' prompt as a list: n choices for each prompt in turn (choice k*n + j:
    prompt k's j-th), each prompt counted once in the usage; more than 16 choices in all,
    or a list of token ids: 400 naming prompt."""
    prompts = ["The tallest mountains are", "The longest rivers are"]
    client = openai_client(mesh)
    got = client.completions.create(
        model=QWEN,
        prompt=prompts,
        n=2,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    expected = [reference_tokens(reference_llm, p, 6, ignore_eos=True) for p in prompts]
    texts = [reference_llm.detokenize(tokens).decode() for tokens in expected]
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [texts[0], texts[0], texts[1], texts[1]]
    counted = [len(reference_llm.tokenize(p.encode(), special=True)) for p in prompts]
    assert got.usage is not None and got.usage.prompt_tokens == sum(counted)
    assert got.usage.completion_tokens == 4 * 6
    for bad in ([[1, 2, 3]], ["a"] * 9):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=QWEN, prompt=bad, n=2, max_tokens=2)
        assert refused.value.body["param"] == "prompt", refused.value.body  # type: ignore[index]


def test_completions_echo_the_prompt_before_each_choice(
    mesh: Mesh, reference_llm: llama_cpp.Llama
) -> None:
    """echo: each choice's text begins with its prompt, whole and streamed (its first
    chunk), the usage unchanged; with logprobs (the prompt's own): 400 naming echo."""
    prompts = ["The tallest mountains are", "The longest rivers are"]
    client = openai_client(mesh)
    options: dict[str, Any] = {
        "model": QWEN,
        "max_tokens": 4,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    expected = [reference_tokens(reference_llm, p, 4, ignore_eos=True) for p in prompts]
    texts = [
        p + reference_llm.detokenize(t).decode() for p, t in zip(prompts, expected, strict=True)
    ]
    got = client.completions.create(prompt=prompts, n=2, echo=True, **options)
    assert [c.text for c in got.choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert got.usage is not None and got.usage.completion_tokens == 4 * 4
    streamed: dict[int, str] = {}
    firsts: dict[int, str] = {}
    for chunk in client.completions.create(prompt=prompts, echo=True, stream=True, **options):
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice.text)
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {0: texts[0], 1: texts[1]}
    assert [firsts[0][: len(prompts[0])], firsts[1][: len(prompts[1])]] == prompts
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(prompt=prompts[0], echo=True, logprobs=1, **options)
    assert refused.value.body["param"] == "echo", refused.value.body  # type: ignore[index]


def test_openai_chat_streaming_and_not_agree(mesh: Mesh) -> None:
    client = openai_client(mesh)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "What is a list in Python?"},
    ]
    whole = client.chat.completions.create(
        model=QWEN,
        messages=messages,
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = whole.choices[0].message.content or ""
    assert text and whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == 20
    chunks = list(
        client.chat.completions.create(
            model=QWEN,
            messages=messages,
            max_tokens=20,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20


def test_openai_streams_sse_ending_with_done(mesh: Mesh) -> None:
    with httpx.stream(
        "POST",
        f"{http_url(mesh)}/v1/chat/completions",
        json={
            "model": QWEN,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
        },
        timeout=60,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["disagg"]["method"] == "disaggregated"


async def test_a_chat_too_long_loses_its_oldest_turns_as_in_ollama(mesh: Mesh) -> None:
    """Ollama's /api/chat drops a chat's oldest turns until it fits the context (its
    `truncate`, on by default), the system message and the last turn kept; `truncate:
    false`, OpenAI's door and a gRPC call without truncate_history refuse it instead."""
    long = "word " * int(N_CTX * 0.4)
    chat = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "First: " + long},
        {"role": "assistant", "content": "Second: " + long},
        {"role": "user", "content": "Third: " + long},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "What is the colour of the sky?"},
    ]
    kept = [chat[0], *chat[2:]]  # the first user turn alone goes: the rest fits
    options = {"temperature": 0, "num_predict": 8}
    client = ollama.AsyncClient(host=http_url(mesh))
    truncated = await client.chat(model=QWEN, messages=chat, options=options)
    async with httpx.AsyncClient(base_url=http_url(mesh), timeout=120) as http:
        fields = {"model": QWEN, "options": options, "stream": False, "truncate": False}
        reference = (await http.post("/api/chat", json={**fields, "messages": kept})).json()
        refused = await http.post("/api/chat", json={**fields, "messages": chat})
        bad = await http.post("/api/chat", json={**fields, "messages": chat, "truncate": "yes"})
    assert truncated.message.content == reference["message"]["content"], reference
    assert truncated.prompt_eval_count == reference["prompt_eval_count"] < N_CTX
    assert refused.status_code == 400, refused.text
    assert f"a context of {N_CTX} must hold it" in refused.json()["error"]
    assert bad.status_code == 400 and "truncate: must be true or false" in bad.json()["error"]
    # Only the last turn beyond the system message, and still too long: refused, its size
    # named (Ollama keeps the last turn whatever its size).
    huge = [chat[0], {"role": "user", "content": "word " * (N_CTX + 10)}]
    with pytest.raises(ollama.ResponseError) as too_long:
        await client.chat(model=QWEN, messages=huge, options=options)
    assert too_long.value.status_code == 400 and "must hold it" in too_long.value.error
    # OpenAI's door keeps OpenAI's answer: context_length_exceeded.
    openai_chat: list[ChatCompletionMessageParam] = chat  # type: ignore[assignment]
    with pytest.raises(openai.BadRequestError) as exceeded:
        await asyncio.to_thread(
            lambda: openai_client(mesh).chat.completions.create(
                model=QWEN, messages=openai_chat, max_tokens=8
            )
        )
    assert exceeded.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    # The gRPC API: truncate_history asks for it.
    async with AsyncMeshClient(mesh.router_address) as grpc_client:
        call = GenerateCall(QWEN, messages=chat, max_tokens=8, temperature=0)
        with pytest.raises(InvalidRequest, match=f"a context of {N_CTX} must hold it"):
            await grpc_client.generate(call)
        fitted = await grpc_client.generate(dataclasses.replace(call, truncate_history=True))
    assert fitted.text == reference["message"]["content"]
    assert fitted.metrics.prompt_tokens == reference["prompt_eval_count"]


async def test_truncate_prompt_tokens_evaluates_the_prompts_last_tokens_as_vllm(
    mesh: Mesh, reference_llm: llama_cpp.Llama
) -> None:
    """vLLM's truncate_prompt_tokens: the answer to the prompt's last k tokens (computed here
    from those token ids), on the OpenAI door and gRPC; -1 keeps what the context holds."""
    prompt = "Once upon a time, in a small village by the sea, there lived an old fisherman. " * 4
    ids = reference_llm.tokenize(prompt.encode(), add_bos=True, special=True)
    keep = 12
    assert len(ids) > 2 * keep
    expected = reference_llm.detokenize(
        reference_tokens(reference_llm, ids[-keep:], 10, ignore_eos=True)
    ).decode()
    client = openai_client(mesh)
    extra = {"truncate_prompt_tokens": keep, "ignore_eos": True}
    got = await asyncio.to_thread(
        lambda: client.completions.create(
            model=QWEN, prompt=prompt, max_tokens=10, temperature=0, extra_body=extra
        )
    )
    assert got.choices[0].text == expected
    assert got.usage is not None and got.usage.prompt_tokens == keep
    async with AsyncMeshClient(mesh.router_address) as grpc_client:
        call = GenerateCall(
            QWEN, prompt, max_tokens=10, temperature=0, ignore_eos=True, truncate_prompt_tokens=keep
        )
        result = await grpc_client.generate(call)
    assert result.text == expected and result.metrics.prompt_tokens == keep
    # A chat: its rendered prompt's last tokens, the template's start gone.
    chat = await asyncio.to_thread(
        lambda: client.chat.completions.create(
            model=QWEN,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=2,
            extra_body={"truncate_prompt_tokens": keep},
        )
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == keep
    # -1: as many as the context holds beside one generated token.
    words = "word " * (N_CTX + 10)
    whole = await asyncio.to_thread(
        lambda: client.completions.create(
            model=QWEN, prompt=words, max_tokens=1, extra_body={"truncate_prompt_tokens": -1}
        )
    )
    assert whole.usage is not None and whole.usage.prompt_tokens == N_CTX - 1

    def refused(**fields: Any) -> Any:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=QWEN, prompt="hi", max_tokens=1, **fields)
        return bad.value.body

    for value in (0, -2, N_CTX + 1, "8", True):
        body = await asyncio.to_thread(refused, extra_body={"truncate_prompt_tokens": value})
        assert body["param"] == "truncate_prompt_tokens", body
    body = await asyncio.to_thread(refused, echo=True, extra_body={"truncate_prompt_tokens": 4})
    assert body["param"] == "truncate_prompt_tokens", body


async def test_a_suffix_on_a_model_without_fim_tokens_is_refused_naming_it(mesh: Mesh) -> None:
    """SmolLM2's vocabulary has no fill-in-the-middle tokens: a suffix is a 400 naming it
    on both doors (INVALID_ARGUMENT on gRPC), and /api/show does not list "insert"
    (tests/test_fill_in_the_middle.py fills in on a model that has them)."""
    client = ollama.Client(host=http_url(mesh))
    with pytest.raises(ollama.ResponseError) as bad:
        await asyncio.to_thread(client.generate, model=QWEN, prompt="def f(", suffix="):")
    assert bad.value.status_code == 400, bad.value.error
    # The router knows it from the nodes' model facts, and asks no node.
    assert bad.value.error.startswith(f"suffix: {QWEN!r} does not support insert"), bad.value.error
    assert "insert" not in (client.show(QWEN).capabilities or [])
    with pytest.raises(openai.BadRequestError) as refused:
        await asyncio.to_thread(
            lambda: openai_client(mesh).completions.create(
                model=QWEN, prompt="def f(", suffix="):", max_tokens=1
            )
        )
    assert refused.value.body["param"] == "suffix", refused.value.body  # type: ignore[index]
    async with AsyncMeshClient(mesh.router_address) as grpc_client:
        with pytest.raises(InvalidRequest, match=r"suffix: .* does not support insert"):
            await grpc_client.generate(GenerateCall(QWEN, "def f(", suffix="):", max_tokens=1))


def test_openai_models_and_errors(mesh: Mesh) -> None:
    client = openai_client(mesh)
    assert {QWEN, "gpt-oss:120b"} <= {m.id for m in client.models.list()}
    assert client.models.retrieve(QWEN).id == QWEN
    # vLLM's max_model_len: the context a request gets.
    assert (client.models.retrieve(QWEN).model_extra or {})["max_model_len"] == N_CTX
    with pytest.raises(openai.NotFoundError, match="'no/such:model' is not served here; models"):
        client.models.retrieve("no/such:model")
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=QWEN, messages=[{"role": "user", "content": "hi"}], temperature=3
        )
    assert bad.value.status_code == 400 and "temperature" in str(bad.value)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=QWEN, messages=[])
    with pytest.raises(openai.APIStatusError) as too_large:
        client.chat.completions.create(
            model=QWEN, messages=[{"role": "user", "content": "word " * (4 << 20)}]
        )
    assert too_large.value.status_code == 413
    assert too_large.value.body["param"] == "body", too_large.value.body  # type: ignore[index]
    # A prompt the context cannot hold: OpenAI's own code for it, naming the messages (a
    # chat) or the prompt (a completion), and the tokens and the context.
    words = "word " * (N_CTX + 10)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=QWEN, messages=[{"role": "user", "content": words}])
    with pytest.raises(openai.BadRequestError) as too_long_text:
        client.completions.create(model=QWEN, prompt=words)
    for refused, param in ((too_long, "messages"), (too_long_text, "prompt")):
        body: Any = refused.value.body
        assert (body["code"], body["param"]) == ("context_length_exceeded", param), body
        assert f"a context of {N_CTX} must hold it" in body["message"], body
    # Only an assistant's message may go without content (its calls alone), as OpenAI's API.
    for message, param in (
        ({"role": "user", "content": None}, "messages[0].content"),
        ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0].text"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[0].content[0].text"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=QWEN, messages=[message])  # type: ignore[list-item]
        assert bad.value.body["param"] == param, bad.value.body  # type: ignore[index]
    hi: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    # A stream's options without a stream, as OpenAI's API and vLLM refuse them.
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=QWEN, messages=hi, max_tokens=1, stream_options={"include_usage": True}
        )
    assert bad.value.body["param"] == "stream_options", bad.value.body  # type: ignore[index]
    # What the mesh does not apply is refused, naming the field, never silently ignored;
    # the defaults that some clients send unasked are accepted.
    unapplied: list[tuple[str, object]] = [
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("web_search_options", {"search_context_size": "low"}),
    ]
    for field, value in unapplied:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=QWEN, messages=hi, extra_body={field: value})
        assert bad.value.status_code == 400, field
        assert bad.value.body["param"] == field, bad.value.body  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=QWEN, prompt="hi", best_of=2)
    defaults = client.chat.completions.create(
        model=QWEN,
        messages=hi,
        max_tokens=2,
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
        modalities=["text"],
    )
    assert defaults.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )


def test_a_path_the_mesh_does_not_serve_is_a_json_error_naming_it(mesh: Mesh) -> None:
    """Embeddings, pulls and a stored response: the real clients get their API's own
    error, naming the path, why, and what is served; a wrong method names the right one."""
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=http_url(mesh)).embed(model=QWEN, input="hi")
    assert info.value.status_code == 404
    assert "POST /api/embed" in info.value.error and "no embeddings" in info.value.error
    assert "POST /api/chat" in info.value.error and "/api/dashboard" not in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=http_url(mesh)).pull(QWEN)
    assert info.value.status_code == 404 and "topology lists the models" in info.value.error
    client = openai_client(mesh)
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model=QWEN, input="hi")
    assert "POST /v1/embeddings" in missing.value.message
    assert "POST /v1/chat/completions" in missing.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve("resp_1")
    assert "GET /v1/responses/resp_1" in missing.value.message
    assert "keeps no responses" in missing.value.message
    assert "POST /v1/responses" in missing.value.message
    wrong = httpx.get(f"{http_url(mesh)}/v1/chat/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.headers["Allow"] == "POST"
    assert wrong.json()["error"]["code"] == "unimplemented"
    assert wrong.json()["error"]["message"].endswith("the method is not allowed here; use POST")
    assert (
        httpx.get(f"{http_url(mesh)}/nowhere", timeout=10)
        .json()["error"]
        .startswith("this mesh does not serve GET /nowhere; it serves")
    )
    router = mesh.topology.router
    counted = httpx.get(f"http://{router.host}:{router.metrics_port}/metrics", timeout=10).text
    assert 'disagg_http_requests_total{api="openai",path="unserved",status="404"}' in counted


# -- max_tokens optional, over gRPC too --------------------------------------------------------


async def test_max_tokens_is_optional_on_grpc(mesh: Mesh) -> None:
    from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc, types_pb2

    async with grpc.aio.insecure_channel(mesh.router_address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        request = router_pb2.GenerateRequest(
            model=QWEN,
            prompt=PROMPT,
            sampling=types_pb2.SamplingParams(temperature=0, stop=["."]),
        )
        assert not request.sampling.HasField("max_tokens")
        text, summary = "", None
        async for reply in stub.Generate(request):
            if reply.HasField("delta"):
                text += reply.delta.text
            else:
                summary = reply.summary
    assert summary is not None and summary.finish_reason == types_pb2.FINISH_REASON_STOP
    assert 0 < summary.completion_tokens < 4096 and "." not in text


# -- disconnects -------------------------------------------------------------------------------


async def busy_slots(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = node_pb2_grpc.NodeServiceStub(channel)
        info = await stub.GetNodeInfo(node_pb2.GetNodeInfoRequest())
        return int(info.slots_busy)


async def test_a_client_that_disconnects_frees_the_decode_node(
    mesh: Mesh, reference_llm: llama_cpp.Llama
) -> None:
    decode = mesh.address("decode-qwen")
    long_prompt = prompt_running(reference_llm, 64)
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream(
            "POST",
            f"{http_url(mesh)}/api/generate",
            json={
                "model": QWEN,
                "prompt": long_prompt,
                "raw": True,
                "options": {"temperature": 0, "num_predict": 2000},
            },
        ) as response:
            lines = response.aiter_lines()
            for _ in range(3):
                assert not json.loads(await anext(lines))["done"]
            assert await busy_slots(decode) == 1
        # The connection is closed here, mid-answer.
    for _ in range(100):
        if await busy_slots(decode) == 0:
            break
        await asyncio.sleep(0.05)
    assert await busy_slots(decode) == 0
    started = asyncio.get_running_loop().time()
    got = await ollama.AsyncClient(host=http_url(mesh)).generate(
        model=QWEN, prompt=long_prompt, raw=True, options={"temperature": 0, "num_predict": 4}
    )
    assert got.eval_count == 4 and asyncio.get_running_loop().time() - started < 10


# -- a token, and the grader unchanged ---------------------------------------------------------


@pytest.fixture(scope="module")
def token_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    os.environ["DISAGG_TEST_HTTP_TOKEN"] = "s3cret"
    folder = tmp_path_factory.mktemp("http-token")
    from disagg_mesh.server.common.runtime.processes import free_port

    port = free_port()
    parts = [
        '[security]\ntoken_env = "DISAGG_TEST_HTTP_TOKEN"\n',
        router_node(http_port=port, http_origins=[GRADER_PAGE]),
        engine_node("decode-t", "decode", 1, slots=2),
        route("t", [], ["decode-t"], chain=["decode_only"]),
    ]
    with running_mesh(folder, parts):
        yield f"http://127.0.0.1:{port}"


GRADER_PAGE = "https://grader.example.edu"


@pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="no chromium: `make test` installs Debian's (apt-get install chromium)",
)
def test_a_page_of_this_machine_streams_from_the_doors_in_a_real_browser(
    token_mesh: str,
) -> None:
    """Chromium itself, on a page of another origin of this machine (a dev server's), calls
    the OpenAI door with the token (a preflight first) and reads the streamed answer; a page
    of an origin neither Ollama's list nor the topology names (served from this machine
    too, under another name) is refused at the preflight, and cannot call the door."""
    from playwright.sync_api import sync_playwright

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", "13")
            self.end_headers()
            self.wfile.write(b"<html></html>")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    pages = HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=pages.serve_forever, daemon=True).start()
    call = f"""async () => {{
        const reply = await fetch("{token_mesh}/v1/chat/completions", {{
            method: "POST",
            headers: {{"Authorization": "Bearer s3cret", "Content-Type": "application/json"}},
            body: JSON.stringify({{model: "t", messages: [{{role: "user", content: "hi"}}],
                                   max_tokens: 3, stream: true}}),
        }});
        return [reply.status, await reply.text()];
    }}"""
    rules = "--host-resolver-rules=MAP elsewhere.test 127.0.0.1"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=shutil.which("chromium"), args=["--no-sandbox", rules]
            )
            try:
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{pages.server_port}/")
                status, text = page.evaluate(call)
                assert status == 200 and text.rstrip().endswith("data: [DONE]"), text
                page.goto(f"http://elsewhere.test:{pages.server_port}/")
                with pytest.raises(Exception, match="Failed to fetch"):
                    page.evaluate(call)
            finally:
                browser.close()
    finally:
        pages.shutdown()


def test_origin_patterns_match_whole_origins() -> None:
    """Ollama's patterns: "*" stands for anything, the rest must match exactly; a door on
    a loopback address serves requests naming this machine only, as Ollama's."""
    origins = BrowserOrigins(["https://*.example.edu"])
    for allowed in ("https://grader.example.edu", "http://localhost:8080", "file://"):
        assert origins.allows(allowed), allowed
    for refused in ("https://example.edu.evil.com", "http://localhost.evil.com", "null"):
        assert not origins.allows(refused), refused
    assert BrowserOrigins(["*"]).allows("https://anywhere.example.com")
    for host in ("127.0.0.1:11435", "localhost", "[::1]:80", "10.1.2.3", "mac.local", "x.internal"):
        assert local_host(host), host
    assert local_host(f"{socket.gethostname()}:11435")
    for host in ("attacker.example.com:11435", "8.8.8.8", "localhost.evil.com"):
        assert not local_host(host), host


def test_browser_pages_may_call_the_doors_as_ollama_allows_them(token_mesh: str) -> None:
    """CORS as Ollama's: this machine's pages (any port), editors' and apps' webviews,
    browser extensions and the topology's http_origins get the headers, a preflight
    answered before the token is asked for, a stream's headers too; any other page is
    refused 403 before its request is read; no Origin, no browser; a request naming
    another host than this machine is refused."""
    auth = {"Authorization": "Bearer s3cret"}
    ask = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    pages = (
        "http://localhost:5173",
        "http://127.0.0.1",
        "vscode-webview://x1",
        "chrome-extension://ab",
        GRADER_PAGE,
        token_mesh,
    )
    with httpx.Client(base_url=token_mesh, timeout=60) as client:
        for origin in pages:
            for path in ("/v1/chat/completions", "/api/chat"):
                preflight = client.options(path, headers={"Origin": origin, **ask})
                assert preflight.status_code == 204, (origin, path, preflight.text)
                assert preflight.headers["access-control-allow-origin"] == origin
                assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        body = {"model": "t", "prompt": PROMPT, "raw": True, "options": {"num_predict": 2}}
        page = {**auth, "Origin": "http://localhost:5173"}
        with client.stream("POST", "/api/generate", json=body, headers=page) as streamed:
            assert streamed.status_code == 200
            assert streamed.headers["access-control-allow-origin"] == "http://localhost:5173"
            assert b'"done": true' in streamed.read()
        listed = client.get("/v1/models", headers={**auth, "Origin": GRADER_PAGE})
        assert listed.status_code == 200
        assert listed.headers["access-control-allow-origin"] == GRADER_PAGE
        foreign = {**auth, "Origin": "https://elsewhere.example.com"}
        refused = client.post("/api/generate", json=body, headers=foreign)
        assert refused.status_code == 403 and "http_origins" in refused.json()["error"]
        refused = client.post("/v1/completions", json=body, headers=foreign)
        assert refused.status_code == 403
        assert refused.json()["error"]["type"] == "permission_error"
        plain = client.get("/v1/models", headers=auth)
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
        # The door listens on 127.0.0.1: a request naming another host is a page whose name
        # was pointed at this machine (DNS rebinding), refused as Ollama refuses it.
        rebound = client.get("/api/tags", headers={**auth, "Host": "rebound.example.com"})
        assert rebound.status_code == 403 and "listen_host" in rebound.json()["error"]
    # An HTTP/1.0 caller may send no Host at all: not refused, as in Ollama.
    port = int(token_mesh.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(b"GET /api/version HTTP/1.0\r\nAuthorization: Bearer s3cret\r\n\r\n")
        assert b" 200 " in raw.recv(256).split(b"\r\n", 1)[0]


def test_a_missing_or_wrong_token_is_401_on_both_apis(token_mesh: str) -> None:
    for key in ("", "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(
            f"{token_mesh}/api/generate",
            json={"model": "t", "prompt": "hi"},
            headers=headers,
            timeout=10,
        )
        assert r.status_code == 401 and "token" in r.json()["error"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"{token_mesh}/v1", api_key=key or "x", max_retries=0
            ).models.list()
    good = ollama.Client(host=token_mesh, headers={"Authorization": "Bearer s3cret"})
    assert good.generate(model="t", prompt=PROMPT, raw=True, options={"num_predict": 2}).done
    models = openai.OpenAI(base_url=f"{token_mesh}/v1", api_key="s3cret").models.list()
    assert [m.id for m in models] == ["t"]


@pytest.fixture(scope="module")
def grader_door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The grader's two models on one thread each: the session mesh's two-thread nodes
    oversubscribe 2 cores when both generate at once, which slows llama.cpp's spinning
    threads many times over."""
    from disagg_mesh.server.common.runtime.processes import free_port

    port = free_port()
    parts = [
        router_node(http_port=port),
        engine_node("decode-code", "decode", 1, slots=2),
        engine_node("decode-feedback", "decode", 1, slots=2),
        route(QWEN, [], ["decode-code"], chain=["decode_only"]),
        route("gpt-oss:120b", [], ["decode-feedback"], chain=["decode_only"]),
    ]
    with running_mesh(tmp_path_factory.mktemp("grader"), parts):
        yield f"http://127.0.0.1:{port}"


def test_the_grader_works_unchanged_against_the_ollama_door(grader_door: str) -> None:
    """examples/ollama_grader.py is the grader's own Ollama code; only the host changes."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples/ollama_grader.py"), "--host", grader_door],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== code analysis (qwen3-coder:30b)\n" in done.stdout
    assert "== written feedback (gpt-oss:120b)\n" in done.stdout
    assert done.stdout.count(" generated at ") == 2


# -- Any field, any value ------------------------------------------------------------------

ODD_VALUES: list[Any] = [None, True, -1, 2**63, -(2**63), 1.5, "x", [], {}, [1], {"a": 1}]
OPENAI_FIELDS = {
    "/v1/chat/completions": (
        "messages max_tokens max_completion_tokens temperature top_p top_k min_p n stop seed "
        "stream logprobs top_logprobs logit_bias frequency_penalty presence_penalty "
        "repetition_penalty repeat_last_n response_format tools tool_choice "
        "parallel_tool_calls stream_options reasoning_effort ignore_eos modalities"
    ),
    "/v1/completions": "prompt max_tokens temperature n stop seed logprobs logit_bias echo",
    "/v1/responses": (
        "input instructions max_output_tokens temperature top_p stream tools tool_choice "
        "parallel_tool_calls text reasoning truncation include metadata store background "
        "previous_response_id conversation top_logprobs"
    ),
}
OLLAMA_FIELDS = "prompt messages format options keep_alive think logprobs top_logprobs raw context"
OLLAMA_OPTIONS = (
    "num_predict temperature top_p top_k min_p seed stop num_ctx repeat_penalty "
    "frequency_penalty presence_penalty repeat_last_n"
)


def test_odd_values_in_any_field_are_answered_never_a_500(mesh: Mesh) -> None:
    """Every field of both doors (/v1/responses too) given values of every JSON kind (and
    integers beyond int64): each request is served or refused with a 4xx and an error body
    in JSON, never a 500 (integers beyond a proto field's int32 were one: top_k,
    repeat_last_n). One token each, so the sweep stays short: a field that bounds the
    answer (max_tokens, options, num_predict) is not given a value that lifts the bound
    (absent, -1, no options)."""

    def values(name: str) -> list[Any]:
        bounds = ("max_tokens", "max_completion_tokens", "max_output_tokens", "options")
        if name not in (*bounds, "num_predict"):
            return ODD_VALUES
        return [v for v in ODD_VALUES if v not in (None, -1, {})]

    openai_bases: dict[str, dict[str, Any]] = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
        "/v1/completions": {"prompt": "Hi"},
        "/v1/responses": {"input": "Hi"},
    }
    cases = []
    for path, base in openai_bases.items():
        bound = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
        base = {"model": QWEN, **base, bound: 1}
        for name in OPENAI_FIELDS[path].split():
            cases += [(path, {**base, name: v}) for v in values(name)]
    for path, text in (("/api/generate", "prompt"), ("/api/chat", "messages")):
        base = {
            "model": QWEN,
            "prompt": "Hi",
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": False,
            "options": {"num_predict": 1},
        }
        base.pop("messages" if text == "prompt" else "prompt")
        for name in OLLAMA_FIELDS.split():
            cases += [(path, {**base, name: v}) for v in values(name)]
        for name in OLLAMA_OPTIONS.split():
            options = [{"num_predict": 1, name: v} for v in values(name)]
            cases += [(path, {**base, "options": o}) for o in options]
    failures = []
    with httpx.Client(base_url=http_url(mesh), timeout=60) as client:
        for path, body in cases:
            reply = client.post(path, json=body)
            if reply.status_code >= 500:
                failures.append((path, body, reply.status_code, reply.text[:200]))
            elif reply.status_code >= 400 and "error" not in reply.json():
                failures.append((path, body, reply.status_code, reply.text[:200]))
    assert not failures, failures[:5]
    # JSON's 1e999 is an infinite float to Python's parser (no client sends it; a raw body
    # can): refused, naming the field, not sampled with.
    with httpx.Client(base_url=http_url(mesh), timeout=60) as client:
        for option in ("temperature", "repeat_penalty"):
            raw = f'{{"model": "{QWEN}", "prompt": "Hi", "options": {{"{option}": 1e999}}}}'
            reply = client.post("/api/generate", content=raw)
            assert reply.status_code == 400 and f"options.{option}:" in reply.json()["error"]
