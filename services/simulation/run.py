"""`disagg simulate`: a topology and a workload, through the real routers over sim nodes
and through the Ollama baseline, reported side by side (the package's docstring says
how)."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from pathlib import Path

from disagg_mesh.batch import plan, read_requests
from disagg_mesh.server.common.config.topology import load_topology
from disagg_mesh.server.common.engines.sim.profile import load_baseline, load_profile
from disagg_mesh.server.simulation.baseline import run_baseline
from disagg_mesh.server.simulation.mesh import run_mesh
from disagg_mesh.server.simulation.report import Report, report
from disagg_mesh.server.simulation.topology import (
    SimulationError,
    simulated_topology,
    write_toml,
)
from disagg_mesh.server.simulation.workload import work

DEFAULT_SPEEDUP = 20.0


def simulate(
    topology_file: Path,
    workload_file: Path,
    *,
    profile: str | None = None,
    speedup: float = DEFAULT_SPEEDUP,
    concurrency: int | None = None,
    keep_logs: Path | None = None,
    progress: Callable[[str], None] | None = None,
    ollama_parallel: int | None = None,
) -> Report:
    topology = load_topology(topology_file)
    requests = read_requests(workload_file)
    served = {route.name for route in topology.models}
    unknown = sorted({r.model for r in requests} - served)
    if unknown:
        raise SimulationError(
            f"{workload_file}: model {unknown[0]!r} is not in {topology_file} "
            f"(its models: {', '.join(sorted(served))})"
        )
    with tempfile.TemporaryDirectory(prefix="disagg-simulate-") as tmp:
        folder = keep_logs or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        sim_file = folder / "simulated-topology.toml"
        write_toml(simulated_topology(topology, speedup, profile), sim_file)
        sim = load_topology(sim_file)
        mesh = asyncio.run(
            run_mesh(sim_file, requests, speedup, folder / "logs", concurrency, progress)
        )
    if progress is not None:
        progress("the Ollama baseline (virtual clock)")
    limit = sim.mesh.max_tokens_limit
    order = [(work(r, limit), after) for r, after in plan(requests)]
    serving = load_baseline()
    if ollama_parallel is not None:
        serving = serving.with_num_parallel(ollama_parallel)
    baseline = run_baseline(sim, order, mesh.concurrency, serving, mesh.model_concurrency)
    speeds = {
        n.name: load_profile(n.hardware or "").model(n.model or "")
        for n in sim.nodes
        if n.role != "router"
    }
    parallel = {model: serving.parallel_for(model) for model in sorted(served)}
    return report(
        topology=str(topology_file),
        speedup=speedup,
        mesh=mesh,
        baseline=baseline,
        speeds=speeds,
        baseline_parallel=parallel,
    )


__all__ = ["DEFAULT_SPEEDUP", "Report", "SimulationError", "simulate"]
