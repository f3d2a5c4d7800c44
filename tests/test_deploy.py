"""deploy/: the Prometheus configuration and alert rules, and the Grafana dashboard.

The shipped files are what their generators write; Debian's promtool accepts them; and a
real Prometheus scraping a test mesh with traffic returns data for every PromQL expression
of the Grafana dashboard."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from disagg_mesh.server.common.config.topology import load_topology
from disagg_mesh.server.common.runtime.observability.prometheus_config import prometheus_config
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port
from tests.conftest import ROOT, engine_node, route, router_node, running_mesh

PROMETHEUS = ROOT / "deploy/prometheus"
GRAFANA = ROOT / "deploy/grafana"
PROMTOOL = shutil.which("promtool")
PROMETHEUS_BIN = shutil.which("prometheus")
NO_PROMETHEUS = (
    "no Prometheus: `make test` installs Debian's (apt-get install prometheus); elsewhere "
    "put prometheus and promtool on PATH"
)


def builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_files_are_what_their_generators_write() -> None:
    topology = load_topology(ROOT / "topology/local.toml")
    shipped = (PROMETHEUS / "prometheus.yml").read_text()
    assert shipped == prometheus_config(topology, "topology/local.toml"), (
        "run: disagg prometheus-config --topology topology/local.toml "
        "--out deploy/prometheus/prometheus.yml"
    )
    dashboard = json.loads((GRAFANA / "disagg-mesh.json").read_text())
    assert dashboard == builder().dashboard(), "run: python deploy/grafana/build_dashboard.py"
    # Laid out as Dynamo's disaggregated dashboard: one row each.
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == [
        "Router: requests",
        "Router: failures",
        "Prefill vs decode, per node",
        "KV transfer",
        "Cache",
    ]


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMETHEUS)
def test_promtool_accepts_the_config_and_the_rules(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    for args in (
        ["check", "config", str(PROMETHEUS / "prometheus.yml")],
        ["check", "rules", str(PROMETHEUS / "alerts.yml")],
    ):
        done = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    # And the config written for another topology (the seeds', which scrapes nothing yet).
    seed = prometheus_config(load_topology(ROOT / "topology/seed.toml"), "topology/seed.toml")
    (tmp_path / "prometheus.yml").write_text(seed)
    shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    done = subprocess.run(
        [PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def scraped_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MeshProcesses, str]]:
    """A mesh whose every node has a metrics_port, and its router an HTTP door."""
    http = free_port()
    parts = [
        router_node(http_port=http, metrics_port=free_port()),
        engine_node("prefill-p", "prefill", 1, slots=2, metrics_port=free_port()),
        engine_node("decode-p", "decode", 1, slots=2, metrics_port=free_port()),
        route("code", ["prefill-p"], ["decode-p"]),
        route("feedback", ["prefill-p"], ["decode-p"]),
    ]
    with running_mesh(tmp_path_factory.mktemp("scraped"), parts) as processes:
        yield processes, f"http://127.0.0.1:{http}"


@pytest.mark.skipif(PROMETHEUS_BIN is None, reason=NO_PROMETHEUS)
def test_a_real_prometheus_has_data_for_every_grafana_expression(
    scraped_mesh: tuple[MeshProcesses, str], tmp_path: Path
) -> None:
    assert PROMETHEUS_BIN is not None
    processes, url = scraped_mesh
    config = prometheus_config(processes.topology, "the test mesh", scrape_interval_s=1.0)
    (tmp_path / "prometheus.yml").write_text(config)
    shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    port = free_port()
    server = subprocess.Popen(
        [
            PROMETHEUS_BIN,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("wb"),
    )
    api = f"http://127.0.0.1:{port}/api/v1"
    try:

        def targets_up() -> bool:
            try:
                reply = httpx.get(f"{api}/query", params={"query": "up"}, timeout=5).json()
            except httpx.HTTPError:
                return False
            values = [r["value"][1] for r in reply["data"]["result"]]
            return len(values) == 3 and all(v == "1" for v in values)

        deadline = time.monotonic() + 60
        while not targets_up():
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-3000:]
            time.sleep(0.5)
        # Traffic once Prometheus scrapes (rates need points before and after it): both
        # models, a shared rubric (the prefix cache serves its blocks).
        rubric = "Grade this homework. Say what is right and wrong, and one fix. " * 20
        for i in range(6):
            reply = httpx.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": ("code", "feedback")[i % 2],
                    "messages": [
                        {"role": "system", "content": rubric},
                        {"role": "user", "content": f"Submission {i}: print({i})"},
                    ],
                    "max_tokens": 8,
                },
                timeout=120,
            )
            assert reply.status_code == 200, reply.text
            time.sleep(0.5)

        time.sleep(5)  # a few scrapes after the traffic: rates over [1m] have their points
        empty: list[str] = []
        for expr in builder().expressions():
            reply = httpx.get(f"{api}/query", params={"query": expr}, timeout=10).json()
            assert reply["status"] == "success", (expr, reply)
            result: list[Any] = reply["data"]["result"]
            if not result:
                empty.append(expr)
        assert not empty, empty
        # The rules load, and the node-down alert is there to fire.
        rules = httpx.get(f"{api}/rules", timeout=10).json()["data"]["groups"][0]["rules"]
        assert {r["name"] for r in rules} >= {"DisaggNodeDown", "DisaggKvTransferFailures"}
    finally:
        server.terminate()
        server.wait(30)


def test_the_command_prints_writes_and_says_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from disagg_mesh import cli

    local = str(ROOT / "topology/local.toml")
    assert cli.main(["prometheus-config", "--topology", local]) == 0
    printed = capsys.readouterr().out
    assert printed == prometheus_config(load_topology(local), local)
    out = tmp_path / "prom" / "prometheus.yml"
    assert cli.main(["prometheus-config", "--topology", local, "--out", str(out)]) == 0
    assert out.read_text() == printed and "5 targets" in capsys.readouterr().out
    seed = str(ROOT / "topology/seed.toml")
    assert cli.main(["prometheus-config", "--topology", seed]) == 0
    captured = capsys.readouterr()
    assert "scrape_configs: []" in captured.out and "no node of" in captured.err
    assert cli.main(["prometheus-config", "--topology", str(tmp_path / "none.toml")]) == 2
    assert "no such topology file" in capsys.readouterr().err
