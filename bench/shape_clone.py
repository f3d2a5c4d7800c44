"""A model file of the same architecture, tensor shapes and tensor types as a real GGUF, with
random weights, for a machine the real file cannot travel to (a lent GPU machine takes 64 MiB
with the code; SmolLM2-135M's file is 98 MB). A pass's time depends on the shapes and types,
not on the weights, so both sides of a benchmark's ratio run the clone there
(BENCH_MODEL=clone.gguf); its text is meaningless, so only rows that ignore end tokens or
compare the same work apply.

    python -m bench.shape_clone skeleton REAL.gguf DIR   # DIR/meta.gguf (every key, no
                                                         # tensors: 1.8 MB) + DIR/tensors.json
    python -m bench.shape_clone build DIR CLONE.gguf     # the clone, on the other machine

Quantized blocks are written directly (Q4_0, Q4_1, Q8_0: small scales, random quants), F32
tensors (norms) as ones, F16 ones as small random values.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

# The reader's own bookkeeping, which the writer writes again.
_BOOKKEEPING = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


def _text(part: npt.NDArray[Any]) -> str:
    return bytes(part).decode("utf-8", "surrogateescape")


def _copy_keys(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for key, field in reader.fields.items():
        if key in _BOOKKEEPING:
            continue
        kind = gguf.GGUFValueType(field.types[0])
        value: Any
        if kind is gguf.GGUFValueType.ARRAY:
            sub = gguf.GGUFValueType(field.types[1])
            if sub is gguf.GGUFValueType.STRING:
                value = [_text(field.parts[i]) for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(key, value, kind, sub_type=sub)
        elif kind is gguf.GGUFValueType.STRING:
            writer.add_key_value(key, _text(field.parts[field.data[0]]), kind)
        else:
            writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], kind)


def _architecture(reader: gguf.GGUFReader) -> str:
    return _text(reader.fields["general.architecture"].parts[-1])


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def skeleton(real: Path, out: Path) -> None:
    """Every key of `real` (its tokenizer included) and its tensors' names, shapes, types."""
    out.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(real)
    writer = gguf.GGUFWriter(out / "meta.gguf", _architecture(reader))
    _copy_keys(reader, writer)
    _finish(writer)
    tensors = [[t.name, [int(n) for n in t.shape], t.tensor_type.name] for t in reader.tensors]
    (out / "tensors.json").write_text(json.dumps(tensors))


def _f16(value: float) -> npt.NDArray[np.uint8]:
    return np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)


def _blocks(kind: str, count: int, rng: np.random.Generator) -> npt.NDArray[np.uint8]:
    """`count` blocks of 32 weights of a block-quantized type, each about +-0.04."""
    if kind == "Q8_0":  # f16 scale, 32 int8
        blocks = np.empty((count, 34), dtype=np.uint8)
        blocks[:, :2] = _f16(0.0005)
        blocks[:, 2:] = rng.integers(-64, 64, (count, 32), dtype=np.int8).view(np.uint8)
    elif kind == "Q4_1":  # f16 scale, f16 minimum, 32 nibbles
        blocks = np.empty((count, 20), dtype=np.uint8)
        blocks[:, :2] = _f16(0.005)
        blocks[:, 2:4] = _f16(-0.04)
        blocks[:, 4:] = rng.integers(0, 256, (count, 16), dtype=np.uint8)
    elif kind == "Q4_0":  # f16 scale, 32 nibbles (minus 8)
        blocks = np.empty((count, 18), dtype=np.uint8)
        blocks[:, :2] = _f16(0.005)
        blocks[:, 2:] = rng.integers(0, 256, (count, 16), dtype=np.uint8)
    else:
        raise SystemExit(f"shape_clone: tensor type {kind} is not written here")
    return blocks


def build(skeleton_dir: Path, clone: Path) -> None:
    reader = gguf.GGUFReader(skeleton_dir / "meta.gguf")
    writer = gguf.GGUFWriter(clone, _architecture(reader))
    _copy_keys(reader, writer)
    rng = np.random.default_rng(0)
    for name, shape, kind in json.loads((skeleton_dir / "tensors.json").read_text()):
        dims = shape[::-1]  # numpy's order: rows last
        if kind == "F32":
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))
        elif kind == "F16":
            writer.add_tensor(name, rng.normal(0.0, 0.02, dims).astype(np.float16))
        else:
            rows = int(np.prod(dims[:-1]))
            data = _blocks(kind, rows * dims[-1] // 32, rng).reshape(rows, -1)
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    _finish(writer)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("skeleton", "build"):
        print(__doc__, file=sys.stderr)
        return 2
    command, source, target = argv
    (skeleton if command == "skeleton" else build)(Path(source), Path(target))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
