"""bench/shape_clone.py: a random-weight file of the real model's shapes and types, for a lent
GPU machine the real file cannot travel to; llama.cpp loads it as it loads the real one."""

from __future__ import annotations

from pathlib import Path

import gguf
import llama_cpp
import numpy as np

from bench.shape_clone import build, skeleton
from disagg_mesh.server.common.models import resolve_model_path
from tests.conftest import MODEL, ROOT


def test_a_clone_has_the_real_files_keys_tensors_and_size_and_runs(tmp_path: Path) -> None:
    real = resolve_model_path(MODEL, ROOT)
    skeleton(real, tmp_path / "skeleton")
    assert (tmp_path / "skeleton/meta.gguf").stat().st_size < 4_000_000  # it travels
    clone = tmp_path / "clone.gguf"
    build(tmp_path / "skeleton", clone)
    assert clone.stat().st_size == real.stat().st_size

    a, b = gguf.GGUFReader(real), gguf.GGUFReader(clone)
    assert list(a.fields) == list(b.fields)
    for key in ("llama.block_count", "tokenizer.ggml.tokens", "tokenizer.chat_template"):
        assert [bytes(p) for p in a.fields[key].parts] == [bytes(p) for p in b.fields[key].parts]
    shapes = [(t.name, list(t.shape), t.tensor_type) for t in a.tensors]
    assert shapes == [(t.name, list(t.shape), t.tensor_type) for t in b.tensors]

    llm = llama_cpp.Llama(str(clone), n_ctx=256, n_threads=1, verbose=False, logits_all=True)
    original = llama_cpp.Llama(str(real), vocab_only=True, verbose=False)
    tokens = llm.tokenize(b"def add(a, b):", add_bos=True, special=True)
    assert tokens == original.tokenize(b"def add(a, b):", add_bos=True, special=True)
    llm.eval(tokens)
    assert np.isfinite(llm.scores[len(tokens) - 1]).all()
