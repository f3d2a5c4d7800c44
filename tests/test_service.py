"""`disagg service`: the systemd unit and the launchd agent of one node, as files a service
manager accepts (systemd-analyze verify where it is installed, plistlib for the plist)."""

from __future__ import annotations

import configparser
import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SEED = "topology/seed.toml"


def disagg(*args: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"HOME": str(home)} if home else {})}
    return subprocess.run(
        [sys.executable, "-m", "disagg_mesh.cli", "--topology", SEED, "service", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def printed(*args: str) -> tuple[str, str]:
    """(the file's path, its text) from --print."""
    out = disagg(*args, "--print")
    assert out.returncode == 0, out.stderr
    header, text = out.stdout.split("\n", 1)
    return header.removeprefix("# "), text


def test_the_systemd_unit_restarts_the_node_on_failure(tmp_path: Path) -> None:
    path, text = printed("install", "--node", "dgx-spark-1", "--os", "linux")
    assert path.endswith(".config/systemd/user/disagg-dgx-spark-1.service")
    unit = configparser.ConfigParser(interpolation=None, strict=False)  # Environment= twice
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(text)
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    command = service["ExecStart"].split()
    assert command[0] == sys.executable and Path(command[0]).is_absolute()
    assert command[1:3] == ["-m", "disagg_mesh.server.node"] and command[-2:] == [
        "--node",
        "dgx-spark-1",
    ]
    assert Path(command[command.index("--topology") + 1]) == ROOT / SEED
    assert service["WorkingDirectory"] == str(ROOT)
    assert unit["Install"]["WantedBy"] == "default.target"
    if shutil.which("systemd-analyze"):
        file = tmp_path / "disagg-dgx-spark-1.service"
        file.write_text(text)
        verify = subprocess.run(
            ["systemd-analyze", "verify", str(file)], capture_output=True, text=True, check=False
        )
        assert verify.returncode == 0, verify.stderr
    system_path, system = printed("install", "--node", "dgx-spark-1", "--os", "linux", "--system")
    assert system_path == "/etc/systemd/system/disagg-dgx-spark-1.service"
    assert "WantedBy=multi-user.target" in system


def test_the_launchd_agent_keeps_the_node_alive() -> None:
    path, text = printed("install", "--node", "mac-studio-1", "--os", "macos")
    assert path.endswith("Library/LaunchAgents/com.disagg-mesh.mac-studio-1.plist")
    plist = plistlib.loads(text.encode())
    assert plist["Label"] == "com.disagg-mesh.mac-studio-1"
    assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["RunAtLoad"] is True
    assert plist["ProgramArguments"][0] == sys.executable
    assert plist["ProgramArguments"][-2:] == ["--node", "mac-studio-1"]
    assert plist["StandardOutPath"].endswith("Library/Logs/disagg-mesh/mac-studio-1.log")


@pytest.mark.parametrize("system_os", ["linux", "macos"])
def test_install_writes_the_file_and_uninstall_removes_it(tmp_path: Path, system_os: str) -> None:
    installed = disagg("install", "--node", "dgx-spark-2", "--os", system_os, home=tmp_path)
    assert installed.returncode == 0, installed.stderr
    [file] = [p for p in tmp_path.rglob("*") if p.suffix in (".service", ".plist")]
    assert f"wrote {file}" in installed.stdout and "start it now" in installed.stdout
    removed = disagg("uninstall", "--node", "dgx-spark-2", "--os", system_os, home=tmp_path)
    assert removed.returncode == 0 and not file.exists(), removed.stderr
    again = disagg("uninstall", "--node", "dgx-spark-2", "--os", system_os, home=tmp_path)
    assert again.returncode == 1 and "nothing to uninstall" in again.stderr


def test_an_unknown_node_is_one_line_naming_the_nodes() -> None:
    out = disagg("install", "--node", "nope", "--print")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--node: no node named 'nope'" in out.stderr and "dgx-spark-1" in out.stderr
