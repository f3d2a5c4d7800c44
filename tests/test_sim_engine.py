"""The simulated engine (`engine = "sim"`) behind the real router: a DGX Spark prefill node
and a Mac Studio decode node of qwen3-coder:30b, timed by the shipped profiles. Generation,
the KV handoff at its real size, decode_only, continuous batching, a cancelled stream, a
caller's deadline, a migration, a router killed mid-answer, structured output, tool calls
and stop strings (through the OpenAI door) give what real nodes give."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import jsonschema
import ollama
import openai
import pytest

from disagg_mesh.proto.v1 import node_pb2, node_pb2_grpc, router_pb2, router_pb2_grpc, types_pb2
from disagg_mesh.server.common.engines.sim.engine import prompt_tokens
from disagg_mesh.server.common.engines.sim.profile import load_profile
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port
from disagg_mesh.server.common.tools.calls import ToolCall
from disagg_mesh.server.common.types import ChatTurn, Prompt
from tests.conftest import Mesh, node_entry, route, router_node, running_mesh
from tests.streams import collect

MODEL = "qwen3-coder:30b"
ALONE = "sim/decode-only"
PROMPT = "Grade this homework: def add(a, b): return a - b. " * 8


def sim_node(name: str, role: str, hardware: str, **extra: object) -> str:
    return node_entry(name, role, "sim", MODEL, hardware=hardware, **extra)


@pytest.fixture(scope="module")
def sim_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    parts = [
        "[mesh]\ncooldown_s = 0.5\nhealth_check_every_s = 0.5\n",
        router_node(http_port=free_port()),
        sim_node("spark", "prefill", "dgx-spark"),
        sim_node("mac-1", "decode", "m3-ultra", slots=4, max_queue=0),
        sim_node("mac-2", "decode", "m3-ultra", slots=4, max_queue=0),
        route(MODEL, ["spark"], ["mac-1", "mac-2"], chain=["disaggregated", "decode_only"]),
        route(ALONE, [], ["mac-1"], chain=["decode_only"]),
    ]
    with running_mesh(tmp_path_factory.mktemp("sim"), parts) as processes:
        yield processes


def generate(model: str, max_tokens: int, prompt: str = PROMPT) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        model=model,
        prompt=prompt,
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


async def once_idle(address: str) -> Any:
    """The node's GetNodeInfo once no slot is busy (or after 5 s)."""
    async with grpc.aio.insecure_channel(address) as channel:
        node: Any = node_pb2_grpc.NodeServiceStub(channel)
        for _ in range(50):
            info = await node.GetNodeInfo(node_pb2.GetNodeInfoRequest())
            if info.slots_busy == 0:
                break
            await asyncio.sleep(0.1)
    return info


async def test_a_sim_mesh_answers_with_the_real_kv_size_and_the_profiles_time(
    sim_mesh: MeshProcesses,
) -> None:
    spark = load_profile("dgx-spark").model(MODEL)
    mac = load_profile("m3-ultra").model(MODEL)
    tokens = prompt_tokens(Prompt(text=PROMPT))
    async with grpc.aio.insecure_channel(sim_mesh.topology.router.address) as channel:
        stub: Any = router_pb2_grpc.RouterServiceStub(channel)
        got = await collect(stub.Generate(generate(MODEL, 24)))
        again = await collect(stub.Generate(generate(MODEL, 24)))
        alone = await collect(stub.Generate(generate(ALONE, 24)))
    s = got.summary
    assert s.method == router_pb2.ROUTE_METHOD_DISAGGREGATED and s.prefill_node == "spark"
    assert s.kv_transfer_bytes == spark.kv_bytes(tokens) == mac.kv_bytes(tokens)
    assert s.prompt_tokens == tokens and s.completion_tokens == 24
    assert 1 < got.deltas <= 24  # steps shorter than MIN_TICK_S come together
    assert got.text == again.text == alone.text  # the same request, the same answer
    assert alone.summary.method == router_pb2.ROUTE_METHOD_DECODE_ONLY
    # A decode node keeps a handed-over prompt's whole blocks, as the embedded engine does:
    # mac-1 serves the prompt alone from them if it had the first request.
    kept = tokens // 64 * 64 if s.decode_node == "mac-1" else 0
    assert alone.summary.cached_prompt_tokens == kept
    # The profiles' time: the prefill on the Spark (in passes of its n_ubatch, 512 by
    # default), 23 steps of one stream on the Mac.
    prefill_s = s.prefill_duration.ToTimedelta().total_seconds()
    assert prefill_s == pytest.approx(spark.prefill_seconds(tokens, ubatch=512), rel=1e-3)
    decode_s = s.decode_duration.ToTimedelta().total_seconds()
    assert decode_s >= 23 * mac.decode_step_seconds(1, tokens) * 0.9


