"""Benchmark: does `disagg simulate` predict this machine's own mesh? (#41's calibration)

    python -m bench.calibration [--submissions 12]

A mesh of its own (bench/batch.py's: a router and, per model, a prefill and a decode node of
the embedded engine, all on this machine sharing its cores) and a grader-shaped batch (a
~600-token rubric shared by each model's submissions of ~100 tokens, both models, 32-token
answers, ignore_eos). In order:

1. `disagg calibrate` on that topology writes a profile of this machine;
2. the real `disagg batch` of the file through the real mesh: its wall time;
3. `disagg simulate` of the same topology and file with that profile (speedup 2): its
   predicted wall time for the mesh.

Reported: predicted / measured wall time, goal within 0.85-1.15.

Writes JSON to bench/results/ when run alone; `make bench` (bench/run.py) runs it as row 24.
"""

from __future__ import annotations

# isort: off
# llama.cpp's libraries load before grpc's (services/node.py says why).
import llama_cpp
# isort: on

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.batch import requests, topology_text
from bench.common import run_alone, say
from bench.grader import prompts
from disagg_mesh.client import AsyncMeshClient
from disagg_mesh.server.common.runtime.processes import serving_mesh

_ = llama_cpp  # imported first for its side effect
SPEEDUP = 2


async def measure(submissions: int) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="disagg-calibration-"))
    text = topology_text()
    (folder / "topology.toml").write_text(text)
    batch = requests(prompts(submissions, 600, 100), "calibration")
    workload = folder / "class.jsonl"
    workload.write_text(
        "".join(
            json.dumps({"custom_id": r.custom_id, "method": "POST", "url": r.url, "body": r.body})
            + "\n"
            for r in batch
        )
    )
    profile = folder / "this-machine.toml"
    say("disagg calibrate")
    command = [sys.executable, "-m", "disagg_mesh.cli", "calibrate"]
    command += ["--topology", str(folder / "topology.toml"), "--out", str(profile)]
    await asyncio.to_thread(subprocess.run, command, check=True)
    say("the real mesh: disagg batch")
    async with serving_mesh(text, "disagg-calibration-mesh-") as mesh:
        async with AsyncMeshClient(mesh.topology.router.address, timeout=3600) as client:
            run = await client.batch_run(batch)
            started = time.perf_counter()
            results = [r async for r in run.results()]
            measured = time.perf_counter() - started
    failed = [r for r in results if not r.ok]
    assert not failed, f"{len(failed)} failed: {failed[0].message}"
    say("disagg simulate with the calibrated profile")

    def simulated() -> dict[str, Any]:
        from disagg_mesh.server.simulation.run import simulate

        topology = folder / "topology.toml"
        got = simulate(topology, workload, profile=str(profile), speedup=SPEEDUP, progress=say)
        return got.data

    predicted = await asyncio.to_thread(simulated)
    return {
        "requests": len(batch),
        "measured_wall_seconds": round(measured, 2),
        "predicted_wall_seconds": predicted["wall_seconds"],
        "ratio": round(predicted["wall_seconds"] / measured, 3),
        "speedup": SPEEDUP,
        "profile": profile.read_text(),
        "simulation": predicted,
    }


def rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        (
            f"disagg simulate with a calibrated profile / the real disagg batch, {m['requests']} "
            f"grader requests on this machine's mesh ({m['predicted_wall_seconds']:.1f} s vs "
            f"{m['measured_wall_seconds']:.1f} s)",
            f"{m['ratio']:.2f}",
            "0.85-1.15",
        )
    ]


def main() -> int:
    return run_alone(__doc__, "calibration", measure, rows, {"submissions": 12}, repeats=None)


if __name__ == "__main__":
    sys.exit(main())
