"""Benchmark: a standard load tool, NVIDIA's AIPerf, on make run's mesh and llama-server (#45).

    python -m bench.aiperf_load [--seconds 60]

AIPerf (PyPI `aiperf`, installed once into a virtual environment of its own under
~/.cache/disagg-mesh: it brings ~1 GB of dependencies the mesh does not need) drives each
side's OpenAI door in turn, with a tokenizer folder written from the GGUF's own vocabulary,
merges and chat template (checked to count as llama.cpp does). Its synthetic workload has
the grader's shape: a 1,024-token system prompt shared by every request (the rubric), a
128-token user prompt of its own, 32 tokens out (greedy, ignore_eos), both models in turn
(llama-server: its one model). After two warm-up requests (one a model), a closed loop at 1,
8, 32 and 128 at once (a new request as soon as one ends), each level for --seconds (1 at
once: half), in-flight answers given 30 s more. The mesh is `make run`'s
(topology/local.toml on free ports) with queue_budget_s QUEUE_BUDGET_S, so a request that
would wait longer for admission is refused at once; llama-server (`-np 8 -kvu -t <cores>`,
the same llama.cpp, bench/llama_server.py) queues. AIPerf counts a refusal as an error and
sends the next request at once (it does not read Retry-After). The two sides' prompt caches
differ on purpose (llama-server keeps one a slot, the mesh shares the rubric's blocks).

20. request throughput (requests answered per second) and goodput (answered within the SLO:
    time to first token <= SLO_TTFT_MS and inter-token latency <= SLO_ITL_MS) at each level,
    for both sides; goals: the mesh's goodput at 32 and 128 at once >= 0.9x its peak, and
    mesh / llama-server request throughput >= 1.0x. Beside the goodput, the cores the
    mesh's processes and AIPerf's own kept busy at that level (CPU time over the level's
    time: the load tool shares the machine's cores). Both sides answer the same requests
    (AIPerf's seed): the prompt and generated tokens per request are checked equal.

Writes JSON to bench/results/ when run alone; `make bench` (bench/run.py) runs it as row 20.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path
from typing import Any

import llama_cpp
from gguf import GGUFReader

from bench.common import MODEL, ROOT, cpu_seconds, run_alone, say
from bench.llama_server import CannotBuild, llama_server_binary, local_topology, side_by_side
from disagg_mesh.server.common.models import resolve_model_path
from disagg_mesh.server.common.models.files import cache_dir

AIPERF = "aiperf==0.13.0"
LEVELS = (1, 8, 32, 128)
SYSTEM_TOKENS, USER_TOKENS, NEW_TOKENS = 1024, 128, 32
SLO_TTFT_MS, SLO_ITL_MS = 10_000, 300
# A quarter of the TTFT goal: a request may wait about this long at the router, then as
# long again for its turn in a prefill node and for a decode slot (the budget bounds the
# calls a prefill node gets at once and the states made for a decode node beyond its slots).
QUEUE_BUDGET_S = SLO_TTFT_MS / 1000 / 4
GRACE_S = 30
GOAL_GOODPUT, GOAL_THROUGHPUT = 0.9, 1.0
# A text with digits, spaces, tabs, code and non-ASCII: the tokenizer folder must count it
# as llama.cpp does.
SAMPLE = "Grade 12345 essays:\n\tdef f(x):  return x**2  # café, naïve; 'quoted' — done."


class CannotInstall(Exception):
    """AIPerf could not be installed here (no package index?)."""


def aiperf_binary() -> Path:
    """AIPerf from its own virtual environment in the cache, installed on first use."""
    env = cache_dir() / f"aiperf-{AIPERF.partition('==')[2]}"
    binary = env / "bin" / "aiperf"
    if binary.exists():
        return binary
    say(f"   installing {AIPERF} once into {env} (a minute or two)")
    venv.create(env, with_pip=True, clear=True)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet", AIPERF]
    if subprocess.run(pip, check=False).returncode != 0:
        raise CannotInstall(f"pip install {AIPERF} failed (see above)")
    return binary


def tokenizer_folder(aiperf: Path) -> Path:
    """A Hugging Face tokenizer folder for the embedded model, written from its GGUF
    (byte-level BPE, SmolLM's digit split, special tokens, chat template), checked to give
    llama.cpp's tokens for SAMPLE."""
    gguf = resolve_model_path(MODEL, ROOT)
    folder = cache_dir() / f"tokenizer-{gguf.stem}"
    reader = GGUFReader(gguf)

    def field(key: str) -> Any:
        return reader.fields[key].contents()

    tokens, kinds = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "smollm"
    special = [
        {"id": i, "content": t, "special": True, "normalized": False}
        | {"single_word": False, "lstrip": False, "rstrip": False}
        for i, (t, kind) in enumerate(zip(tokens, kinds, strict=True))
        if kind == 3  # control
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    tokenizer = {
        "version": "1.0",
        "added_tokens": special,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                byte_level | {"use_regex": True},
            ],
        },
        "decoder": byte_level | {"use_regex": True},
        "model": {
            "type": "BPE",
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in field("tokenizer.ggml.merges")],
        },
    }
    eos = tokens[field("tokenizer.ggml.eos_token_id")]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": field("tokenizer.chat_template"),
        "bos_token": tokens[field("tokenizer.ggml.bos_token_id")],
        "eos_token": eos,
        "pad_token": eos,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = subprocess.run(
        [
            str(aiperf.parent / "python"),
            "-c",
            "import sys, json; from transformers import AutoTokenizer as T; "
            "print(json.dumps(T.from_pretrained(sys.argv[1]).encode(sys.argv[2])))",
            str(folder),
            SAMPLE,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    vocab = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    ours = vocab.tokenize(SAMPLE.encode(), add_bos=False, special=True)
    assert json.loads(theirs.stdout) == ours, ("the tokenizer folder counts differently", theirs)
    return folder


def mesh_topology() -> str:
    """make run's topology on free ports, each model's queue_budget_s QUEUE_BUDGET_S."""
    return re.sub(
        r"^(decode_deadline_s = .*)$",
        rf"\1\nqueue_budget_s = {QUEUE_BUDGET_S}",
        local_topology(),
        flags=re.M,
    )


async def profile(
    aiperf: Path, tokenizer: Path, url: str, models: tuple[str, ...], at_once: int, seconds: int
) -> dict[str, Any]:
    """One AIPerf run: its summary figures, and its log's path if it failed."""
    out = Path(tempfile.mkdtemp(prefix=f"aiperf-{at_once}-"))
    command = [
        str(aiperf),
        "profile",
        *("--model", ",".join(models), "--url", url, "--endpoint-type", "chat", "--streaming"),
        *("--tokenizer", str(tokenizer), "--concurrency", str(at_once)),
        *("--benchmark-duration", str(seconds), "--benchmark-grace-period", str(GRACE_S)),
        *("--isl", str(USER_TOKENS), "--isl-stddev", "0", "--osl", str(NEW_TOKENS)),
        *("--shared-system-prompt-length", str(SYSTEM_TOKENS)),
        *("--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0"),
        *("--goodput", f"time_to_first_token:{SLO_TTFT_MS} inter_token_latency:{SLO_ITL_MS}"),
        # One request a model first, one at a time: the system prompt then cached on both
        # sides, as in a class's steady state.
        *("--warmup-request-count", "2", "--warmup-concurrency", "1"),
        *("--random-seed", "1", "--ui-type", "none", "--use-server-token-count"),
        *("--artifact-dir", str(out)),
    ]
    log = out / "run.log"
    before, started = _children_cpu_s(), time.perf_counter()
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(*command, stdout=sink, stderr=sink)
        await proc.wait()
    elapsed_s = time.perf_counter() - started
    summary = out / "profile_export_aiperf.json"
    if proc.returncode != 0 or not summary.exists():
        raise RuntimeError(f"aiperf exited {proc.returncode}: see {log}")
    data = json.loads(summary.read_text())

    def get(name: str, stat: str = "avg") -> float:
        return float((data.get(name) or {}).get(stat) or 0.0)

    return {
        "request_throughput": get("request_throughput"),
        "goodput": get("goodput"),
        "answered": get("request_count"),
        "errors": get("error_request_count"),
        "ttft_p50_ms": get("time_to_first_token", "p50"),
        "ttft_p99_ms": get("time_to_first_token", "p99"),
        "itl_ms": get("inter_token_latency"),
        "prompt_tokens": get("usage_prompt_tokens"),
        "completion_tokens": get("usage_completion_tokens"),
        "artifacts": str(out),
        "elapsed_s": elapsed_s,
        # AIPerf's own processes (it waits for its workers, and this process for it).
        "tool_cores": (_children_cpu_s() - before) / elapsed_s,
    }


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's children that have ended, theirs
    included."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def measure(seconds: int) -> dict[str, Any]:
    try:
        binary = llama_server_binary()
        aiperf = aiperf_binary()
    except (CannotBuild, CannotInstall, subprocess.CalledProcessError) as exc:
        say(f"   skipped: {exc}")
        return {"skipped": str(exc)}
    tokenizer = tokenizer_folder(aiperf)
    threads = os.cpu_count() or 1
    say(f">> 20. AIPerf at {', '.join(map(str, LEVELS))} at once: the mesh and llama-server")
    sides: dict[str, dict[str, Any]] = {"mesh": {}, "llama-server": {}}
    async with side_by_side(binary, threads, 8, "bench-aiperf-", mesh_topology()) as (
        _,
        targets,
        pids,
    ):
        for name, (url, models) in targets.items():
            server = pids[name]
            for level in LEVELS:
                cpu = cpu_seconds(server)
                got = await profile(
                    aiperf, tokenizer, url, models, level, seconds // 2 if level == 1 else seconds
                )
                got["server_cores"] = (cpu_seconds(server) - cpu) / got["elapsed_s"]
                sides[name][str(level)] = got
                say(
                    f"   {name} at {level}: {got['request_throughput']:.2f} req/s, goodput "
                    f"{got['goodput']:.2f}, {got['errors']:.0f} refused or failed, TTFT p50 "
                    f"{got['ttft_p50_ms'] / 1000:.1f} s, ITL {got['itl_ms']:.0f} ms; cores "
                    f"busy: {name} {got['server_cores']:.2f}, AIPerf {got['tool_cores']:.2f}"
                )
                await asyncio.sleep(5)  # answers AIPerf gave up on end before the next level
    result: dict[str, Any] = {"threads": threads, "seconds": seconds, "sides": sides}
    result["same_requests"] = all(
        abs(sides["mesh"][k][t] - sides["llama-server"][k][t]) < 1.0
        for k in sides["mesh"]
        for t in ("prompt_tokens", "completion_tokens")
    )
    for row in rows(result):
        say("   " + "  ".join(row))
    return result


def rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    if "skipped" in m:
        return [("AIPerf against llama-server", f"skipped: {m['skipped']}", "")]
    ours, theirs = m["sides"]["mesh"], m["sides"]["llama-server"]
    peak = max(v["goodput"] for v in ours.values())
    out = []
    for level in map(str, LEVELS):
        mine, other = ours[level], theirs[level]
        ratio = mine["request_throughput"] / max(other["request_throughput"], 1e-9)
        out.append(
            (
                f"AIPerf, {level} at once: request throughput, mesh / llama-server",
                f"{ratio:.2f}x ({mine['request_throughput']:.2f} vs "
                f"{other['request_throughput']:.2f} req/s)"
                if m["same_requests"]
                else "requests differ: " + json.dumps({"mesh": mine, "llama-server": other}),
                f">= {GOAL_THROUGHPUT:.1f}x",
            )
        )
        out.append(
            (
                f"AIPerf, {level} at once: goodput (TTFT <= {SLO_TTFT_MS / 1000:g} s, ITL <= "
                f"{SLO_ITL_MS} ms), the mesh's / its peak",
                f"{mine['goodput'] / max(peak, 1e-9):.2f} ({mine['goodput']:.2f} of "
                f"{peak:.2f} req/s; llama-server {other['goodput']:.2f}; the mesh refused "
                f"{mine['errors']:.0f}{_cores(mine)})",
                f">= {GOAL_GOODPUT}" if int(level) >= 32 else "",
            )
        )
    return out


def _cores(level: dict[str, Any]) -> str:
    """The cores the mesh's processes and AIPerf's kept busy at this level, if measured."""
    if "server_cores" not in level:
        return ""
    return f"; cores busy: the mesh {level['server_cores']:.2f}, AIPerf {level['tool_cores']:.2f}"


def main() -> int:
    return run_alone(__doc__, "aiperf_load", measure, rows, {"seconds": 60}, repeats=None)


if __name__ == "__main__":
    sys.exit(main())
