"""Ollama's own gpt-oss GGUF (architecture `gptoss`) rewritten once for stock llama.cpp.

Ollama re-published its gpt-oss models (around 2025-10) as GGUF blobs in a layout of its own
engine: architecture `gptoss`, metadata under `gptoss.*`, three tensor names of its own, and
no `expert_feed_forward_length` or `rope.scaling.type`. The tensors, their types (MXFP4 is
ggml type 39 in both) and their bytes are llama.cpp's. Ollama itself loads these blobs in
llama.cpp through the same renames, in memory (`llama/compat/llama-ollama-compat.cpp`,
`handle_gptoss`). Here the renamed header is written once in front of a byte-for-byte copy
of the blob's tensor data, into the mesh's cache (`~/.cache/disagg-mesh/gguf/`), never
touching Ollama's store:

| Ollama's blob                 | llama.cpp's gpt-oss                                   |
| ----------------------------- | ----------------------------------------------------- |
| general.architecture gptoss   | gpt-oss                                               |
| gptoss.*                      | gpt-oss.*                                             |
| (none)                        | gpt-oss.expert_feed_forward_length = ne[1] of         |
|                               | blk.0.ffn_gate_exps.weight                            |
| (none)                        | gpt-oss.rope.scaling.type = "yarn" (else linear)      |
| tokenizer.ggml.pre default    | gpt-4o                                                |
| blk.N.attn_out.*              | blk.N.attn_output.*                                   |
| blk.N.attn_sinks              | blk.N.attn_sinks.weight                               |
| blk.N.ffn_norm.weight         | blk.N.post_attention_norm.weight                      |

Blobs pulled before that (MXFP4 stored as ggml type 4, a slot ggml has since removed) need
their data rewritten, not just their header: they are refused, saying to pull again.

The data section keeps its offsets (they count from its own start, which moves with the
header but stays aligned), so the copy is one sequential read and write. The file is
written under a temporary name and renamed when whole, with a lock so that two nodes on
one machine convert once; its SHA-256, computed while writing, is kept beside it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from disagg_mesh.server.common.models.files import ModelFileError, cache_dir
from disagg_mesh.server.common.models.gguf_header import OLLAMA_GPT_OSS, Reader, gguf

SOURCE_ARCH = OLLAMA_GPT_OSS
TARGET_ARCH = "gpt-oss"
# Ollama's MXFP4 before ggml had a type for it (the slot of the removed Q4_2).
_OLD_MXFP4 = 4
_DEFAULT_ALIGNMENT = 32
_TENSOR_RENAMES = (
    (".attn_out.", ".attn_output."),
    (".attn_sinks", ".attn_sinks.weight"),
    (".ffn_norm.", ".post_attention_norm."),
)
# Progress: bytes written so far, and in all.
Progress = Callable[[int, int], None]


@dataclass
class _Kv:
    key: str
    kind: int
    raw: bytes  # the encoded value, as in the file


@dataclass
class _Tensor:
    name: str
    dims: list[int]
    ggml_type: int
    offset: int


@dataclass
class _Header:
    version: int
    kvs: list[_Kv]
    tensors: list[_Tensor]
    alignment: int
    data_start: int


def _read_header(f: BinaryIO) -> _Header:
    r = Reader(f)
    version, n_tensors, n_kv = r.preamble()
    kvs = []
    for _ in range(n_kv):
        key = r.string().decode()
        kind = r.u32()
        kvs.append(_Kv(key, kind, r.raw(kind)))
    tensors = []
    for _ in range(n_tensors):
        name = r.string().decode()
        dims = [r.u64() for _ in range(r.u32())]
        tensors.append(_Tensor(name, dims, r.u32(), r.u64()))
    alignment = next(
        (struct.unpack("<I", kv.raw)[0] for kv in kvs if kv.key == "general.alignment"),
        _DEFAULT_ALIGNMENT,
    )
    data_start = -(-f.tell() // alignment) * alignment
    return _Header(version, kvs, tensors, alignment, data_start)


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _rename(header: _Header) -> None:
    """llama.cpp's names, in place (see the module's table)."""
    kinds = gguf.GGUFValueType
    for kv in header.kvs:
        if kv.key == "general.architecture":
            kv.raw = _string(TARGET_ARCH)
        elif kv.key.startswith(f"{SOURCE_ARCH}."):
            kv.key = TARGET_ARCH + kv.key[len(SOURCE_ARCH) :]
        elif kv.key == "tokenizer.ggml.pre":
            kv.raw = _string("gpt-4o")
    keys = {kv.key for kv in header.kvs}
    if f"{TARGET_ARCH}.expert_feed_forward_length" not in keys:
        gate = next((t for t in header.tensors if t.name == "blk.0.ffn_gate_exps.weight"), None)
        if gate is None or len(gate.dims) < 2:
            raise ValueError("no blk.0.ffn_gate_exps.weight to take the experts' width from")
        header.kvs.append(
            _Kv(
                f"{TARGET_ARCH}.expert_feed_forward_length",
                kinds.UINT32,
                struct.pack("<I", gate.dims[1]),
            )
        )
    if f"{TARGET_ARCH}.rope.scaling.type" not in keys:
        header.kvs.append(_Kv(f"{TARGET_ARCH}.rope.scaling.type", kinds.STRING, _string("yarn")))
    for tensor in header.tensors:
        for old, new in _TENSOR_RENAMES:
            if old in tensor.name + "." and new not in tensor.name:
                tensor.name = (tensor.name + ".").replace(old, new, 1).rstrip(".")
                break


def _encode(header: _Header) -> bytes:
    out = bytearray(
        struct.pack("<IIQQ", gguf.GGUF_MAGIC, header.version, len(header.tensors), len(header.kvs))
    )
    for kv in header.kvs:
        out += _string(kv.key) + struct.pack("<I", kv.kind) + kv.raw
    for t in header.tensors:
        out += _string(t.name) + struct.pack("<I", len(t.dims))
        out += b"".join(struct.pack("<Q", d) for d in t.dims)
        out += struct.pack("<IQ", t.ggml_type, t.offset)
    out += bytes(-len(out) % header.alignment)
    return bytes(out)


def converted_path(blob_sha256: str, folder: Path | None = None) -> Path:
    return (folder or cache_dir() / "gguf") / f"ollama-{blob_sha256[:16]}-{TARGET_ARCH}.gguf"


def convert(
    blob: Path,
    blob_sha256: str,
    spec: str,
    folder: Path | None = None,
    progress: Progress | None = None,
) -> tuple[Path, str]:
    """The llama.cpp gpt-oss file for an Ollama gptoss blob, and its SHA-256: written once
    (the blob is only read), reused while its size and checksum file agree."""
    target = converted_path(blob_sha256, folder)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with (target.parent / f"{target.name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another node on this machine may be writing it
            done = _done(target)
            if done is not None:
                return target, done
            return target, _write(blob, target, spec, progress)
    except OSError as exc:
        raise ModelFileError(
            f"model {spec!r}: cannot write the llama.cpp version of Ollama's gpt-oss blob to "
            f"{target}: {exc}"
        ) from None


def _done(target: Path) -> str | None:
    """The SHA-256 of a conversion finished earlier, if the file is whole."""
    try:
        saved = json.loads(target.with_name(target.name + ".json").read_text(encoding="utf-8"))
        if saved.get("size") == target.stat().st_size and len(saved.get("sha256", "")) == 64:
            return str(saved["sha256"])
    except (OSError, ValueError):
        pass
    return None


def _write(blob: Path, target: Path, spec: str, progress: Progress | None) -> str:
    with blob.open("rb") as src:
        try:
            header = _read_header(src)
        except (EOFError, ValueError, UnicodeDecodeError) as exc:
            raise ModelFileError(f"model {spec!r}: {blob} cannot be read as GGUF: {exc}") from None
        old = sorted({t.name for t in header.tensors if t.ggml_type == _OLD_MXFP4})
        if old:
            raise ModelFileError(
                f"model {spec!r}: this gpt-oss blob stores MXFP4 as ggml type 4 (pulled before "
                f"Ollama's 2025-10 re-publish; {len(old)} tensors, e.g. {old[0]}), which "
                "llama.cpp no longer reads and a header rewrite cannot fix: run `ollama pull` "
                "for it again"
            )
        try:
            _rename(header)
        except ValueError as exc:
            raise ModelFileError(
                f"model {spec!r}: {blob} declares Ollama's gpt-oss architecture but is not a "
                f"gpt-oss model llama.cpp can load: {exc}"
            ) from None
        head = _encode(header)
        total = blob.stat().st_size - header.data_start
        digest = hashlib.sha256(head)
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            with partial.open("wb") as out:
                out.write(head)
                src.seek(header.data_start)
                copied = 0
                while chunk := src.read(64 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    copied += len(chunk)
                    if progress is not None:
                        progress(copied, total)
            sha256 = digest.hexdigest()
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
    info = {"size": target.stat().st_size, "sha256": sha256, "source": str(blob)}
    target.with_name(target.name + ".json").write_text(json.dumps(info), encoding="utf-8")
    return sha256
