"""A loaded GGUF file: weights, tokenizer, chat template and the facts the engine needs.

Read-only once loaded, so tokenizing and detokenizing are safe from any thread while the
engine thread decodes. Tokenizing follows llama-cpp-python's `Llama` exactly (same calls,
same flags), so the mesh's output can be compared with single-process llama-cpp-python.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import _internals, _logger
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from services.common.errors import FailedPrecondition, InvalidArgument, MeshError
from services.common.types import Prompt

ENGINE_VERSION = f"llama-cpp-python/{llama_cpp.__version__}"
# Bytes per element of the KV cache types the engine uses (ggml's f16).
_F16_BYTES = 2


class ModelLoadError(MeshError):
    """llama.cpp cannot load the model file."""


class LlamaModel:
    def __init__(self, path: Path, n_gpu_layers: int = 0) -> None:
        _logger.set_verbose(False)  # llama.cpp's own log: errors only
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        try:
            self._model: Any = _internals.LlamaModel(
                path_model=str(path), params=params, verbose=False
            )
        except ValueError as exc:
            raise ModelLoadError(f"llama.cpp cannot load {path}: {exc}") from None
        self.ptr = self._model.model
        self.n_vocab: int = self._model.n_vocab()
        self.metadata: dict[str, str] = self._model.metadata()
        self._bos: int = self._model.token_bos()
        self._chat: Jinja2ChatFormatter | None = None
        template = self.metadata.get("tokenizer.chat_template")
        if template:
            self._chat = Jinja2ChatFormatter(
                template=template,
                eos_token=self._special_text(self._model.token_eos()),
                bos_token=self._special_text(self._bos),
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token takes in every layer (f16 K and V)."""
        arch = self.metadata.get("general.architecture", "")
        n_head = llama_cpp.llama_model_n_head(self.ptr)
        n_head_kv = llama_cpp.llama_model_n_head_kv(self.ptr)
        n_embd = llama_cpp.llama_model_n_embd(self.ptr)
        head_k = int(self.metadata.get(f"{arch}.attention.key_length", n_embd // max(n_head, 1)))
        head_v = int(self.metadata.get(f"{arch}.attention.value_length", head_k))
        n_layer = llama_cpp.llama_model_n_layer(self.ptr)
        return int(n_layer * n_head_kv * (head_k + head_v) * _F16_BYTES)

    def _special_text(self, token: int) -> str:
        if token < 0:
            return ""
        return bytes(self._model.detokenize([token], special=True)).decode("utf-8", "replace")

    def tokenize(self, prompt: Prompt, n_ctx: int) -> list[int]:
        """The prompt's tokens; refused unless at least one token can still be generated."""
        if prompt.messages:
            if self._chat is None:
                raise FailedPrecondition("this model has no chat template: send prompt text")
            turns: Any = [{"role": m.role, "content": m.content} for m in prompt.messages]
            rendered = self._chat(messages=turns)
            tokens = self._tokenize(rendered.prompt.encode(), add_bos=False)
        else:
            # As Llama.create_completion does, so output matches single-process generation.
            tokens = self._tokenize(prompt.text.encode(), add_bos=True)
        if not tokens:
            raise InvalidArgument("prompt", "has no tokens")
        if len(tokens) >= n_ctx:
            raise InvalidArgument(
                "prompt",
                f"is {len(tokens)} tokens; the context holds {n_ctx} "
                "including at least one generated token",
            )
        return tokens

    def _tokenize(self, text: bytes, add_bos: bool) -> list[int]:
        return list(self._model.tokenize(text, add_bos, True))

    def piece(self, token: int) -> bytes:
        """A token's bytes, as Llama.detokenize([token]) gives them."""
        return bytes(self._model.detokenize([token], special=False))

    def is_end(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._model.vocab, token))

    def close(self) -> None:
        self._model.close()
