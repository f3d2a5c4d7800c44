"""`make run` (disagg_mesh.server.launcher) and `make run-<node>` (disagg_mesh.server.node)
as a user runs them."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from disagg_mesh import MeshClient
from disagg_mesh.server.common.config.topology import load_topology
from disagg_mesh.server.common.wire.node_clients import health_status, open_channel
from tests.conftest import ROOT, engine_node, route, router_node, write_test_topology


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )


def launcher_args(topology: Path, folder: Path, max_tokens: int) -> list[str]:
    return [
        "disagg_mesh.server.launcher",
        "--topology",
        str(topology),
        "--log-dir",
        str(folder / "logs"),
        "--max-tokens",
        str(max_tokens),
    ]


def test_launcher_starts_the_mesh_streams_examples_and_stops_everything(tmp_path: Path) -> None:
    topology = write_test_topology(tmp_path / "topology.toml", edge_cases=False)
    out = run(*launcher_args(topology, tmp_path, 12), "--exit-after-examples")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "all nodes SERVING" in text
    for model in ("qwen3-coder:30b", "gpt-oss:120b"):
        assert f">> {model}: streaming an example" in text
    # Greedy chat answers differ between CPUs: one may end before its 12 tokens.
    assert text.count("disaggregated via") >= 2 and re.search(r"\| \d+ tok in ", text)
    assert ">> stopped" in text and "non-zero exits" not in text
    # Every node it started is gone.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    assert str(topology) not in ps.stdout


def test_unknown_node_name_is_one_clear_line() -> None:
    out = run(
        "disagg_mesh.server.node", "--topology", "topology/local.toml", "--node", "nope", timeout=60
    )
    assert out.returncode == 2
    assert "no node named 'nope'" in out.stderr and "Traceback" not in out.stderr


def test_bad_topology_is_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[nodes]]\nname = 'x'\n")
    out = run("disagg_mesh.server.node", "--topology", str(bad), "--node", "x", timeout=60)
    assert out.returncode == 2
    assert str(bad) in out.stderr and "Traceback" not in out.stderr


async def until_serving(address: str, timeout_s: float = 120) -> None:
    channel = open_channel(address, None)
    try:
        deadline = time.monotonic() + timeout_s
        while (await health_status(channel, timeout_s=1.0))[0] != "SERVING":
            assert time.monotonic() < deadline, f"{address} not SERVING after {timeout_s} s"
            await asyncio.sleep(0.5)
    finally:
        await channel.close()


def test_the_launcher_restarts_a_node_that_dies_and_the_next_request_uses_it(
    tmp_path: Path,
) -> None:
    topology = tmp_path / "topology.toml"
    topology.write_text(
        "\n".join(
            [
                router_node(),
                engine_node("prefill", "prefill"),
                engine_node("decode", "decode"),
                route("tiny", ["prefill"], ["decode"], chain=["disaggregated"]),
            ]
        )
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", *launcher_args(topology, tmp_path, 4)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []

    def read_until(marker: str, timeout_s: float = 240) -> str:
        deadline = time.monotonic() + timeout_s
        assert launcher.stdout is not None
        while time.monotonic() < deadline:
            line = launcher.stdout.readline()
            if not line:
                break
            lines.append(line)
            if marker in line:
                return line
        raise AssertionError(f"no {marker!r} in:\n{''.join(lines)}")

    try:
        read_until(">> mesh serving")
        ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True)
        [pid] = [
            int(row.split()[0])
            for row in ps.stdout.splitlines()
            if str(topology) in row and "--node decode" in row
        ]
        os.kill(pid, signal.SIGKILL)
        line = read_until(">> node decode exited")
        assert "killed by SIGKILL" in line and "restarting it in 1 s (restart 1;" in line
        loaded = load_topology(topology)
        asyncio.run(until_serving(loaded.node("decode").address))
        router = loaded.router.address
        status = subprocess.run(
            [sys.executable, "-m", "disagg_mesh.cli", "--topology", str(topology), "status"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert "restarted 1x" in status.stdout, status.stdout + status.stderr
        with MeshClient(router) as client:
            result = client.generate("tiny", "Hello", max_tokens=4, temperature=0)
        assert result.metrics.decode_server == loaded.node("decode").address
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(60)
    assert launcher.returncode == 0, "".join(lines)
