"""The router's chain, retries and migration, driven in process with fake node clients: no
processes, no model. Each fake decode node "generates" the same answer, token ids 101, 102,
... with text "t101 t102 ...", and goes on from where a KvSource or a Continuation says, so
a migration's text can be checked to have nothing repeated and nothing lost. The end-to-end
tests (test_failover.py, test_migration.py, ...) run the same paths with real nodes. And
the router's channels, against an in-process gRPC server that starts listening late."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from disagg_mesh.server.common.config.topology import Topology
from disagg_mesh.server.common.errors import MeshError, UpstreamError
from disagg_mesh.server.common.runtime.processes import free_port
from disagg_mesh.server.common.types import (
    Continuation,
    DecodeCandidate,
    DecodeStats,
    Fingerprint,
    FinishReason,
    KvSource,
    KvTransferKind,
    PrefillResult,
    Prompt,
    Sampling,
    StageLimits,
    TextChunk,
)
from disagg_mesh.server.common.wire.node_clients import ChannelPool
from disagg_mesh.server.router import failures, node_health
from disagg_mesh.server.router.failures import CallerDeadlineExceeded, StageDeadlineExceeded
from disagg_mesh.server.router.knowledge import Knowledge
from disagg_mesh.server.router.node_health import NodeHealth, Overloaded
from disagg_mesh.server.router.prefixes import prompt_bytes, text_blocks
from disagg_mesh.server.router.request import Clock, Request
from disagg_mesh.server.router.routing import ResumeInfo, RouteMethod, Router, RouteSummary
from disagg_mesh.server.router.stages import DecodeCalls, PrefillCalls

MODEL = "m"
FIRST = 101
PROMPT = Prompt(text="Grade this essay.")
FINGERPRINT = Fingerprint(model_sha256="0" * 64, n_ctx_tokens=4096, engine_version="test")


def token_text(token: int) -> str:
    return f"t{token} "


def answer(max_tokens: int) -> str:
    return "".join(token_text(FIRST + i) for i in range(max_tokens))


@dataclass
class Script:
    """How a fake node behaves on its next calls: each call takes the first entry (the
    last one stays): None serves; (code, after) fails with code after that many chunks
    (prefill: at once)."""

    steps: list[tuple[grpc.StatusCode, int] | None] = field(default_factory=lambda: [None])
    # Prefill: the decode node it says it chose (its prefix cache saves the most).
    chooses: str = ""

    def next(self) -> tuple[grpc.StatusCode, int] | None:
        return self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]


@dataclass
class Call:
    source: KvSource | Prompt | None = None
    continuation: Continuation | None = None
    candidates: Sequence[DecodeCandidate] = ()
    timeout_s: float = 0.0
    limits: StageLimits | None = None


class FakeNodes:
    """NodeClients over scripts, by address; records every call."""

    def __init__(self, topology: Topology) -> None:
        self.names = {n.address: n.name for n in topology.nodes}
        self.scripts: dict[str, Script] = {n.name: Script() for n in topology.nodes}
        self.calls: dict[str, list[Call]] = {n.name: [] for n in topology.nodes}

    def prefill(self, address: str) -> PrefillCalls:
        return _FakePrefill(self, self.names[address])

    def decode(self, address: str) -> DecodeCalls:
        return _FakeDecode(self, self.names[address])


class _FakePrefill:
    def __init__(self, nodes: FakeNodes, name: str) -> None:
        self._nodes, self._name = nodes, name

    async def prefill(
        self,
        model: str,
        prompt: Prompt,
        sampling: Sampling,
        timeout_s: float,
        candidates: Sequence[DecodeCandidate] = (),
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> PrefillResult:
        self._nodes.calls[self._name].append(
            Call(prompt, continuation, candidates, timeout_s, limits)
        )
        script = self._nodes.scripts[self._name]
        step = script.next()
        if step is not None:
            raise UpstreamError(step[0], f"prefill node {self._name}: scripted {step[0].name}")
        # A continuation's state holds the delivered tokens but the last, which the decode
        # node evaluates first.
        done = continuation.generated_tokens if continuation else 0
        first = FIRST + done - 1 if continuation else FIRST
        return PrefillResult(
            kv_handle=f"{self._name}-{len(self._nodes.calls[self._name])}",
            first_token_id=first,
            first_token_text=token_text(first),
            prompt_tokens=10,
            prefill_seconds=0.01,
            kv_size_bytes=1000,
            fingerprint=FINGERPRINT,
            kv_ttl_seconds=60.0,
            kv_transfer=KvTransferKind.STATE,
            # as a prefill node does: one of the decode nodes offered
            kv_prefix_node=script.chooses if script.chooses in {c.node for c in candidates} else "",
            kv_state_bytes=1000,
            replayed_tokens=max(done - 1, 0),
        )


class _FakeDecode:
    def __init__(self, nodes: FakeNodes, name: str) -> None:
        self._nodes, self._name = nodes, name

    async def generate(
        self,
        model: str,
        source: KvSource | Prompt,
        sampling: Sampling,
        timeout_s: float,
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> AsyncGenerator[TextChunk | DecodeStats, None]:
        self._nodes.calls[self._name].append(Call(source, continuation, (), timeout_s, limits))
        step = self._nodes.scripts[self._name].next()
        start = FIRST + (continuation.generated_tokens if continuation else 0)
        for i, token in enumerate(range(start, FIRST + sampling.max_tokens)):
            if step is not None and i >= step[1]:
                break
            await asyncio.sleep(0)
            yield TextChunk(token_text(token), [token])
        if step is not None:
            raise UpstreamError(step[0], f"decode node {self._name}: scripted {step[0].name}")
        kv = isinstance(source, KvSource)
        yield DecodeStats(
            prompt_tokens=10,
            completion_tokens=sampling.max_tokens,
            finish_reason=FinishReason.LENGTH,
            kv_transfer=KvTransferKind.STATE if kv else KvTransferKind.NONE,
            decode_seconds=0.01,
        )


def topology(**route: Any) -> Topology:
    def node(name: str, role: str, port: int) -> dict[str, Any]:
        extra = {"engine": "llama_cpp", "model": "m.gguf"} if role != "router" else {}
        return {"name": name, "role": role, "host": "127.0.0.1", "port": port, **extra}

    return Topology.model_validate(
        {
            "nodes": [
                node("router", "router", 7000),
                node("p1", "prefill", 7001),
                node("p2", "prefill", 7002),
                node("d1", "decode", 7003),
                node("d2", "decode", 7004),
            ],
            "models": [{"name": MODEL, "prefill": ["p1", "p2"], "decode": ["d1", "d2"], **route}],
        }
    )


def build(**route: Any) -> tuple[Router, FakeNodes]:
    t = topology(**route)
    nodes = FakeNodes(t)
    health = NodeHealth(
        [n for n in t.nodes if n.role != "router"], ChannelPool(), every_s=1.0, cooldown_s=30.0
    )
    return Router(t, ChannelPool(), health, nodes), nodes


async def run(
    router: Router, max_tokens: int = 8, time_remaining: float | None = None, **kwargs: Any
) -> tuple[str, RouteSummary]:
    text: list[str] = []
    summary: RouteSummary | None = None
    sampling = Sampling(max_tokens=max_tokens, temperature=0.0)
    items = router.generate_resumable(MODEL, PROMPT, sampling, time_remaining, **kwargs)
    async for item in items:
        if isinstance(item, TextChunk):
            text.append(item.text)
        elif isinstance(item, RouteSummary):
            summary = item
        else:
            assert isinstance(item, ResumeInfo)
    assert summary is not None
    return "".join(text), summary


def fail(code: grpc.StatusCode, after: int = 0) -> tuple[grpc.StatusCode, int]:
    return code, after


async def test_disaggregated_request_hands_the_prefill_state_to_the_decode_node() -> None:
    router, nodes = build()
    text, summary = await run(router)
    assert text == answer(8)
    assert summary.method == RouteMethod.DISAGGREGATED
    assert (summary.prefill_node, summary.decode_node) == ("p1", "d1")
    assert summary.failed_attempts == [] and summary.migrations == []
    source = nodes.calls["d1"][0].source
    assert isinstance(source, KvSource) and source.reference.kv_handle == "p1-1"
    assert source.prefill_address == "127.0.0.1:7001"
    # The prefill node chose among the free decode nodes, with what each is believed to hold.
    assert [c.node for c in nodes.calls["p1"][0].candidates] == ["d1", "d2"]


async def test_a_prefill_retry_moves_to_the_next_prefill_node_and_sets_the_first_aside() -> None:
    router, nodes = build()
    nodes.scripts["p1"] = Script([fail(grpc.StatusCode.UNAVAILABLE), None])
    text, summary = await run(router)
    assert text == answer(8)
    assert summary.prefill_node == "p2"
    assert [(f.node, f.code) for f in summary.failed_attempts] == [("p1", "UNAVAILABLE")]
    assert not router.health.available(router.topology.node("p1"))
    # The next request starts on the healthy node.
    _, again = await run(router)
    assert again.prefill_node == "p2" and again.failed_attempts == []


async def test_a_stage_deadline_is_retried_on_another_node_but_never_on_a_node_that_hung() -> None:
    router, nodes = build()
    nodes.scripts["p1"] = Script([fail(grpc.StatusCode.DEADLINE_EXCEEDED)])
    nodes.scripts["p2"] = Script([fail(grpc.StatusCode.DEADLINE_EXCEEDED)])
    text, summary = await run(router)
    assert text == answer(8)
    # Both prefill nodes hung once each; the chain's next step served.
    assert summary.method == RouteMethod.DECODE_ONLY
    failed = [(f.method.value, f.node, f.code) for f in summary.failed_attempts]
    assert failed == [
        ("disaggregated", "p1", "DEADLINE_EXCEEDED"),
        ("disaggregated", "p2", "DEADLINE_EXCEEDED"),
    ]
    assert len(nodes.calls["p1"]) == len(nodes.calls["p2"]) == 1
    assert "stage deadline passed" in summary.failed_attempts[0].message


async def test_a_final_code_stops_the_chain_untried() -> None:
    router, nodes = build()
    nodes.scripts["d1"] = Script([fail(grpc.StatusCode.INVALID_ARGUMENT)])
    with pytest.raises(MeshError) as caught:
        await run(router)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(nodes.calls["d1"]) == 1 and nodes.calls["d2"] == []
    assert router.health.available(router.topology.node("d1"))  # not the node's fault


async def test_every_step_failing_names_each_attempt() -> None:
    router, nodes = build()
    for name in ("p1", "p2", "d1", "d2"):
        nodes.scripts[name] = Script([fail(grpc.StatusCode.INTERNAL)])
    with pytest.raises(MeshError) as caught:
        await run(router)
    message = caught.value.message
    assert caught.value.code == grpc.StatusCode.INTERNAL
    assert message.startswith(f"every step of {MODEL}'s chain failed: disaggregated on p1")
    assert "decode_only on d1: INTERNAL" in message and "decode_only on d2: INTERNAL" in message


async def test_the_callers_deadline_is_final_and_blames_no_node() -> None:
    router, nodes = build(chain=["decode_only"])
    nodes.scripts["d1"] = Script([fail(grpc.StatusCode.DEADLINE_EXCEEDED)])
    with pytest.raises(CallerDeadlineExceeded) as caught:
        await run(router, time_remaining=5.0)
    assert "the caller's deadline passed" in caught.value.message
    assert nodes.calls["d1"][0].timeout_s <= 5.0 and nodes.calls["d2"] == []
    assert router.health.available(router.topology.node("d1"))


async def test_a_prefill_node_counts_the_wait_and_the_work_and_busy_there_blames_nothing() -> None:
    """The prefill call gives the node its own bounds: the wait for the prompt's turn (the
    request's queue budget: other routers' prompts may be ahead of it there) and the work
    from then (the stage deadline); the call's deadline is the two in turn. A node that
    answers busy after that wait is not set aside, and the prompt goes to the next node."""
    router, nodes = build(prefill_deadline_s=20.0, queue_budget_s=70.0)
    nodes.scripts["p1"] = Script([fail(grpc.StatusCode.RESOURCE_EXHAUSTED), None])
    text, summary = await run(router, time_remaining=200.0)
    assert text == answer(8) and summary.prefill_node == "p2"
    first = nodes.calls["p1"][0]
    assert first.limits is not None and first.limits.work_s == 20.0
    assert first.limits.queue_s == pytest.approx(70.0, abs=0.1)
    assert first.timeout_s == pytest.approx(90.0, abs=0.1)
    # Never stricter than when the stage deadline covered the wait too: at least that.
    router, nodes = build(prefill_deadline_s=20.0, queue_budget_s=7.0)
    await run(router, time_remaining=200.0)
    assert nodes.calls["p1"][0].limits == StageLimits(queue_s=20.0, work_s=20.0)
    assert [(f.node, f.code) for f in summary.failed_attempts] == [("p1", "RESOURCE_EXHAUSTED")]
    assert router.health.available(router.topology.node("p1"))


async def test_busy_prefill_nodes_send_the_prompt_on_only_to_an_idle_decode_node() -> None:
    """Every prefill node busy is not a failure: the chain's next step (decode_only) is
    tried only on a decode node with none of the router's calls, where evaluating the
    prompt slows no stream; with streams on both decode nodes, the caller hears busy
    (RESOURCE_EXHAUSTED) and nothing is evaluated on them."""
    router, nodes = build()
    busy = fail(grpc.StatusCode.RESOURCE_EXHAUSTED)
    nodes.scripts["p1"] = nodes.scripts["p2"] = Script([busy])
    health = router.health
    d1, d2 = router.topology.node("d1"), router.topology.node("d2")
    health._slots.update(d1=8, d2=8)
    with health.busy(d1), health.busy(d2):  # a stream on each, slots free
        with pytest.raises(MeshError) as refused:
            await run(router)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert nodes.calls["d1"] == [] and nodes.calls["d2"] == []
    with health.busy(d1):  # d2 idle: it evaluates the prompt
        text, summary = await run(router)
    assert text == answer(8) and summary.decode_node == "d2"
    assert summary.method == RouteMethod.DECODE_ONLY
    assert health.available(router.topology.node("p1"))


async def test_a_nodes_own_stage_deadline_is_the_stages_while_the_caller_has_time() -> None:
    """A caller with more time than the stage deadline but less than the node's wait and
    work together: the call ends with the caller's deadline, but a node that answers
    DEADLINE_EXCEEDED before then ran its work past the stage deadline (the stage's:
    retried on the next node, the first set aside), not out of the caller's time."""
    router, nodes = build(prefill_deadline_s=20.0)
    nodes.scripts["p1"] = Script([fail(grpc.StatusCode.DEADLINE_EXCEEDED)])
    text, summary = await run(router, time_remaining=30.0)
    first = nodes.calls["p1"][0]
    assert first.timeout_s <= 30.0 and first.limits is not None
    assert first.limits.work_s == 20.0
    assert text == answer(8) and summary.prefill_node == "p2"
    assert "stage deadline passed" in summary.failed_attempts[0].message
    assert not router.health.available(router.topology.node("p1"))


