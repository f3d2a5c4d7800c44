"""One sampler chain per request, so each slot samples with its own settings and its own
random generator: a seeded request gives the same text alone and in a batch.

Structured output adds a grammar sampler of the slot's own, applied before the chain
(every token the grammar forbids gets -inf) and told of every token the stream takes,
sampled here or elsewhere (a prefill node's first token, a migration's replayed tokens):
so a stream continued on another node is constrained exactly as it would have been.

Repetition penalties, as llama-server applies them: first in the chain, over a window of
the prompt's last tokens (which the sampler is told of before it samples) and every token
the stream takes, sampled or not; a decode node is told of the prompt's by the prefill node
(KvReference.penalty_token_ids)."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp
import numpy as np

from disagg_mesh.server.common.engines.llama_cpp.grammars import Grammar
from disagg_mesh.server.common.errors import FailedPrecondition, InvalidArgument
from disagg_mesh.server.common.types import Sampling, TokenChoice, TokenLogprob

# llama_token_data, as numpy sees it.
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
# Llama._init_sampler's default (as its top_k and min_p, a request's own when it sets them).
TYPICAL_P = 1.0


def end_tokens(vocab: Any, n_vocab: int) -> tuple[int, ...]:
    """Every end-of-generation id of a vocabulary (EOS, EOT, <|im_end|>, ...): what
    ignore_eos suppresses."""
    return tuple(t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t))


class SlotSampler:
    def __init__(
        self,
        sampling: Sampling,
        seed_offset: int = 0,
        end_tokens: tuple[int, ...] = (),
        n_vocab: int = 0,
        grammar: Grammar | None = None,
        n_ctx: int = 0,
        history: Sequence[int] = (),
    ) -> None:
        """end_tokens: the model's end-of-generation ids (of n_vocab), suppressed when
        sampling.ignore_eos (a -inf logit bias at the chain's start, as llama-server does).
        grammar: the response format's, parsed (grammars.py); the slot samples with a
        clone of it. history: the prompt's tokens (or its last ones), which repetition
        penalties count (their window of n_ctx tokens at most). InvalidArgument for a logit
        bias on a token id outside the vocabulary."""
        outside = [t for t, _ in sampling.logit_bias if t >= n_vocab]
        if outside:
            raise InvalidArgument(
                "sampling.logit_bias",
                f"token ids must be in 0..{n_vocab - 1} (the model's vocabulary), got {outside[0]}",
            )
        chain: Any = llama_cpp.llama_sampler_chain_init(
            llama_cpp.llama_sampler_chain_default_params()
        )
        self._chain = chain
        self._greedy = sampling.temperature == 0.0
        window = sampling.penalty_window(n_ctx)
        # Penalties keep a history: every token the stream takes goes through the chain.
        self._penalized = window > 0
        # Penalties and biases change the logits the greedy pick and a grammar's shortcut
        # look at: the chain picks.
        self._shaped = self._penalized or bool(sampling.logit_bias)
        self._n_vocab = n_vocab
        self._grammar: Any = None
        if sampling.response_format is not None:
            assert grammar is not None, "a response format's grammar is parsed beforehand"
            self._grammar = grammar.clone()
        # skip()'s one candidate: any id the bias leaves alone.
        self._skip_id = 0
        self._end_ids: np.ndarray[Any, np.dtype[np.intp]] | None = None
        if sampling.logit_bias:  # first, as llama-server's
            self._add(_logit_bias(sampling.logit_bias, n_vocab))
        if sampling.ignore_eos and end_tokens:
            self._add(_logit_bias([(t, -math.inf) for t in end_tokens], n_vocab))
            self._skip_id = next(t for t in range(len(end_tokens) + 1) if t not in end_tokens)
            self._end_ids = np.array(end_tokens, dtype=np.intp)
        if self._penalized:
            self._add(
                # The vendored llama.cpp's signature (n_vocab first), as the binding
                # declares it: the second argument is the window (measured).
                llama_cpp.llama_sampler_init_penalties(
                    n_vocab,
                    window,
                    sampling.repeat_penalty,
                    sampling.frequency_penalty,
                    sampling.presence_penalty,
                )
            )
            for token in history[-window:]:
                llama_cpp.llama_sampler_accept(self._chain, token)
        if self._greedy:
            self._add(llama_cpp.llama_sampler_init_greedy())
            return
        seed = (
            (sampling.seed + seed_offset) & 0xFFFFFFFF
            if sampling.seed is not None
            else llama_cpp.LLAMA_DEFAULT_SEED
        )
        self._add(llama_cpp.llama_sampler_init_top_k(sampling.top_k))
        self._add(llama_cpp.llama_sampler_init_typical(TYPICAL_P, 1))
        self._add(llama_cpp.llama_sampler_init_top_p(sampling.top_p, 1))
        self._add(llama_cpp.llama_sampler_init_min_p(sampling.min_p, 1))
        self._add(llama_cpp.llama_sampler_init_temp(sampling.temperature))
        self._add(llama_cpp.llama_sampler_init_dist(seed))

    def _add(self, sampler: Any) -> None:
        llama_cpp.llama_sampler_chain_add(self._chain, sampler)  # the chain owns it now

    def sample(self, ctx: Any, row: int) -> int:
        """Sample from the logits of batch row `row` (which must have asked for logits);
        the token is accepted into the chain's state."""
        if self._grammar is None and (self._shaped or not self._greedy):
            return int(llama_cpp.llama_sampler_sample(self._chain, ctx, row))
        logits = logits_view(ctx, row, self._n_vocab)
        if self._grammar is None:
            # What the greedy chain picks (end tokens at -inf for ignore_eos, then the first
            # most likely token), without its copy of every logit: ~40 us less a row here.
            # The chain keeps no state for a greedy pick to be accepted into.
            if self._end_ids is not None:
                logits[self._end_ids] = -np.inf
            return int(np.argmax(logits))
        if self._greedy and not self._shaped:
            # The most likely token, when the grammar allows it, is what greedy sampling of
            # the constrained logits picks: the grammar then looks at one candidate, not all.
            best = int(np.argmax(logits))
            if self.allows(best):
                self._accept(best)
                return best
        candidates = np.empty(self._n_vocab, dtype=TOKEN_DATA)
        candidates["id"] = np.arange(self._n_vocab, dtype=np.int32)
        candidates["logit"] = logits
        candidates["p"] = 0.0
        array = llama_cpp.llama_token_data_array(
            data=candidates.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
            size=self._n_vocab,
            selected=-1,
            sorted=False,
        )
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(array))
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(array))
        token = int(array.data[array.selected].id)
        self._accept(token)
        return token

    def allows(self, token: int) -> bool:
        """Whether the response format's grammar allows `token` next (True without one)."""
        if self._grammar is None:
            return True
        candidate = llama_cpp.llama_token_data(id=token, logit=0.0, p=0.0)
        array = llama_cpp.llama_token_data_array(
            data=ctypes.pointer(candidate), size=1, selected=-1, sorted=False
        )
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(array))
        return bool(math.isfinite(candidate.logit))

    def take(self, token: int) -> None:
        """A token this stream takes that this sampler did not draw (a prefill node's first
        token, a replayed one): the grammar moves past it, the penalties count it.
        FailedPrecondition when the grammar forbids it (llama.cpp would abort on it)."""
        if self._grammar is not None:
            if not self.allows(token):
                raise FailedPrecondition(
                    f"token {token} of the generation so far is not allowed by the response "
                    "format's grammar (the stream was not constrained the same way before)"
                )
            llama_cpp.llama_sampler_accept(self._grammar, token)
        if self._penalized:  # the penalties' history
            llama_cpp.llama_sampler_accept(self._chain, token)

    def _accept(self, token: int) -> None:
        llama_cpp.llama_sampler_accept(self._grammar, token)
        llama_cpp.llama_sampler_accept(self._chain, token)

    def skip(self, draws: int) -> None:
        """Advance the random generator as `draws` samples would, without logits: a decode
        node taking over a seeded generation whose tokens were evaluated elsewhere (a
        prefill node's continuation) draws next what the interrupted sampler would have.
        Only the chain's last sampler (dist) uses the generator, once per sample however
        many candidates are left (llama-sampler.cpp), so a one-candidate array will do."""
        if draws <= 0 or self._greedy:
            return
        candidate = llama_cpp.llama_token_data(id=self._skip_id, logit=0.0, p=1.0)
        array = llama_cpp.llama_token_data_array(
            data=ctypes.pointer(candidate), size=1, selected=-1, sorted=True
        )
        for _ in range(draws):
            array.size = 1
            llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(array))

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None


