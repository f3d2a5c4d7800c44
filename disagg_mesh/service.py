"""`disagg service`: run one node of a topology under the machine's service manager, which
starts it at boot and again whenever it dies: a systemd unit on Linux (Restart=on-failure)
or a launchd agent on macOS (KeepAlive). Plain text in, plain files out: no protobuf.

    disagg service install --topology topology/seed.toml --node dgx-spark-1 [--print]
    disagg service uninstall --topology topology/seed.toml --node dgx-spark-1
"""

from __future__ import annotations

import plistlib
import sys
from dataclasses import dataclass
from pathlib import Path

LABEL_PREFIX = "com.disagg-mesh"


@dataclass(frozen=True)
class ServiceSpec:
    """One node as a service: what runs, where, and for which OS ("linux" or "macos")."""

    node: str
    role: str
    topology: Path  # absolute
    workdir: Path  # the repository: `services` is imported from there
    python: Path
    os: str
    system: bool = False  # Linux: a system unit (/etc, root) instead of a user unit

    @property
    def name(self) -> str:
        return f"disagg-{self.node}" if self.os == "linux" else f"{LABEL_PREFIX}.{self.node}"

    @property
    def command(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "disagg_mesh.server.node",
            "--topology",
            str(self.topology),
            "--node",
            self.node,
        ]

    def path(self, home: Path) -> Path:
        """Where the unit or agent file goes."""
        if self.os == "macos":
            return home / "Library" / "LaunchAgents" / f"{self.name}.plist"
        if self.system:
            return Path("/etc/systemd/system") / f"{self.name}.service"
        return home / ".config" / "systemd" / "user" / f"{self.name}.service"

    def log_file(self, home: Path) -> Path:
        return home / "Library" / "Logs" / "disagg-mesh" / f"{self.node}.log"

    def render(self, home: Path) -> str:
        return self.systemd_unit() if self.os == "linux" else self.launchd_plist(home)

    def systemd_unit(self) -> str:
        """Restart=on-failure: started again after a crash or a kill, not after a clean stop
        (SIGTERM drains the node and it exits 0)."""
        target = "multi-user.target" if self.system else "default.target"
        return "\n".join(
            [
                "[Unit]",
                f"Description=disagg-mesh {self.role} node {self.node} ({self.topology})",
                "After=network-online.target",
                "Wants=network-online.target",
                "",
                "[Service]",
                "Type=simple",
                f"WorkingDirectory={self.workdir}",
                "Environment=LOG_FORMAT=json",
                "Environment=PYTHONUNBUFFERED=1",
                "ExecStart=" + " ".join(_quoted(part) for part in self.command),
                "Restart=on-failure",
                "RestartSec=2",
                "KillSignal=SIGTERM",
                # The node gives streams in flight 10 s to finish before it exits.
                "TimeoutStopSec=20",
                "",
                "[Install]",
                f"WantedBy={target}",
                "",
            ]
        )

    def launchd_plist(self, home: Path) -> str:
        """KeepAlive/SuccessfulExit false: started again unless it exited 0 (a clean stop)."""
        log = str(self.log_file(home))
        plist = {
            "Label": self.name,
            "ProgramArguments": self.command,
            "WorkingDirectory": str(self.workdir),
            "EnvironmentVariables": {"LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"},
            "RunAtLoad": True,
            "KeepAlive": {"SuccessfulExit": False},
            "ThrottleInterval": 2,
            "ExitTimeOut": 20,
            "StandardOutPath": log,
            "StandardErrorPath": log,
        }
        return plistlib.dumps(plist).decode()

    def enable_commands(self, home: Path) -> list[str]:
        """What starts it now and at every boot, once the file is in place."""
        if self.os == "macos":
            return [f"launchctl bootstrap gui/$(id -u) {self.path(home)}"]
        ctl = "systemctl" if self.system else "systemctl --user"
        return [f"{ctl} daemon-reload", f"{ctl} enable --now {self.name}"]

    def disable_commands(self, home: Path) -> list[str]:
        if self.os == "macos":
            return [f"launchctl bootout gui/$(id -u)/{self.name}"]
        ctl = "systemctl" if self.system else "systemctl --user"
        return [f"{ctl} disable --now {self.name}", f"{ctl} daemon-reload"]


def this_os() -> str:
    return "macos" if sys.platform == "darwin" else "linux"


def _quoted(part: str) -> str:
    """systemd's command-line quoting: double quotes around anything with a space."""
    if part and not any(c in part for c in ' \t"\\'):
        return part
    return '"' + part.replace("\\", "\\\\").replace('"', '\\"') + '"'
