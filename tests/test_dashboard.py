"""The router's live dashboard (/dashboard): its JSON endpoint's schema, its figures, and the
page itself in a real browser (Debian's chromium, driven by Playwright) against a real mesh:
no console errors, nothing fetched from outside 127.0.0.1, every node and model shown,
counts and charts that move after requests, a SIGKILLed decode node drawn down within 5 s
and serving again after its restart, and the page reconnecting after its router restarts.
Screenshots go to .run/test-artifacts/dashboard/ (or $DISAGG_TEST_ARTIFACTS)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc
import httpx
import jsonschema
import pytest

from disagg_mesh.proto.v1 import node_pb2, node_pb2_grpc
from disagg_mesh.server.common.config.topology import load_topology
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port
from disagg_mesh.server.common.types import HostUsage, NodeReport
from disagg_mesh.server.router.dashboard.recent import (
    KEEP_S,
    Done,
    Failed,
    Merged,
    Recent,
    Records,
    busy_seconds,
    percentile,
)
from disagg_mesh.server.router.dashboard.state import ASKS_PER_TICK, HISTORY, DashboardState
from disagg_mesh.server.router.summary import FailedAttempt, RouteMethod, RouteSummary
from tests.conftest import ROOT, engine_node, route, router_node, running_mesh

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("DISAGG_TEST_ARTIFACTS", ROOT / ".run/test-artifacts/dashboard"))
MODELS = ("code", "feedback")

_NUMBER_OR_NULL = {"type": ["number", "null"]}
_QUANTILES = {
    "type": "object",
    "required": ["p50", "p95", "p99"],
    "properties": {q: _NUMBER_OR_NULL for q in ("p50", "p95", "p99")},
}
# The documented shape of GET /api/dashboard (README, "The dashboard").
SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "schema",
        "router",
        "routers_counted",
        "generated_at",
        "sample_every_seconds",
        "window_seconds",
        "nodes",
        "hosts",
        "models",
        "targets",
        "history",
    ],
    "properties": {
        "schema": {"const": "disagg-mesh.dashboard.v1"},
        "router": {"type": "string"},
        "routers_counted": {"type": "array", "items": {"type": "string"}},
        "generated_at": {"type": "number"},
        "nodes": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "name",
                    "role",
                    "host",
                    "address",
                    "models",
                    "engine",
                    "health",
                    "problem",
                    "backend",
                    "gpu_layers",
                    "model_layers",
                    "slots",
                    "slots_busy",
                    "queue_depth",
                    "restarts",
                    "uptime_seconds",
                    "asked_seconds_ago",
                ],
                "properties": {
                    "role": {"enum": ["router", "prefill", "decode"]},
                    "health": {"enum": ["serving", "not ready", "down"]},
                    "models": {"type": "array", "items": {"type": "string"}},
                    "uptime_seconds": _NUMBER_OR_NULL,
                    "asked_seconds_ago": _NUMBER_OR_NULL,
                },
            },
        },
        "hosts": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["host", "nodes", "usage"],
                "properties": {
                    "usage": {
                        "type": ["object", "null"],
                        "required": [
                            "hostname",
                            "cpu_cores",
                            "cpu_busy_percent",
                            "memory_used_bytes",
                            "memory_total_bytes",
                            "gpu_name",
                            "gpu_utilization_percent",
                            "gpu_memory_used_bytes",
                            "gpu_memory_total_bytes",
                            "unavailable",
                        ],
                    }
                },
            },
        },
        "models": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": [
                    "requests",
                    "failed",
                    "requests_per_second",
                    "tokens_per_second",
                    "ttft_seconds",
                    "total_seconds",
                    "kv_handoff_seconds_p50",
                    "kv_megabytes_per_second",
                    "prefix_cache_hit_rate",
                    "migrations",
                    "failovers",
                    "errors",
                ],
                "properties": {
                    "ttft_seconds": _QUANTILES,
                    "total_seconds": _QUANTILES,
                    "errors": {"type": "object", "additionalProperties": {"type": "integer"}},
                },
            },
        },
        "targets": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "what", "goal", "unit", "value", "ok"],
                "properties": {"ok": {"type": ["boolean", "null"]}, "value": _NUMBER_OR_NULL},
            },
        },
        "history": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["t", "models", "hosts", "serving"],
            },
        },
    },
}


@dataclass
class Dash:
    processes: MeshProcesses
    url: str


@pytest.fixture(scope="module")
def dash(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dash]:
    port = free_port()
    parts = [
        router_node(http_port=port),
        engine_node("prefill-d", "prefill", 1, slots=2),
        engine_node("decode-d", "decode", 1, slots=2),
        *(route(m, ["prefill-d"], ["decode-d"]) for m in MODELS),
    ]
    with running_mesh(tmp_path_factory.mktemp("dashboard"), parts) as processes:
        yield Dash(processes, f"http://127.0.0.1:{port}")


def ask(url: str, model: str, text: str = "Say hello.") -> None:
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text


def state(url: str) -> dict[str, Any]:
    reply = httpx.get(f"{url}/api/dashboard", timeout=10)
    assert reply.status_code == 200
    return dict(reply.json())


def serving(processes: MeshProcesses, name: str, timeout_s: float) -> None:
    """Wait until a node restarted by the test serves (in a thread: Playwright's sync API
    keeps an event loop of its own on this one)."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, processes.wait_serving(timeout_s=timeout_s, names=[name])).result()