async def test_the_prefill_nodes_choice_of_decode_node_is_taken() -> None:
    router, nodes = build()
    nodes.scripts["p1"] = Script([None], chooses="d2")
    text, summary = await run(router)
    assert text == answer(8)
    assert summary.decode_node == "d2" and nodes.calls["d1"] == []


async def test_a_state_goes_only_to_decode_nodes_not_busier_than_the_least_loaded() -> None:
    """The decode nodes offered to the prefill node (which picks the one holding most of
    the prompt) and the one planned are those with a free slot and at most BALANCE_CALLS
    calls over the least loaded: a prefix held saves moving part of a state, a stream
    more slows every other stream on the node."""
    router, nodes = build()
    health = router.health
    d1 = router.topology.node("d1")
    health._slots.update(d1=8, d2=8)
    nodes.scripts["p1"] = Script([None], chooses="d1")  # d1 holds the prompt's prefix
    with health.busy(d1), health.busy(d1):  # two streams on d1, none on d2
        text, summary = await run(router)
        offered = [c.node for c in nodes.calls["p1"][0].candidates]
    assert offered == ["d2"] and summary.decode_node == "d2" and text == answer(8)
    with health.busy(d1):  # one more than d2: still offered, and its prefix wins
        text, summary = await run(router)
        offered = [c.node for c in nodes.calls["p1"][1].candidates]
    assert sorted(offered) == ["d1", "d2"] and summary.decode_node == "d1"


