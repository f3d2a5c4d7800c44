"""Benchmark: time to resume when the router serving an answer dies (router failover).

    python -m bench.router_failover [--kills 5] [--new-tokens 200]

Starts a mesh of its own (two routers, a prefill node and a decode node, embedded, one
thread each) and, for each kill: a greedy answer of `--new-tokens` tokens starts through
`AsyncMeshClient` given both routers, the router serving it is SIGKILLed once the caller has
5 deltas, and the client resumes the answer through the other router. Reported, median over
the kills:

12. resume time at the caller: from the kill to the next delta the caller got (the
    client's failover `resume_time`), against the user's 5 s failover target; and whether
    the text equals the uninterrupted answer.

The killed router is restarted before the next kill. Writes JSON to bench/results/ when run
alone; `make bench` (bench/run.py) runs it as row 12.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from bench.common import MODEL, median, run_alone, say
from bench.migration import KILL_AFTER, PROMPT, TARGET_S
from disagg_mesh import AsyncMeshClient, GenerateCall, Metrics
from disagg_mesh.server.common.runtime.processes import free_port, serving_mesh

ROUTERS = ("router-a", "router-b")


def topology_text() -> str:
    node = '[[nodes]]\nname = "{}"\nrole = "{}"\nhost = "127.0.0.1"\nport = {}\n'
    engine = f'engine = "llama_cpp"\nmodel = "{MODEL}"\nn_ctx = 2048\nslots = 2\nn_threads = 1\n'
    parts = [node.format(name, "router", free_port()) for name in ROUTERS]
    parts += [
        node.format("prefill", "prefill", free_port()) + engine,
        node.format("decode", "decode", free_port()) + engine,
        '[[models]]\nname = "m"\nchain = ["disaggregated"]\nprefill = ["prefill"]\n'
        'decode = ["decode"]\n',
    ]
    return "\n".join(parts)


async def answer(
    addresses: list[str], new_tokens: int, kill: Any = None
) -> tuple[str, Metrics | None]:
    call = GenerateCall("m", prompt=PROMPT, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    text, metrics, deltas = "", None, 0
    async with AsyncMeshClient(addresses, timeout=300) as client:
        async for item in client.stream(call):
            if isinstance(item, Metrics):
                metrics = item
                continue
            assert isinstance(item, str)  # no tools offered: text alone
            text += item
            deltas += 1
            if deltas == KILL_AFTER and kill is not None:
                kill()
    return text, metrics


async def measure(kills: int, new_tokens: int) -> dict[str, Any]:
    resume_s: list[float] = []
    same: list[bool] = []
    async with serving_mesh(topology_text(), "bench-router-failover-") as mesh:
        addresses = [mesh.topology.node(name).address for name in ROUTERS]
        alone, _ = await answer(addresses, new_tokens)
        for k in range(kills):
            pid = mesh.procs["router-a"].pid
            text, metrics = await answer(
                addresses, new_tokens, lambda pid=pid: os.kill(pid, signal.SIGKILL)
            )
            assert metrics is not None
            (failover,) = [m for m in metrics.migrations if m.failed_node.startswith("router ")]
            resume_s.append(failover.resume_time)
            same.append(text == alone)
            say(
                f"   kill {k + 1}: router-a after {failover.tokens_delivered} tokens, resumed "
                f"through router-b on {failover.resumed_on} in {resume_s[-1] * 1000:.0f} ms, "
                f"same text: {same[-1]}"
            )
            mesh.procs["router-a"].wait()
            mesh.start_node(mesh.topology.node("router-a"))
            await mesh.wait_serving(300, names=["router-a"])
    return {
        "kills": kills,
        "new_tokens": new_tokens,
        "resume_s": resume_s,
        "same_text": same,
        "median_resume_s": median(resume_s),
        "target_s": TARGET_S,
    }


def rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        (
            f"resume after the serving router dies, at the caller, median of {m['kills']} kills",
            f"{m['median_resume_s'] * 1000:.0f} ms; same text "
            f"{sum(m['same_text'])}/{len(m['same_text'])}",
            f"< {TARGET_S:g} s",
        )
    ]


def main() -> int:
    return run_alone(__doc__, "router_failover", measure, rows)


if __name__ == "__main__":
    sys.exit(main())