def wait_for(what: str, check: Any, timeout_s: float) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.1)
    return time.monotonic() - started


def test_the_json_endpoint_keeps_its_documented_shape(dash: Dash) -> None:
    for model in MODELS:
        ask(dash.url, model)
    wait_for(
        "the requests in the state",
        lambda: all(state(dash.url)["models"][m]["requests"] >= 1 for m in MODELS),
        10,
    )
    body = state(dash.url)
    jsonschema.validate(body, SCHEMA)
    assert {n["name"] for n in body["nodes"]} == {"router", "prefill-d", "decode-d"}
    assert all(n["health"] == "serving" for n in body["nodes"])
    (host,) = body["hosts"]
    assert host["host"] == "127.0.0.1" and sorted(host["nodes"]) == sorted(
        ["router", "prefill-d", "decode-d"]
    )
    usage = host["usage"]
    assert usage["cpu_cores"] >= 1 and 0 < usage["memory_used_bytes"] < usage["memory_total_bytes"]
    if not usage["gpu_name"]:  # no GPU here: the page says why, not a silent zero
        assert usage["unavailable"] and usage["unavailable"][0].startswith("gpu:")
    for model in MODELS:
        figures = body["models"][model]
        assert figures["ttft_seconds"]["p50"] > 0 and figures["tokens_per_second"] > 0
        assert figures["kv_megabytes_per_second"] > 0  # disaggregated: a KV state moved
    assert body["history"] and body["history"][-1]["t"] <= body["generated_at"] + 1e-6
    # Where the figures come from: each node's GetNodeInfo, with its machine and uptime.
    decode = dash.processes.topology.node("decode-d")
    with grpc.insecure_channel(decode.address) as channel:
        info = node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(
            node_pb2.GetNodeInfoRequest(), timeout=10
        )
    assert info.uptime_seconds > 0 and info.host.cpu_cores >= 1
    assert 0 < info.host.memory_used_bytes < info.host.memory_total_bytes
    assert info.host.hostname and (info.host.gpu_name or info.host.unavailable)
    # The page and its files come from the router, with a licence for what is vendored.
    for path, kind in (
        ("/dashboard", "text/html"),
        ("/dashboard/static/dashboard.js", "text/javascript"),
        ("/dashboard/static/uPlot.iife.min.js", "text/javascript"),
        ("/dashboard/static/LICENSE-uPlot", "text/plain"),
    ):
        reply = httpx.get(f"{dash.url}{path}", timeout=10)
        assert reply.status_code == 200 and reply.headers["content-type"].startswith(kind)
    assert httpx.get(f"{dash.url}/dashboard/static/../x", timeout=10).status_code == 404