async def test_a_decode_node_that_let_the_prefix_go_gets_the_prompt_prefilled_again() -> None:
    router, nodes = build()
    nodes.scripts["d1"] = Script([fail(grpc.StatusCode.ABORTED), None])
    text, summary = await run(router)
    assert text == answer(8)
    assert len(nodes.calls["p1"]) == 2 and len(nodes.calls["d1"]) == 2
    assert [(f.node, f.code) for f in summary.failed_attempts] == [("d1", "ABORTED")]


def test_the_router_believes_no_more_of_a_node_than_its_prefix_cache_holds() -> None:
    """A decode node's cache lets its least recently used blocks go; the router's belief of
    it is bounded the same way (prefix_cache_tokens, default n_ctx), so it does not send a
    delta on blocks long evicted (which would come back ABORTED)."""
    t = topology()
    small = t.node("d1").model_copy(update={"prefix_cache_tokens": 4 * 64})
    knowledge = Knowledge([small, t.node("d2")])
    rubrics = [[bytes([r, b]) * 8 for b in range(2)] for r in range(3)]  # 2 blocks each
    for blocks in rubrics:
        knowledge.prefixes.learn("d1", blocks)
        knowledge.prefixes.learn("d2", blocks)
    assert knowledge.prefixes.held("d1") == (*rubrics[1], *rubrics[2])  # 4 blocks
    assert len(knowledge.prefixes.held("d2")) == 6  # n_ctx 4,096: 64 blocks
    assert t.node("d2").prefix_cache_capacity_tokens == 4096


