"""The Python client (sync and asyncio), the `disagg` CLI and the example grader, against
the real mesh."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import llama_cpp
import pytest

from disagg_mesh import (
    AsyncMeshClient,
    GenerateCall,
    InvalidRequest,
    Logprobs,
    MeshClient,
    Metrics,
    ModelNotFound,
    Result,
    Unavailable,
)
from disagg_mesh.server.common.runtime.processes import free_port
from tests.conftest import ROOT, Mesh
from tests.streams import reference_tokens, shaped_reference_tokens

PROMPT = "def add(a, b):"
METRIC_NAMES = {
    "prefill_time", "decode_time", "total_time", "prompt_tokens", "completion_tokens",
    "total_tokens", "prefill_speed", "decode_speed", "method", "prefill_server",
    "decode_server", "ttft", "kv_bytes", "kv_transfer_time",
}  # fmt: skip


def test_sync_generate_returns_text_and_the_graders_metrics(mesh: Mesh) -> None:
    with MeshClient(mesh.router_address) as client:
        result = client.generate(
            "qwen3-coder:30b", PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True
        )
    m = result.metrics
    assert result.text and m.completion_tokens == 8
    assert METRIC_NAMES <= set(m.as_dict())
    assert m.total_tokens == m.prompt_tokens + m.completion_tokens
    assert m.method == "disaggregated" and m.kv_transfer == "state"
    assert m.prefill_server == mesh.address("prefill-qwen")
    assert m.decode_server == mesh.address("decode-qwen")
    assert 0 < m.ttft < m.total_time and m.kv_bytes > 0 and m.decode_speed > 0


def test_sync_stream_yields_text_then_metrics(mesh: Mesh) -> None:
    with MeshClient(mesh.router_address) as client:
        items = list(
            client.stream("gpt-oss:120b", PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
        )
    assert all(isinstance(i, str) for i in items[:-1]) and len(items) > 2
    assert isinstance(items[-1], Metrics)


def test_logprobs_come_back_in_the_result_and_in_the_stream(mesh: Mesh) -> None:
    """GenerateCall.logprobs: Result.logprobs, one per token, their texts the answer;
    stream() yields each delta's as Logprobs after its text."""
    call = GenerateCall(
        "qwen3-coder:30b", "def square(x):", max_tokens=6, temperature=0.0, ignore_eos=True
    )
    with MeshClient(mesh.router_address) as client:
        result = client.generate(dataclasses.replace(call, logprobs=1))
        items = list(client.stream(dataclasses.replace(call, logprobs=1)))
        plain = client.generate(call)
    assert len(result.logprobs) == result.metrics.completion_tokens == 6
    assert "".join(lp.text for lp in result.logprobs) == result.text
    assert all(len(lp.top) == 1 and lp.top[0].token_id == lp.token_id for lp in result.logprobs)
    streamed = [lp for item in items if isinstance(item, Logprobs) for lp in item]
    assert [lp.token_id for lp in streamed] == [lp.token_id for lp in result.logprobs]
    assert plain.logprobs == ()


def test_sync_gather_keeps_order_and_one_failure_does_not_cancel_the_other(mesh: Mesh) -> None:
    calls = [
        GenerateCall("qwen3-coder:30b", PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True),
        GenerateCall("no-such-model", PROMPT, max_tokens=4),
        GenerateCall("gpt-oss:120b", PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True),
    ]
    with MeshClient(mesh.router_address) as client:
        first, second, third = client.gather(*calls)
    assert isinstance(first, Result) and first.metrics.decode_node == "decode-qwen"
    assert isinstance(second, ModelNotFound) and "no-such-model" in second.message
    assert isinstance(third, Result) and third.metrics.decode_node == "decode-gpt-oss"


async def test_async_client_grades_with_both_models_at_once(mesh: Mesh) -> None:
    async with AsyncMeshClient(mesh.router_address) as client:
        analysis, feedback = await client.gather(
            GenerateCall("qwen3-coder:30b", PROMPT, max_tokens=6, temperature=0.0),
            GenerateCall(
                "gpt-oss:120b",
                messages=[{"role": "user", "content": "Feedback on: " + PROMPT}],
                max_tokens=6,
                temperature=0.0,
            ),
        )
        assert isinstance(analysis, Result) and isinstance(feedback, Result)
        with pytest.raises(InvalidRequest) as info:
            await client.generate("qwen3-coder:30b", PROMPT, max_tokens=0)
        assert info.value.message.startswith("sampling.max_tokens:")
        with pytest.raises(ModelNotFound):
            await client.gather(
                GenerateCall("qwen3-coder:30b", PROMPT, max_tokens=4),
                GenerateCall("no-such-model", PROMPT),
                cancel_on_error=True,
            )


async def test_async_list_models(mesh: Mesh) -> None:
    async with AsyncMeshClient(mesh.router_address) as client:
        routes = await client.list_models()
    assert {r.model for r in routes} == {m.name for m in mesh.topology.models}


def test_unreachable_router_is_unavailable() -> None:
    with MeshClient(f"127.0.0.1:{free_port()}", timeout=5) as client, pytest.raises(Unavailable):
        client.generate("qwen3-coder:30b", PROMPT, max_tokens=4)


