"""Benchmark: `make run`'s mesh against llama-server on the same machine.

    python -m bench.llama_server [--repeats 3] [--submissions 8]

llama-server is built once, as a user would, from the llama.cpp that llama-cpp-python
vendors (the sdist of the very version the nodes run: same llama.cpp, the compiler flags
`make venv` used: -march=native, OpenMP) into
~/.cache/disagg-mesh/llama-server-<version>-<flags' hash>/; later runs reuse it. It runs as
the issue's comparison ran it: `-np 16 -kvu -t <cores>` (16 slots over one unified KV cache,
every core), flash attention on and 512-token batches as the nodes have them, the same
SmolLM2 file. The mesh is `topology/local.toml` on free ports: a router and, per model, a
prefill and a decode node, its settings (prefill nodes of 8 slots; cores shared at run
time). Both serve at once and take turns being asked (an idle side uses no CPU), repeat by
repeat, so the machine's drift falls on both.

16. The same 16 greedy prompts (64 tokens each, ignore_eos; through the router's OpenAI
    door, alternating the two models; llama-server's /v1/completions, one model) 1, 4 and
    16 at once: generated tokens per second over all 16, mesh over llama-server (goal, #42's:
    >= 1.0x at each). Beside it, where a request's time went on each side, averaged over
    its requests: until its first token (the mesh's router reports it, llama-server its
    prompt's evaluation: `disagg.time_to_first_token_seconds` and `timings.prompt_ms` in
    their answers), and each later token ((the request's wall time at the caller - that) /
    (its tokens - 1)). Prompts are short (no whole 64-token block for the mesh's prefix
    cache) and llama-server is asked `cache_prompt: false`, so both sides evaluate every
    prompt token: the work is checked equal.
    The grader workload against both: a ~1,500-token rubric + ~200-token submissions, both
    models per submission (llama-server: both requests to its one model), 4 submissions in
    flight, cold (a rubric neither has seen) then warm (the same again): wall time, mesh
    over llama-server. Each side uses its own prompt cache (the mesh's prefix cache,
    llama-server's slots), so the sides differ in cached tokens on purpose, nothing else.

Writes JSON to bench/results/ when run alone; `make bench` (bench/run.py) runs it as row 16.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# isort: off
# llama.cpp's libraries load before grpc's (services/node.py says why).
import llama_cpp
# isort: on

import aiohttp

from bench.common import MODEL, ROOT, median, run_alone, say
from bench.grader import prompts as grader_prompts
from bench.shared_cores import PROMPTS
from bench.work import Work, figure, record, total
from disagg_mesh.server.common.models import resolve_model_path
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port, serving_mesh

MODELS = ("qwen3-coder:30b", "gpt-oss:120b")
LEVELS = (1, 4, 16)
NEW_TOKENS = 64
GRADER_TOKENS = 32
SUBMISSIONS_IN_FLIGHT = 4
# #42's goals: at least llama-server's tokens a second at 1, 4 and 16 at once, and the
# grader in at most 0.8 of its wall time, cold and warm.
GOALS = {1: 1.0, 4: 1.0, 16: 1.0}
GRADER_GOAL = 0.8
# Sixteen different short prompts (the eight of row 14, and eight more), none a prefix of
# another.
SIXTEEN = [
    *PROMPTS,
    "The capital of Australia is",
    "def fibonacci(n):",
    "Three uses of a paper clip:",
    "SELECT name FROM users WHERE",
    "A haiku about autumn rain:",
    "The speed of light is",
    "class Stack:\n    def __init__(self):",
    "Translate 'good morning' into French:",
]


# -- llama-server, built once ----------------------------------------------------------------


def cpu_flags() -> str:
    """The compiler flags the nodes' llama.cpp was built with, so both sides run the same
    kernels: what `make venv` wrote beside the venv (the Makefile's LLAMA_CPU_FLAGS); none
    in a venv made otherwise."""
    written = Path(sys.prefix) / ".llama-cpu-flags"
    return written.read_text().strip() if written.exists() else ""


def cache_dir() -> Path:
    """One build per llama.cpp version and compiler flags (a binary cached with other flags,
    e.g. with ggml's AMX code, is not the nodes' twin)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    flags = hashlib.sha256(cpu_flags().encode()).hexdigest()[:8]
    return base / "disagg-mesh" / f"llama-server-{llama_cpp.__version__}-{flags}"


def llama_server_binary() -> Path:
    """llama-server of the nodes' llama.cpp version: from the cache, else built into it
    from llama-cpp-python's sdist (pip download; cmake; several minutes on 2 cores)."""
    binary = cache_dir() / "llama-server"
    if binary.exists():
        return binary
    missing = [tool for tool in ("cmake", "ninja", "c++") if shutil.which(tool) is None]
    if missing:
        raise CannotBuild(f"building llama-server needs {', '.join(missing)}, not found here")
    version = llama_cpp.__version__
    say(f"   building llama-server {version} once into {cache_dir()} (minutes)")
    with tempfile.TemporaryDirectory(prefix="llama-server-build-") as tmp:
        subprocess.run(
            [
                sys.executable,
                *("-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"),
                f"llama-cpp-python=={version}",
                *("-d", tmp),
            ],
            check=True,
        )
        with tarfile.open(next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))) as sdist:
            sdist.extractall(tmp, filter="data")
        source = Path(tmp) / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
        build = Path(tmp) / "build"
        subprocess.run(
            [
                *("cmake", "-S", str(source), "-B", str(build), "-G", "Ninja"),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DBUILD_SHARED_LIBS=OFF",
                "-DLLAMA_BUILD_SERVER=ON",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_OPENSSL=OFF",
                f"-DCMAKE_C_FLAGS={cpu_flags()}",
                f"-DCMAKE_CXX_FLAGS={cpu_flags()}",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        subprocess.run(
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count())],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        cache_dir().mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", binary)
    return binary


class CannotBuild(Exception):
    """llama-server cannot be built on this machine (the row is skipped, saying why)."""


class LlamaServer:
    """llama-server on a free port, stopped on exit."""

    def __init__(
        self,
        binary: Path,
        threads: int,
        slots: int = 16,
        cache_types: tuple[str, str] = ("f16", "f16"),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        self.command = [
            str(binary),
            *("-m", str(resolve_model_path(MODEL, ROOT))),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("-np", str(slots), "-kvu", "-c", str(slots * 4096)),
            *("-t", str(threads), "-tb", str(threads)),
            *("-fa", "on", "-b", "512", "-ub", "512"),
            *("-ctk", cache_types[0], "-ctv", cache_types[1]),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)

    async def ready(self) -> None:
        """Wait for /health to answer 200 (the model loaded)."""
        deadline = time.monotonic() + 120
        async with aiohttp.ClientSession() as session:
            while True:
                assert self.proc is not None and self.proc.poll() is None, (
                    f"llama-server exited: see {self.log}"
                )
                try:
                    async with session.get(self.url + "/health") as got:
                        if got.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, f"llama-server never ready: see {self.log}"
                await asyncio.sleep(0.2)

    @property
    def pid(self) -> int:
        assert self.proc is not None, "llama-server was not started"
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


# -- the two sides ------------------------------------------------------------------------


def local_topology() -> str:
    """topology/local.toml with every port replaced by a free one."""
    text = (ROOT / "topology" / "local.toml").read_text()
    return re.sub(
        r"^(port|metrics_port|http_port) = \d+",
        lambda m: f"{m.group(1)} = {free_port()}",
        text,
        flags=re.M,
    )


@dataclass(frozen=True)
class Answered:
    """One request: its work, its wall time at the caller, and the seconds until its first
    token as the side reports it (the mesh's router: `disagg.time_to_first_token_seconds`;
    llama-server: `timings.prompt_ms`, its prompt's evaluation; 0 when neither is there)."""

    work: Work
    wall_s: float
    first_s: float

    @property
    def later_token_s(self) -> float:
        """Each token after the first, at the caller."""
        return (self.wall_s - self.first_s) / max(self.work.generated_tokens - 1, 1)


async def complete(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str, tokens: int, cache: bool
) -> Answered:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if not cache:
        body["cache_prompt"] = False  # llama-server: evaluate the whole prompt
    started = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as got:
        answer = await got.json()
        assert got.status == 200, answer
    wall_s = time.perf_counter() - started
    usage = answer["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if "disagg" in answer:
        first_s = float(answer["disagg"]["time_to_first_token_seconds"])
    else:
        first_s = float((answer.get("timings") or {}).get("prompt_ms", 0.0)) / 1000
    work = Work(usage["prompt_tokens"], cached, usage["completion_tokens"])
    return Answered(work, wall_s, first_s)


async def at_once(
    url: str, models: tuple[str, ...], prompts: list[str], level: int, tokens: int, cache: bool
) -> tuple[float, Work, float, list[Answered]]:
    """The prompts, `level` at once (models alternating): tok/s, work, seconds, and each
    request's own figures."""
    gate = asyncio.Semaphore(level)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(i: int, prompt: str) -> Answered:
            async with gate:
                return await complete(session, url, models[i % len(models)], prompt, tokens, cache)

        started = time.perf_counter()
        answered = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        seconds = time.perf_counter() - started
    done = total([a.work for a in answered])
    return done.generated_tokens / seconds, done, seconds, list(answered)


async def sides(targets: Targets, repeats: int, texts: list[str]) -> dict[str, dict[str, Any]]:
    """Both sides' measurements, taking turns (both serve, only one is asked at a time):
    tok/s at each level, repeated; then the grader cold and warm (each submission's two
    requests, 4 submissions in flight)."""
    out: dict[str, dict[str, Any]] = {
        name: {"tok_s": {}, "work": {}, "answered": {}, "grader_s": {}, "grader_work": {}}
        for name in targets
    }
    for url, models in targets.values():
        await at_once(url, models, SIXTEEN[:4], 4, 4, cache=False)  # warm-up
    for level in LEVELS:
        for name in targets:
            out[name]["tok_s"][level], out[name]["work"][level] = [], Work()
            out[name]["answered"][level] = []
        for _ in range(repeats):
            for name, (url, models) in targets.items():
                rate, work, _, answered = await at_once(
                    url, models, SIXTEEN, level, NEW_TOKENS, cache=False
                )
                out[name]["tok_s"][level].append(rate)
                out[name]["work"][level] += work
                out[name]["answered"][level] += answered
        say(
            f"   {level} at once: "
            + ", ".join(f"{n} {median(o['tok_s'][level]):.0f} tok/s" for n, o in out.items())
        )
    for kind in ("cold", "warm"):  # the same rubric: new to each side, then seen
        for name, (url, models) in targets.items():
            pair = models if len(models) == 2 else models * 2
            asked = [t for t in texts for _ in pair]
            _, work, seconds, _ = await at_once(
                url, pair, asked, 2 * SUBMISSIONS_IN_FLIGHT, GRADER_TOKENS, cache=True
            )
            out[name]["grader_s"][kind] = seconds
            out[name]["grader_work"][kind] = work
            cached = f"{work.cached_tokens} of {work.prompt_tokens}"
            say(f"   grader {kind}, {name}: {seconds:.1f} s, {cached} prompt tokens cached")
    return out


Targets = dict[str, tuple[str, tuple[str, ...]]]
# Each side's own processes (the mesh's nodes; llama-server), by the side's name in Targets.
Pids = dict[str, list[int]]


@asynccontextmanager
async def side_by_side(
    binary: Path, threads: int, slots: int, prefix: str, topology: str | None = None
) -> AsyncIterator[tuple[MeshProcesses, Targets, Pids]]:
    """make run's mesh (or `topology`) and llama-server (-np slots -kvu, the KV cache types
    of the mesh's engine nodes), both serving: each side's OpenAI URL and the models to ask
    it for (llama-server has one), and each side's processes."""
    async with serving_mesh(topology or local_topology(), prefix) as mesh:
        engines = [n for n in mesh.topology.nodes if n.engine == "llama_cpp"]
        types = {(n.type_k, n.type_v) for n in engines} or {("f16", "f16")}
        assert len(types) == 1, f"the mesh's engine nodes differ in KV cache types: {types}"
        server = LlamaServer(binary, threads, slots, types.pop())
        server.start()
        try:
            await server.ready()
            await asyncio.sleep(1.0)  # the router's health checks see every node
            router = mesh.topology.router
            yield (
                mesh,
                {
                    "mesh": (f"http://{router.host}:{router.http_port}", MODELS),
                    "llama-server": (server.url, ("smollm2",)),
                },
                {"mesh": [p.pid for p in mesh.procs.values()], "llama-server": [server.pid]},
            )
        finally:
            server.stop()


async def measure(repeats: int, submissions: int) -> dict[str, Any]:
    try:
        binary = llama_server_binary()
    except (CannotBuild, subprocess.CalledProcessError) as exc:
        say(f"   skipped: {exc}")
        return {"skipped": str(exc)}
    threads = os.cpu_count() or 1
    # The rubric's first line differs from row 10's and 15's: nothing of it is cached.
    texts = ["Course 16.\n" + t for t in grader_prompts(submissions, 1500, 200)]
    say(f">> 16. the mesh (topology/local.toml) and llama-server -np 16 -kvu -t {threads}")
    async with side_by_side(binary, threads, 16, "bench-llama-server-") as (_, targets, _):
        measured = await sides(targets, repeats, texts)
    ours, theirs = measured["mesh"], measured["llama-server"]
    levels = {}
    for level in LEVELS:
        mine, other = median(ours["tok_s"][level]), median(theirs["tok_s"][level])
        levels[str(level)] = {
            "mesh_tok_s": ours["tok_s"][level],
            "llama_server_tok_s": theirs["tok_s"][level],
            "mesh_over_llama_server": mine / other,
            # Where a request's time went, averaged over the level's requests (ms).
            "first_token_ms": {
                "mesh": mean_ms([a.first_s for a in ours["answered"][level]]),
                "llama_server": mean_ms([a.first_s for a in theirs["answered"][level]]),
            },
            "later_token_ms": {
                "mesh": mean_ms([a.later_token_s for a in ours["answered"][level]]),
                "llama_server": mean_ms([a.later_token_s for a in theirs["answered"][level]]),
            },
            "work": record(("mesh", "llama_server"), ours["work"][level], theirs["work"][level]),
        }
    grader_rows = {}
    for kind in ("cold", "warm"):
        grader_rows[kind] = {
            "mesh_s": ours["grader_s"][kind],
            "llama_server_s": theirs["grader_s"][kind],
            "mesh_over_llama_server": ours["grader_s"][kind] / theirs["grader_s"][kind],
            "work": record(
                ("mesh", "llama_server"),
                ours["grader_work"][kind],
                theirs["grader_work"][kind],
                cache_compared=True,
            ),
        }
    result = {
        "threads": threads,
        "new_tokens": NEW_TOKENS,
        "levels": levels,
        "grader": grader_rows,
        "submissions": submissions,
    }
    for row in rows(result):
        say("   " + "  ".join(row))
    return result


def mean_ms(seconds: list[float]) -> float:
    return 1000 * sum(seconds) / max(len(seconds), 1)


def rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    if "skipped" in m:
        return [("make run's mesh / llama-server", f"skipped: {m['skipped']}", "-")]
    out = []
    for level, r in m["levels"].items():
        goal = GOALS.get(int(level))
        split = ""
        if "first_token_ms" in r:  # results written before it was measured have none
            first, later = r["first_token_ms"], r["later_token_ms"]
            split = (
                f"; a request's first token {first['mesh']:.0f} vs "
                f"{first['llama_server']:.0f} ms, each later one {later['mesh']:.1f} vs "
                f"{later['llama_server']:.1f} ms"
            )
        out.append(
            (
                f"make run's mesh / llama-server -np 16 -kvu, {level} at once, 16 prompts x "
                f"{m['new_tokens']} tokens, tok/s",
                figure(
                    f"{r['mesh_over_llama_server']:.2f}x ({median(r['mesh_tok_s']):.0f} vs "
                    f"{median(r['llama_server_tok_s']):.0f} tok/s{split})",
                    r.get("work"),
                ),
                f">= {goal:g}x" if goal else "-",
            )
        )
    for kind, g in m["grader"].items():
        w = g["work"]
        out.append(
            (
                f"grader ({m['submissions']} submissions x 2 models, 4 in flight), {kind}: "
                "wall time, mesh / llama-server",
                figure(
                    f"{g['mesh_over_llama_server']:.2f}x ({g['mesh_s']:.1f} vs "
                    f"{g['llama_server_s']:.1f} s; cached {w['mesh']['cached_tokens']} vs "
                    f"{w['llama_server']['cached_tokens']} tokens)",
                    w,
                ),
                f"<= {GRADER_GOAL:g}x",
            )
        )
    return out


def main() -> int:
    options = {"repeats": 3, "submissions": 8}
    return run_alone(__doc__, "llama_server", measure, rows, options, repeats="repeats")


if __name__ == "__main__":
    sys.exit(main())