@pytest.mark.parametrize("via", ["decode", "prefill"])
async def test_a_decode_node_failing_mid_answer_hands_over_with_nothing_lost(via: str) -> None:
    router, nodes = build(migrate_via=via)
    nodes.scripts["d1"] = Script([fail(grpc.StatusCode.UNAVAILABLE, after=3)])
    text, summary = await run(router, max_tokens=10)
    assert text == answer(10)
    [migration] = summary.migrations
    assert (migration.failed_node, migration.resumed_on) == ("d1", "d2")
    assert migration.code == "UNAVAILABLE" and migration.tokens_delivered == 3
    assert summary.decode_node == "d2" and summary.completion_tokens == 10
    continuation = nodes.calls["d2"][0].continuation
    assert continuation is not None
    assert continuation.generated_token_ids == (101, 102, 103)
    assert continuation.first_token_from_prefill
    source = nodes.calls["d2"][0].source
    if via == "prefill":
        assert migration.via_prefill_node == "p1"  # the node that holds the prompt
        assert isinstance(source, KvSource) and source.reference.kv_handle == "p1-2"
        assert nodes.calls["p1"][1].continuation == continuation
    else:
        assert migration.via_prefill_node == "" and source == PROMPT


async def test_with_no_node_to_take_over_the_error_says_what_was_delivered() -> None:
    router, nodes = build(decode=["d1"])
    nodes.scripts["d1"] = Script([fail(grpc.StatusCode.UNAVAILABLE, after=2)])
    with pytest.raises(MeshError) as caught:
        await run(router)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert "after 2 text deltas were delivered" in caught.value.message
    assert "no text is sent twice" in caught.value.message


async def test_migrations_stop_at_max_migrations() -> None:
    router, nodes = build(max_migrations=1, migrate_via="decode")
    nodes.scripts["d1"] = Script([fail(grpc.StatusCode.INTERNAL, after=2)])
    nodes.scripts["d2"] = Script([fail(grpc.StatusCode.INTERNAL, after=2)])
    with pytest.raises(MeshError) as caught:
        await run(router)
    assert "failed on d2 after 1 migrations after 4 text deltas" in caught.value.message