def disagg(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "disagg_mesh.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )


def test_cli_generate_streams_then_prints_one_summary_line(mesh: Mesh) -> None:
    out = disagg(
        "--router",
        mesh.router_address,
        "generate",
        "-m",
        "qwen3-coder:30b",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--ignore-eos",
        PROMPT,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    [summary] = out.stderr.strip().splitlines()
    assert (
        summary.startswith("disaggregated via prefill-qwen -> decode-qwen") and "8 tok" in summary
    )


def test_cli_generate_takes_penalties_and_logit_biases(
    mesh: Mesh, reference_llm: llama_cpp.Llama
) -> None:
    """--repeat-penalty, --frequency-penalty, --presence-penalty and --logit-bias reach the
    nodes: the answer is a single process's with the same shaping (a prompt of its own,
    evaluated from its start). A malformed --logit-bias is one line, exit 2."""
    prompt = "The days of the week are Monday, Tuesday, Wednesday, Thursday,"
    banned = reference_tokens(reference_llm, prompt, 1, True)[0]
    expected = shaped_reference_tokens(
        reference_llm, prompt, 12, (1.25, 0.5, 0.25), {banned: -100.0}, ignore_eos=True
    )
    greedy = ["-m", "qwen3-coder:30b", "--max-tokens", "12", "--temperature", "0", "--ignore-eos"]
    options = ["--repeat-penalty", "1.25", "--frequency-penalty", "0.5"]
    options += ["--presence-penalty", "0.25", "--logit-bias", f"{banned}=-100"]
    out = disagg("--router", mesh.router_address, "generate", *greedy, *options, prompt)
    assert out.returncode == 0, out.stderr
    assert out.stdout == reference_llm.detokenize(expected).decode() + "\n"
    out = disagg("--router", mesh.router_address, "generate", "-m", "x", "--logit-bias", "a", "hi")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--logit-bias" in out.stderr


def test_cli_generate_shows_log_probabilities(mesh: Mesh) -> None:
    """--logprobs N: after the answer, a line a token on stderr (its text, log probability,
    probability and the N most likely), then the summary line; with --json, "logprobs":
    one per token, their texts the answer."""
    common = ["--router", mesh.router_address, "generate", "-m", "qwen3-coder:30b"]
    common += ["--max-tokens", "5", "--temperature", "0", "--ignore-eos", "--logprobs", "2"]
    out = disagg(*common, "def cube(x):")
    assert out.returncode == 0, out.stderr
    *scores, summary = out.stderr.strip().splitlines()
    assert len(scores) == 5 and "5 tok" in summary
    assert all(line.count("%") == 3 for line in scores), scores  # its own and 2 more
    out = disagg(*common, "--json", "def cube(x):")
    data = json.loads(out.stdout)
    assert "".join(lp["text"] for lp in data["logprobs"]) == data["text"]
    assert [len(lp["top"]) for lp in data["logprobs"]] == [2] * 5
    assert all(lp["logprob"] <= 0 for lp in data["logprobs"])


def test_cli_generate_json_from_stdin(mesh: Mesh) -> None:
    out = disagg(
        "--router",
        mesh.router_address,
        "generate",
        "-m",
        "gpt-oss:120b",
        "--max-tokens",
        "4",
        "--ignore-eos",
        "--json",
        "-",
        stdin=PROMPT,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert METRIC_NAMES <= set(data["metrics"]) and data["metrics"]["completion_tokens"] == 4


def test_cli_errors_are_one_line_with_a_hint(mesh: Mesh) -> None:
    out = disagg("--router", mesh.router_address, "generate", "-m", "nope", PROMPT)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert (
        out.stderr.count("\n") == 1 and "NOT_FOUND" in out.stderr and "disagg models" in out.stderr
    )
    out = disagg(
        "--router", f"127.0.0.1:{free_port()}", "--timeout", "5", "generate", "-m", "x", PROMPT
    )
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr and "make run" in out.stderr
    assert "Traceback" not in out.stderr
    # Values the request's fields cannot carry: one line naming the option, before any call.
    for option, value in (("--top-k", str(2**40)), ("--seed", "-2"), ("--logit-bias", "9" * 12)):
        value = f"{value}=1" if option == "--logit-bias" else value
        out = disagg("--router", mesh.router_address, "generate", "-m", "x", option, value, "hi")
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.count("\n") == 1 and option.strip("-").replace("-", "_") in out.stderr
    # -1 is a random seed, as on Ollama's and OpenAI's doors.
    seeded = ["-m", "qwen3-coder:30b", "--seed", "-1", "--max-tokens", "2", PROMPT]
    out = disagg("--router", mesh.router_address, "generate", *seeded)
    assert out.returncode == 0, out.stderr


def test_cli_models(mesh: Mesh) -> None:
    out = disagg("--router", mesh.router_address, "models")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].split() == ["MODEL", "PREFILL", "DECODE", "DEADLINES"]
    assert "qwen3-coder:30b" in out.stdout and "decode-qwen" in out.stdout


def test_cli_status_shows_every_node_and_fails_when_one_is_down(mesh: Mesh, tmp_path: Path) -> None:
    topology = mesh.topology.source
    out = disagg("--topology", str(topology), "status")
    assert out.returncode == 0, out.stdout + out.stderr
    for node in mesh.topology.nodes:
        assert node.name in out.stdout
    assert f"{len(mesh.topology.nodes)} of {len(mesh.topology.nodes)} nodes SERVING" in out.stdout
    router_line = next(line for line in out.stdout.splitlines() if line.startswith("router "))
    assert " calls, " in router_line and " in flight" in router_line  # from its /metrics
    decode_line = next(line for line in out.stdout.splitlines() if line.startswith("decode-qwen "))
    assert "slots 0/8, queue 0/16, " in decode_line and " decode tok/s" in decode_line
    assert "CPU, 0/31 layers on GPU" in decode_line
    assert "prefix cache " in decode_line and "/4096 tokens" in decode_line
    with_dead = tmp_path / "topology.toml"
    with_dead.write_text(
        topology.read_text() + f'\n[[nodes]]\nname = "ghost"\nrole = "decode"\nhost = "127.0.0.1"\n'
        f'port = {free_port()}\nengine = "llama_cpp"\nmodel = "x.gguf"\n'
    )
    out = disagg("--topology", str(with_dead), "status", "--json")
    assert out.returncode == 1
    rows = {r["node"]: r for r in json.loads(out.stdout)}
    assert rows["ghost"]["health"] == "DOWN" and rows["router"]["health"] == "SERVING"


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "disagg"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and "generate" in out.stdout


def test_example_grader_grades_one_submission_with_both_models(mesh: Mesh) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "examples/grade_submission.py",
            "--router",
            mesh.router_address,
            "--max-tokens",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "== Code analysis" in out.stdout and "== Feedback" in out.stdout
    assert out.stdout.count("-- disaggregated via") == 2 and "both in parallel" in out.stdout


# The server extra's packages (pyproject.toml): the client and the CLI run without them.
SERVER_ONLY = ("llama_cpp", "numpy", "gguf", "ollama", "grpc_reflection", "psutil", "pynvml")
BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ModuleNotFoundError(f"{{name}} is blocked: not installed with the client")
        return None
sys.meta_path.insert(0, Blocker())
"""


def without(blocked: tuple[str, ...], code: str) -> subprocess.CompletedProcess[str]:
    """Python code run with these packages (and what is under them) unimportable."""
    return subprocess.run(
        [sys.executable, "-c", BLOCKER.format(blocked=set(blocked)) + code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )


def test_the_client_library_needs_no_server_code_nor_the_server_extra(mesh: Mesh) -> None:
    out = without(
        ("disagg_mesh.server", *SERVER_ONLY),
        f"""
from disagg_mesh import MeshClient
from disagg_mesh import cli  # imports nothing of the server until a command needs it
with MeshClient({mesh.router_address!r}) as client:
    result = client.generate("qwen3-coder:30b", "def add(a, b):", max_tokens=4, temperature=0.0)
server = sorted(m for m in sys.modules if m.startswith(("disagg_mesh.server", "services")))
print(result.metrics.completion_tokens, server)
""",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4", "[]"]


def test_the_clis_topology_commands_need_only_the_base_dependencies(mesh: Mesh) -> None:
    topology = str(mesh.topology.source)
    out = without(
        SERVER_ONLY,
        f"""
from disagg_mesh import cli
code = cli.main(["--topology", {topology!r}, "status"])
args = ["generate", "-m", "gpt-oss:120b", "--max-tokens", "3", "Hi"]
code += cli.main(["--topology", {topology!r}, *args])
sys.exit(code)
""",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(mesh.topology.nodes)} of {len(mesh.topology.nodes)} nodes SERVING" in out.stdout


SKIP = (".venv", ".git", "build", "*.egg-info", "__pycache__", ".*_cache", ".run", "results")


def test_the_distribution_installs_one_name(tmp_path: Path) -> None:
    """The wheel holds disagg_mesh and nothing else at the top: the nodes' code (services/)
    as disagg_mesh.server and the stubs (generated/disagg) as disagg_mesh.proto, whole."""
    # From a copy: setuptools builds in the source folder (build/, *.egg-info).
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*SKIP))
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip, str(source), "-w", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("disagg_mesh-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert {n.split("/")[0] for n in names} == {
        "disagg_mesh",
        wheel.name.split("-py")[0] + ".dist-info",
    }
    services = sources(ROOT / "services")
    stubs = sources(ROOT / "generated" / "disagg")
    assert {f"disagg_mesh/server/{s}" for s in services} <= set(names)
    assert {f"disagg_mesh/proto/{s}" for s in stubs} <= set(names)


def sources(folder: Path) -> set[str]:
    """The folder's Python modules and stubs, relative to it."""
    found = (*folder.rglob("*.py"), *folder.rglob("*.pyi"))
    return {str(p.relative_to(folder)) for p in found if "__pycache__" not in p.parts}
