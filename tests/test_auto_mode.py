"""Automatic mode: disaggregated or decode_only per request, from measured figures. A real
mesh whose decode node evaluates prompts slowly (8 tokens a pass) sends long prompts to the
prefill node and short ones straight to the decode node; the estimate follows whatever
was measured; the summary says why."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc
from disagg_mesh.server.common.runtime.processes import MeshProcesses
from disagg_mesh.server.router.costs import Candidate, Costs, Observation
from tests.conftest import engine_node, route, router_node, router_stub, running_mesh
from tests.streams import collect, request

MODEL = "auto"
DISAGGREGATED = router_pb2.ROUTE_METHOD_DISAGGREGATED
DECODE_ONLY = router_pb2.ROUTE_METHOD_DECODE_ONLY


def long_prompt(i: int) -> str:
    """About 800 tokens, different every time (no prefix cache helps either mode)."""
    return f"Essay {i}. " + " ".join(
        f"Point {i}.{k}: the tests cover edge cases." for k in range(80)
    )


@pytest.fixture(scope="module")
def auto_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    folder: Path = tmp_path_factory.mktemp("auto-mode")
    parts = [
        "[mesh]\ncooldown_s = 0.5\nhealth_check_every_s = 0.5\n",
        router_node(),
        engine_node("prefill-fast", "prefill", 1, slots=2, prefix_cache_tokens=0),
        # Throttled: prompts in passes of 8 tokens.
        engine_node(
            "decode-slow", "decode", 1, slots=2, n_batch=8, n_ubatch=8, prefix_cache_tokens=0
        ),
        route(
            MODEL,
            ["prefill-fast"],
            ["decode-slow"],
            chain=["disaggregated", "decode_only"],
            mode="auto",
        ),
    ]
    with running_mesh(folder, parts) as processes:
        # The router dialled the nodes while they loaded; its channels retry at most every
        # 2 s (grpc.max_reconnect_backoff_ms). The first request must not meet one still
        # waiting to retry (it would count a failed attempt the test does not expect).
        time.sleep(2.5)
        yield processes


@pytest_asyncio.fixture
async def router(auto_mesh: MeshProcesses) -> AsyncIterator[router_pb2_grpc.RouterServiceAsyncStub]:
    async with router_stub(auto_mesh) as stub:
        yield stub


async def served(
    router: router_pb2_grpc.RouterServiceAsyncStub, prompt: str
) -> router_pb2.GenerateSummary:
    got = await collect(router.Generate(request(MODEL, prompt, 2, ignore_eos=True)))
    summary: router_pb2.GenerateSummary | None = got.summary
    assert summary is not None and not summary.failed_attempts
    return summary


async def test_long_prompts_go_to_the_faster_prefill_node_short_ones_the_cheaper_way(
    router: router_pb2_grpc.RouterServiceAsyncStub,
) -> None:
    # No figures yet: each mode is measured once.
    first = await served(router, long_prompt(0))
    assert first.method == DISAGGREGATED
    assert first.route_reason.startswith("auto: measuring disaggregated")
    second = await served(router, long_prompt(1))
    assert second.method == DECODE_ONLY
    assert second.route_reason.startswith("auto: measuring decode_only")
    # From the figures: the prefill node evaluates long prompts several times faster, which
    # covers moving their KV. A short prompt is a near thing (the handoff's fixed cost
    # against a token or two at the throttled node's measured rate, which depends on the
    # CPU): whichever the router picks, it is the cheaper of the two estimates it states.
    for i in range(2, 5):
        long = await served(router, long_prompt(i))
        assert long.method == DISAGGREGATED, long.route_reason
        assert long.route_reason.endswith(": disaggregated")
        short = await served(router, f"Hi {i}")
        cheaper = min(estimates(short).items(), key=lambda kv: kv[1])[0]
        assert short.route_reason.endswith(f": {cheaper}"), short.route_reason
        assert short.method == (DECODE_ONLY if cheaper == "decode_only" else DISAGGREGATED)
        # A short prompt's decode_only estimate is a small part of a long one's.
        assert estimates(short)["decode_only"] < estimates(long)["decode_only"] / 10


def estimates(summary: router_pb2.GenerateSummary) -> dict[str, int]:
    """The two estimates the route reason states, in ms."""
    found = re.search(r"disaggregated ~(\d+) ms .* vs decode_only ~(\d+) ms", summary.route_reason)
    assert found, summary.route_reason
    return {"disaggregated": int(found[1]), "decode_only": int(found[2])}


def observe(costs: Costs, method: str, tokens: int, seconds: float) -> None:
    costs.learn(
        "m",
        Observation(
            method=method,
            prefill_node="p",
            decode_node="d",
            prompt_chars=4 * tokens,
            prompt_tokens=tokens,
            cached_prompt_tokens=0,
            prompt_seconds=seconds,
            handoff_seconds=0.02 if method == "disaggregated" else 0.0,
            kv_transfer_bytes=23_040 * tokens if method == "disaggregated" else 0,
            kv_state_bytes=23_040 * tokens if method == "disaggregated" else 0,
            time_to_first_token_seconds=seconds + (0.05 if method == "disaggregated" else 0.005),
        ),
    )


def test_the_choice_follows_the_measured_costs() -> None:
    idle_p, idle_d = Candidate("p", 0, 0.0), Candidate("d", 0, 0.0)
    # Equal nodes: disaggregating only adds the handoff, so decode_only wins at every size.
    equal = Costs()
    observe(equal, "disaggregated", 1000, 1.0)
    observe(equal, "decode_only", 1000, 1.0)
    for chars in (40, 4_000, 40_000):
        assert equal.decide("m", chars, idle_p, idle_d).method == "decode_only"
    # A prefill node 4x as fast: long prompts go disaggregated, short ones do not.
    fast = Costs()
    observe(fast, "disaggregated", 1000, 0.25)
    observe(fast, "decode_only", 1000, 1.0)
    assert fast.decide("m", 40, idle_p, idle_d).method == "decode_only"
    decision = fast.decide("m", 4_000, idle_p, idle_d)
    assert decision.method == "disaggregated" and decision.basis == "cost"
    # The same, but the prefill node's slots are all taken 4 times over: decode_only.
    busy = Candidate("p", 0, 4.0)
    assert fast.decide("m", 4_000, busy, idle_d).method == "decode_only"
    # The decode node already holds most of the prompt (its prefix cache): decode_only.
    holding = Candidate("d", 3_800, 0.0)
    assert fast.decide("m", 4_000, idle_p, holding).method == "decode_only"


def test_a_prompt_stays_off_a_decode_machine_whose_streams_it_would_slow() -> None:
    """The user's machines: a Mac Studio evaluates a short uncached part about as fast as a
    DGX Spark (and no handoff), so alone decode_only is the quicker first token; with 8
    streams on the Mac (another machine than the Spark), its prompt would take as long from
    each of them: disaggregated. On one machine (streams 0) both ways take the same compute."""
    costs = Costs()
    observe(costs, "disaggregated", 1000, 0.4)
    observe(costs, "decode_only", 1000, 0.3)
    idle_p = Candidate("p", 0, 0.0)
    alone = costs.decide("m", 1_200, idle_p, Candidate("d", 0, 0.0))
    assert alone.method == "decode_only"
    busy = costs.decide("m", 1_200, idle_p, Candidate("d", 0, 0.0, streams=8))
    assert busy.method == "disaggregated", busy.reason
    assert "(d, 8 streams' time): disaggregated" in busy.reason


def test_a_migration_weighs_the_prefill_node_against_the_decode_node() -> None:
    """Who evaluates a migrated generation's prompt and delivered tokens: the decode node
    taking over, or a prefill node that hands their KV state over. The user's machines: a
    prefill node 8x as fast at prompts, but decoding at half the speed (a DGX Spark's memory
    bandwidth against a Mac Studio's)."""
    costs = Costs()
    idle_d = Candidate("d", 0, 0.0)
    holding_p = Candidate("p", 4_000, 0.0)  # it prefilled this prompt: its cache holds it
    decision = costs.resume("m", 4_000, 1000, 50, holding_p, idle_d)
    assert decision.via == "decode" and decision.basis == "measuring"
    observe(costs, "disaggregated", 1000, 0.25)
    # The decode node's prompt speed is not known yet: taken as the prefill node's, which
    # holds the prompt already.
    decision = costs.resume("m", 4_000, 1000, 50, holding_p, idle_d)
    assert decision.via == "prefill" and decision.basis == "assumed"
    assert "d's prompt speed not measured: taken as p's" in decision.reason
    observe(costs, "decode_only", 1000, 2.0)
    costs.learn_steps("d", 100, 2.0)
    costs.learn_steps("p", 100, 4.0)
    # 50 tokens delivered of a 1000-token prompt: ~2 s on the prefill node against ~3 s.
    decision = costs.resume("m", 4_000, 1000, 50, holding_p, idle_d)
    assert decision.via == "prefill" and decision.basis == "cost"
    assert "1000 prompt + 50 delivered" in decision.reason
    # 400 delivered: replaying them at the prefill node's slower steps costs more.
    assert costs.resume("m", 4_000, 1000, 400, holding_p, idle_d).via == "decode"
    # The decode node holds the prompt itself (its prefix cache): it only replays.
    holding_d = Candidate("d", 4_000, 0.0)
    assert costs.resume("m", 4_000, 1000, 50, holding_p, holding_d).via == "decode"
