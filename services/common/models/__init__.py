"""Model files: by path, by installed package or from Ollama's store, and their identity.

- `files.py`         paths and package:DIST/FILE names; a file's SHA-256, cached
- `ollama_store.py`  "ollama:NAME": the GGUF blob of a model pulled with Ollama
- `gguf_header.py`   the architecture a GGUF declares, checked before llama.cpp loads it
- `gptoss.py`        Ollama's own gpt-oss blob, rewritten once for llama.cpp (a new header)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from disagg_mesh.server.common.models import gptoss, ollama_store
from disagg_mesh.server.common.models.files import ModelFileError, cached_sha256, resolve_model_path
from disagg_mesh.server.common.models.gguf_header import check_loadable
from disagg_mesh.server.common.models.gptoss import Progress

__all__ = ["LocatedModel", "ModelFileError", "locate_model", "resolve_model_path"]


@dataclass(frozen=True)
class LocatedModel:
    path: Path
    sha256: str
    architecture: str


def locate_model(
    spec: str,
    relative_to: Path,
    ollama_models: str | None = None,
    progress: Progress | None = None,
) -> LocatedModel:
    """The GGUF file a llama_cpp node's `model` names, checked loadable, with its SHA-256
    (Ollama's digest, or hashed once and cached). Ollama's own gpt-oss build is rewritten
    for llama.cpp the first time (gptoss.py; progress(bytes done, bytes in all) while it
    copies). Blocking: run it in a thread."""
    digest = None
    if spec.startswith(ollama_store.PREFIX):
        found = ollama_store.find_model(spec.removeprefix(ollama_store.PREFIX), ollama_models)
        path, digest = found.path, found.sha256
    else:
        path = resolve_model_path(spec, relative_to)
    arch = check_loadable(path, spec)  # before hashing: a file llama.cpp refuses is not read
    if arch == gptoss.SOURCE_ARCH:
        source = digest or cached_sha256(path)
        path, digest = gptoss.convert(path, source, spec, progress=progress)
        arch = check_loadable(path, spec)
    return LocatedModel(path=path, sha256=digest or cached_sha256(path), architecture=arch)
