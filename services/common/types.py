"""Plain-Python request and result types shared by the nodes (no protobuf here)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from disagg_mesh.server.common.tools.calls import Piece, ToolCall
from disagg_mesh.server.common.tools.requests import ToolRequest

DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_P = 0.95
# llama-cpp-python's defaults (Llama._init_sampler), so sampling behaves as in a single
# llama-cpp-python process unless a request sets them.
DEFAULT_TOP_K = 40
DEFAULT_MIN_P = 0.05
# Repetition penalties, off unless a request sets them; their window, Ollama's and
# llama-server's.
DEFAULT_REPEAT_PENALTY = 1.0
DEFAULT_REPEAT_LAST_N = 64
# What a caller may ask of a reasoning model's effort (gpt-oss's harmony "Reasoning:" line).
REASONING_EFFORTS = ("low", "medium", "high")

Rendered = TypeVar("Rendered")


@dataclass(frozen=True)
class ResponseFormat:
    """Structured output: the answer is JSON, constrained by a grammar where tokens are
    sampled. json_schema None: any JSON object; else a JSON Schema, as JSON text."""

    json_schema: str | None = None
    # The answer must be a call of one of these functions (name, its parameters' JSON Schema
    # as JSON text), written as the model's format writes one (calls_format: "harmony" for
    # gpt-oss, "qwen3_coder" for Qwen3-Coder's XML); set by the node from the request's tools
    # (tools/formats.py), never sent.
    calls: tuple[tuple[str, str], ...] = ()
    calls_format: str = ""
    # The JSON is written between these (a template's call markers, `<tool_call>\n` and
    # `\n</tool_call>`), once, or (repeated) one or more times a line apart; set by the node.
    before: str = ""
    after: str = ""
    repeated: bool = False


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen (temperature 0 is greedy and deterministic), and how the text
    is delivered."""

    max_tokens: int
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # End tokens are never sampled: the answer runs to max_tokens (or a stop string).
    ignore_eos: bool = False
    # None: free text.
    response_format: ResponseFormat | None = None
    # Each text chunk carries at least this many tokens (the first token and the end go
    # at once): fewer messages for a caller that reads the whole answer.
    stream_interval_tokens: int = 1
    # Functions the model may call (None: none); the node renders them and parses the calls.
    tools: ToolRequest | None = None
    # The candidates: the top_k most likely (0 or -1: any), none below min_p of the most
    # likely.
    top_k: int = DEFAULT_TOP_K
    min_p: float = DEFAULT_MIN_P
    # Repetition penalties, as llama-server's: over the last repeat_last_n tokens of the
    # prompt and the answer (-1: the whole context), a token's logit is divided by
    # repeat_penalty (a negative one multiplied), then lowered by frequency_penalty times
    # its count and by presence_penalty if it occurs.
    repeat_penalty: float = DEFAULT_REPEAT_PENALTY
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_last_n: int = DEFAULT_REPEAT_LAST_N
    # (token id, bias) pairs added to the logits before any other step (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Log probabilities of the generated tokens (TextChunk.logprobs), with this many of the
    # most likely at each place (0: each token's own); None: none.
    logprobs: int | None = None

    @property
    def penalized(self) -> bool:
        """Whether any repetition penalty applies (the sampler then keeps a history)."""
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != DEFAULT_REPEAT_PENALTY
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def penalty_window(self, n_ctx: int) -> int:
        """The tokens the penalties look back over (-1: the whole context); 0 without
        penalties."""
        if not self.penalized:
            return 0
        return n_ctx if self.repeat_last_n == -1 else self.repeat_last_n


@dataclass(frozen=True)
class ChatTurn:
    role: str  # system, user, assistant or tool
    content: str
    # An assistant turn's calls; a tool turn's call id.
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