async def test_a_client_resumes_through_this_router_after_another_router_failed() -> None:
    router, nodes = build(migrate_via="decode")
    resume = Continuation(
        generated_token_ids=(101, 102, 103, 104),
        generated_text=answer(4),
        first_token_from_prefill=True,
        generated_tokens=4,
        prompt_cached_tokens=0,
    )
    text, summary = await run(router, resume=resume, resumed_from="127.0.0.1:7999")
    assert answer(4) + text == answer(8)
    [migration] = summary.migrations
    assert migration.failed_node == "router 127.0.0.1:7999" and migration.resumed_on == "d1"
    assert summary.route_reason == "resumed after router 127.0.0.1:7999 failed mid-answer"
    assert nodes.calls["p1"] == []
    continuation = nodes.calls["d1"][0].continuation
    assert continuation is not None and continuation.generated_token_ids == (101, 102, 103, 104)
    assert continuation.first_token_from_prefill and continuation.generated_text == answer(4)


def test_the_failure_table() -> None:
    node = topology().node("p1")
    stage = failures.stage_error(
        UpstreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "late"), "prefill", node, 60.0, False
    )
    caller = failures.stage_error(
        UpstreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "late"), "prefill", node, 1.0, True
    )
    assert isinstance(stage, StageDeadlineExceeded) and isinstance(caller, CallerDeadlineExceeded)
    assert failures.blames_node(stage) and not failures.is_final(stage)
    assert failures.is_final(caller) and not failures.blames_node(caller)
    assert not failures.can_migrate(caller) and failures.can_migrate(stage)
    busy = UpstreamError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    assert failures.is_retryable(busy) and not failures.blames_node(busy)
    assert not failures.is_retryable(stage)  # the prefill stage decides those itself
    wrong = UpstreamError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: empty")
    assert failures.is_final(wrong) and not failures.can_migrate(wrong)
    gone = UpstreamError(grpc.StatusCode.ABORTED, "prefix gone")
    assert not any(f(gone) for f in (failures.is_final, failures.blames_node, failures.can_migrate))


@pytest.mark.parametrize("listens_after_s", [2.2, 2.8, 3.6, 4.8])
async def test_a_node_that_starts_listening_late_is_reached_within_a_second_or_less(
    listens_after_s: float,
) -> None:
    """The router's channel to a node that was not listening yet (still loading its model,
    or restarting) is in gRPC's reconnect back-off. The node must be reached soon after it
    listens, not a back-off later (gRPC's default: 1 s growing to 120 s; 2 s with the old
    cap), which made the first request after `make run`'s "all nodes SERVING" fail."""
    loop = asyncio.get_running_loop()
    address = f"127.0.0.1:{free_port()}"
    pool = ChannelPool()
    stub: Any = health_pb2_grpc.HealthStub(pool.get(address))
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    try:
        until = loop.time() + listens_after_s
        while loop.time() < until:  # the router checking a node that is not up yet
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            await asyncio.sleep(0.05)
        server.add_insecure_port(address)  # gRPC binds and listens here
        await server.start()
        listening = loop.time()
        while True:
            try:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
        assert loop.time() - listening < 0.75
    finally:
        await server.stop(None)
        await pool.close()


class _CheckOnly(health.aio.HealthServicer):
    """A node whose grpc.health.v1 has no Watch (as some servers do), counting its Checks."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    async def Check(self, request: Any, context: Any) -> Any:
        self.checks += 1
        return await super().Check(request, context)

    async def Watch(self, request: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no Watch here")


async def test_a_node_without_health_watch_is_polled_not_spun_on() -> None:
    """The router follows each node's Watch stream; a node that answers Check but not Watch
    is seen serving and checked once every health_check_every_s, never in a tight loop."""
    node = topology().node("d1").model_copy(update={"port": free_port()})
    servicer = _CheckOnly()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(node.address)
    await server.start()
    pool = ChannelPool()
    health_ = NodeHealth([node], pool, every_s=0.25, cooldown_s=1.0)
    watching = asyncio.create_task(health_.watch())
    try:
        await asyncio.sleep(1.6)
        assert health_.serving(node) and health_.available(node)
        assert 3 <= servicer.checks <= 9  # 1.6 s at one check every 0.25 s
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await server.stop(None)
        await pool.close()


async def test_a_prompt_prefers_the_node_already_evaluating_its_prefix() -> None:
    """While a node evaluates a prompt (before the request is served), the next prompt
    starting the same way prefers that node, where it waits for the shared blocks instead of
    evaluating them on another node too; other prompts keep the topology's order."""
    router, _ = build()
    rubric = "Rubric: " + "grade carefully. " * 100
    sampling = Sampling(max_tokens=4, temperature=0.0)
    p1, p2 = router.topology.node("p1"), router.topology.node("p2")
    router.health.failed(p1)  # cooling down: the first prompt goes to p2
    first = router.generate_resumable(MODEL, Prompt(text=rubric + "Submission 1"), sampling, None)
    await anext(first)  # under way on p2, not served yet
    router.health.succeeded(p1)

    def order(text: str) -> list[str]:
        blocks = text_blocks(MODEL, prompt_bytes(Prompt(text=text)))
        return [n.name for n in router.selection.by_prefix([p1, p2], blocks)]

    assert order(rubric + "Submission 2") == ["p2", "p1"]
    assert order("Something else entirely. " * 20) == ["p1", "p2"]
    async for _ in first:
        pass