async def test_a_prefix_the_decode_node_holds_moves_once(sim_mesh: MeshProcesses) -> None:
    """The delta transfer, as the embedded engine does it: a second prompt starting with the
    first's rubric goes to the decode node that kept the rubric, and only the rest of its
    state moves; that node restarted (its cache gone), the router's belief is stale: ABORTED,
    and the whole state goes again."""
    mac = load_profile("m3-ultra").model(MODEL)
    rubric = "Rubric: correctness first, then style, then the tests it brings. " * 24
    texts = [rubric + f"Submission {i}: def add(a, b): return a + {i}\n" for i in range(3)]
    async with grpc.aio.insecure_channel(sim_mesh.topology.router.address) as channel:
        stub: Any = router_pb2_grpc.RouterServiceStub(channel)
        first = (await collect(stub.Generate(generate(MODEL, 8, texts[0])))).summary
        second = (await collect(stub.Generate(generate(MODEL, 8, texts[1])))).summary
        holder = second.decode_node
        assert holder == first.decode_node and not second.failed_attempts
        held = second.decode_cached_prompt_tokens
        tokens = prompt_tokens(Prompt(text=texts[1]))
        assert held == len(rubric) // 4 // 64 * 64 > 0  # the rubric's whole blocks
        assert second.kv_state_bytes == mac.kv_bytes(tokens)
        assert second.kv_transfer_bytes == mac.kv_bytes(tokens - held)
        os.kill(sim_mesh.procs[holder].pid, signal.SIGKILL)
        sim_mesh.procs[holder].wait()
        await sim_mesh.restart_node(holder, 60)
        third = (await collect(stub.Generate(generate(MODEL, 8, texts[2])))).summary
    (aborted,) = third.failed_attempts
    assert (aborted.code, aborted.node) == ("ABORTED", holder)
    assert f"no longer holds the prompt's first {held} tokens" in aborted.message
    tokens = prompt_tokens(Prompt(text=texts[2]))
    assert third.kv_transfer_bytes == mac.kv_bytes(tokens) and not third.decode_cached_prompt_tokens


async def test_streams_on_one_node_decode_together(sim_mesh: MeshProcesses) -> None:
    """Four streams on one simulated Mac share its steps (continuous batching: together in
    well under four times one alone, as the profile's batch rates say). The node's busy
    time counts its slots' time as they were held."""
    mac = sim_mesh.topology.node("mac-1").address
    before = await once_idle(mac)
    async with grpc.aio.insecure_channel(sim_mesh.topology.router.address) as channel:
        stub: Any = router_pb2_grpc.RouterServiceStub(channel)
        started = asyncio.get_running_loop().time()
        alone = await collect(stub.Generate(generate(ALONE, 40)))
        one = asyncio.get_running_loop().time() - started
        started = asyncio.get_running_loop().time()
        four = await asyncio.gather(
            *(collect(stub.Generate(generate(ALONE, 40, f"{PROMPT} {i}"))) for i in range(4))
        )
        together = asyncio.get_running_loop().time() - started
    assert all(g.summary.completion_tokens == 40 for g in four)
    assert together < 2.5 * one, (together, one)
    after = await once_idle(mac)
    busy = after.busy_seconds - before.busy_seconds
    slot_busy = after.slot_busy_seconds - before.slot_busy_seconds

    def decode_s(got: Any) -> float:
        return float(got.summary.decode_duration.ToTimedelta().total_seconds())

    # Each stream held its slot at least while it decoded (speedup 1: simulated = real);
    # the lone one and the four came one after the other; 4 slots at most at once.
    assert decode_s(alone) + max(map(decode_s, four)) <= busy <= one + together
    assert decode_s(alone) + sum(map(decode_s, four)) <= slot_busy <= 4 * busy