@dataclass(frozen=True)
class Prompt:
    """Either raw text or chat turns (rendered with the model's chat template)."""

    text: str = ""
    messages: tuple[ChatTurn, ...] = ()
    # How hard a reasoning model thinks ("low", "medium", "high"; "": its default), given
    # to the chat template (gpt-oss's harmony "Reasoning:" line).
    reasoning_effort: str = ""
    # A chat too long for the node's context loses its oldest turns until it fits, as
    # Ollama's /api/chat (its `truncate`, on by default); see fitted().
    truncate_history: bool = False
    # Only the rendered prompt's last this many tokens are evaluated (vLLM's
    # truncate_prompt_tokens); 0: the whole prompt.
    truncate_prompt_tokens: int = 0
    # Fill in the middle: with text (the code before the gap, may be empty), the text after
    # it; the model's FIM tokens frame both (llama.cpp's infill, Ollama's `suffix`), and the
    # answer is what goes between. "": a plain prompt.
    suffix: str = ""

    def fitted(
        self, render: Callable[[Prompt], Rendered], fits: Callable[[Rendered], bool]
    ) -> tuple[Rendered, int]:
        """render(self), or with truncate_history and a chat that does not fit, the
        rendering of the most turns from its end that fit, and how many turns were left
        out. As Ollama's chatPrompt: the system messages are kept, and the last turn always.
        Beyond it, a chat never starts at a tool result (the call it answers goes with it),
        and an assistant message the answer goes on with keeps the turn before it. When even
        the fewest turns do not fit, their rendering (the node refuses it)."""
        whole = render(self)
        if not self.truncate_history or not self.messages or fits(whole):
            return whole, 0
        turns = self.messages
        last = len(turns) - 1 - (1 if self.continues_last_turn and len(turns) > 1 else 0)
        starts = [i for i in range(1, last + 1) if turns[i].role not in ("system", "tool")]
        if not starts:
            return whole, 0

        def from_turn(i: int) -> Prompt:
            kept = tuple(t for t in turns[:i] if t.role == "system") + turns[i:]
            return dataclasses.replace(self, messages=kept)

        renderings: dict[int, Rendered] = {}

        def rendered(k: int) -> Rendered:
            if k not in renderings:
                renderings[k] = render(from_turn(starts[k]))
            return renderings[k]

        # Fewer turns never render longer, so the first start that fits is found by halves;
        # when none does, the search ends on the last start: the fewest turns.
        low, high = 0, len(starts) - 1
        while low < high:
            mid = (low + high) // 2
            if fits(rendered(mid)):
                high = mid
            else:
                low = mid + 1
        start = starts[low]
        return rendered(low), start - sum(t.role == "system" for t in turns[:start])

    @property
    def continues_last_turn(self) -> bool:
        """The chat ends with an assistant message (without calls), which the answer goes on
        with, as llama-server (its prefill_assistant, on by default) and Ollama (its
        templates leave the last assistant turn open) do."""
        last = self.messages[-1] if self.messages else None
        return last is not None and last.role == "assistant" and not last.tool_calls


@dataclass(frozen=True)
class ModelFacts:
    """What a node's model is, as Ollama's /api/tags and /api/show describe a model (the
    proto's ModelFacts); empty where the engine cannot tell."""

    architecture: str = ""
    parameter_count: int = 0
    parameter_size: str = ""
    quantization: str = ""
    file_size_bytes: int = 0
    trained_context_tokens: int = 0
    embedding_length: int = 0
    # "completion", "tools", "insert" (fill in the middle), "thinking"; () when not known.
    capabilities: tuple[str, ...] = ()
    # How a prompt is framed, as Ollama's /api/show gives it (a Go template); "": not known.
    template: str = ""

    def can(self, capability: str) -> bool | None:
        """Whether the model has this capability; None when its capabilities are not known."""
        return capability in self.capabilities if self.capabilities else None

    @property
    def reasons(self) -> bool | None:
        """Whether the model reasons apart from its answer; None when not known."""
        return self.can("thinking")

    @property
    def takes_tools(self) -> bool | None:
        """Whether the model's template takes tools; None when not known."""
        return self.can("tools")

    @property
    def inserts(self) -> bool | None:
        """Whether the model fills in the middle (has FIM tokens); None when not known."""
        return self.can("insert")


def ollama_template(branches: Sequence[tuple[str, str]]) -> str:
    """How a prompt is framed, in Ollama's template syntax (ModelFacts.template), from its
    branches in order: (condition, text), the condition ".Suffix" or ".System", or "" for
    otherwise: {{ if A }}a{{ else if B }}b{{ else }}c{{ end }}. Without an unconditional
    last branch, nothing otherwise; one unconditional branch alone is just its text."""
    branches = list(branches)
    if not branches or branches[-1][0]:
        branches.append(("", ""))
    if len(branches) == 1:
        return branches[0][1]
    text = ""
    for i, (condition, body) in enumerate(branches):
        action = "else" if i and not condition else f"{'else ' if i else ''}if {condition}"
        text += f"{{{{ {action} }}}}{body}"
    return text + "{{ end }}"