def logits_view(ctx: Any, row: int, n_vocab: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Batch row `row`'s logits in the context's own memory (a sampling step that changes
    them changes these)."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, row), shape=(n_vocab,))


def row_logits(ctx: Any, row: int, n_vocab: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """A copy of batch row `row`'s logits, as the model gave them (before any sampling step
    changes them)."""
    return logits_view(ctx, row, n_vocab).copy()


def token_logprob(
    logits: np.ndarray[Any, np.dtype[np.float32]],
    chosen: int,
    top: int,
    piece: Callable[[int, bool], bytes],
) -> TokenLogprob:
    """The chosen token's log probability under the model's distribution (the softmax of the
    raw logits, as llama-server's n_probs and OpenAI's logprobs), and the `top` most likely
    tokens', most likely first. piece(token, special): its bytes; the chosen token's as the
    answer has them, the others' with a control token's own text (an end token's
    <|im_end|>, not nothing)."""
    values = logits.astype(np.float64)
    peak = values.max()
    log_total = peak + math.log(float(np.exp(values - peak).sum()))
    best = np.argpartition(-values, top - 1)[:top] if top else np.empty(0, dtype=np.intp)
    best = best[np.argsort(-values[best], kind="stable")]

    def choice(token: int, special: bool) -> TokenChoice:
        return TokenChoice(token, piece(token, special), float(values[token] - log_total))

    return TokenLogprob(choice(chosen, False), tuple(choice(int(t), True) for t in best))


def _logit_bias(biases: Sequence[tuple[int, float]], n_vocab: int) -> Any:
    """A logit-bias sampler adding each bias to its token's logit (-inf: never sampled)."""
    array = (llama_cpp.llama_logit_bias * len(biases))(
        *(llama_cpp.llama_logit_bias(token=t, bias=b) for t, b in biases)
    )
    return llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(biases), array)
