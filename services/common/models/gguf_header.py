"""The architecture a GGUF file declares, read from its header before llama.cpp loads it.

Only the key/value section is walked, and only until `general.architecture` (normally the
first key), so a 65 GB file costs a few reads. Value types, the magic and the architectures
llama.cpp knows come from the `gguf` package (llama.cpp's own gguf-py), from its
`constants` module alone: importing the whole package pulls in sentencepiece where it is
installed, and with sentencepiece loaded a CUDA build of llama.cpp crashed (SIGSEGV) while
loading a model (seen on an H100 machine).
"""

from __future__ import annotations

import importlib.util
import struct
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO

from disagg_mesh.server.common.models.files import ModelFileError


@cache
def _constants() -> ModuleType:
    """gguf/constants.py (standard library imports only), without gguf/__init__.py."""
    package = importlib.util.find_spec("gguf")
    if package is None or not package.submodule_search_locations:
        raise ModuleNotFoundError("the gguf package is not installed (pip install gguf)")
    path = Path(next(iter(package.submodule_search_locations))) / "constants.py"
    spec = importlib.util.spec_from_file_location("_disagg_gguf_constants", path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gguf: Any = _constants()

ARCHITECTURE_KEY = "general.architecture"
# Ollama's own gpt-oss GGUFs: renamed tensors that stock llama.cpp refuses (gptoss.py
# rewrites their header).
OLLAMA_GPT_OSS = "gptoss"
_SCALARS = {
    gguf.GGUFValueType.UINT8: 1,
    gguf.GGUFValueType.INT8: 1,
    gguf.GGUFValueType.UINT16: 2,
    gguf.GGUFValueType.INT16: 2,
    gguf.GGUFValueType.UINT32: 4,
    gguf.GGUFValueType.INT32: 4,
    gguf.GGUFValueType.FLOAT32: 4,
    gguf.GGUFValueType.BOOL: 1,
    gguf.GGUFValueType.UINT64: 8,
    gguf.GGUFValueType.INT64: 8,
    gguf.GGUFValueType.FLOAT64: 8,
}
_MAX_KEYS = 1 << 20


class Reader:
    """Little-endian GGUF values from a file, read where it stands."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise EOFError
        return data

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def string(self) -> bytes:
        return self.take(self.u64())

    def preamble(self) -> tuple[int, int, int]:
        """A GGUF file's version, tensor count and key count; ValueError if it is none."""
        if self.u32() != gguf.GGUF_MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        version = self.u32()
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        return version, self.u64(), self.u64()

    def raw(self, kind: int) -> bytes:
        """A value of this type as encoded in the file."""
        start = self.f.tell()
        self.skip(kind)
        length = self.f.tell() - start
        self.f.seek(start)
        return self.take(length)

    def skip(self, kind: int) -> None:
        if kind == gguf.GGUFValueType.STRING:
            self.f.seek(self.u64(), 1)
        elif kind == gguf.GGUFValueType.ARRAY:
            item, count = self.u32(), self.u64()
            if item in _SCALARS:
                self.f.seek(_SCALARS[gguf.GGUFValueType(item)] * count, 1)
            else:
                for _ in range(count):
                    self.skip(item)
        elif kind in _SCALARS:
            self.f.seek(_SCALARS[gguf.GGUFValueType(kind)], 1)
        else:
            raise ValueError(f"unknown value type {kind}")


def architecture(path: Path) -> str:
    """general.architecture of a GGUF file; ValueError if it is no GGUF file or has none."""
    with path.open("rb") as f:
        r = Reader(f)
        try:
            _, _, keys = r.preamble()
            for _ in range(min(keys, _MAX_KEYS)):
                key = r.string().decode(errors="replace")
                kind = r.u32()
                if key == ARCHITECTURE_KEY and kind == gguf.GGUFValueType.STRING:
                    return r.string().decode(errors="replace")
                r.skip(kind)
        except EOFError:
            raise ValueError("the GGUF header ends early (truncated file)") from None
    raise ValueError(f"the GGUF header has no {ARCHITECTURE_KEY}")


def check_loadable(path: Path, spec: str) -> str:
    """The file's architecture, or ModelFileError if llama.cpp cannot load it (Ollama's own
    gpt-oss passes: gptoss.py rewrites it)."""
    try:
        arch = architecture(path)
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"model {spec!r}: {path} cannot be read as GGUF: {exc}") from None
    if arch != OLLAMA_GPT_OSS and arch not in gguf.MODEL_ARCH_NAMES.values():
        raise ModelFileError(
            f"model {spec!r}: GGUF architecture {arch!r} is not one llama.cpp knows: this "
            "file needs the runtime that wrote it"
        )
    return arch