def parameter_size(count: int) -> str:
    """A count of weights as Ollama writes it (its format.HumanNumber): "134.52M", "30.5B",
    "20B"."""
    for unit, scale in (("B", 10**9), ("M", 10**6)):
        if count >= scale:
            number = count / scale
            if number == int(number):
                return f"{int(number)}{unit}"
            return f"{number:.1f}{unit}" if unit == "B" else f"{number:.2f}{unit}"
    return f"{round(count / 1000)}K" if count >= 1000 else str(count)


@dataclass(frozen=True)
class Fingerprint:
    """Everything that shapes a KV state's bytes; a state loads only into an engine whose
    fingerprint is equal (`mismatch` names the first setting that differs)."""

    model_sha256: str
    n_ctx_tokens: int
    # llama-cpp-python's version and the llama.cpp it carries.
    engine_version: str
    # ggml type names of the K and V caches ("f16", "q8_0", ...).
    type_k: str = "f16"
    type_v: str = "f16"
    # Flash attention decides the V cache's layout (transposed without it).
    flash_attn: bool = True
    # One KV stream for all sequences (a one-sequence state loads only into one).
    kv_unified: bool = True
    # Full-size cache for sliding-window layers, or only the window.
    swa_full: bool = False

    # The settings() a topology sets per node (topology.Node's fields of the same names),
    # which a model's prefill and decode nodes must therefore agree on; the others come
    # from the model file and the build.
    TOPOLOGY_KEYS: ClassVar[tuple[str, ...]] = (
        "n_ctx",
        "flash_attn",
        "type_k",
        "type_v",
        "swa_full",
    )

    def settings(self) -> dict[str, object]:
        return {
            "model_sha256": self.model_sha256,
            "n_ctx": self.n_ctx_tokens,
            "engine_version": self.engine_version,
            "type_k": self.type_k,
            "type_v": self.type_v,
            "flash_attn": self.flash_attn,
            "kv_unified": self.kv_unified,
            "swa_full": self.swa_full,
        }

    def mismatch(self, other: Fingerprint) -> tuple[str, object, object] | None:
        """The first setting that differs: (name, this value, the other's), or None."""
        theirs = other.settings()
        for name, mine in self.settings().items():
            if mine != theirs[name]:
                return name, mine, theirs[name]
        return None


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"

    def with_calls(self, called: bool) -> FinishReason:
        """An answer that ended by itself after making tool calls ended TOOL_CALLS (one cut
        by max_tokens stays LENGTH)."""
        return FinishReason.TOOL_CALLS if called and self is FinishReason.STOP else self


class KvTransferKind(enum.Enum):
    NONE = "none"
    STATE = "state"
    TOKEN_IDS = "token_ids"


