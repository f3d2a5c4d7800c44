"""Benchmark: time to resume when a decode node dies mid-answer (migration).

    python -m bench.migration [--kills 5] [--new-tokens 200]

Starts a mesh of its own (a router, a prefill node and two decode nodes, embedded, one
thread each; the decode nodes without a prefix cache, so the node taking over holds none of
the prompt), then, for a short prompt and a ~1,000-token one, and for each way the prompt
and the delivered tokens are evaluated for the node taking over (`migrate_via`: "decode",
by that node itself; "prefill", by the prefill node, which prefilled the request and holds
the prompt in its cache, then a KV handoff), for each kill: a greedy disaggregated answer
of `--new-tokens` tokens starts, the decode node generating it is SIGKILLed once the caller
has 5 deltas, and the router continues on the other node. Reported, median over the kills:

9. resume time: the summary's `resume_duration` (from the failure to the next text sent),
   and what the caller saw (the longest gap between two deltas of the answer), against the
   user's 5 s failover target; whether the text equals the uninterrupted answer; and, per
   prompt, the prefill node's way against the decode node's.

The killed node is restarted, and the router given time to see it, before the next kill.
Writes JSON to bench/results/ when run alone; `make bench` (bench/run.py) runs it as row 9.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import Any

import grpc

from bench.common import MODEL, median, run_alone, say
from disagg_mesh.proto.v1 import node_pb2, node_pb2_grpc, router_pb2, router_pb2_grpc, types_pb2
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port, serving_mesh

NODES = ("decode-a", "decode-b")
PROMPT = "Count from one to one hundred in words, separated by commas: one, two,"
# ~1,000 tokens of context before the same question.
CONTEXT = (
    "Grading notes. Each answer is read for correctness first, then for clarity, then for "
    "the use of the course's terms. A correct answer that is hard to follow loses a point; "
    "an unclear answer that is wrong loses all of them. "
) * 22
PROMPTS = {"short": PROMPT, "long": CONTEXT + PROMPT}
WAYS = ("decode", "prefill")
TARGET_S = 5.0
KILL_AFTER = 5


def topology_text() -> str:
    node = '[[nodes]]\nname = "{}"\nrole = "{}"\nhost = "127.0.0.1"\nport = {}\n'
    engine = f'engine = "llama_cpp"\nmodel = "{MODEL}"\nn_ctx = 2048\nslots = 2\nn_threads = 1\n'
    parts = [
        "[mesh]\ncooldown_s = 0.5\nhealth_check_every_s = 0.5\n",
        node.format("router", "router", free_port()),
        node.format("prefill-p", "prefill", free_port()) + engine,
    ]
    parts += [
        node.format(name, "decode", free_port()) + engine + "prefix_cache_tokens = 0\n"
        for name in NODES
    ]
    decode = ", ".join(f'"{n}"' for n in NODES)
    parts += [
        f'[[models]]\nname = "{way}"\nchain = ["disaggregated"]\nprefill = ["prefill-p"]\n'
        f'decode = [{decode}]\nmigrate_via = "{way}"\n'
        for way in WAYS
    ]
    return "\n".join(parts)


class Answer:
    def __init__(self) -> None:
        self.deltas: list[str] = []
        self.at: list[float] = []
        self.summary: router_pb2.GenerateSummary | None = None


async def answer(stub: Any, way: str, prompt: str, new_tokens: int, kill: Any = None) -> Answer:
    out = Answer()
    request = router_pb2.GenerateRequest(
        model=way,
        prompt=prompt,
        sampling=types_pb2.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
    )
    async for reply in stub.Generate(request, timeout=300):
        if reply.HasField("delta"):
            out.deltas.append(reply.delta.text)
            out.at.append(time.perf_counter())
            if len(out.deltas) == KILL_AFTER and kill is not None:
                await kill()
        else:
            out.summary = reply.summary
    return out


async def generating_node(mesh: MeshProcesses) -> str:
    for name in NODES:
        address = mesh.topology.node(name).address
        async with grpc.aio.insecure_channel(address) as channel:
            info = await node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(
                node_pb2.GetNodeInfoRequest(), timeout=2
            )
        if info.slots_busy:
            return name
    raise RuntimeError("no decode node is generating")


async def measure(kills: int, new_tokens: int) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    async with (
        serving_mesh(topology_text(), "bench-migration-") as mesh,
        grpc.aio.insecure_channel(mesh.topology.router.address) as channel,
    ):
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for size, prompt in PROMPTS.items():
            for way in WAYS:
                runs.append(await measure_way(mesh, stub, way, size, prompt, kills, new_tokens))
    return {"kills": kills, "new_tokens": new_tokens, "runs": runs, "target_s": TARGET_S}


async def measure_way(
    mesh: MeshProcesses, stub: Any, way: str, size: str, prompt: str, kills: int, new_tokens: int
) -> dict[str, Any]:
    alone = await answer(stub, way, prompt, new_tokens)
    assert alone.summary is not None
    resume_s, caller_gap_s, same, via = [], [], [], []
    killed: list[str] = []

    async def kill() -> None:
        name = await generating_node(mesh)
        os.kill(mesh.procs[name].pid, signal.SIGKILL)
        killed[:] = [name]

    for k in range(kills):
        got = await answer(stub, way, prompt, new_tokens, kill)
        assert got.summary is not None
        (migration,) = got.summary.migrations
        resume_s.append(migration.resume_duration.ToNanoseconds() / 1e9)
        caller_gap_s.append(max(b - a for a, b in zip(got.at, got.at[1:], strict=False)))
        same.append("".join(got.deltas) == "".join(alone.deltas))
        via.append(migration.via_prefill_node)
        say(
            f"   {size} prompt, via {way}, kill {k + 1}: {killed[0]} after "
            f"{migration.tokens_delivered} tokens, resumed on {migration.resumed_on}"
            f"{' via ' + migration.via_prefill_node if migration.via_prefill_node else ''} in "
            f"{resume_s[-1] * 1000:.0f} ms (caller's longest gap "
            f"{caller_gap_s[-1] * 1000:.0f} ms), same text: {same[-1]}"
        )
        mesh.procs[killed[0]].wait()
        mesh.start_node(mesh.topology.node(killed[0]))
        await mesh.wait_serving(300, names=killed)
        await asyncio.sleep(6.0)  # the router's channel reconnects with back-off
    return {
        "way": way,
        "prompt": size,
        "prompt_tokens": alone.summary.prompt_tokens,
        "resume_s": resume_s,
        "caller_gap_s": caller_gap_s,
        "same_text": same,
        "via_prefill_node": via,
        "median_resume_s": median(resume_s),
        "median_caller_gap_s": median(caller_gap_s),
    }


def rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    out = []
    by = {(r["prompt"], r["way"]): r for r in m["runs"]}
    for r in m["runs"]:
        who = "the prefill node" if r["way"] == "prefill" else "the new decode node"
        same = sum(r["same_text"])
        out.append(
            (
                f"resume after a decode node dies, {r['prompt_tokens']}-token prompt evaluated "
                f"by {who}, median of {len(r['resume_s'])} kills",
                f"{r['median_resume_s'] * 1000:.0f} ms; caller's longest gap "
                f"{r['median_caller_gap_s'] * 1000:.0f} ms; same text {same}/{len(r['same_text'])}",
                f"< {TARGET_S:g} s",
            )
        )
    for size in PROMPTS:
        prefill, decode = by.get((size, "prefill")), by.get((size, "decode"))
        if prefill and decode and decode["median_resume_s"]:
            ratio = prefill["median_resume_s"] / decode["median_resume_s"]
            out.append(
                (
                    f"  {prefill['prompt_tokens']}-token prompt: resume via the prefill node / "
                    "by the new decode node",
                    f"{ratio:.2f}x",
                    "(auto picks the sooner)",
                )
            )
    return out


def main() -> int:
    return run_alone(__doc__, "migration", measure, rows)


if __name__ == "__main__":
    sys.exit(main())
