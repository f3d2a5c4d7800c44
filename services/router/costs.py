"""Automatic mode: `disaggregated` or `decode_only`, per request, from measured figures.

Disaggregation pays when the prefill machine evaluates the uncached part of a prompt enough
faster than the decode machine would to cover moving its KV state. The router learns, from
every request it serves:

- each node's prompt evaluation speed (uncached prompt tokens per second: a prefill node's
  from `disaggregated` requests, a decode node's from `decode_only` ones);
- the KV handoff's seconds per byte (fetch and load) and each model's KV bytes per token;
- the fixed cost of each mode: time to first token less the prompt evaluation and the
  handoff (the extra calls of a disaggregated request, the first decode step);
- characters per token of each model's prompts (the router does not tokenize).

and estimates, for a request of C characters of which the chosen nodes are believed to hold
some leading blocks already (their prefix caches; `prefixes.text_blocks`):

    disaggregated = fixed_d + uncached_prefill / prefill_rate * (1 + prefill load)
                    + moved_tokens * kv_bytes_per_token * seconds_per_byte
    decode_only   = fixed_o + uncached_decode / decode_rate * (1 + decode load)
                    * (1 + decode streams)

Load is calls in flight per slot beyond the node's slots (0 with a free slot). Streams are
the router's calls on the decode node when it is on another machine than the prefill node: a
prompt evaluated there takes its compute from each of them as long (disaggregation keeps
prompts off the machine that generates), where a prefill node on the same machine would take
the same compute either way (0). So the estimate is the time the request's prompt costs, its
own wait and the others': alone the two are times to first token, and under load the mesh's
prompts stay on its prefill machines unless those are far slower or queued (on the user's
machines the Mac Studios' generation sets the pace of a class: `disagg simulate` measured a
class of 200 x 2 at 472 s when each request took the quicker way to its first token, 421 s
with prompts kept off the Macs). The cheaper mode goes first; the route's chain stays the
fallback order. Until both modes have figures, the one without is tried first (once is
enough to measure it). Every decision is explained in the summary's `route_reason`.

A migration (a decode node failed mid-answer) weighs the same figures, plus each node's
seconds per decode step, for the node taking over: it evaluates the prompt and replays the
N tokens delivered one step each itself, or a prefill node does both and hands the KV
state of the prompt and N - 1 tokens over (the last is the first token it evaluates):

    decode  = fixed_o + uncached_decode / decode_rate * (1 + decode load) + N * decode_step
    prefill = fixed_d + uncached_prefill / prefill_rate * (1 + prefill load)
              + (N - 1) * prefill_step + moved_tokens * kv_bytes_per_token * seconds_per_byte

The prompt is usually all in the prefill node's prefix cache (it served the request), so
the choice turns on the decode node's prompt speed against the handoff of a longer state.
A decode node whose prompt speed was never measured (in chain mode only migrations and
decode_only requests measure it) is taken to be as fast as the prefill node: a migration
is no time to measure a way that can take seconds more. Without the prefill node's figures
(no disaggregated request yet), the decode node evaluates them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

# Weight of the newest observation in a running average.
ALPHA = 0.3
DEFAULT_CHARS_PER_TOKEN = 4.0
K = TypeVar("K")


class Average:
    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - ALPHA) * self.value + ALPHA * x


@dataclass
class Observation:
    """What one served request tells: the method, its nodes and the summary's figures."""

    method: str  # "disaggregated" or "decode_only"
    prefill_node: str
    decode_node: str
    prompt_chars: int
    prompt_tokens: int
    cached_prompt_tokens: int
    prompt_seconds: float
    handoff_seconds: float
    kv_transfer_bytes: int
    kv_state_bytes: int
    time_to_first_token_seconds: float


@dataclass
class Candidate:
    """A node the request would use, what it is believed to hold, and its load."""

    node: str
    held_chars: int
    load: float
    # decode only: the calls its prompt would take compute from (0: none, or the prefill
    # node shares the machine).
    streams: int = 0


@dataclass
class Decision:
    method: str
    reason: str
    # "cost" (both estimated) or "measuring" (one mode lacks figures).
    basis: str


@dataclass
class Resumption:
    """Who evaluates a migrated generation's prompt and delivered tokens: "decode" (the node
    taking over) or "prefill" (a prefill node, handing the KV state over), and why."""

    via: str
    reason: str
    # "cost" (both estimated), "assumed" (the decode node's prompt speed taken as the
    # prefill node's) or "measuring" (no figures for the prefill node's way).
    basis: str


