"""Fill in the middle: Ollama's `suffix` on /api/generate, OpenAI's on /v1/completions,
gRPC's GenerateRequest.suffix, on a model whose vocabulary has FIM tokens: a tiny random
qwen3moe with Qwen3-Coder's vocabulary and chat template, in which llama.cpp finds
<|fim_prefix|>, <|fim_suffix|> and <|fim_middle|> as it does in the real model's file.

The reference is this process's greedy llama.cpp from the prompt Ollama's Qwen coder
templates write (`<|fim_prefix|>{{ .Prompt }}<|fim_suffix|>{{ .Suffix }}<|fim_middle|>`),
through a prefill node and a decode node (the state handed over) and a decode node alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import llama_cpp
import ollama
import openai
import pytest

from disagg_mesh import GenerateCall, MeshClient
from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc, types_pb2
from disagg_mesh.server.common.engines.llama_cpp.model import LlamaModel
from disagg_mesh.server.common.errors import InvalidArgument
from disagg_mesh.server.common.models import resolve_model_path
from disagg_mesh.server.common.runtime.processes import free_port
from disagg_mesh.server.common.types import Prompt
from tests.conftest import MODEL as SMOLLM2
from tests.conftest import N_CTX, ROOT, engine_node, route, router_node, running_mesh
from tests.streams import reference_tokens
from tests.test_client import disagg
from tests.tiny_models import llama_cpp_template, write_qwen3moe

SPLIT = "test/coder"  # a prefill node, then the state handed to a decode node
ALONE = "test/coder-decode-only"
PREFIX = "def mean(values):\n    total = sum(values)\n    "
SUFFIX = "\n    return result\n\n\nprint(mean([1, 2, 3]))\n"
MAX_TOKENS = 12


@dataclass(frozen=True)
class CoderMesh:
    url: str  # the HTTP doors
    router: str  # gRPC
    llm: llama_cpp.Llama  # the reference


@pytest.fixture(scope="module")
def coder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoderMesh]:
    folder = tmp_path_factory.mktemp("fim")
    path = write_qwen3moe(
        folder / "tiny-coder.gguf", llama_cpp_template("Qwen3-Coder"), vocabulary="qwen"
    )
    parts = [
        router_node(http_port=free_port()),
        engine_node("prefill", "prefill", 1, model=str(path)),
        engine_node("decode", "decode", 1, model=str(path)),
        route(SPLIT, ["prefill"], ["decode"], chain=["disaggregated"]),
        route(ALONE, [], ["decode"], chain=["decode_only"]),
    ]
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=N_CTX, n_threads=1, n_batch=512, flash_attn=True, verbose=False
    )
    with running_mesh(folder, parts) as processes:
        router = processes.topology.router
        yield CoderMesh(f"http://{router.host}:{router.http_port}", router.address, llm)
    llm.close()


def fim_ids(llm: llama_cpp.Llama, prefix: str, suffix: str) -> list[int]:
    """The prompt as Ollama's Qwen coder templates write it, the code tokenized as text."""

    def special(text: str) -> list[int]:
        (token,) = llm.tokenize(text.encode(), add_bos=False, special=True)
        return [token]

    def code(text: str) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=False, special=False)

    return [
        *special("<|fim_prefix|>"),
        *code(prefix),
        *special("<|fim_suffix|>"),
        *code(suffix),
        *special("<|fim_middle|>"),
    ]


def expected(llm: llama_cpp.Llama, prefix: str = PREFIX, suffix: str = SUFFIX) -> str:
    ids = fim_ids(llm, prefix, suffix)
    return llm.detokenize(reference_tokens(llm, ids, MAX_TOKENS)).decode()


@pytest.mark.parametrize("model", [SPLIT, ALONE])
def test_the_ollama_door_fills_in_the_middle_as_ollamas_coder_templates(
    coder: CoderMesh, model: str
) -> None:
    """The `ollama` client's generate with a suffix: the text between, greedy, as this
    process makes it from the FIM prompt, whole and streamed; prompt_eval_count counts the
    FIM tokens; /api/show lists "insert" (Ollama's name for it)."""
    want = expected(coder.llm)
    client = ollama.Client(host=coder.url)
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    whole = client.generate(model=model, prompt=PREFIX, suffix=SUFFIX, options=options)
    assert whole.response == want
    assert whole.prompt_eval_count == len(fim_ids(coder.llm, PREFIX, SUFFIX))
    pieces = client.generate(
        model=model, prompt=PREFIX, suffix=SUFFIX, options=options, stream=True
    )
    assert "".join(p.response or "" for p in pieces) == want
    # A code file's text that spells a FIM token stays text, as llama-server's /infill.
    tricky = PREFIX + "# <|fim_middle|>\n    "
    spelled = client.generate(model=model, prompt=tricky, suffix=SUFFIX, options=options)
    assert spelled.response == expected(coder.llm, tricky)
    assert spelled.prompt_eval_count == len(fim_ids(coder.llm, tricky, SUFFIX))
    shown = client.show(model)
    assert "insert" in (shown.capabilities or [])
    # Its template's fill-in-the-middle branch, which editors' plugins (Continue) look for,
    # is the framing the node evaluates.
    template = shown.template or ""
    assert template.startswith("{{ if .Suffix }}"), template
    frame = template.removeprefix("{{ if .Suffix }}").split("{{ else if .System }}")[0]
    framed = frame.replace("{{ .Prompt }}", PREFIX).replace("{{ .Suffix }}", SUFFIX)
    tokens = coder.llm.tokenize(framed.encode(), add_bos=False, special=True)
    assert tokens == fim_ids(coder.llm, PREFIX, SUFFIX)


