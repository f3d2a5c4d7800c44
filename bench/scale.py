"""Benchmark: the real router at 200 nodes (#41): 100 prefill + 100 decode simulated nodes,
10 logical models, 3 routers, a fixed arrival rate.

    python -m bench.scale [--requests 5000] [--rate 40] [--kills 0|1]

Each logical model has 10 prefill nodes (DGX Spark profile) and 10 decode nodes (M3 Ultra),
sim nodes 10 to a process (one node of a role of each model). Each model's requests belong
to 20 assignments, each with its own ~750-token rubric; a node's prefix cache holds about
4 rubrics (prefix_cache_tokens = 3,200; 704 tokens of whole blocks each), and the routes
place new prefixes by hash (prefix_placement = "hash"): the router's prefix-aware choice
keeps an assignment on the nodes that hold its rubric, where a random choice would evict it
again and again. Requests arrive at a fixed rate through 3 clients (one per router, each
failing over to the others), 32-token answers, speedup 20. Reported:

- the routers' CPU per request (utime + stime of the 3 router processes over the run, by
  /proc, divided by the requests), goal <= 2 ms; and, after the steady run, the floor under
  it: a bare Python gRPC relay making the same calls with as many messages, at one router's
  share of the rate (bench/relay_floor.py); beside it, in the steady run, what else loads
  the same cores: the sim processes' CPU per request (and their idle share, measured as the
  routers') and the clients' (this process), and the share of the machine's cores all of
  them kept busy;
- added latency: a request's time to first token at the client minus the simulated
  machines' own time before it: its prefill node's evaluation and its KV state's trip over
  the link between the two machines (each the profile's seconds / speedup), p99, goal <= 20
  ms; beside it the same with the link's time left in (what this row reported before
  2026-11-29 22:00 UTC: a whole 767-token state is 3.3 ms of it, a delta ~0.3);
- the prefix-cache hit rate (prompt tokens from a cache / prompt tokens) against random
  choice (the same requests, in the same order, over the same caches: computed with the
  sim engine's own block cache);
- load spread: max / mean requests served per decode node over the run, and max / mean
  busy slots per decode node sampled every second (median of the samples busy enough to
  say: at least one busy slot a node on average; 0 when none was).

With --kills 1: the same load while 10 % of the sim nodes (two processes of 10, one node
of a role of each model in each) and one router are SIGKILLed at random times, and
restarted 3 s later: nothing may be lost.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from bench.common import cpu_seconds, pct, run_alone, say
from bench.relay_floor import floor_ms
from disagg_mesh.client import AsyncMeshClient, GenerateCall
from disagg_mesh.metrics import Metrics
from disagg_mesh.proto.v1 import node_pb2, node_pb2_grpc
from disagg_mesh.server.common.config.topology import load_topology
from disagg_mesh.server.common.engines.sim.engine import prompt_tokens
from disagg_mesh.server.common.engines.sim.prefix import BlockCache, prompt_blocks
from disagg_mesh.server.common.engines.sim.profile import load_profile
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port
from disagg_mesh.server.common.types import Prompt

MODELS = 10
PER_MODEL = 10  # prefill nodes, and decode nodes, per model
ROUTERS = 3
ASSIGNMENTS = 20  # rubrics per model
CACHE_TOKENS = 3200
SPEEDUP = 20
NEW_TOKENS = 32
PER_PROCESS = 10
SIM_MODEL = "qwen3-coder:30b"
PLACEMENT = "hash"


def topology_text() -> str:
    parts = [
        "[mesh]\nhealth_check_every_s = 1.0\ncooldown_s = 2.0\n"
        f"sim_speedup = {SPEEDUP}\nsim_compact_kv = true\n"
    ]
    for r in range(ROUTERS):
        parts.append(
            f'[[nodes]]\nname = "router-{r}"\nrole = "router"\nhost = "127.0.0.1"\n'
            f"port = {free_port()}\n"
        )
    for m in range(MODELS):
        for role, hardware in (("prefill", "dgx-spark"), ("decode", "m3-ultra")):
            for i in range(PER_MODEL):
                parts.append(
                    f'[[nodes]]\nname = "m{m}-{role}-{i}"\nrole = "{role}"\nhost = "127.0.0.1"\n'
                    f'port = {free_port()}\nengine = "sim"\nmodel = "{SIM_MODEL}"\n'
                    f'hardware = "{hardware}"\nslots = 8\nmax_queue = 64\n'
                    f"prefix_cache_tokens = {CACHE_TOKENS}\nn_ctx = 8192\n"
                    f'sim_host = "m{m}-{role}-{i}"\n'
                )
        names = [f'"m{m}-%s-{i}"' for i in range(PER_MODEL)]
        parts.append(
            f'[[models]]\nname = "class-{m}"\nchain = ["disaggregated", "decode_only"]\n'
            f'prefix_placement = "{PLACEMENT}"\n'
            f"prefill = [{', '.join(n % 'prefill' for n in names)}]\n"
            f"decode = [{', '.join(n % 'decode' for n in names)}]\n"
        )
    return "\n".join(parts)


def prompt(model: int, assignment: int, student: int) -> str:
    rubric = f"Assignment {assignment} of class {model}: grade correctness, style, tests. " * 52
    return rubric + f"\nSubmission {student}: def solve(xs): return sorted(xs)[{student}]\n"


def workload(requests: int, seed: int = 7) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [
        (f"class-{m}", prompt(m, rng.randrange(ASSIGNMENTS), i))
        for i in range(requests)
        for m in [rng.randrange(MODELS)]
    ]


def random_choice_hit_rate(work: Sequence[tuple[str, str]], seed: int = 11) -> float:
    """The same requests over the same prefill caches, each to a node chosen at random."""
    rng = random.Random(seed)
    caches: dict[tuple[str, int], BlockCache] = {}
    cached = total = 0
    for model, text in work:
        node = (model, rng.randrange(PER_MODEL))
        cache = caches.setdefault(node, BlockCache(CACHE_TOKENS))
        blocks = prompt_blocks(text.encode())
        n = prompt_tokens(Prompt(text=text))
        cached += min(cache.cached_tokens(blocks), n - 1)
        total += n
        cache.keep(blocks)
    return cached / total


async def measure(requests: int, rate: int, kills: int) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="disagg-scale-"))
    path = folder / "topology.toml"
    path.write_text(topology_text())
    topology = load_topology(path)
    mesh = MeshProcesses(topology, folder / "logs")
    started_at = time.perf_counter()
    # Sim nodes PER_PROCESS to a process, each process one node of each of several models
    # (a process killed takes 10 % of the nodes, never all of one model's).
    mesh.start([n for n in topology.nodes if n.role == "router"])
    sims = [n for n in topology.nodes if n.role != "router"]
    groups = len(sims) // PER_PROCESS
    for g in range(groups):
        mesh.start_group(sims[g::groups])
    try:
        await mesh.wait_serving(timeout_s=300, progress=say, every_s=10)
        await asyncio.to_thread(mesh.wait_routers_see_serving, 120)
        say(f"200 sim nodes and 3 routers serving in {time.perf_counter() - started_at:.0f} s")
        got = await _load(mesh, requests, rate, bool(kills))
    finally:
        mesh.stop()
    if not kills:
        # The floor: a bare relay of the same calls at one router's share of the rate.
        say("a bare gRPC relay of the same calls at the same rate per router")
        messages = max(2, round(got["replies_per_request"]))
        got["bare_relay_cpu_ms_per_request"] = round(
            await floor_ms(rate / ROUTERS, min(requests // ROUTERS, 400), messages), 3
        )
    return got


async def _load(mesh: MeshProcesses, requests: int, rate: int, kills: bool) -> dict[str, Any]:
    topology = mesh.topology
    routers = [r.address for r in topology.routers]
    clients = [AsyncMeshClient(routers[i:] + routers[:i], timeout=120) for i in range(ROUTERS)]
    work = workload(requests)
    spark = load_profile("dgx-spark").model(SIM_MODEL)
    # The decode node's profile's link: what a state from the prefill node's machine costs.
    link = load_profile("m3-ultra").link
    # A prefill node's own time: the profile's, in passes of its n_ubatch.
    ubatch = next(n.n_ubatch for n in topology.nodes if n.role == "prefill")
    router_pids = [mesh.procs[r.name].pid for r in topology.routers]
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    spread: list[float] = []
    served = {n.name: 0 for n in topology.nodes if n.role == "decode"}
    killed: list[str] = []

    async def one(i: int, model: str, text: str) -> None:
        sent = time.perf_counter()
        first = 0.0
        replies = 0
        metrics: Metrics | None = None
        call = GenerateCall(model=model, prompt=text, max_tokens=NEW_TOKENS, ignore_eos=True)
        try:
            async for item in clients[i % ROUTERS].stream(call):
                replies += 1
                if isinstance(item, Metrics):
                    metrics = item
                elif not first:
                    first = time.perf_counter() - sent
        except Exception as exc:  # counted: nothing may be lost
            failures.append(f"{type(exc).__name__}: {exc}"[:200])
            return
        assert metrics is not None
        cached = metrics.cached_prompt_tokens
        prefill_real = spark.prefill_seconds(metrics.prompt_tokens - cached, cached, ubatch)
        prefill_real /= SPEEDUP
        served[metrics.decode_node] = served.get(metrics.decode_node, 0) + 1
        # KV moved, real size: the decode node's own copy of a prefix stayed (none moves
        # when a decode node evaluated the prompt itself).
        moved, link_s = 0, 0.0
        if metrics.method == "disaggregated":
            moved = spark.kv_bytes(metrics.prompt_tokens - metrics.decode_cached_prompt_tokens)
            link_s = link.seconds(moved) / SPEEDUP
        with_link = first - prefill_real
        results.append(
            {
                "ttft": first,
                "added": with_link - link_s,
                "added_with_link": with_link,
                "prompt": metrics.prompt_tokens,
                "cached": cached,
                "moved": moved,
                "method": metrics.method,
                "migrations": len(metrics.migrations),
                "failed_attempts": len(metrics.failed_attempts),
                "replies": replies,
            }
        )

    async def sample() -> None:
        decode = [n for n in topology.nodes if n.role == "decode"]
        stubs: dict[str, Any] = {
            n.name: node_pb2_grpc.NodeServiceStub(grpc.aio.insecure_channel(n.address))
            for n in decode
        }
        while True:
            await asyncio.sleep(1.0)
            busy = []
            for stub in stubs.values():
                try:
                    info = await stub.GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=1.0)
                    busy.append(info.slots_busy)
                except grpc.aio.AioRpcError:
                    continue
            if busy and sum(busy) >= len(busy):
                spread.append(max(busy) / (sum(busy) / len(busy)))

    async def chaos(duration: float) -> None:
        rng = random.Random(3)
        groups = sorted({p.pid: name for name, p in mesh.procs.items()}.items())
        sims = [name for _, name in groups if "router" not in name]
        victims = [*rng.sample(sims, 2), rng.choice([r.name for r in topology.routers])]
        for name in victims:
            await asyncio.sleep(rng.uniform(0.1, 0.3) * duration)
            nodes = [n for n in topology.nodes if mesh.procs.get(n.name) is mesh.procs[name]]
            mesh.procs[name].kill()
            killed.append(f"{name} ({len(nodes)} nodes)")
            say(f"SIGKILL {name} ({len(nodes)} nodes)")
            await asyncio.sleep(3.0)
            mesh.start_group(nodes)

    sim_pids = sorted({p.pid for p in mesh.procs.values()} - set(router_pids))
    # What the routers and the sim processes spend with no requests (the routers' health
    # streams to 200 nodes, their pings, the nodes' timers).
    routers_idle_from, sims_idle_from = cpu_seconds(router_pids), cpu_seconds(sim_pids)
    idle_at = time.perf_counter()
    await asyncio.sleep(5.0)
    idle_s = time.perf_counter() - idle_at
    idle_rate = (cpu_seconds(router_pids) - routers_idle_from) / idle_s
    sims_idle_rate = (cpu_seconds(sim_pids) - sims_idle_from) / idle_s
    cpu_before = cpu_seconds(router_pids)
    # The rest of this machine's load beside the routers': the sim processes and the clients
    # (this process), over the same span.
    sims_before, clients_before = cpu_seconds(sim_pids), cpu_seconds([os.getpid()])
    sampler = asyncio.create_task(sample())
    duration = requests / rate
    chaos_task = asyncio.create_task(chaos(duration)) if kills else None
    started = time.perf_counter()
    tasks = []
    for i, (model, text) in enumerate(work):
        delay = started + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, model, text)))
        if (i + 1) % max(requests // 10, 1) == 0:
            say(f"{i + 1}/{requests} sent, {len(results)} answered")
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - started
    if chaos_task is not None:
        await chaos_task
    cpu = cpu_seconds([mesh.procs[r.name].pid for r in topology.routers]) - cpu_before
    sims_cpu = cpu_seconds(sim_pids) - sims_before
    clients_cpu = cpu_seconds([os.getpid()]) - clients_before
    sampler.cancel()
    for client in clients:
        await client.close()
    prompt_total = sum(r["prompt"] for r in results) or 1

    def ms_each(seconds: float) -> float:
        """CPU seconds over the run as milliseconds per request answered."""
        return round(1000 * seconds / max(len(results), 1), 3)

    def latency_ms(seconds: list[float], share: float) -> float:
        return round(1000 * pct(seconds, share), 1)

    added = [r["added"] for r in results]
    added_with_link = [r["added_with_link"] for r in results]
    first_try = [r["added"] for r in results if not r["failed_attempts"]] or [0.0]
    retried = [r["added"] for r in results if r["failed_attempts"]] or [0.0]
    return {
        "requests": requests,
        "rate_per_second": rate,
        "answered": len(results),
        "failed": len(failures),
        "failures": failures[:10],
        "killed": killed,
        "wall_seconds": round(wall, 1),
        "router_cpu_ms_per_request": ms_each(cpu),
        "router_idle_cpu_ms_per_request": ms_each(idle_rate * wall),
        # With SIGKILLs, a killed sim process's CPU is not counted (its restart's is not either).
        "sims_cpu_ms_per_request": ms_each(sims_cpu),
        "sims_idle_cpu_ms_per_request": ms_each(sims_idle_rate * wall),
        "clients_cpu_ms_per_request": ms_each(clients_cpu),
        "machine_busy": round((cpu + sims_cpu + clients_cpu) / wall / (os.cpu_count() or 1), 3),
        "added_latency_p50_ms": latency_ms(added, 0.50),
        "added_latency_p99_ms": latency_ms(added, 0.99),
        "added_latency_with_link_p50_ms": latency_ms(added_with_link, 0.50),
        "added_latency_with_link_p99_ms": latency_ms(added_with_link, 0.99),
        # Those answered at the first try, and the retried ones' median (an ABORTED state:
        # a prefill again and the whole state): what sets the p99.
        "added_latency_p99_first_try_ms": latency_ms(first_try, 0.99),
        "added_latency_p50_retried_ms": latency_ms(retried, 0.50),
        "hit_rate": round(sum(r["cached"] for r in results) / prompt_total, 3),
        "random_choice_hit_rate": round(random_choice_hit_rate(work), 3),
        # Busy slots per decode node, sampled every second while it ran (samples with at
        # least one busy slot per node on average), and requests served per decode node.
        "load_spread_max_over_mean": round(pct(spread, 0.5), 2) if spread else 0.0,
        "requests_spread_max_over_mean": round(
            max(served.values()) / (sum(served.values()) / len(served)), 2
        ),
        "kv_gb_moved": round(sum(r["moved"] for r in results) / 1e9, 2),
        "migrations": sum(r["migrations"] for r in results),
        "failed_attempts": sum(r["failed_attempts"] for r in results),
        "methods": {
            m: sum(r["method"] == m for r in results) for m in {r["method"] for r in results}
        },
        "replies_per_request": round(sum(r["replies"] for r in results) / max(len(results), 1), 2),
    }


async def measure_both(requests: int, rate: int) -> dict[str, Any]:
    """make bench's row 23: the steady run, then the one with SIGKILLs."""
    return {
        "steady": await measure(requests, rate, 0),
        "kills": await measure(requests, rate, 1),
    }


def rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    kills = f", {len(m['killed'])} SIGKILLs" if m["killed"] else ""
    # Results from before 2026-11-29 22:00 UTC left the link's time in the added latency.
    linked = "added_latency_with_link_p99_ms" in m
    return [
        (
            f"200 sim nodes, 3 routers, {m['requests']} requests at {m['rate_per_second']}/s"
            f"{kills}: answered (failed)",
            f"{m['answered']} ({m['failed']})",
            "all (0)",
        ),
        (
            "  router CPU per request (of which idle health checks)",
            f"{m['router_cpu_ms_per_request']:.2f} ms ({m['router_idle_cpu_ms_per_request']:.2f})",
            "<= 2 ms",
        ),
        *(
            [
                (
                    "  a bare Python gRPC relay of the same calls at one router's rate (floor)",
                    f"{m['bare_relay_cpu_ms_per_request']:.2f} ms",
                    "-",
                )
            ]
            if "bare_relay_cpu_ms_per_request" in m
            else []
        ),
        *(
            [
                (
                    "  CPU per request beside: sim nodes (of which idle), clients (cores busy)",
                    f"{m['sims_cpu_ms_per_request']:.2f} ms "
                    f"({m['sims_idle_cpu_ms_per_request']:.2f}), "
                    f"{m['clients_cpu_ms_per_request']:.2f} ms ({100 * m['machine_busy']:.0f} %)",
                    "-",
                )
            ]
            if "sims_idle_cpu_ms_per_request" in m and not m["killed"]
            else []
        ),
        (
            "  added latency p99 (p50)"
            + (": TTFT - the prefill's and the KV link's simulated time" if linked else ""),
            f"{m['added_latency_p99_ms']:.0f} ms ({m['added_latency_p50_ms']:.0f})",
            "<= 20 ms",
        ),
        *(
            [
                (
                    "  ... with the KV link's simulated time left in",
                    f"{m['added_latency_with_link_p99_ms']:.0f} ms "
                    f"({m['added_latency_with_link_p50_ms']:.0f})",
                    "-",
                )
            ]
            if linked
            else []
        ),
        (
            "  ... p99 of those answered at the first try (p50 of the retried)",
            f"{m['added_latency_p99_first_try_ms']:.0f} ms "
            f"({m['added_latency_p50_retried_ms']:.0f})",
            "-",
        ),
        (
            "  prefix-cache hit rate / random choice's",
            f"{m['hit_rate']:.2f} / {m['random_choice_hit_rate']:.2f}",
            "> random",
        ),
        (
            "  load spread per decode node, max / mean: requests served (busy slots)",
            f"{m['requests_spread_max_over_mean']:.2f} ({m['load_spread_max_over_mean']:.2f})",
            "-",
        ),
    ]


def main() -> int:
    options = {"requests": 5000, "rate": 40, "kills": 0}
    return run_alone(__doc__, "scale", measure, rows, options, repeats=None)


if __name__ == "__main__":
    sys.exit(main())