@dataclass(frozen=True)
class TokenChoice:
    """A token, its bytes (a piece of UTF-8 that can end inside a character) and the natural
    log of its probability (the proto's TokenChoice)."""

    token_id: int
    piece: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability, and the most likely tokens at its place (most
    likely first; the proto's TokenLogprob)."""

    chosen: TokenChoice
    top: tuple[TokenChoice, ...] = ()


@dataclass
class TextChunk:
    """Text produced by some tokens (text can be empty inside a multi-byte character)."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    # The model's reasoning these tokens produced (gpt-oss's analysis channel), apart from
    # the answer in `text`.
    reasoning: str = ""
    # Pieces of tool calls these tokens made (CallStart, ArgumentsPiece), apart from `text`.
    tool_calls: list[Piece] = field(default_factory=list)
    # With Sampling.logprobs: one per answer token of token_ids, in order (harmony's control
    # tokens, headers and reasoning have none).
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # The last this many of token_ids made a stop string and nothing of `text` (the chunk
    # that ends a generation on a stop string): they have no log probability to send.
    stop_tokens: int = 0

    def __add__(self, later: TextChunk) -> TextChunk:
        """One chunk for this one and a later one's tokens (text, reasoning, calls alike)."""
        return TextChunk(
            self.text + later.text,
            self.token_ids + later.token_ids,
            self.reasoning + later.reasoning,
            self.tool_calls + later.tool_calls,
            self.logprobs + later.logprobs,
            later.stop_tokens,
        )


@dataclass(frozen=True, kw_only=True)
class KvReference:
    """A prompt's KV state kept by a prefill node, as a decode node needs it (the proto's
    KvReference). PrefillResult holds these values among its own, by the same names, and
    hands them on as `reference`."""

    kv_handle: str
    first_token_id: int
    first_token_text: str = ""
    # Positions the state covers.
    prompt_tokens: int
    fingerprint: Fingerprint
    kv_size_bytes: int
    # The prompt's block hashes, and where the state starts: positions before
    # kv_prefix_tokens are in the decode node's prefix cache (0: the state holds them all).
    block_hashes: tuple[bytes, ...] = ()
    kv_prefix_tokens: int = 0
    # A harmony model's: the prompt's open message header (HarmonyParser.opening).
    open_message: tuple[int, ...] = ()
    # With repetition penalties: the prompt's last tokens, which they count.
    penalty_token_ids: tuple[int, ...] = ()
    # With Sampling.logprobs: the first token's (one entry).
    first_token_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, kw_only=True)
class PrefillStats:
    """What evaluating a prompt took on a prefill node (the proto's PrefillStats).
    PrefillFigures holds these values among its own, by the same names, and offers them as
    `stats`."""

    prefill_seconds: float
    # Prompt tokens taken from the engine's prefix cache.
    cached_prompt_tokens: int = 0
    # The prompt's whole KV state's size.
    kv_state_bytes: int = 0
    # A continuation's generated tokens evaluated after the prompt (one step each), and the
    # seconds that took (part of prefill_seconds).
    replayed_tokens: int = 0
    replay_seconds: float = 0.0


@dataclass(frozen=True, kw_only=True)
class PrefillFigures:
    """What a prefill engine reports of a prompt, passed on by name: the engine's
    PrefillOutput and the node's PrefillResult (and so PrefillResponse, wire/mirror.py) both
    are these. A new figure is written here and in the proto, nowhere between."""

    first_token_id: int
    # Set by engines that report text rather than token bytes (Ollama).
    first_token_text: str = ""
    prompt_tokens: int
    prefill_seconds: float
    # Prompt tokens taken from the engine's prefix cache.
    cached_prompt_tokens: int = 0
    # The prompt's block hashes (prefix_keys.block_hashes); the state leaves out positions
    # before kv_prefix_tokens, which the decode node kv_prefix_node holds (0: the whole
    # state); the whole state's size.
    block_hashes: tuple[bytes, ...] = ()
    kv_prefix_tokens: int = 0
    kv_prefix_node: str = ""
    kv_state_bytes: int = 0
    # A continuation's generated tokens evaluated after the prompt (one step each), and the
    # seconds that took (part of prefill_seconds).
    replayed_tokens: int = 0
    replay_seconds: float = 0.0
    # A harmony model's: the prompt's open message header (HarmonyParser.opening).
    open_message: tuple[int, ...] = ()
    # With repetition penalties: the prompt's last tokens, which they count (Sampling's
    # penalty_window of them), for the decode node's sampler.
    penalty_token_ids: tuple[int, ...] = ()
    # With Sampling.logprobs: the first token's (one entry), which the decode node sends.
    first_token_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def stats(self) -> PrefillStats:
        """What the prompt took: these figures' values of PrefillStats's fields, by name."""
        return PrefillStats(**_values(self, PrefillStats))


@dataclass(frozen=True, kw_only=True)
class PrefillResult(PrefillFigures):
    """What a prefill node returns: the engine's figures, and where the KV state is."""

    kv_handle: str
    kv_size_bytes: int
    fingerprint: Fingerprint
    kv_ttl_seconds: float
    kv_transfer: KvTransferKind

    @property
    def reference(self) -> KvReference:
        """The state as a decode node needs it: this result's values of KvReference's
        fields, by name."""
        return KvReference(**_values(self, KvReference))