async def test_a_cancelled_stream_frees_its_slot(sim_mesh: MeshProcesses) -> None:
    address = sim_mesh.topology.node("mac-1").address
    async with grpc.aio.insecure_channel(sim_mesh.topology.router.address) as channel:
        stub: Any = router_pb2_grpc.RouterServiceStub(channel)
        call = stub.Generate(generate(ALONE, 400))
        async for _ in call:
            break
        call.cancel()
    info = await once_idle(address)
    assert info.slots_busy == 0 and info.backend == "sim (m3-ultra)"
    assert info.gpu_layers == info.model_layers == 49


async def test_a_killed_sim_decode_node_is_replaced_mid_answer(sim_mesh: MeshProcesses) -> None:
    """The answer goes on on the other Mac: the same text as uninterrupted, once."""
    async with grpc.aio.insecure_channel(sim_mesh.topology.router.address) as channel:
        stub: Any = router_pb2_grpc.RouterServiceStub(channel)
        whole = await collect(stub.Generate(generate(MODEL, 120)))
        text, summary = "", None
        killed = ""
        async for reply in stub.Generate(generate(MODEL, 120)):
            if reply.HasField("summary"):
                summary = reply.summary
                continue
            text += reply.delta.text
            if not killed and len(text.split()) >= 10:
                killed = "mac-1" if whole.summary.decode_node == "mac-1" else "mac-2"
                os.kill(sim_mesh.procs[killed].pid, signal.SIGKILL)
    assert summary is not None and text == whole.text
    assert [m.failed_node for m in summary.migrations] == [killed]
    await sim_mesh.restart_node(killed, 60)


async def test_a_stopped_node_ends_its_health_streams_and_stops_at_once(
    sim_mesh: MeshProcesses,
) -> None:
    """SIGTERM: the node's last word on the router's health stream is NOT_SERVING and the
    stream ends, so the stop does not wait out its grace period (10 s) for it."""
    router = sim_mesh.topology.router.name
    mark = len(sim_mesh.log_lines(router))
    started = time.monotonic()
    assert sim_mesh.stop_node("mac-2") == 0
    assert time.monotonic() - started < 5
    await asyncio.sleep(0.5)
    seen = sim_mesh.log_lines(router)[mark:]
    assert any('"node": "mac-2"' in line and '"serving": false' in line for line in seen)
    await sim_mesh.restart_node("mac-2", 60)


async def test_a_callers_deadline_ends_the_call_and_frees_the_slot(
    sim_mesh: MeshProcesses,
) -> None:
    """The caller's own deadline: DEADLINE_EXCEEDED, and the sim node's slot comes back."""
    async with grpc.aio.insecure_channel(sim_mesh.topology.router.address) as channel:
        stub: Any = router_pb2_grpc.RouterServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await collect(stub.Generate(generate(ALONE, 400), timeout=1.0))
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    info = await once_idle(sim_mesh.topology.node("mac-1").address)
    assert info.slots_busy == 0


