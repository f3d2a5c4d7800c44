"""The topology a simulation runs: any topology's nodes as sim nodes on 127.0.0.1.

Every engine node becomes `engine = "sim"` timed by its `hardware` profile (or the one
`--profile` names for all), simulating the model it serves (an "ollama:" model by its tag),
and standing for the machine its `host` names (`sim_host`): KV states between machines pay
the profile's link. Every node gets a free loopback port (the addresses a topology names,
seed.toml's being the user's machines, are never dialled), every router an HTTP door for
the workload. Steps that call an outside server (direct_ollama) leave the chain; the
routes' time limits are divided by the speedup, so they hold in simulated time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disagg_mesh.server.common.config.topology import ModelRoute, Topology
from disagg_mesh.server.common.engines.sim.profile import (
    PROFILES,
    find_profile,
    load_profile,
)
from disagg_mesh.server.common.errors import MeshError
from disagg_mesh.server.common.runtime.processes import free_port

LOOPBACK = "127.0.0.1"
# Route keys that are durations, held in simulated time.
ROUTE_SECONDS = ("prefill_deadline_s", "decode_deadline_s", "queue_budget_s")
# Node keys the simulation sets itself or that name things outside it.
DROPPED_NODE_KEYS = ("listen_host", "metrics_port", "ollama_url", "ollama_models", "n_threads")


class SimulationError(MeshError):
    """A topology or workload the simulation cannot run: the message names the node, the
    model or the file."""


def sim_model(model: str) -> str:
    """The model a node's `model` names, as profiles name it."""
    return model.removeprefix("ollama:")


def simulated_topology(
    topology: Topology, speedup: float, profile: str | None = None
) -> dict[str, Any]:
    """The simulation's topology, as the data of a TOML file."""
    data = topology.model_dump(mode="json", exclude_defaults=True, exclude={"source"})
    data["mesh"] = {**data.get("mesh", {}), "sim_speedup": speedup, "sim_compact_kv": True}
    data["security"] = {"plaintext": True}
    nodes = []
    for node, entry in zip(topology.nodes, data["nodes"], strict=True):
        entry = {k: v for k, v in entry.items() if k not in DROPPED_NODE_KEYS}
        entry.update(host=LOOPBACK, port=free_port())
        if node.role == "router":
            entry["http_port"] = free_port()
        else:
            entry.update(_sim_engine(topology, node.name, node.model or "", node.hardware, profile))
            entry["sim_host"] = node.machine
            if "kv_ttl_s" in entry:
                entry["kv_ttl_s"] = entry["kv_ttl_s"] / speedup
        nodes.append(entry)
    data["nodes"] = nodes
    routes = []
    for route in data["models"]:
        route = {k: v for k, v in route.items() if k not in ("ollama_url", "ollama_model")}
        chain = route.get("chain", ModelRoute.model_fields["chain"].default)
        route["chain"] = [step for step in chain if step != "direct_ollama"]
        if not route["chain"]:
            raise SimulationError(
                f"model {route['name']!r}: its chain has only direct_ollama, which a "
                "simulation cannot run (it dials an Ollama server)"
            )
        for key in ROUTE_SECONDS:
            seconds = route.get(key, ModelRoute.model_fields[key].default)
            route[key] = seconds / speedup
        routes.append(route)
    data["models"] = routes
    return data


def _sim_engine(
    topology: Topology, name: str, model: str, hardware: str | None, profile: str | None
) -> dict[str, Any]:
    spec = profile or hardware
    if spec is None:
        shipped = ", ".join(sorted(p.stem for p in PROFILES.glob("*.toml") if p.stem != "ollama"))
        raise SimulationError(
            f"node {name!r} has no hardware key: give it one (a profile: {shipped}, or a "
            "file) or pass --profile"
        )
    path = find_profile(spec, topology.source.parent)
    speeds = load_profile(str(path))
    speeds.model(sim_model(model))  # a node whose model the profile lacks fails here
    return {
        "engine": "sim",
        "model": sim_model(model),
        "hardware": path.stem if path.parent == PROFILES else str(path),
    }


def write_toml(data: dict[str, Any], path: Path) -> None:
    """The topology's data as TOML (tables, arrays of tables, and JSON-like values)."""
    lines: list[str] = []

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + "}"
        raise TypeError(f"no TOML for {v!r}")

    def table(header: str, entries: dict[str, Any]) -> None:
        lines.append(header)
        nested = {k: v for k, v in entries.items() if isinstance(v, dict)}
        for k, v in entries.items():
            if k not in nested:
                lines.append(f"{json.dumps(k)} = {value(v)}")
        lines.append("")
        name = header.strip("[]")
        for k, v in nested.items():
            table(f"[{name}.{json.dumps(k)}]", v)

    for key, entries in data.items():
        if isinstance(entries, dict):
            table(f"[{key}]", entries)
        else:
            for entry in entries:
                table(f"[[{key}]]", entry)
    path.write_text("\n".join(lines))
