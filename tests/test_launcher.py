"""`make run` (services.launcher) and `make run-<node>` (services.node) as a user runs them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, write_test_topology


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


def test_launcher_starts_the_mesh_streams_examples_and_stops_everything(tmp_path: Path) -> None:
    topology = write_test_topology(tmp_path / "topology.toml", edge_cases=False)
    out = run(
        "services.launcher",
        "--topology",
        str(topology),
        "--log-dir",
        str(tmp_path / "logs"),
        "--max-tokens",
        "12",
        "--exit-after-examples",
    )
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
    out = run("services.node", "--topology", "topology/local.toml", "--node", "nope", timeout=60)
    assert out.returncode == 2
    assert "no node named 'nope'" in out.stderr and "Traceback" not in out.stderr


def test_bad_topology_is_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[nodes]]\nname = 'x'\n")
    out = run("services.node", "--topology", str(bad), "--node", "x", timeout=60)
    assert out.returncode == 2
    assert str(bad) in out.stderr and "Traceback" not in out.stderr