def test_a_router_killed_mid_answer_costs_nothing_over_sim_nodes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two routers over sim nodes sharing one process; the client's router SIGKILLed
    mid-answer: the answer goes on through the other, the same text as uninterrupted."""
    from disagg_mesh import AsyncMeshClient, GenerateCall, Metrics

    parts = [
        router_node().replace('name = "router"', 'name = "router-a"'),
        router_node().replace('name = "router"', 'name = "router-b"'),
        sim_node("spark", "prefill", "dgx-spark"),
        sim_node("mac", "decode", "m3-ultra"),
        route(MODEL, ["spark"], ["mac"]),
    ]
    with running_mesh(tmp_path_factory.mktemp("sim-routers"), parts) as mesh:
        addresses = [r.address for r in mesh.topology.routers]
        call = GenerateCall(model=MODEL, prompt=PROMPT, max_tokens=150, ignore_eos=True)

        async def run(kill: bool) -> tuple[str, Metrics | None]:
            text, metrics = "", None
            async with AsyncMeshClient(addresses, timeout=60) as client:
                async for item in client.stream(call):
                    if isinstance(item, Metrics):
                        metrics = item
                        continue
                    text += str(item)
                    if kill and len(text.split()) >= 20 and mesh.procs["router-a"].poll() is None:
                        mesh.procs["router-a"].kill()
            return text, metrics

        whole, _ = asyncio.run(run(kill=False))
        text, metrics = asyncio.run(run(kill=True))
        killed = mesh.procs["router-a"].poll() is not None
    assert killed  # the client's first router died under it
    assert text == whole and metrics is not None and metrics.completion_tokens == 150


GRADE = {
    "type": "object",
    "properties": {
        "score": {"type": "integer", "minimum": 0, "maximum": 4},
        "feedback": {"type": "string"},
        "issues": {"type": "array", "items": {"type": "string", "enum": ["naming", "tests"]}},
    },
    "required": ["score", "feedback", "issues"],
}
RUN_TESTS = {
    "type": "function",
    "function": {
        "name": "run_tests",
        "description": "Run the submission's tests",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "timeout_s": {"type": "integer"}},
            "required": ["path"],
        },
    },
}


def openai_client(mesh: MeshProcesses) -> Any:
    url = f"http://127.0.0.1:{mesh.topology.router.http_port}/v1"
    return openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)


async def streamed_text(client: Any, **request: Any) -> str:
    chunks = await client.chat.completions.create(stream=True, **request)
    return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


async def test_structured_output_is_json_its_schema_allows_on_every_path(
    sim_mesh: MeshProcesses,
) -> None:
    """response_format through the OpenAI door: a value the schema allows, the same whole
    and streamed, disaggregated (prefill node's first token, decode node's rest) and
    decode_only."""
    client = openai_client(sim_mesh)
    messages = [{"role": "user", "content": PROMPT}]
    fmt = {"type": "json_schema", "json_schema": {"name": "grade", "schema": GRADE}}
    answers = []
    for model in (MODEL, ALONE):
        whole = await client.chat.completions.create(
            model=model, messages=messages, response_format=fmt, max_tokens=400
        )
        assert whole.choices[0].finish_reason == "stop"
        answers.append(whole.choices[0].message.content)
        answers.append(
            await streamed_text(
                client, model=model, messages=messages, response_format=fmt, max_tokens=400
            )
        )
    assert len(set(answers)) == 1, answers
    jsonschema.validate(json.loads(answers[0]), GRADE)
    anything = await client.chat.completions.create(
        model=MODEL, messages=messages, response_format={"type": "json_object"}, max_tokens=600
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


async def test_tools_are_called_with_arguments_their_parameters_allow(
    sim_mesh: MeshProcesses,
) -> None:
    """tool_choice required and named: one call of the tool, its arguments JSON the
    function's parameters allow, finish_reason tool_calls; streamed, the same call."""
    client = openai_client(sim_mesh)
    messages = [{"role": "user", "content": f"Run the tests of this: {PROMPT}"}]
    named = {"type": "function", "function": {"name": "run_tests"}}
    for model, choice in ((MODEL, "required"), (ALONE, named)):
        whole = await client.chat.completions.create(
            model=model, messages=messages, tools=[RUN_TESTS], tool_choice=choice, max_tokens=300
        )
        (call,) = whole.choices[0].message.tool_calls
        assert whole.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "run_tests"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, RUN_TESTS["function"]["parameters"])  # type: ignore[index]
        chunks = await client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[RUN_TESTS],
            tool_choice=choice,
            max_tokens=300,
            stream=True,
        )
        pieces = [
            c.choices[0].delta.tool_calls
            async for c in chunks
            if c.choices and c.choices[0].delta.tool_calls
        ]
        streamed = "".join(p[0].function.arguments or "" for p in pieces)
        assert json.loads(streamed) == arguments