def test_every_routers_page_counts_the_whole_meshs_requests(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Requests served by one router show on the other's page: each pulls the others'
    requests (GET /api/dashboard/requests) every tick."""
    ports = [free_port(), free_port()]
    routers = [
        f'[[nodes]]\nname = "router-{i}"\nrole = "router"\nhost = "127.0.0.1"\n'
        f"port = {free_port()}\nhttp_port = {ports[i]}\n"
        for i in range(2)
    ]
    parts = [
        *routers,
        engine_node("decode-r", "decode", 1, slots=2),
        route("code", [], ["decode-r"], chain=["decode_only"]),
    ]
    with running_mesh(tmp_path_factory.mktemp("two-routers"), parts) as processes:
        first, second = (f"http://127.0.0.1:{port}" for port in ports)
        for _ in range(2):
            ask(second, "code")
        ask(first, "code")

        def counted() -> bool:
            body = state(first)
            return body["models"]["code"]["requests"] == 3 and sorted(body["routers_counted"]) == [
                "router-0",
                "router-1",
            ]

        wait_for("the other router's requests on the first's page", counted, 10)
        reply = httpx.get(f"{second}/api/dashboard/requests", params={"since": "0"}, timeout=5)
        assert reply.status_code == 200 and len(reply.json()["done"]) == 2
        for since in ("x", "nan"):
            bad = httpx.get(f"{second}/api/dashboard/requests", params={"since": since})
            assert bad.status_code == 400 and "since" in bad.text

        # A router stopping with a page open ends the page's feed and exits at once.
        ended = threading.Event()

        def read() -> None:
            with httpx.stream("GET", f"{first}/api/dashboard/events", timeout=30) as events:
                for _ in events.iter_lines():
                    pass
            ended.set()

        threading.Thread(target=read, daemon=True).start()
        time.sleep(2.5)  # connected, and an update read
        router = processes.procs["router-0"]
        started = time.monotonic()
        router.send_signal(signal.SIGTERM)
        assert router.wait(30) == 0
        assert time.monotonic() - started < 8
        assert ended.wait(5)


# -- the page in a real browser ------------------------------------------------------------


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium: `make test` installs Debian's (apt-get install chromium); "
    "elsewhere install Chromium and put it on PATH",
)
def test_the_page_in_a_real_browser_follows_the_mesh(dash: Dash) -> None:
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    outside: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on(
                "request",
                lambda r: (
                    outside.append(r.url)
                    if urlparse(r.url).hostname not in ("127.0.0.1", None)
                    else None
                ),
            )
            page.goto(f"{dash.url}/dashboard")
            page.wait_for_function("document.getElementById('status').textContent === 'live'")
            for name in ("router", "prefill-d", "decode-d"):
                page.wait_for_selector(f"[data-node='{name}'] [data-health='serving']")
            for model in MODELS:
                page.wait_for_selector(f"[data-model='{model}'] [data-chart='{model}/rate']")
            page.screenshot(path=ARTIFACTS / "1-loaded.png", full_page=True)

            # After requests, the counts and the charts move.
            chart = page.locator("[data-chart='code/ttft'] canvas").first
            before = chart.screenshot()
            for _ in range(2):
                for model in MODELS:
                    ask(dash.url, model, "Write one line about testing.")
            page.wait_for_function(
                "Number(document.querySelector(\"[data-model='code'] [data-figure='requests']\")"
                ".textContent) >= 2",
                timeout=10_000,
            )
            page.wait_for_timeout(2500)  # a tick later the chart has the new points
            assert chart.screenshot() != before
            page.screenshot(path=ARTIFACTS / "2-after-requests.png", full_page=True)

            # A SIGKILLed decode node is drawn down within 5 s; the page keeps drawing.
            decode = dash.processes.topology.node("decode-d")
            dash.processes.procs["decode-d"].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            page.wait_for_selector("[data-node='decode-d'] [data-health='down']", timeout=5_000)
            took = time.monotonic() - killed
            assert took < 5.0, took
            updated = page.text_content("#updated")
            page.wait_for_function(
                f"document.getElementById('updated').textContent !== {updated!r}",
                timeout=5_000,
            )
            page.screenshot(path=ARTIFACTS / "3-decode-node-down.png", full_page=True)
            dash.processes.procs["decode-d"].wait(10)
            dash.processes.start_node(decode)
            serving(dash.processes, "decode-d", 120)
            page.wait_for_selector("[data-node='decode-d'] [data-health='serving']", timeout=10_000)
            page.screenshot(path=ARTIFACTS / "4-decode-node-back.png", full_page=True)

            # The router restarts: the page says so, reconnects and draws again.
            router = dash.processes.topology.router
            dash.processes.procs[router.name].send_signal(signal.SIGKILL)
            dash.processes.procs[router.name].wait(10)
            page.wait_for_function(
                "document.getElementById('status').textContent.startsWith('reconnecting')",
                timeout=10_000,
            )
            dash.processes.start_node(router)
            serving(dash.processes, router.name, 60)
            page.wait_for_function(
                "document.getElementById('status').textContent === 'live'", timeout=15_000
            )
            page.wait_for_selector("[data-node='decode-d'] [data-health='serving']")
            page.screenshot(path=ARTIFACTS / "5-router-restarted.png", full_page=True)
        finally:
            browser.close()
    # A page that lost its router logs the failed fetches of its event stream: those are
    # the reconnects asked of it, not faults of the page.
    faults = [p for p in problems if "api/dashboard/events" not in p and "ERR_" not in p]
    assert not faults, faults
    assert not outside, outside


# -- figures, without a mesh -----------------------------------------------------------------


def test_percentiles_and_busy_time() -> None:
    assert percentile([], 50) is None
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 95), percentile(values, 99)) == (
        50.0,
        95.0,
        99.0,
    )
    assert busy_seconds([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17


def summary(total: float, ttft: float, failed_s: float = 0.0) -> RouteSummary:
    s = RouteSummary(
        method=RouteMethod.DISAGGREGATED,
        total_seconds=total,
        time_to_first_token_seconds=ttft,
        prompt_tokens=100,
        cached_prompt_tokens=60,
        completion_tokens=20,
        kv_transfer_bytes=2_000_000,
        kv_transfer_seconds=0.01,
        kv_load_seconds=0.01,
    )
    if failed_s:
        s.failed_attempts.append(
            FailedAttempt(RouteMethod.DISAGGREGATED, "x", "UNAVAILABLE", "", failed_s)
        )
    return s


def test_parallel_efficiency_is_the_two_pipelines_overlap() -> None:
    now = [1000.0]
    recent = Recent(clock=lambda: now[0])
    recent.served("code", summary(10, 1))  # 990-1000
    recent.served("feedback", summary(10, 1))  # the same ten seconds: side by side
    assert recent.parallel_efficiency(60) == pytest.approx(2.0)
    now[0] = 1010.0
    recent.served("code", summary(10, 1))  # 1000-1010, feedback idle: alone
    assert recent.parallel_efficiency(60) == pytest.approx(30 / 20)
    figures = recent.figures(["code", "feedback"], 60)
    assert figures["code"].requests == 2 and figures["code"].prefix_cache_hit_rate == 0.6
    assert figures["code"].kv_megabytes_per_second == pytest.approx(100.0)


def test_records_read_from_their_newest_end_say_what_a_scan_of_all_would() -> None:
    """A window is read from the newest record back (a tick costs the window, not the hour):
    with other routers' records arriving out of order, late, and the hour running out, the
    windows, a peer's pull and the hour's counts equal what the definitions say."""
    rng = random.Random(7)
    now = [0.0]
    own = Recent(clock=lambda: now[0])
    peers = Records(clock=lambda: now[0])
    mesh = Merged([own, peers], clock=lambda: now[0])
    every_done: list[Done] = []
    every_failed: list[Failed] = []
    for step in range(5_000):
        now[0] += rng.uniform(0.5, 3.0)
        if rng.random() < 0.8:
            own.served("code", summary(1.0, 0.2, failed_s=5.0 if rng.random() < 0.05 else 0))
            every_done.append(own.done[-1])
        else:
            own.refused("code", "UNAVAILABLE")
            every_failed.append(own.failed[-1])
        if step % 3 == 0:  # another router's, pulled late: up to 4 s old, in its own order
            done = [
                Done("feedback", t - 1, t, 0.1, 1.0, 10, 5, 0, 0.0, 0, 0, 0, 0.0)
                for t in sorted(now[0] - rng.uniform(0, 4) for _ in range(rng.randint(0, 3)))
            ]
            failed = [Failed("feedback", now[0] - rng.uniform(0, 4), "INTERNAL")]
            peers.add(done, failed)
            every_done += done
            every_failed += failed
        if step % 97 == 0:
            for seconds in (60.0, 600.0, KEEP_S):
                start = now[0] - seconds
                done, failed = mesh.since(seconds)
                assert sorted(d.ended for d in done) == sorted(
                    d.ended for d in every_done if d.ended >= start
                )
                assert sorted(f.at for f in failed) == sorted(
                    f.at for f in every_failed if f.at >= start
                )
            t = now[0] - rng.uniform(0, 30)
            assert own.after(t)[0] == [d for d in own.done if d.ended > t]
            hour = mesh.hour()
            in_hour = [d for d in every_done if d.ended >= now[0] - KEEP_S]
            assert hour.done == len(in_hour)
            assert hour.failed == sum(1 for f in every_failed if f.at >= now[0] - KEEP_S)
            longest = max((d.failover_s for d in in_hour if d.failover_s > 0), default=None)
            assert hour.longest_failover_s == longest
    assert now[0] > 2 * KEEP_S  # the hour ran out, more than once


def report(name: str, ready: bool = True) -> NodeReport:
    host = HostUsage("box", 2, 50.0, 1 << 30, 4 << 30, unavailable=("gpu: none here",))
    return NodeReport(
        name, "decode", "llama_cpp", "m", "CPU", 0, 31, ready, "", 2, 1, 0, 0, 5.0, host
    )


def test_targets_go_red_and_green_with_what_they_measure(tmp_path: Path) -> None:
    path = tmp_path / "topology.toml"
    path.write_text(
        "\n".join(
            [
                router_node(),
                engine_node("prefill-t", "prefill"),
                engine_node("decode-t", "decode"),
                route("code", ["prefill-t"], ["decode-t"]),
            ]
        )
    )
    topology = load_topology(path)
    answers: dict[str, NodeReport | None] = {
        "prefill-t": report("prefill-t"),
        "decode-t": report("decode-t"),
    }

    async def ask_node(node: Any) -> NodeReport | None:
        return answers[node.name]

    now = [5000.0]
    recent = Recent(clock=lambda: now[0])
    dashboard = DashboardState(topology, topology.router, recent, ask_node, clock=lambda: now[0])

    def targets() -> dict[str, tuple[float | None, bool | None]]:
        asyncio.run(dashboard.tick())
        return {t["key"]: (t["value"], t["ok"]) for t in dashboard.current["targets"]}

    assert targets()["uptime"] == (100.0, True)
    recent.served("code", summary(20, 2, failed_s=7))  # slow, and a 7 s failover
    recent.refused("code", "RESOURCE_EXHAUSTED")
    t = targets()
    assert t["end_to_end_p95"] == (20.0, False) and t["failover"] == (7.0, False)
    assert t["error_rate"] == (50.0, False) and t["parallel_efficiency"] == (None, None)
    answers["decode-t"] = None  # down: drawn so, and uptime falls
    t = targets()
    rows = {n["name"]: n for n in dashboard.current["nodes"]}
    assert rows["decode-t"]["health"] == "down" and t["uptime"][1] is False
    assert len(dashboard.history) == 3 and dashboard.history[-1]["serving"] == 2


def test_an_hours_history_is_encoded_once_and_sent_as_the_state_reads(tmp_path: Path) -> None:
    """GET /api/dashboard's body is built once a tick from samples encoded once each (an
    hour of samples re-encoded took ~35 ms a GET on the user's topology), and it and the
    feed's update say what the state holds."""
    path = tmp_path / "topology.toml"
    path.write_text(
        "\n".join(
            [
                router_node(),
                engine_node("decode-h", "decode"),
                route("code", [], ["decode-h"], chain=["decode_only"]),
            ]
        )
    )
    topology = load_topology(path)

    async def ask_node(node: Any) -> NodeReport | None:
        return report(node.name)

    now = [5000.0]
    recent = Recent(clock=lambda: now[0])
    dashboard = DashboardState(topology, topology.router, recent, ask_node, clock=lambda: now[0])
    before = json.loads(dashboard.snapshot_json())  # before the first tick: no history yet
    assert before["history"] == [] and before["schema"] == "disagg-mesh.dashboard.v1"

    async def ticks(n: int) -> None:
        for _ in range(n):
            now[0] += 2.0
            recent.served("code", summary(1.0, 0.25))
            await dashboard.tick()

    asyncio.run(ticks(HISTORY + 3))
    body = dashboard.snapshot_json()
    assert dashboard.snapshot_json() is body  # one build a tick
    state = json.loads(body)
    assert len(state["history"]) == HISTORY and state["history"] == dashboard.history
    assert state["history"][-1]["t"] == now[0] and state["history"][0]["t"] == now[0] - 2 * (
        HISTORY - 1
    )
    assert {k: v for k, v in state.items() if k != "history"} == json.loads(
        json.dumps(dashboard.current)
    )
    ttft = state["models"]["code"]["ttft_seconds"]["p50"]
    assert state["history"][-1]["models"]["code"]["ttft_p50"] == float(f"{ttft:.4g}")

    async def one_update() -> dict[str, Any]:
        async with dashboard.feed() as updates:
            await ticks(1)
            update = updates.get_nowait()
            assert update is not None
            return dict(json.loads(update))

    update = asyncio.run(one_update())
    assert dashboard.snapshot_json() is not body  # a new tick, a new body
    assert update.pop("sample") == dashboard.history[-1] and "history" not in update
    assert update == json.loads(json.dumps(dashboard.current))


def test_with_a_mesh_token_the_dashboard_wants_it_as_a_header_or_in_the_url(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISAGG_TEST_DASHBOARD_TOKEN", "s3cret")
    port = free_port()
    parts = [
        '[security]\ntoken_env = "DISAGG_TEST_DASHBOARD_TOKEN"\n',
        router_node(http_port=port),
        engine_node("decode-k", "decode", 1, slots=2),
        route("k", [], ["decode-k"], chain=["decode_only"]),
    ]
    with running_mesh(tmp_path_factory.mktemp("dashboard-token"), parts):
        url = f"http://127.0.0.1:{port}"
        for path in ("/dashboard", "/api/dashboard", "/api/dashboard/requests"):
            assert httpx.get(f"{url}{path}", timeout=10).status_code == 401, path
            wrong = httpx.get(f"{url}{path}", params={"token": "nope"}, timeout=10)
            assert wrong.status_code == 401, path
            header = {"Authorization": "Bearer s3cret"}
            assert httpx.get(f"{url}{path}", headers=header, timeout=10).status_code == 200
            query = httpx.get(f"{url}{path}", params={"token": "s3cret"}, timeout=10)
            assert query.status_code == 200, path


def test_on_a_big_mesh_a_tick_asks_a_bounded_few_and_the_health_watch_fills_in(
    tmp_path: Path,
) -> None:
    """At 200 nodes, asking every node every 2 s was 100 GetNodeInfo calls a second a
    router: a tick asks every node once, then ASKS_PER_TICK at most, those asked longest
    ago; a node the health watch loses in between is drawn down at once and asked first."""
    nodes = [f"{role}-{i}" for role in ("prefill", "decode") for i in range(30)]
    path = tmp_path / "topology.toml"
    path.write_text(
        "\n".join(
            [
                router_node(),
                *(engine_node(n, n.partition("-")[0]) for n in nodes),
                route("code", nodes[:30], nodes[30:]),
            ]
        )
    )
    topology = load_topology(path)
    answers: dict[str, NodeReport | None] = {n: report(n) for n in nodes}
    asked: list[str] = []
    watch: dict[str, bool] = {}

    async def ask_node(node: Any) -> NodeReport | None:
        asked.append(node.name)
        return answers[node.name]

    dashboard = DashboardState(
        topology,
        topology.router,
        Recent(),
        ask_node,
        serving=lambda node: watch.get(node.name, True),
    )

    def tick() -> dict[str, dict[str, Any]]:
        asked.clear()
        asyncio.run(dashboard.tick())
        return {n["name"]: n for n in dashboard.current["nodes"]}

    rows = tick()
    assert len(asked) == len(nodes) and len(rows) == len(nodes) + 1  # the router asks itself
    assert all(r["health"] == "serving" for r in rows.values())
    seen: set[str] = set()
    for _ in range(3):  # 60 nodes and the router, 24 a tick: each in turn within 3 ticks
        left = set(nodes) - seen
        rows = tick()
        # (the router's row is one of the tick's, asked of itself)
        assert ASKS_PER_TICK - 1 <= len(asked) <= ASKS_PER_TICK
        assert set(asked) >= left or set(asked) <= left  # none again before the rest
        seen |= set(asked)
        assert all(r["health"] == "serving" and r["asked_seconds_ago"] >= 0 for r in rows.values())
    assert seen == set(nodes)
    lost = next(n for n in nodes if n not in asked)  # answered a while ago
    watch[lost] = False
    answers[lost] = None
    rows = tick()
    assert asked[0] == lost and rows[lost]["health"] == "down"
    assert rows[lost]["problem"] == "no answer to GetNodeInfo"
    watch[lost] = True  # back: asked first again, drawn serving
    answers[lost] = report(lost)
    rows = tick()
    assert asked[0] == lost and rows[lost]["health"] == "serving"
    # More lost at once than a tick asks: those it does not ask yet are drawn down at once.
    gone = nodes[:30]
    watch.update(dict.fromkeys(gone, False))
    answers.update(dict.fromkeys(gone))
    rows = tick()
    assert set(asked) < set(gone) and len(asked) == ASKS_PER_TICK
    assert all(rows[n]["health"] == "down" for n in gone)
    late = [n for n in gone if n not in asked]
    assert late and all(rows[n]["problem"].startswith("its health watch lost it") for n in late)
