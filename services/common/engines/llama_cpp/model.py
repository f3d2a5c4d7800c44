"""A loaded GGUF file: weights, tokenizer, chat template and the facts the engine needs.

Read-only once loaded, so tokenizing and detokenizing are safe from any thread while the
engine thread decodes. Tokenizing follows llama-cpp-python's `Llama` exactly (same calls,
same flags), so the mesh's output can be compared with single-process llama-cpp-python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jinja2
import llama_cpp
import structlog
from llama_cpp import _internals, _logger
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from disagg_mesh.server.common.engines.base import Placement
from disagg_mesh.server.common.engines.llama_cpp.harmony import (
    HARMONY_FINAL,
    HARMONY_TEMPLATE,
    HarmonyParser,
    HarmonyTokens,
)
from disagg_mesh.server.common.engines.llama_cpp.sampling import end_tokens
from disagg_mesh.server.common.errors import FailedPrecondition, InvalidArgument, MeshError
from disagg_mesh.server.common.tools.formats import (
    template_tools,
    tool_format,
)
from disagg_mesh.server.common.tools.formats import turns as tool_turns
from disagg_mesh.server.common.tools.requests import ToolRequest
from disagg_mesh.server.common.types import (
    REASONING_EFFORTS,
    ModelFacts,
    Prompt,
    ollama_template,
    parameter_size,
)
from disagg_mesh.server.common.validation import NO_FIM_TOKENS, prompt_too_long

log = structlog.get_logger("engine")

ENGINE_VERSION = (
    f"llama-cpp-python/{llama_cpp.__version__} "
    f"(llama.cpp {llama_cpp.llama_version().decode(errors='replace')})"
)


@dataclass(frozen=True)
class KvCacheType:
    """A ggml type the K or V cache may use: its id and the bytes of one block of values."""

    ggml_type: int
    block_bytes: int
    block_values: int

    def size(self, values: int) -> int:
        return -(-values // self.block_values) * self.block_bytes


# The cache types llama.cpp's server accepts (--cache-type-k/-v); quantized V needs flash
# attention.
KV_CACHE_TYPES = {
    "f32": KvCacheType(llama_cpp.GGML_TYPE_F32, 4, 1),
    "f16": KvCacheType(llama_cpp.GGML_TYPE_F16, 2, 1),
    "bf16": KvCacheType(30, 2, 1),  # GGML_TYPE_BF16, which llama_cpp does not export
    "q8_0": KvCacheType(llama_cpp.GGML_TYPE_Q8_0, 34, 32),
    "q4_0": KvCacheType(llama_cpp.GGML_TYPE_Q4_0, 18, 32),
    "q4_1": KvCacheType(llama_cpp.GGML_TYPE_Q4_1, 20, 32),
    "iq4_nl": KvCacheType(llama_cpp.GGML_TYPE_IQ4_NL, 18, 32),
    "q5_0": KvCacheType(llama_cpp.GGML_TYPE_Q5_0, 22, 32),
    "q5_1": KvCacheType(llama_cpp.GGML_TYPE_Q5_1, 24, 32),
}
# n_gpu_layers meaning "every layer" (llama.cpp offloads min(n_gpu_layers, layers)).
ALL_LAYERS = 999


def gpu_backend() -> str | None:
    """The GPU backend this llama.cpp build can use now: "CUDA", "Metal", another name, or
    None when it has none (a CPU build, or no device visible: CUDA_VISIBLE_DEVICES="")."""
    llama_cpp.llama_backend_init()
    if not llama_cpp.llama_supports_gpu_offload():
        return None
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    for marker, name in (("CUDA", "CUDA"), ("MTL", "Metal"), ("Metal", "Metal")):
        if f"{marker} :" in info:
            return name
    return "GPU"


def layers_on_gpu(n_gpu_layers: int | None, backend: str | None) -> int:
    """The n_gpu_layers to give llama.cpp: none without a GPU backend or when asked for 0,
    every layer when unset (or negative), else as asked."""
    if backend is None or n_gpu_layers == 0:
        return 0
    if n_gpu_layers is None or n_gpu_layers < 0:
        return ALL_LAYERS
    return n_gpu_layers


def attended_from(position: int, window: int) -> int:
    """The lowest position a token at `position` attends to in every layer of a model with
    this sliding window (0: none): what a KV cache must hold for that token. llama.cpp's
    sliding-window layers keep only that much of a sequence (its older cells are reused, and
    a saved state leaves them out), so a sequence's KV is complete for continuing at a
    position only where the window layers still reach back this far. Exact for the usual
    window (gemma3, gpt-oss); llama4's chunked window needs less, so it is safe there too."""
    return max(0, position - window + 1) if window else 0