async def test_an_answer_ends_at_its_first_stop_string(sim_mesh: MeshProcesses) -> None:
    """The text before the first stop string, finish_reason stop, the tokens up to the one
    that completed it: fewer than the answer without it."""
    client = openai_client(sim_mesh)
    messages = [{"role": "user", "content": PROMPT}]
    free = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60)
    text = free.choices[0].message.content
    stop = " ".join(text.split()[10:12])
    for model in (MODEL, ALONE):
        cut = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=60, stop=[stop, "never said"]
        )
        assert cut.choices[0].message.content == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
        assert cut.usage.completion_tokens < free.usage.completion_tokens
        streamed = await streamed_text(
            client, model=model, messages=messages, max_tokens=60, stop=[stop]
        )
        assert streamed == text[: text.index(stop)]


async def test_a_chat_too_long_is_truncated_on_sim_nodes(
    sim_mesh: MeshProcesses,
) -> None:
    """Ollama's truncation on sim nodes as on real ones: the same answer and prompt size as
    the chat without its first turns; refused with `truncate: false`; and vLLM's."""
    long = "word " * 3000  # ~0.9 of the context a turn, at the profiles' bytes a token
    chat = [
        {"role": "system", "content": "Grade it."},
        {"role": "user", "content": long},
        {"role": "assistant", "content": long},
        {"role": "user", "content": "def add(a, b): return a - b"},
    ]
    url = f"http://127.0.0.1:{sim_mesh.topology.router.http_port}"
    fields = {"model": MODEL, "stream": False, "options": {"num_predict": 12, "temperature": 0}}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        fitted = (await http.post("/api/chat", json={**fields, "messages": chat})).json()
        alone = [chat[0], *chat[2:]]  # one long turn fits: the first goes
        reference = await http.post(
            "/api/chat", json={**fields, "messages": alone, "truncate": False}
        )
        refused = await http.post("/api/chat", json={**fields, "messages": chat, "truncate": False})
    assert fitted["message"] == reference.json()["message"], fitted
    assert fitted["prompt_eval_count"] == reference.json()["prompt_eval_count"]
    assert refused.status_code == 400 and "must hold it" in refused.json()["error"], refused.text
    assert "simulated: " in refused.json()["error"]
    # vLLM's truncate_prompt_tokens on the OpenAI door: the prompt's last tokens alone.
    kept = await openai_client(sim_mesh).chat.completions.create(
        model=MODEL, messages=chat, max_tokens=4, extra_body={"truncate_prompt_tokens": 100}
    )
    assert kept.usage.prompt_tokens == 100


def test_a_chats_oldest_turns_go_first_and_a_call_stays_with_its_result() -> None:
    """Prompt.fitted's rule, with a rendering that counts words: the system messages stay,
    a chat never starts at a tool result, an answer continued keeps the turn before it, and
    the fewest turns are given (to be refused) when nothing fits."""
    call = ToolCall("c1", "run", "{}")

    def words(prompt: Prompt) -> list[str]:
        return " ".join(t.content for t in prompt.messages).split()

    def fitted(turns: list[ChatTurn], limit: int) -> tuple[list[str], int]:
        prompt = Prompt(messages=tuple(turns), truncate_history=True)
        return prompt.fitted(words, lambda w: len(w) <= limit)

    system, user = ChatTurn("system", "s"), ChatTurn("user", "u u u")
    asked = ChatTurn("assistant", "", (call,))
    result = ChatTurn("tool", "r r r", tool_call_id="c1")
    assert fitted([system, user, user, ChatTurn("user", "q")], 5) == (["s", *"u u u q".split()], 1)
    # The tool result is last: its call stays with it, whatever it costs.
    assert fitted([system, user, asked, result], 4) == (["s", "r", "r", "r"], 1)
    assert fitted([system, user, asked, result], 3) == (["s", "r", "r", "r"], 1)
    # An answer continued: the turn before it stays too.
    continued = ChatTurn("assistant", "a")
    assert fitted([user, user, continued], 4) == (["u", "u", "u", "a"], 1)
    # Without truncate_history, or when it fits, the whole chat.
    whole = Prompt(messages=(system, user, user))
    assert whole.fitted(words, lambda w: len(w) <= 3) == (words(whole), 0)
    assert fitted([system, user, user], 100) == (["s", *["u"] * 6], 0)


