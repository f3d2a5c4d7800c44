"""Nothing imports upward: the shared vocabulary imports no engine, KV, wire or runtime
code, and the router no engine of the nodes' (read from the source, so a lazy import inside
a function counts too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parent.parent / "services"
PREFIX = "disagg_mesh.server."
# The plain vocabulary every layer speaks, and what each may import of the server's code
# (the tool vocabulary too: a tool, a call, the tools a request offers).
VOCABULARY = ("common/types.py", "common/errors.py", "common/validation.py")
TOOL_VOCABULARY = ("common.tools.calls", "common.tools.requests")
LAYERS = {
    **{
        path: (
            "common.types",
            "common.errors",
            "common.config",
            "common.structured",
            *TOOL_VOCABULARY,
        )
        for path in VOCABULARY
    },
    "common/tools/calls.py": (),
    "common/tools/requests.py": ("common.errors", "common.tools.calls"),
    "common/structured": ("common.types", "common.errors", "common.config", "common.structured"),
    "common/config": ("common.types", "common.errors", "common.config"),
}
# The router runs no engine: the only engine code it may use is the prefix cache's keys
# (shared with the nodes) and the Ollama engine (its direct-Ollama stage).
ROUTER_ENGINES = ("common.engines.prefix_keys", "common.engines.ollama_engine")


def imported(path: Path) -> set[str]:
    """The server modules a file imports, without the package prefix."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name.removeprefix(PREFIX) for name in names if name.startswith(PREFIX)}


def files(where: str) -> list[Path]:
    path = SERVER / where
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


@pytest.mark.parametrize("where", sorted(LAYERS))
def test_the_shared_vocabulary_imports_nothing_above_it(where: str) -> None:
    allowed = LAYERS[where]
    for path in files(where):
        upward = {m for m in imported(path) if not m.startswith(allowed)}
        assert not upward, f"{path.relative_to(SERVER)} imports {sorted(upward)}"


def test_the_router_imports_no_engine_of_the_nodes() -> None:
    for path in files("router"):
        engines = {
            m
            for m in imported(path)
            if m.startswith("common.engines") and not m.startswith(ROUTER_ENGINES)
        }
        assert not engines, f"{path.relative_to(SERVER)} imports {sorted(engines)}"