def test_openai_completions_and_grpc_fill_in_the_middle(coder: CoderMesh) -> None:
    """OpenAI's legacy completions' `suffix` and gRPC's, the same text; an empty prompt
    (the gap at the file's start) on gRPC."""
    want = expected(coder.llm)
    client = openai.OpenAI(base_url=f"{coder.url}/v1", api_key="x", max_retries=0)
    got = client.completions.create(
        model=SPLIT, prompt=PREFIX, suffix=SUFFIX, max_tokens=MAX_TOKENS, temperature=0
    )
    assert got.choices[0].text == want
    assert got.usage is not None
    assert got.usage.prompt_tokens == len(fim_ids(coder.llm, PREFIX, SUFFIX))
    with MeshClient(coder.router) as mesh:
        for model in (SPLIT, ALONE):
            call = GenerateCall(model, PREFIX, suffix=SUFFIX, max_tokens=MAX_TOKENS, temperature=0)
            assert mesh.generate(call).text == want
        at_start = GenerateCall(SPLIT, "", suffix=SUFFIX, max_tokens=MAX_TOKENS, temperature=0)
        assert mesh.generate(at_start).text == expected(coder.llm, "")
    # The CLI's --suffix: the text on stdout, the metrics on stderr.
    greedy = ["--temperature", "0", "--max-tokens", str(MAX_TOKENS)]
    out = disagg(
        "--router",
        coder.router,
        "generate",
        "-m",
        SPLIT,
        *greedy,
        "--suffix",
        SUFFIX,
        "-",
        stdin=PREFIX,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"
    both = disagg(
        "--router", coder.router, "generate", "-m", SPLIT, "--chat", "--suffix", "x", "hi"
    )
    assert both.returncode == 2 and "--suffix" in both.stderr and "Traceback" not in both.stderr


def test_what_a_suffix_cannot_go_with_is_refused_naming_it(coder: CoderMesh) -> None:
    """raw (Ollama would drop the suffix), system (Ollama would drop it), echo and
    truncate_prompt_tokens on OpenAI's door: 400s naming suffix. A suffix that is not text
    too. Nothing reaches a node."""
    client = ollama.Client(host=coder.url)
    for extra in ({"raw": True}, {"system": "You complete code."}):
        with pytest.raises(ollama.ResponseError) as bad:
            client.generate(model=SPLIT, prompt=PREFIX, suffix=SUFFIX, **extra)
        assert bad.value.status_code == 400 and "suffix" in bad.value.error, bad.value.error
        assert next(iter(extra)) in bad.value.error
    reply = httpx.post(
        f"{coder.url}/api/generate", json={"model": SPLIT, "prompt": PREFIX, "suffix": 3}
    )
    assert reply.status_code == 400 and "suffix" in reply.json()["error"], reply.text
    openai_client = openai.OpenAI(base_url=f"{coder.url}/v1", api_key="x", max_retries=0)
    for fields in ({"echo": True}, {"extra_body": {"truncate_prompt_tokens": 4}}):
        with pytest.raises(openai.BadRequestError) as refused:
            openai_client.completions.create(
                model=SPLIT, prompt=PREFIX, suffix=SUFFIX, max_tokens=1, **fields
            )
        body: Any = refused.value.body
        assert body["param"] == "suffix", body


def test_grpc_suffix_with_messages_is_invalid_argument(coder: CoderMesh) -> None:
    """Suffix beside chat messages (a chat has no gap) is INVALID_ARGUMENT naming it."""
    with grpc.insecure_channel(coder.router) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        request = router_pb2.GenerateRequest(
            model=SPLIT,
            messages=[types_pb2.ChatMessage(role="user", content="hi")],
            suffix=SUFFIX,
            sampling=types_pb2.SamplingParams(max_tokens=1),
        )
        with pytest.raises(grpc.RpcError) as failed:
            for _ in stub.Generate(request):
                pass
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (failed.value.details() or "").startswith("suffix"), failed.value.details()


def test_a_model_without_fim_tokens_cannot_insert(coder: CoderMesh) -> None:
    """On the node itself (the router refuses first where the nodes have said so):
    SmolLM2's vocabulary has no FIM tokens, so a suffix is INVALID_ARGUMENT naming it, and
    its facts lack "insert"; the coder's prompt is the FIM framing of its texts."""
    smol = LlamaModel(resolve_model_path(SMOLLM2, ROOT))
    try:
        assert "insert" not in smol.facts.capabilities
        with pytest.raises(InvalidArgument, match="cannot fill in the middle") as refused:
            smol.tokenize(Prompt(text="def f(", suffix="):"), N_CTX)
        assert refused.value.field == "suffix"
    finally:
        smol.close()
    coder_model = LlamaModel(Path(coder.llm.model_path))
    try:
        assert "insert" in coder_model.facts.capabilities
        tokens = coder_model.tokenize(Prompt(text=PREFIX, suffix=SUFFIX), N_CTX)
        assert tokens == fim_ids(coder.llm, PREFIX, SUFFIX)
    finally:
        coder_model.close()