def test_hash_placement_spreads_new_prefixes_and_keeps_held_ones() -> None:
    """prefix_placement = "hash": a prompt start no node holds gets its own order of the
    nodes (the same on every router), so different starts spread over them; a node that
    holds the start still comes first."""
    router, _ = build()
    other, _ = build()  # another router: no shared state
    p1, p2 = router.topology.node("p1"), router.topology.node("p2")

    def first(selection: Any, start: str) -> str:
        blocks = text_blocks(MODEL, prompt_bytes(Prompt(text=start * 40 + "Submission")))
        return str(selection.by_prefix([p1, p2], blocks, "hash")[0].name)

    starts = [f"Assignment {i}: grade it. " for i in range(40)]
    homes = [first(router.selection, s) for s in starts]
    assert homes == [first(other.selection, s) for s in starts]  # every router agrees
    assert 10 <= homes.count("p1") <= 30  # spread, where "order" sends all 40 to p1
    text = starts[0] * 40 + "Submission"
    blocks = text_blocks(MODEL, prompt_bytes(Prompt(text=text)))
    away = "p2" if homes[0] == "p1" else "p1"
    router.knowledge.text_prefixes.learn(away, blocks)
    assert first(router.selection, starts[0]) == away  # held beats the hash


async def test_callers_wait_for_a_free_slot_in_turn_and_a_busy_node_refuses_after_the_budget() -> (
    None
):
    router, _ = build()
    health, node = router.health, router.topology.node("d1")
    health._slots["d1"] = 1  # what GetNodeInfo says, as a health check would learn it
    order: list[str] = []

    async def caller(name: str, budget_s: float) -> None:
        await health.free_slot(node, budget_s)
        with health.busy(node):
            order.append(name)
            await asyncio.sleep(0.05)

    with health.busy(node):  # the one slot is taken
        first = asyncio.create_task(caller("first", 5.0))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(caller("second", 5.0))
        with pytest.raises(MeshError) as busy:
            await caller("impatient", 0.02)
        assert busy.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue_budget_s" in busy.value.message
    await asyncio.gather(first, second)
    assert order == ["first", "second"]
    await health.free_slot(node, 0.01)  # free again: no wait


async def test_a_queue_that_would_outlast_the_budget_is_refused_at_once() -> None:
    """The router times how fast a busy node's slot frees while callers wait; a caller
    whose turn would come after its budget at that rate is refused at once (Overloaded,
    RESOURCE_EXHAUSTED, retry-after the excess), and under a caller's deadline the call's
    own time counts too; with nothing measured yet a caller waits."""
    router, _ = build()
    health, node = router.health, router.topology.node("d1")
    health._slots["d1"] = 1

    async def caller(budget_s: float, hold_s: float = 0.2, and_serve: bool = False) -> None:
        await health.free_slot(node, budget_s, and_serve)
        with health.busy(node):
            await asyncio.sleep(hold_s)

    with health.busy(node):  # the one slot is taken
        waiter = asyncio.create_task(caller(5.0))
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.01)
    assert health.expected_wait(node) == pytest.approx(0.2, abs=0.05)  # the holder only
    queued = [asyncio.create_task(caller(5.0)) for _ in range(2)]  # turns at ~0.4 and ~0.6 s
    await asyncio.sleep(0.01)
    began = time.monotonic()
    with pytest.raises(Overloaded) as refused:
        await caller(0.5)
    assert time.monotonic() - began < 0.05
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.retry_after_s == pytest.approx(0.1, abs=0.05)
    assert "2 calls already wait" in refused.value.message
    with pytest.raises(Overloaded, match="the caller's deadline"):
        await caller(0.7, and_serve=True)  # its turn fits, its turn and the call do not
    await asyncio.gather(waiter, *queued, caller(0.7))