def shape(message: Any, path: str = "") -> set[str]:
    """The fields a protobuf message sets, a nested message's fields by their path (a
    duration is one value)."""
    out: set[str] = set()
    for field, value in message.ListFields():
        name = path + field.name
        out.add(name)
        kind = field.message_type
        if (
            kind is not None
            and not field.is_repeated
            and kind.full_name != "google.protobuf.Duration"
        ):
            out |= shape(value, name + ".")
    return out


def keys(value: Any, path: str = "") -> set[str]:
    """The keys of a JSON value, nested ones by their path (a list's by its first item)."""
    if isinstance(value, list):
        return keys(value[0], path + "[].") if value else set()
    if not isinstance(value, dict):
        return set()
    out: set[str] = set()
    for key, item in value.items():
        out |= {path + key} | keys(item, path + key + ".")
    return out


async def test_sim_nodes_answer_in_the_shape_real_nodes_answer(
    sim_mesh: MeshProcesses, mesh: Mesh
) -> None:
    """The contract, side by side: a request new to both meshes, through real nodes of the
    embedded model and through sim nodes, each way of serving (KV handoff; the decode node
    alone): over gRPC the same stream and the same summary fields set; through the OpenAI
    door the same JSON, whole and streamed."""
    ways = [("qwen3-coder:30b", MODEL, "disaggregated"), ("test/decode-only", ALONE, "alone")]
    for real_route, sim_route, way in ways:
        prompt = f"Grade submission {way}-{time.time_ns()}: def add(a, b): return a - b."
        async with (
            grpc.aio.insecure_channel(mesh.router_address) as real_channel,
            grpc.aio.insecure_channel(sim_mesh.topology.router.address) as sim_channel,
        ):
            real_stub: Any = router_pb2_grpc.RouterServiceStub(real_channel)
            sim_stub: Any = router_pb2_grpc.RouterServiceStub(sim_channel)
            real = await collect(real_stub.Generate(generate(real_route, 8, prompt)))
            sim = await collect(sim_stub.Generate(generate(sim_route, 8, prompt)))
        assert real.summary is not None and sim.summary is not None
        assert real.summary.method == sim.summary.method, way
        assert real.deltas >= 1 and sim.deltas >= 1
        assert shape(real.summary) == shape(sim.summary), (
            way,
            shape(real.summary) ^ shape(sim.summary),
        )
        for stream in (False, True):
            got = []
            for router, model in (
                (mesh.topology.router, real_route),
                (sim_mesh.topology.router, sim_route),
            ):
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": f"{prompt} {stream}"}],
                    "max_tokens": 8,
                    "stream": stream,
                }
                url = f"http://127.0.0.1:{router.http_port}/v1/chat/completions"
                async with httpx.AsyncClient(timeout=60) as client:
                    reply = await client.post(url, json=body)
                assert reply.status_code == 200, reply.text
                if stream:
                    lines = [x[6:] for x in reply.text.splitlines() if x.startswith("data: ")]
                    assert lines[-1] == "[DONE]"
                    got.append(set().union(*(keys(json.loads(x)) for x in lines[:-1])))
                else:
                    got.append(keys(reply.json()))
            assert got[0] == got[1], (way, stream, got[0] ^ got[1])