class Costs:
    def __init__(self) -> None:
        self._steps: dict[str, Average] = {}  # node -> seconds per decode step
        self._rate: dict[str, Average] = {}  # node -> uncached prompt tokens per second
        self._fixed: dict[tuple[str, str], Average] = {}  # (model, method) -> seconds
        self._per_byte: dict[str, Average] = {}  # model -> handoff seconds per KV byte
        self._bytes_per_token: dict[str, Average] = {}
        self._chars_per_token: dict[str, Average] = {}

    def learn(self, model: str, o: Observation) -> None:
        if o.prompt_tokens <= 0:
            return
        _get(self._chars_per_token, model).add(o.prompt_chars / o.prompt_tokens)
        node = o.prefill_node if o.method == "disaggregated" else o.decode_node
        self.learn_prompt(node, o.prompt_tokens - o.cached_prompt_tokens, o.prompt_seconds)
        if o.method == "disaggregated" and o.kv_transfer_bytes > 0:
            _get(self._per_byte, model).add(o.handoff_seconds / o.kv_transfer_bytes)
            _get(self._bytes_per_token, model).add(o.kv_state_bytes / o.prompt_tokens)
        fixed = o.time_to_first_token_seconds - o.prompt_seconds - o.handoff_seconds
        _get(self._fixed, (model, o.method)).add(max(fixed, 0.0))

    def learn_prompt(self, node: str, uncached_tokens: int, seconds: float) -> None:
        """A node evaluated this many prompt tokens (not from its cache) in this time."""
        if uncached_tokens > 0 and seconds > 0:
            _get(self._rate, node).add(uncached_tokens / seconds)

    def learn_steps(self, node: str, tokens: int, seconds: float) -> None:
        """A node ran this many one-token decode steps (generating or replaying) in this time."""
        if tokens > 1 and seconds > 0:
            _get(self._steps, node).add(seconds / tokens)

    def resume(
        self,
        model: str,
        prompt_chars: int,
        prompt_tokens: int,
        delivered: int,
        prefill: Candidate,
        decode: Candidate,
    ) -> Resumption:
        """How a migrated generation resumes on `decode`: it evaluates the prompt and the
        `delivered` tokens itself, or `prefill` does and hands their KV state over."""
        chars = _value(self._chars_per_token, model) or DEFAULT_CHARS_PER_TOKEN
        tokens = float(prompt_tokens) or prompt_chars / chars
        # A node never seen decoding steps as fast as the other (the replay's steps then
        # weigh the same on both sides); neither seen: steps are left out.
        decode_step = _value(self._steps, decode.node) or _value(self._steps, prefill.node) or 0.0
        prefill_step = _value(self._steps, prefill.node) or decode_step
        d = self._disaggregated(
            model, tokens, chars, prefill, decode, fixed_default=0.0, extra_tokens=delivered - 1
        )
        if d is None:
            reason = f"no figures yet for {prefill.node}'s prompt speed and the KV handoff"
            return Resumption("decode", reason, "measuring")
        d += (delivered - 1) * prefill_step
        assumed = _value(self._rate, decode.node) is None
        o = self._decode_only(
            model, tokens, chars, decode, fixed_default=0.0, rate_default=self._rate[prefill.node]
        )
        assert o is not None  # the prefill node's rate stands in for an unmeasured one
        o += delivered * decode_step
        via = "prefill" if d < o else "decode"
        reason = (
            f"~{tokens:.0f} prompt + {delivered} delivered tokens: {decode.node} alone "
            f"~{o * 1000:.0f} ms vs via {prefill.node} ~{d * 1000:.0f} ms"
        )
        if assumed:
            reason += f" ({decode.node}'s prompt speed not measured: taken as {prefill.node}'s)"
        return Resumption(via, reason, "assumed" if assumed else "cost")

    def decide(
        self, model: str, prompt_chars: int, prefill: Candidate, decode: Candidate
    ) -> Decision:
        """Which of disaggregated and decode_only goes first for this request, and why."""
        chars = _value(self._chars_per_token, model) or DEFAULT_CHARS_PER_TOKEN
        tokens = prompt_chars / chars
        d = self._disaggregated(model, tokens, chars, prefill, decode)
        o = self._decode_only(model, tokens, chars, decode)
        if d is None or o is None:
            method = "disaggregated" if d is None else "decode_only"
            missing = (
                f"{prefill.node}'s prompt speed and the KV handoff"
                if d is None
                else f"{decode.node}'s prompt speed"
            )
            reason = f"auto: measuring {method} (no figures yet for {missing})"
            return Decision(method, reason, "measuring")
        method = "disaggregated" if d <= o else "decode_only"
        streams = f", {decode.streams} streams' time" if decode.streams else ""
        reason = (
            f"auto: ~{tokens:.0f} prompt tokens: disaggregated ~{d * 1000:.0f} ms "
            f"({prefill.node} -> {decode.node}) vs decode_only ~{o * 1000:.0f} ms "
            f"({decode.node}{streams}): {method}"
        )
        return Decision(method, reason, "cost")

    def _disaggregated(
        self,
        model: str,
        tokens: float,
        chars: float,
        prefill: Candidate,
        decode: Candidate,
        fixed_default: float | None = None,
        extra_tokens: int = 0,
    ) -> float | None:
        """`extra_tokens`: evaluated and moved besides the prompt (a migration's replay;
        its steps are the caller's to add)."""
        rate = _value(self._rate, prefill.node)
        fixed = _value(self._fixed, (model, "disaggregated"))
        fixed = fixed_default if fixed is None else fixed
        per_byte = _value(self._per_byte, model)
        per_token = _value(self._bytes_per_token, model)
        if rate is None or fixed is None or per_byte is None or per_token is None:
            return None
        evaluate = max(tokens - prefill.held_chars / chars, 1.0) / rate * (1 + prefill.load)
        moved = max(tokens + extra_tokens - decode.held_chars / chars, 1.0)
        return fixed + evaluate + moved * per_token * per_byte

    def _decode_only(
        self,
        model: str,
        tokens: float,
        chars: float,
        decode: Candidate,
        fixed_default: float | None = None,
        rate_default: Average | None = None,
    ) -> float | None:
        rate = _value(self._rate, decode.node)
        if rate is None and rate_default is not None:
            rate = rate_default.value
        fixed = _value(self._fixed, (model, "decode_only"))
        fixed = fixed_default if fixed is None else fixed
        if rate is None or fixed is None:
            return None
        evaluate = max(tokens - decode.held_chars / chars, 1.0) / rate * (1 + decode.load)
        return fixed + evaluate * (1 + decode.streams)


def _get(table: dict[K, Average], key: K) -> Average:
    return table.setdefault(key, Average())


def _value(table: dict[K, Average], key: K) -> float | None:
    average = table.get(key)
    return None if average is None else average.value