async def test_callers_refused_at_once_past_a_burst_wait_their_budget_instead() -> None:
    """A node refuses at once at most REFUSALS_AT_ONCE callers in a burst, then one more
    for each of its slots freed since: callers that come back before their turn (a closed
    loop ignoring retry-after) wait in turn within their budget instead of spinning, and
    are refused when it ends."""
    router, _ = build()
    health, node = router.health, router.topology.node("d1")
    health._slots["d1"] = 1
    with health.busy(node):  # the one slot taken; a caller waits, its slot frees in 0.3 s
        waiter = asyncio.create_task(health.free_slot(node, 5.0))
        await asyncio.sleep(0.3)
    await waiter
    with health.busy(node):
        health._drain_s["d1"] = 60.0  # a slot frees every minute: no refill here
        for _ in range(node_health.REFUSALS_AT_ONCE):
            with pytest.raises(Overloaded):
                await health.free_slot(node, 0.1)
        began = time.monotonic()
        with pytest.raises(MeshError) as waited:
            await health.free_slot(node, 0.2)
        assert not isinstance(waited.value, Overloaded)
        assert waited.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - began >= 0.2
        # A slot freed every 0.25 s since the last refusal at once, 0.3 s ago: one more.
        health._drain_s["d1"], health._drain_mark["d1"] = 0.25, time.monotonic()
        health._refusals["d1"] = (0.0, time.monotonic() - 0.3)
        with pytest.raises(Overloaded):
            await health.free_slot(node, 0.01)
        with pytest.raises(MeshError) as waited:
            await health.free_slot(node, 0.01)
        assert not isinstance(waited.value, Overloaded)


async def test_a_requests_waits_draw_on_one_queue_budget_on_every_node_it_tries() -> None:
    """The route's queue_budget_s bounds a request's waits for slots in all: after waiting
    it out on one busy node, the next busy node refuses at once; a wait after work was done
    for it (a state made, text delivered) may take the whole budget again."""
    router, _ = build(queue_budget_s=0.3)
    health = router.health
    d1, d2 = router.topology.node("d1"), router.topology.node("d2")
    request = Request(router.topology.models[0], PROMPT, Sampling(max_tokens=4), Clock(None), 0, [])
    for name in ("d1", "d2"):
        health._slots[name] = 1
    with health.busy(d1), health.busy(d2):  # both nodes' one slot taken
        started = time.perf_counter()
        with pytest.raises(MeshError) as first:
            await failures.free_slot(health, request, d1)
        assert time.perf_counter() - started >= 0.29
        assert first.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        started = time.perf_counter()
        with pytest.raises(MeshError):
            await failures.free_slot(health, request, d2)
        assert time.perf_counter() - started < 0.05  # nothing of the budget left
        request.work_done = True  # e.g. a state was made for it
        started = time.perf_counter()
        with pytest.raises(MeshError):
            await failures.free_slot(health, request, d2)
        assert time.perf_counter() - started >= 0.29
    assert request.queued_s == pytest.approx(0.3, abs=0.05)  # the last wait not counted
    await failures.free_slot(health, request, d2)  # a free slot needs no budget


async def test_states_are_made_for_a_decode_node_only_while_it_has_room_for_them() -> None:
    """A decode node of one slot, its stream running: one state may be made for it (a
    slot's worth may wait), a second waits while the stream and the first state's decode
    call fill twice its slot, and goes when one ends; one that would wait past its budget
    is RESOURCE_EXHAUSTED."""
    router, _ = build()
    health, node = router.health, router.topology.node("d1")
    health._slots["d1"] = 1
    order: list[str] = []

    async def state(name: str, budget_s: float = 5.0) -> None:
        route = router.topology.models[0].model_copy(update={"queue_budget_s": budget_s})
        request = Request(route, PROMPT, Sampling(max_tokens=4), Clock(None), 0, [])
        async with failures.decode_room(health, request, node):
            order.append(name)
            await asyncio.sleep(0.05)  # the prefill

    with health.busy(node):  # the stream
        await state("first")
        second = asyncio.create_task(state("second"))
        with health.busy(node):  # the first state's decode call, beside the stream
            await asyncio.sleep(0.1)
            assert order == ["first"]
            with pytest.raises(MeshError) as busy:
                await state("impatient", 0.05)
            assert busy.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    await second
    assert order == ["first", "second"]


def request_for(router: Router, **route: Any) -> Request:
    model = router.topology.models[0].model_copy(update=route)
    return Request(model, PROMPT, Sampling(max_tokens=4), Clock(None), 0, [])


async def test_a_state_made_waits_for_its_decode_slot_and_is_never_refused_at_once() -> None:
    """Once a state was made for a decode node, the decode call waits in turn for a slot
    as long as the prefill node keeps the state (held_s), past the queue budget and
    whatever the node's pace says: refusing it would throw the prefill away. Before any
    work was done, the same wait is refused at once."""
    router, _ = build()
    health, node = router.health, router.topology.node("d1")
    health._slots["d1"] = 1
    health._drain_s["d1"] = 10.0  # the pace says: about 10 s to a slot
    request = request_for(router, queue_budget_s=0.1)
    with health.busy(node):
        with pytest.raises(Overloaded):
            await failures.free_slot(health, request, node)
        request.work_done, request.held_s = True, 5.0  # a state was made for it
        waiter = asyncio.create_task(failures.free_slot(health, request, node))
        await asyncio.sleep(0.3)  # three times its queue budget
        assert not waiter.done()
    await asyncio.wait_for(waiter, 1.0)  # the slot freed: its turn


