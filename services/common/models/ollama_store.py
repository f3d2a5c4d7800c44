"""GGUF files of models pulled with Ollama, found in Ollama's store without Ollama running.

Ollama keeps every pulled model as a manifest and content-addressed blobs:

    <store>/manifests/<host>/<namespace>/<model>/<tag>   JSON, its layers by mediaType
    <store>/blobs/sha256-<hex>                           the bytes; SHA-256 = <hex>

The layer with mediaType `application/vnd.ollama.image.model` is the GGUF file, so its
digest is the file's SHA-256 and the fingerprint never hashes a 65 GB file. Names follow
Ollama's defaults: host `registry.ollama.ai`, namespace `library`, tag `latest`
(`qwen3-coder:30b` is registry.ollama.ai/library/qwen3-coder:30b; `hf.co/org/repo:Q4_K_M`
keeps its host and namespace).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from disagg_mesh.server.common.models.files import ModelFileError

PREFIX = "ollama:"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
# Where Ollama keeps its store, after the node's ollama_models and $OLLAMA_MODELS.
STANDARD_STORES = (
    "~/.ollama/models",
    "/usr/share/ollama/.ollama/models",  # the Linux service's user
    "/var/lib/ollama",
)
_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_HOST = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(:[0-9]+)?$")
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


@dataclass(frozen=True)
class OllamaName:
    host: str
    namespace: str
    model: str
    tag: str

    def manifest(self, store: Path) -> Path:
        return store / "manifests" / self.host / self.namespace / self.model / self.tag

    def __str__(self) -> str:
        if self.host == DEFAULT_HOST:
            prefix = "" if self.namespace == DEFAULT_NAMESPACE else f"{self.namespace}/"
        else:
            prefix = f"{self.host}/{self.namespace}/"
        return f"{prefix}{self.model}:{self.tag}"


@dataclass(frozen=True)
class OllamaModel:
    name: OllamaName
    store: Path
    path: Path
    sha256: str
    size_bytes: int


def parse_name(text: str) -> OllamaName:
    """[host/][namespace/]model[:tag], with Ollama's defaults for what is left out."""
    name = text.strip()
    slash = name.rfind("/")
    tag = DEFAULT_TAG
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    parts = name.split("/")
    if len(parts) == 1:
        host, namespace, model = DEFAULT_HOST, DEFAULT_NAMESPACE, parts[0]
    elif len(parts) == 2:
        host, (namespace, model) = DEFAULT_HOST, parts
    elif len(parts) == 3:
        host, namespace, model = parts
    else:
        raise ModelFileError(
            f"model 'ollama:{text}': an Ollama name is [host/][namespace/]model[:tag]"
        )
    for label, value, pattern in (
        ("host", host, _HOST),
        ("namespace", namespace, _PART),
        ("model", model, _PART),
        ("tag", tag, _PART),
    ):
        if not pattern.match(value) or value in (".", ".."):
            raise ModelFileError(f"model 'ollama:{text}': {label} {value!r} is not a valid name")
    return OllamaName(host, namespace, model, tag)


def candidate_stores(configured: str | None) -> list[Path]:
    """Stores to look in, in order: the node's ollama_models alone when it is set; else
    $OLLAMA_MODELS, then the standard places."""
    if configured:
        return [Path(configured).expanduser()]
    places = [os.environ.get("OLLAMA_MODELS", ""), *STANDARD_STORES]
    return [Path(p).expanduser() for p in places if p]


def find_model(text: str, configured_store: str | None = None) -> OllamaModel:
    """The GGUF blob of a pulled model; ModelFileError with one line saying what to do."""
    name = parse_name(text)
    places = candidate_stores(configured_store)
    stores = [p for p in places if _is_dir(p)]
    if not stores:
        looked = ", ".join(str(p) for p in places)
        raise ModelFileError(
            f"model 'ollama:{text}': no Ollama model store found (looked in {looked}); set "
            "the node's ollama_models or OLLAMA_MODELS to the folder that holds manifests/ "
            "and blobs/"
        )
    for store in stores:
        manifest = _find_manifest(name, store)
        if manifest is not None:
            return _read_model(text, name, store, manifest)
    looked = ", ".join(str(p) for p in stores)
    raise ModelFileError(
        f"model 'ollama:{text}' is not pulled on this machine (no manifest {name} in "
        f"{looked}): run `ollama pull {text}`"
    )


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except PermissionError:
        return True  # it exists; reading it says what is wrong


def _find_manifest(name: OllamaName, store: Path) -> Path | None:
    exact = name.manifest(store)
    try:
        if exact.is_file():
            return exact
        # Ollama matches names without regard to case; the folders keep the first pull's.
        folder = store / "manifests"
        for part in (name.host, name.namespace, name.model, name.tag):
            if not folder.is_dir():
                return None
            match = next((p for p in folder.iterdir() if p.name.lower() == part.lower()), None)
            if match is None:
                return None
            folder = match
        return folder if folder.is_file() else None
    except PermissionError as exc:
        raise _permission(name, exc) from None


def _permission(name: OllamaName, exc: PermissionError) -> ModelFileError:
    return ModelFileError(
        f"model 'ollama:{name}': permission denied reading {exc.filename}: Ollama's service "
        "owns its store; add this user to the ollama group (sudo usermod -aG ollama $USER, "
        "then log in again)"
    )


def _read_model(text: str, name: OllamaName, store: Path, manifest_path: Path) -> OllamaModel:
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except PermissionError as exc:
        raise _permission(name, exc) from None
    except (OSError, ValueError) as exc:
        raise ModelFileError(
            f"model 'ollama:{text}': its manifest {manifest_path} cannot be read ({exc}): "
            f"run `ollama pull {text}` again"
        ) from None
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    layers = [layer for layer in layers or [] if isinstance(layer, dict)]
    gguf = next((layer for layer in layers if layer.get("mediaType") == MODEL_MEDIA_TYPE), None)
    if gguf is None:
        kinds = ", ".join(sorted({str(layer.get("mediaType", "?")) for layer in layers}))
        raise ModelFileError(
            f"model 'ollama:{text}' has no GGUF layer ({MODEL_MEDIA_TYPE}); its layers are "
            f"{kinds or 'none'}: a safetensors/MLX import or a cloud model, which llama.cpp "
            "cannot load: pull a GGUF build of it"
        )
    digest = _DIGEST.match(str(gguf.get("digest", "")))
    size = gguf.get("size")
    if digest is None or not isinstance(size, int) or size <= 0:
        raise ModelFileError(
            f"model 'ollama:{text}': its manifest {manifest_path} has a malformed model layer "
            f"(digest {gguf.get('digest')!r}, size {size!r}): run `ollama pull {text}` again"
        )
    sha256 = digest.group(1)
    blob = store / "blobs" / f"sha256-{sha256}"
    try:
        on_disk = blob.stat().st_size
        with blob.open("rb"):
            pass
    except PermissionError as exc:
        raise _permission(name, exc) from None
    except FileNotFoundError:
        raise ModelFileError(
            f"model 'ollama:{text}': its GGUF blob {blob} is missing from the store: run "
            f"`ollama pull {text}` again"
        ) from None
    if on_disk != size:
        raise ModelFileError(
            f"model 'ollama:{text}': its GGUF blob {blob} is {on_disk} bytes, the manifest "
            f"says {size} (truncated or still downloading): run `ollama pull {text}` again"
        )
    return OllamaModel(name=name, store=store, path=blob, sha256=sha256, size_bytes=size)