def _values(obj: object, group: type) -> dict[str, Any]:
    """`obj`'s values of the dataclass `group`'s fields, by name."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(group)}


@dataclass(frozen=True)
class DecodeCandidate:
    """A decode node a prefill node may hand its KV state to, and the block hashes of the
    prefixes the router believes it holds."""

    node: str
    block_hashes: frozenset[bytes]


@dataclass(frozen=True)
class Continuation:
    """A generation another node started and that failed: what it generated and the caller
    already received. The node that takes over evaluates the prompt and these tokens, then
    generates what comes next, never sending them again."""

    generated_token_ids: tuple[int, ...]
    generated_text: str
    # The first token was sampled by a prefill node (a disaggregated generation).
    first_token_from_prefill: bool = False
    # The prompt text was evaluated with no chat template (a llama.cpp node given text).
    raw_prompt: bool = False
    # Tokens generated so far (generated_token_ids may be empty: Ollama streams text only).
    generated_tokens: int = 0
    # Prompt tokens the original evaluation took from a prefix cache: its n_batch pieces
    # started there, and a llama.cpp node cuts the prompt on the same grid (None: unknown).
    prompt_cached_tokens: int | None = None


@dataclass(frozen=True)
class StageLimits:
    """A node's own bounds on one request, counted by the node (None: only the call's
    deadline): how long it may wait inside the node before its work begins (queue_s; past
    it the node answers busy, ResourceExhausted), and how long the work may take from then
    (work_s, the stage deadline; past it DeadlineExceeded)."""

    queue_s: float | None = None
    work_s: float | None = None


@dataclass(frozen=True)
class KvSource:
    """Where a decode node pulls a prompt's KV state from: the prefill node, and the state
    as that node described it (PrefillResult.reference, passed on unchanged)."""

    prefill_address: str
    reference: KvReference


@dataclass(frozen=True)
class GenerationEnd:
    """How an engine's generation ended; durations in seconds."""

    completion_tokens: int
    finish_reason: FinishReason
    prompt_tokens: int = 0
    # Prompt tokens taken from the engine's prefix cache, and those (whole blocks) it keeps
    # there for later requests.
    cached_prompt_tokens: int = 0
    kept_prefix_tokens: int = 0
    # The engine's own evaluation of the prompt (zero when a KV state was loaded).
    prompt_eval_seconds: float = 0.0
    kv_load_seconds: float = 0.0
    decode_seconds: float = 0.0


@dataclass
class DecodeStats:
    """A decode node's summary of one generation; durations in seconds."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason = FinishReason.STOP
    kv_transfer: KvTransferKind = KvTransferKind.NONE
    kv_fetch_seconds: float = 0.0
    kv_fetch_bytes: int = 0
    kv_load_seconds: float = 0.0
    prompt_eval_seconds: float = 0.0
    decode_seconds: float = 0.0
    time_to_first_token_seconds: float = 0.0
    cached_prompt_tokens: int = 0
    kept_prefix_tokens: int = 0

    def add_end(self, end: GenerationEnd) -> None:
        """Take in what the engine reported when its generation ended."""
        self.prompt_tokens = end.prompt_tokens
        self.cached_prompt_tokens = end.cached_prompt_tokens
        self.kept_prefix_tokens = end.kept_prefix_tokens
        self.completion_tokens = end.completion_tokens
        self.finish_reason = end.finish_reason
        self.kv_load_seconds = end.kv_load_seconds
        self.prompt_eval_seconds = end.prompt_eval_seconds
        self.decode_seconds = end.decode_seconds


@dataclass(frozen=True)
class HostUsage:
    """What a node's machine is doing (runtime/observability/host.py measures it)."""

    hostname: str
    cpu_cores: int
    cpu_busy_percent: float
    memory_used_bytes: int
    memory_total_bytes: int
    gpu_name: str = ""
    gpu_utilization_percent: float = 0.0
    gpu_memory_used_bytes: int = 0
    gpu_memory_total_bytes: int = 0
    # What could not be measured here, and why.
    unavailable: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeReport:
    """What a node tells another (GetNodeInfo), in plain values: the router's dashboard."""

    name: str
    role: str
    engine: str
    engine_model: str
    backend: str
    gpu_layers: int
    model_layers: int
    ready: bool
    problem: str
    slots: int
    slots_busy: int
    queue_depth: int
    restarts: int
    uptime_seconds: float
    host: HostUsage | None