async def test_a_decode_node_keeps_room_for_as_many_states_as_free_within_the_budget() -> None:
    """Beyond its slots, a decode node takes as many states as its slots free within the
    route's queue budget at their measured pace (at most its slots), so a state made does
    not wait for a slot longer than a request may wait for admission."""
    router, _ = build()
    health, node = router.health, router.topology.node("d1")
    health._slots["d1"] = 4
    assert health._waiting_room("d1", 4) == 4  # nothing measured: a slot's worth each
    health._drain_s["d1"] = 1.0
    for budget_s, extra in ((2.0, 2), (0.5, 0), (600.0, 4)):
        await health.wait_for_room(node, 1.0, budget_s)
        health.leave_room(node)
        assert health._waiting_room("d1", 4) == extra
    for _ in range(4):
        health._in_flight["d1"] += 1  # its four slots busy
    await health.wait_for_room(node, 0.01, 2.0)
    await health.wait_for_room(node, 0.01, 2.0)
    with pytest.raises(MeshError) as full:
        await health.wait_for_room(node, 0.01, 2.0)
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_prefill_node_gets_no_more_calls_than_it_ends_within_the_budget() -> None:
    """A prefill node evaluates long prompts in turn: the router lets it have no more
    calls at once than end within the route's queue budget at their measured pace, so a
    prompt does not wait inside the node longer than it may wait for admission; the
    others wait at the router, in turn."""
    router, _ = build()
    health, node = router.health, router.topology.node("p1")
    health._slots["p1"] = 8
    health._drain_s["p1"] = 1.0
    held = []
    for _ in range(3):
        await health.free_slot(node, 1.0, queue_budget_s=3.0)
        held.append(health.busy(node))
        held[-1].__enter__()
    assert not health.has_free_slot(node)
    with pytest.raises(Overloaded):  # its turn: after ~1 s, over a 0.5 s budget
        await health.free_slot(node, 0.5, queue_budget_s=3.0)
    fourth = asyncio.create_task(health.free_slot(node, 5.0, queue_budget_s=3.0))
    await asyncio.sleep(0.05)
    assert not fourth.done()
    held.pop().__exit__(None, None, None)
    await asyncio.wait_for(fourth, 1.0)
    for busy in held:
        busy.__exit__(None, None, None)
    health._slots["d1"], health._drain_s["d1"], health._budget_s["d1"] = 8, 1.0, 3.0
    assert health._open("d1") == 8  # a decode node: its slots (its room bounds its queue)


async def test_after_a_state_was_let_go_the_retry_waits_only_its_queue_budget() -> None:
    """A decode node answering ABORTED (it let the prefix go) has the prompt prefilled
    again; that retry's wait for room is the queue budget's again, not the life of the
    state it no longer waits for: with no room left on that node it moves on at once."""
    router, nodes = build(queue_budget_s=0.1)
    health = router.health
    nodes.scripts["d1"] = Script([fail(grpc.StatusCode.ABORTED)])
    decode = nodes.decode

    def full_after_the_call(address: str) -> DecodeCalls:
        if nodes.names[address] == "d1":
            health._slots["d1"], health._promised["d1"] = 1, 2  # no room from now on
        return decode(address)

    nodes.decode = full_after_the_call  # type: ignore[method-assign]
    began = time.perf_counter()
    text, summary = await asyncio.wait_for(run(router), 5.0)
    assert text == answer(8) and summary.decode_node == "d2"
    assert time.perf_counter() - began < 1.0
    first = summary.failed_attempts[0]
    assert (first.node, first.code) == ("d1", "ABORTED")


async def test_before_callers_wait_a_prefill_nodes_pace_is_its_calls_time_alone() -> None:
    """Before callers have waited for a prefill node (nothing timed between two calls
    ending), the calls it gets at once are bounded by how long a call took that had the
    node to itself, and before any call has ended it gets one: a burst's first prompts do
    not all queue inside it."""
    router, _ = build()
    health, node = router.health, router.topology.node("p1")
    health._slots["p1"] = 8
    await health.free_slot(node, 1.0, queue_budget_s=1.0)
    assert health._open("p1") == 1  # nothing known yet: one call, whose time tells its pace
    with health.busy(node):
        await asyncio.sleep(0.2)
    alone_s = health._alone_s["p1"]
    assert alone_s >= 0.2 and health._open("p1") == int(1.0 / alone_s)  # 5 on an idle machine


async def test_a_prefill_nodes_calls_at_once_end_within_half_their_stage_deadline() -> None:
    """Whatever the queue budget, a slow prefill node gets no more calls at once than end
    within half the stage deadline at its pace: a call's stage deadline (the node's work on
    it) is not spent waiting inside the node behind the calls before it (#45: a burst's
    prefill killed by its 60 s stage deadline after waiting there on a slow day)."""
    router, _ = build()
    health, node = router.health, router.topology.node("p1")
    health._slots["p1"] = 8
    health._drain_s["p1"] = 8.0  # a ~1,750-token prompt on a slow 2-core machine
    await health.free_slot(node, 1.0, queue_budget_s=600.0, stage_s=60.0)
    assert health._open("p1") == 3  # 3 x 8 s within 30 s; the slots (8) would take 64 s
    health._drain_s["p1"] = 0.5
    assert health._open("p1") == 8  # fast prompts: its slots
    health._drain_s["p1"] = 80.0
    assert health._open("p1") == 1  # always one
