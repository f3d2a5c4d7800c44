"""Tiny random-weight GGUFs of architectures with no small real model (gpt-oss, qwen3moe),
written with the `gguf` package, as well-known projects keep tiny random models of every
architecture they support. Random weights still give deterministic greedy tokens, so a test
comparing two ways of running one file checks real numbers.

Each file carries SmolLM2's tokenizer (copied from the embedded model's GGUF, 49,152 tokens),
so prompts are text as usual; the layers are the architecture's own: gpt-oss with attention
sinks, a 128-position sliding window on every other layer, biased projections and 4 experts
in MXFP4 (2 used per token); qwen3moe with q/k norms and 4 experts (2 used).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from services.common.models import resolve_model_path
from tests.conftest import MODEL, ROOT

LAYERS = 4
EMBED = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
EXPERTS = 4
EXPERTS_USED = 2
EXPERT_FF = 64
CONTEXT = 4096
GPT_OSS_WINDOW = 128


def _tokenizer(writer: gguf.GGUFWriter) -> int:
    """Copy SmolLM2's tokenizer (every tokenizer.* key but its chat template); returns the
    vocabulary size."""
    reader = gguf.GGUFReader(resolve_model_path(MODEL, ROOT))
    n_vocab = 0
    for name, f in reader.fields.items():
        if not name.startswith("tokenizer.") or name == "tokenizer.chat_template":
            continue
        value = f.contents()
        if name == "tokenizer.ggml.tokens":
            n_vocab = len(value)
        kind = f.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, kind, sub_type=f.types[-1])
        else:
            writer.add_key_value(name, value, kind)
    return n_vocab


# llama.cpp's gpt-oss tensor names and Ollama's.
OLLAMA_NAMES = (
    (".attn_output.", ".attn_out."),
    (".attn_sinks.weight", ".attn_sinks"),
    (".post_attention_norm.", ".ffn_norm."),
)


class _Weights:
    def __init__(
        self, writer: gguf.GGUFWriter, seed: int, renames: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.writer = writer
        self.rng = np.random.default_rng(seed)
        self.renames = renames

    def _name(self, name: str) -> str:
        for old, new in self.renames:
            name = name.replace(old, new)
        return name

    def add(self, name: str, *shape: int, scale: float = 0.25, mxfp4: bool = False) -> None:
        """A tensor of this numpy shape (gguf's dimensions are the reverse), normal values."""
        name = self._name(name)
        data: npt.NDArray[Any] = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        if mxfp4:
            mxfp4_type = gguf.GGMLQuantizationType.MXFP4
            quantized = gguf.quants.quantize(data, mxfp4_type)
            self.writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=mxfp4_type)
        else:
            self.writer.add_tensor(name, data)

    def ends(self, n_vocab: int) -> None:
        """The token embeddings, the output norm and the output projection (large values:
        the logits spread, so greedy picks are clear)."""
        self.add("token_embd.weight", n_vocab, EMBED, scale=1.0)
        self.norm("output_norm.weight", EMBED)
        self.add("output.weight", n_vocab, EMBED, scale=1.0)

    def norm(self, name: str, size: int) -> None:
        name = self._name(name)
        values = 1.0 + 0.1 * self.rng.standard_normal(size)
        self.writer.add_tensor(name, values.astype(np.float32))


def _common(writer: gguf.GGUFWriter, family: str) -> None:
    writer.add_name(f"tiny random {family}")
    writer.add_context_length(CONTEXT)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(EMBED)
    writer.add_feed_forward_length(EXPERT_FF)
    writer.add_expert_feed_forward_length(EXPERT_FF)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(EXPERTS_USED)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def write_gpt_oss(path: Path, ollama_layout: bool = False) -> Path:
    """A tiny gpt-oss as llama.cpp's converter writes it, or (ollama_layout) as Ollama
    publishes its gpt-oss models: architecture `gptoss` and keys under `gptoss.*`, no
    experts' width or RoPE scaling type, the generic pre-tokenizer, and three tensor names of
    its own (services/common/models/gptoss.py has the table). Same weights either way."""
    arch = "gptoss" if ollama_layout else "gpt-oss"
    writer = gguf.GGUFWriter(path, arch)
    _common(writer, "gpt-oss")
    if ollama_layout:
        writer.kv_data[0].pop(f"{arch}.expert_feed_forward_length")
    else:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(32.0)
    writer.add_rope_scaling_orig_ctx_len(CONTEXT)
    writer.add_sliding_window(GPT_OSS_WINDOW)
    n_vocab = _tokenizer(writer)
    writer.kv_data[0].pop("tokenizer.ggml.pre")
    writer.add_tokenizer_pre("default" if ollama_layout else "gpt-4o")
    w = _Weights(writer, seed=20, renames=OLLAMA_NAMES if ollama_layout else ())
    w.ends(n_vocab)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        blk = f"blk.{i}"
        w.norm(f"{blk}.attn_norm.weight", EMBED)
        w.norm(f"{blk}.post_attention_norm.weight", EMBED)
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            w.add(f"{blk}.{name}.weight", rows, EMBED)
            w.add(f"{blk}.{name}.bias", rows, scale=0.1)
        w.add(f"{blk}.attn_output.weight", EMBED, q)
        w.add(f"{blk}.attn_output.bias", EMBED, scale=0.1)
        w.add(f"{blk}.attn_sinks.weight", HEADS, scale=1.0)
        w.add(f"{blk}.ffn_gate_inp.weight", EXPERTS, EMBED)
        w.add(f"{blk}.ffn_gate_inp.bias", EXPERTS, scale=0.1)
        for name, shape in (
            ("ffn_gate_exps", (EXPERTS, EXPERT_FF, EMBED)),
            ("ffn_up_exps", (EXPERTS, EXPERT_FF, EMBED)),
            ("ffn_down_exps", (EXPERTS, EMBED, EXPERT_FF)),
        ):
            w.add(f"{blk}.{name}.weight", *shape, mxfp4=True)
            w.add(f"{blk}.{name}.bias", *shape[:2], scale=0.1)
    return _write(writer, path)


def write_qwen3moe(path: Path) -> Path:
    writer = gguf.GGUFWriter(path, "qwen3moe")
    _common(writer, "qwen3moe")
    n_vocab = _tokenizer(writer)
    w = _Weights(writer, seed=30)
    w.ends(n_vocab)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        blk = f"blk.{i}"
        w.norm(f"{blk}.attn_norm.weight", EMBED)
        w.add(f"{blk}.attn_q.weight", q, EMBED)
        w.add(f"{blk}.attn_k.weight", kv, EMBED)
        w.add(f"{blk}.attn_v.weight", kv, EMBED)
        w.add(f"{blk}.attn_output.weight", EMBED, q)
        w.norm(f"{blk}.attn_q_norm.weight", HEAD_DIM)
        w.norm(f"{blk}.attn_k_norm.weight", HEAD_DIM)
        w.norm(f"{blk}.ffn_norm.weight", EMBED)
        w.add(f"{blk}.ffn_gate_inp.weight", EXPERTS, EMBED)
        w.add(f"{blk}.ffn_gate_exps.weight", EXPERTS, EXPERT_FF, EMBED)
        w.add(f"{blk}.ffn_up_exps.weight", EXPERTS, EXPERT_FF, EMBED)
        w.add(f"{blk}.ffn_down_exps.weight", EXPERTS, EMBED, EXPERT_FF)
    return _write(writer, path)


def _write(writer: gguf.GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
