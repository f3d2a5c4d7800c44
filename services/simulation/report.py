"""What `disagg simulate` prints: the mesh's run and the Ollama baseline's, side by side."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from disagg_mesh.server.common.engines.sim.profile import ModelSpeed
from disagg_mesh.server.router.dashboard.recent import percentile
from disagg_mesh.server.simulation.baseline import BaselineRun, Served
from disagg_mesh.server.simulation.mesh import MeshRun


def _side(served: Sequence[Served], wall_seconds: float, models: int) -> dict[str, Any]:
    ok = [s for s in served if s.ok]
    ttft = [s.time_to_first_token_seconds for s in ok]
    e2e = [s.latency_seconds for s in ok]

    def p(values: list[float], q: float) -> float:
        return round(percentile(values, q) or 0.0, 2)

    per_hour = len(ok) / wall_seconds * 3600 if wall_seconds else 0.0
    return {
        "wall_seconds": round(wall_seconds, 1),
        "requests": len(served),
        "failed": len(served) - len(ok),
        "requests_per_hour": round(per_hour, 1),
        "submissions_per_hour": round(per_hour / max(models, 1), 1),
        "ttft_p50_seconds": p(ttft, 50),
        "ttft_p95_seconds": p(ttft, 95),
        "e2e_p50_seconds": p(e2e, 50),
        "e2e_p95_seconds": p(e2e, 95),
        "prompt_tokens": sum(s.prompt_tokens for s in ok),
        "completion_tokens": sum(s.completion_tokens for s in ok),
        "errors": dict(Counter(s.error[:120] for s in served if not s.ok)),
    }


@dataclass(frozen=True)
class Report:
    data: dict[str, Any]

    def text(self) -> str:
        d = self.data
        mesh, base = d["mesh"], d["baseline"]
        lines = [
            f"{d['requests']} requests ({d['models']} models) on {d['topology']}, "
            f"speedup {d['speedup']:g} (simulated time below)",
            "",
            f"{'':24}{'mesh':>12}{'Ollama today':>14}",
        ]
        rows = [
            ("wall time", "wall_seconds", "{:.0f} s"),
            ("submissions per hour", "submissions_per_hour", "{:.0f}"),
            ("TTFT p50", "ttft_p50_seconds", "{:.1f} s"),
            ("TTFT p95", "ttft_p95_seconds", "{:.1f} s"),
            ("end-to-end p50", "e2e_p50_seconds", "{:.1f} s"),
            ("end-to-end p95", "e2e_p95_seconds", "{:.1f} s"),
            ("failed", "failed", "{}"),
        ]
        for label, key, fmt in rows:
            lines.append(f"{label:24}{fmt.format(mesh[key]):>12}{fmt.format(base[key]):>14}")
        lines += [
            "",
            f"ratio (Ollama wall / mesh wall): {d['ratio']:.2f}x",
            "",
            "mesh: " + ", ".join(f"{k} {v}" for k, v in mesh["methods"].items()),
            f"  KV moved {mesh['kv_bytes_moved'] / 1e9:.2f} GB (real size), prompt tokens "
            f"from prefix caches {mesh['cached_prompt_tokens']:,}",
        ]
        for name, use in mesh["nodes"].items():
            lines.append(
                f"  {name:18} busy {use['active_share']:.0%} of the time, "
                f"{use['slots_share']:.0%} of its slots"
            )
        at_once = ", ".join(f"{m} {n}" for m, n in base.get("parallel", {}).items())
        lines.append(
            "Ollama today (where each machine's time went"
            + (f"; requests at once: {at_once}" if at_once else "")
            + "):"
        )
        for name, use in base["nodes"].items():
            lines.append(
                f"  {name:18} prompts {use['prompt_seconds']:.0f} s, decode "
                f"{use['decode_seconds']:.0f} s: busy {use['busy_share']:.0%} of the run"
            )
        return "\n".join(lines)


def report(
    *,
    topology: str,
    speedup: float,
    mesh: MeshRun,
    baseline: BaselineRun,
    speeds: Mapping[str, ModelSpeed],
    baseline_parallel: Mapping[str, int] | None = None,
) -> Report:
    """speeds: each engine node's model on its machine (for the KV states' real sizes);
    baseline_parallel: the requests Ollama served at once, by model."""
    models = len({s.model for s in mesh.served})
    mesh_side = _side(mesh.served, mesh.wall_seconds, models)
    methods = Counter(str(d.get("method", "failed")) for d in mesh.details)
    kv_bytes = sum(  # the decode node's own copy of a prefix did not move
        speeds[d["prefill_node"]].kv_bytes(
            s.prompt_tokens - int(d.get("decode_cached_prompt_tokens") or 0)
        )
        for s, d in zip(mesh.served, mesh.details, strict=True)
        if d.get("method") == "disaggregated" and d.get("prefill_node") in speeds
    )
    mesh_side.update(
        concurrency=mesh.concurrency,
        methods=dict(methods),
        kv_bytes_moved=kv_bytes,
        cached_prompt_tokens=sum(int(d.get("cached_prompt_tokens") or 0) for d in mesh.details),
        nodes={
            name: {
                "active_share": round(use.active_share, 3),
                "slots_share": round(use.slots_share, 3),
            }
            for name, use in sorted(mesh.use.items())
        },
    )
    base_side = _side(baseline.served, baseline.wall_seconds, models)
    base_side["parallel"] = dict(baseline_parallel or {})
    wall = baseline.wall_seconds or 1.0
    base_side["nodes"] = {
        name: {
            "prompt_seconds": round(baseline.prompt_seconds[name], 1),
            "decode_seconds": round(baseline.decode_seconds[name], 1),
            "busy_share": round(
                (baseline.prompt_seconds[name] + baseline.decode_seconds[name]) / wall, 3
            ),
        }
        for name in sorted(baseline.prompt_seconds)
    }
    ratio = baseline.wall_seconds / mesh.wall_seconds if mesh.wall_seconds else 0.0
    return Report(
        {
            "topology": topology,
            "speedup": speedup,
            "models": models,
            "requests": mesh_side["requests"],
            "failed": mesh_side["failed"],
            "wall_seconds": mesh_side["wall_seconds"],
            "baseline_wall_seconds": base_side["wall_seconds"],
            "ratio": round(ratio, 3),
            "mesh": mesh_side,
            "baseline": base_side,
        }
    )