# GGUF's general.file_type (llama.cpp's llama_ftype) as Ollama names each (its
# fs/ggml/type.go); "" for the values no file has any more.
FILE_TYPES = (
    "F32 F16 Q4_0 Q4_1 - - - Q8_0 Q5_0 Q5_1 Q2_K Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S "
    "Q5_K_M Q6_K IQ2_XXS IQ2_XS Q2_K_S IQ3_XS IQ3_XXS IQ1_S IQ4_NL IQ3_S IQ3_M IQ2_S IQ2_M "
    "IQ4_XS IQ1_M BF16 - - - TQ1_0 TQ2_0 MXFP4_MOE NVFP4 Q1_0"
).split()


def file_type_name(value: str) -> str:
    """A GGUF file type (general.file_type, a number) as Ollama names it; "" if unknown."""
    try:
        name = FILE_TYPES[int(value)]
    except (ValueError, IndexError):
        return ""
    return "" if name == "-" else name


class ModelLoadError(MeshError):
    """llama.cpp cannot load the model file."""


class LlamaModel:
    def __init__(self, path: Path, n_gpu_layers: int | None = None) -> None:
        """n_gpu_layers: layers to put on the GPU; None: all of them when the build has a
        GPU backend (and a device), none otherwise."""
        _logger.set_verbose(False)  # llama.cpp's own log: errors only
        backend = gpu_backend()  # initialises llama.cpp's backends
        if "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace"):
            # Built before the Makefile compiled AMX out (LLAMA_CPU_FLAGS, README).
            log.warning(
                "llama.cpp was built with ggml's AMX matrix products, which crash some "
                "Intel Xeons on the first prompt (llama.cpp issue 20824): rebuild with "
                "`make clean venv` unless AMX works here",
                model=str(path),
            )
        n_gpu_layers = layers_on_gpu(n_gpu_layers, backend)
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        try:
            self._model: Any = _internals.LlamaModel(
                path_model=str(path), params=params, verbose=False
            )
        except ValueError as exc:
            raise ModelLoadError(f"llama.cpp cannot load {path}: {exc}") from None
        self.ptr = self._model.model
        self.vocab = self._model.vocab
        layers = int(llama_cpp.llama_model_n_layer(self.ptr)) + 1
        self.placement = Placement(
            backend=backend if backend is not None and n_gpu_layers > 0 else "CPU",
            gpu_layers=min(n_gpu_layers, layers),
            layers=layers,
        )
        # Sliding-window attention (gemma3: 512, gpt-oss: 128; 0: every layer attends to every
        # position): a token at position p attends in those layers to p - window + 1 .. p.
        self.window = int(llama_cpp.llama_model_n_swa(self.ptr))
        self.n_vocab: int = self._model.n_vocab()
        self.end_tokens = end_tokens(self._model.vocab, self.n_vocab)
        self._ends = frozenset(self.end_tokens)
        # Each token's bytes, as asked for: every generated token needs its own, and each
        # llama.cpp call leaves the interpreter's lock, which the event loop then takes
        # in the middle of a step (docs/batching.md, "The per-token path").
        self._pieces: tuple[dict[int, bytes], dict[int, bytes]] = ({}, {})
        self.metadata: dict[str, str] = self._model.metadata()
        self._bos: int = self._model.token_bos()
        self._add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        # Fill-in-the-middle's prefix, suffix and middle tokens (llama.cpp finds them in the
        # GGUF's tokenizer.ggml.fim_* keys or by their text: Qwen's <|fim_prefix|>, ...);
        # None: the model cannot fill in.
        fim = tuple(
            int(f(self.vocab))
            for f in (
                llama_cpp.llama_vocab_fim_pre,
                llama_cpp.llama_vocab_fim_suf,
                llama_cpp.llama_vocab_fim_mid,
            )
        )
        self._fim = fim if min(fim) >= 0 else None
        # gpt-oss's harmony control tokens, where the vocabulary has them.
        self.harmony = HarmonyTokens.find(self._control_token)
        self._chat: Jinja2ChatFormatter | None = None
        template = self.metadata.get("tokenizer.chat_template")
        if not template and self.harmony is not None:
            # Ollama keeps gpt-oss's template outside the GGUF: harmony's own.
            template = HARMONY_TEMPLATE
        # How this model takes tools and makes calls (from its template).
        self.tool_format = tool_format(template or "", self.harmony is not None)
        parameters = int(llama_cpp.llama_model_n_params(self.ptr))
        self.facts = ModelFacts(
            architecture=self.metadata.get("general.architecture", ""),
            parameter_count=parameters,
            parameter_size=parameter_size(parameters),
            quantization=file_type_name(self.metadata.get("general.file_type", "")),
            file_size_bytes=path.stat().st_size,
            trained_context_tokens=int(llama_cpp.llama_model_n_ctx_train(self.ptr)),
            embedding_length=int(llama_cpp.llama_model_n_embd(self.ptr)),
            # Any model takes tools (a template without them: the generic format); only
            # harmony's reasoning comes apart from the answer; Ollama calls filling in the
            # middle "insert".
            capabilities=(
                "completion",
                "tools",
                *(("insert",) * (self._fim is not None)),
                *(("thinking",) * (self.harmony is not None)),
            ),
        )
        if template:
            self._chat = Jinja2ChatFormatter(
                template=template,
                eos_token=self._special_text(self._model.token_eos()),
                bos_token=self._special_text(self._bos),
            )
        self.facts = replace(self.facts, template=self._ollama_template())

    def _ollama_template(self) -> str:
        """How this node frames an Ollama /api/generate prompt, in Ollama's template syntax
        (its /api/show `template`, in which editors' plugins look for `.Suffix` to learn
        that a model fills in the middle): the fill-in-the-middle frame for a suffix, else
        the chat template's rendering of a system turn and a user turn. The chat goes
        through the GGUF's own template, which this does not translate."""
        prompt, system = "{{ .Prompt }}", "{{ .System }}"
        branches: list[tuple[str, str]] = []
        if self._fim is not None:
            start = self._special_text(self._bos) if self._add_bos else ""
            pre, suf, mid = (self._special_text(t) for t in self._fim)
            branches.append((".Suffix", f"{start}{pre}{prompt}{suf}{{{{ .Suffix }}}}{mid}"))
        if self._chat is not None:
            user: Any = {"role": "user", "content": prompt}
            both: Any = [{"role": "system", "content": system}, user]
            try:
                with_system, alone = self._chat(messages=both), self._chat(messages=[user])
            except (ValueError, jinja2.TemplateError):
                pass  # a template that refuses such turns: no chat branch to show
            else:
                branches += [(".System", with_system.prompt), ("", alone.prompt)]
        return ollama_template(branches)

    def kv_bytes_per_token(self, type_k: str = "f16", type_v: str = "f16") -> int:
        """KV cache bytes one token takes in every layer, with these cache types."""
        arch = self.metadata.get("general.architecture", "")
        n_head = llama_cpp.llama_model_n_head(self.ptr)
        n_head_kv = llama_cpp.llama_model_n_head_kv(self.ptr)
        n_embd = llama_cpp.llama_model_n_embd(self.ptr)
        head_k = int(self.metadata.get(f"{arch}.attention.key_length", n_embd // max(n_head, 1)))
        head_v = int(self.metadata.get(f"{arch}.attention.value_length", head_k))
        n_layer = llama_cpp.llama_model_n_layer(self.ptr)
        k, v = KV_CACHE_TYPES[type_k], KV_CACHE_TYPES[type_v]
        per_layer = n_head_kv * (k.size(head_k) + v.size(head_v))
        return int(n_layer * per_layer)

    def _control_token(self, text: str) -> int | None:
        """The special token this text is (e.g. "<|channel|>"), or None. llama.cpp marks
        some of harmony's user-defined, not control, so that they always print."""
        ids = self._tokenize(text.encode(), add_bos=False)
        if len(ids) != 1:
            return None
        attr = llama_cpp.llama_vocab_get_attr(self._model.vocab, ids[0])
        special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
        return ids[0] if attr & special else None

    def harmony_parser(
        self, opening: Sequence[int] = (), tools: bool = False
    ) -> HarmonyParser | None:
        """A parser of this model's generated harmony (None: not a harmony model), placed
        after `opening`: a prompt's tokens, or its `open_message`. tools: the request
        offered functions, so a message to one is a call."""
        if self.harmony is None:
            return None
        parser = HarmonyParser(self.harmony, self.piece, tools)
        parser.follow(opening)
        return parser

    def open_message(self, tokens: Sequence[int], tools: bool = False) -> tuple[int, ...]:
        """The few tokens of a prompt a harmony parser needs to place what follows it (its
        last message's header, if still open); () for other models. tools: as
        harmony_parser's (a call's arguments are a message to place too)."""
        parser = self.harmony_parser(tokens, tools)
        return () if parser is None else parser.opening()

    def _special_text(self, token: int) -> str:
        if token < 0:
            return ""
        return bytes(self._model.detokenize([token], special=True)).decode("utf-8", "replace")

    def tokenize(self, prompt: Prompt, n_ctx: int, tools: ToolRequest | None = None) -> list[int]:
        """The prompt's tokens, with the tools offered rendered as this model's format
        takes them; refused unless at least one token can still be generated."""
        if prompt.reasoning_effort and prompt.reasoning_effort not in REASONING_EFFORTS:
            raise InvalidArgument(
                "reasoning_effort",
                f"must be one of {', '.join(REASONING_EFFORTS)}, got {prompt.reasoning_effort!r}",
            )
        if prompt.messages:
            if self._chat is None:
                raise FailedPrecondition("this model has no chat template: send prompt text")
            tokens, dropped = prompt.fitted(
                lambda p: self._chat_tokens(p, tools), lambda t: len(t) < n_ctx
            )
            if dropped:
                log.info(
                    "chat too long for the context: its oldest turns left out",
                    turns_dropped=dropped,
                    prompt_tokens=len(tokens),
                    n_ctx=n_ctx,
                )
        elif tools is not None:
            raise InvalidArgument("tools", "need chat messages, not prompt text")
        elif prompt.suffix:
            tokens = self._infill_tokens(prompt.text, prompt.suffix)
        else:
            # As Llama.create_completion does, so output matches single-process generation.
            tokens = self._tokenize(prompt.text.encode(), add_bos=True)
        if 0 < prompt.truncate_prompt_tokens < len(tokens):  # vLLM's: the start goes
            tokens = tokens[-prompt.truncate_prompt_tokens :]
        if not tokens:
            raise InvalidArgument("prompt", "has no tokens")
        if len(tokens) >= n_ctx:
            raise prompt_too_long(len(tokens), n_ctx)
        return tokens

    def _chat_tokens(self, prompt: Prompt, tools: ToolRequest | None) -> list[int]:
        """The chat's tokens: its turns and the tools offered, rendered by the template."""
        assert self._chat is not None
        # A last assistant message the answer goes on with: the template renders the turns
        # before it up to a new assistant turn, and its text follows.
        messages, prefill = prompt.messages, ""
        if prompt.continues_last_turn:
            messages, prefill = messages[:-1], messages[-1].content
        turns: Any = tool_turns(messages, self.tool_format, tools)
        extra: dict[str, Any] = {}
        described = template_tools(self.tool_format, tools)
        if described is not None:
            extra["tools"] = described
        if prompt.reasoning_effort:
            extra["reasoning_effort"] = prompt.reasoning_effort
        try:
            rendered = self._chat(messages=turns, **extra)
        except (ValueError, jinja2.TemplateError) as exc:
            # The template's own refusal (raise_exception), e.g. gpt-oss's of a message
            # holding harmony's tags: the caller's messages, not the node, are wrong.
            raise InvalidArgument(
                "messages", f"this model's chat template refuses them: {exc}"
            ) from None
        text = rendered.prompt
        if prefill:  # the answer so far, in harmony's final channel for gpt-oss
            text += (HARMONY_FINAL if self.harmony is not None else "") + prefill
        return self._tokenize(text.encode(), add_bos=False)

    def _infill_tokens(self, prefix: str, suffix: str) -> list[int]:
        """A fill-in-the-middle prompt as llama-server's /infill makes it (without its
        repository context): [BOS] <FIM_PRE> prefix <FIM_SUF> suffix <FIM_MID>, the texts
        tokenized without special tokens, so code that spells one stays text."""
        if self._fim is None:
            raise InvalidArgument(
                "suffix", f"this model cannot fill in the middle: it has {NO_FIM_TOKENS}"
            )
        pre, suf, mid = self._fim
        bos = [self._bos] if self._add_bos and self._bos >= 0 else []
        return [
            *bos,
            pre,
            *self._tokenize(prefix.encode(), add_bos=False, special=False),
            suf,
            *self._tokenize(suffix.encode(), add_bos=False, special=False),
            mid,
        ]

    def tokenize_text(self, text: str) -> list[int]:
        """Text following a prompt (a generation continued from text), without BOS."""
        return self._tokenize(text.encode(), add_bos=False)

    def _tokenize(self, text: bytes, add_bos: bool, special: bool = True) -> list[int]:
        """special: text spelling a special token (<|im_end|>) is that token."""
        return list(self._model.tokenize(text, add_bos, special))

    def piece(self, token: int, special: bool = False) -> bytes:
        """A token's bytes, as Llama.detokenize([token]) gives them (special: a control
        token's own text, e.g. <|im_end|>, where the answer's text has none)."""
        pieces = self._pieces[special]
        piece = pieces.get(token)
        if piece is None:
            piece = pieces[token] = bytes(self._model.detokenize([token], special=special))
        return piece

    def is_end(self, token: int) -> bool:
        """Whether the token ends a generation (llama_vocab_is_eog)."""
        return token in self._ends

    def close(self) -> None:
        self._model.close()