async def test_a_suffix_fills_in_the_middle_on_sim_nodes(sim_mesh: MeshProcesses) -> None:
    """A sim node takes a suffix (its model's sizes, not its vocabulary): the same answer
    through the handoff and on a decode node alone, another than the prompt's without it,
    and the suffix's bytes counted in the prompt."""
    url = f"http://127.0.0.1:{sim_mesh.topology.router.http_port}"
    fields = {"prompt": PROMPT, "stream": False, "options": {"num_predict": 12, "temperature": 0}}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        plain = (await http.post("/api/generate", json={**fields, "model": MODEL})).json()
        filled = [
            (await http.post("/api/generate", json={**fields, "model": m, "suffix": "x" * 400}))
            .raise_for_status()
            .json()
            for m in (MODEL, ALONE)
        ]
    assert filled[0]["response"] == filled[1]["response"] != plain["response"]
    assert filled[0]["prompt_eval_count"] > plain["prompt_eval_count"] + 90


def test_sim_nodes_say_what_their_model_is_as_real_nodes_do(sim_mesh: MeshProcesses) -> None:
    """GetNodeInfo's model facts, and so the Ollama door's /api/show, /api/tags and /api/ps,
    describe the simulated model (its shipped facts: qwen3-coder:30b's sizes, tools and fill
    in the middle, no thinking), for each route of its nodes; the template frames a prompt
    as the node counts it, and what the model cannot do is refused before a node is asked,
    as for real nodes."""
    client = ollama.Client(host=f"http://127.0.0.1:{sim_mesh.topology.router.http_port}")
    for model in (MODEL, ALONE):
        shown = client.show(model)
        assert shown.details is not None and shown.modelinfo is not None
        assert shown.details.family == "qwen3moe" and shown.details.parameter_size == "30.5B"
        assert shown.modelinfo["qwen3moe.context_length"] == 262_144
        assert shown.capabilities == ["completion", "tools", "insert"]
        template = shown.template or ""
        assert template.startswith("{{ if .Suffix }}"), template  # Continue looks for it
    details = {m.model: m.details for m in client.list().models}[MODEL]
    assert details is not None and details.quantization_level == "Q4_K_M"
    assert {m.model: m.size for m in client.list().models}[MODEL] == 18_556_700_761
    # Running on the machines' GPUs, every layer (`ollama ps`: "100% GPU").
    running = {m.model: m for m in client.ps().models}
    assert set(running) == {MODEL, ALONE}
    assert running[MODEL].size_vram == running[MODEL].size == 18_556_700_761
    # The template's plain branch, filled in, is the prompt the node counts.
    alone = template.split("{{ else }}")[1].removesuffix("{{ end }}")
    framed = alone.replace("{{ .Prompt }}", PROMPT)
    answer = client.generate(model=MODEL, prompt=PROMPT, options={"num_predict": 1})
    speed = load_profile("dgx-spark").model(MODEL)
    assert answer.prompt_eval_count == prompt_tokens(Prompt(text=framed), speed.bytes_per_token)
    fim = template.split("{{ else if .System }}")[0].removeprefix("{{ if .Suffix }}")
    framed = fim.replace("{{ .Prompt }}", PROMPT).replace("{{ .Suffix }}", "x" * 400)
    filled = client.generate(model=MODEL, prompt=PROMPT, suffix="x" * 400)
    assert filled.prompt_eval_count == prompt_tokens(Prompt(text=framed), speed.bytes_per_token)
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], think=True)
    assert refused.value.status_code == 400
    assert refused.value.error.startswith("think: 'qwen3-coder:30b' does not support thinking")


OSS = "gpt-oss:120b"
OSS_ALONE = "sim/gpt-oss-decode-only"


def test_a_sim_model_that_thinks_reasons_apart_from_its_answer(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A simulated gpt-oss:120b reasons before it answers, as harmony's analysis channel
    comes before the final one: Ollama's `thinking`, OpenAI's `reasoning_content` and the
    Responses API's reasoning item carry it, apart from the answer, at the effort asked
    for; the state handed to the decode node keeps the effort (the disaggregated answer
    equals the decode node's alone); stop strings and JSON hold the answer, not the
    reasoning; and the reasoning counts among the answer's tokens."""
    parts = [
        router_node(http_port=free_port()),
        node_entry("spark-oss", "prefill", "sim", OSS, hardware="dgx-spark"),
        node_entry("mac-oss", "decode", "sim", OSS, hardware="m3-ultra"),
        route(OSS, ["spark-oss"], ["mac-oss"]),
        route(OSS_ALONE, [], ["mac-oss"], chain=["decode_only"]),
    ]
    with running_mesh(tmp_path_factory.mktemp("sim-oss"), parts) as mesh:
        url = f"http://127.0.0.1:{mesh.topology.router.http_port}"
        client = ollama.Client(host=url)
        chat: list[Any] = [{"role": "user", "content": PROMPT}]

        def asked(model: str = OSS, **extra: Any) -> Any:
            extra.setdefault("options", {"num_predict": 600})
            return client.chat(model=model, messages=chat, **extra)

        shown = client.show(OSS)
        assert shown.capabilities == ["completion", "tools", "thinking"]
        by_effort = {effort: asked(think=effort) for effort in ("low", "medium", "high")}
        for effort, got in by_effort.items():
            thought, said = got.message.thinking or "", got.message.content
            assert thought and said, effort
            # Each simulated word is one token: reasoning and answer make the answer's count.
            assert len(thought.split()) + len(said.split()) == got.eval_count, effort
            assert got.done_reason == "stop"
        words = {e: len((g.message.thinking or "").split()) for e, g in by_effort.items()}
        assert words["low"] < words["medium"] < words["high"]
        # A free answer runs as long at any effort; the reasoning is its first part.
        assert len({g.eval_count for g in by_effort.values()}) == 1
        medium = by_effort["medium"]
        # think unset reasons at the model's default (medium), and shows it; false hides it.
        plain, hidden = asked(), asked(think=False)
        assert plain.message.thinking == medium.message.thinking
        assert plain.message.content == hidden.message.content == medium.message.content
        assert not hidden.message.thinking
        # The decode node alone gives the same answer as the handoff (the state's effort).
        alone = asked(OSS_ALONE, think="high")
        assert alone.message.thinking == by_effort["high"].message.thinking
        assert alone.message.content == by_effort["high"].message.content
        # Streamed: the same reasoning, then the same answer.
        pieces = list(asked(think="high", stream=True))
        assert "".join(p.message.thinking or "" for p in pieces) == alone.message.thinking
        assert "".join(p.message.content for p in pieces) == alone.message.content
        # A stop string ends the answer, not the reasoning (its words come in both).
        said = medium.message.content
        stop = " " + said.split()[2]
        assert stop in (medium.message.thinking or "")  # the reasoning has it too
        stopped = asked(think="medium", options={"num_predict": 600, "stop": [stop]})
        assert stopped.message.thinking == medium.message.thinking
        assert stopped.message.content == said[: said.index(stop)]
        # Cut by num_predict inside the reasoning: reasoning only, done_reason length.
        cut = client.chat(
            model=OSS, messages=chat, think="high", options={"num_predict": words["low"]}
        )
        assert cut.message.thinking and not cut.message.content
        assert (cut.done_reason, cut.eval_count) == ("length", words["low"])
        # A JSON answer after the reasoning, as harmony's grammar holds gpt-oss to it.
        schema = {"type": "object", "properties": {"points": {"type": "integer"}}}
        graded = asked(format={**schema, "required": ["points"]})
        assert graded.message.thinking
        jsonschema.validate(json.loads(graded.message.content), schema)

        openai_client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        completion = openai_client.chat.completions.create(
            model=OSS, messages=chat, max_tokens=600, reasoning_effort="low"
        )
        message = completion.choices[0].message
        assert message.content == by_effort["low"].message.content
        assert (message.model_extra or {})["reasoning_content"] == by_effort["low"].message.thinking
        response = openai_client.responses.create(
            model=OSS, input=PROMPT, max_output_tokens=600, reasoning={"effort": "low"}
        )
        assert response.output_text == by_effort["low"].message.content
        assert response.output[0].type == "reasoning"
        usage = response.usage
        assert usage is not None
        assert usage.output_tokens_details.reasoning_tokens == words["low"]
