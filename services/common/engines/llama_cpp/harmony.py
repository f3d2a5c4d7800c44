"""gpt-oss's harmony format: the chat template a gpt-oss file without one gets, and the parser
that splits generated tokens into reasoning and answer.

Harmony messages are `<|start|>{header}<|message|>{body}<|end|>`; an assistant header names
its channel (`assistant<|channel|>analysis`), and the model ends its turn with `<|return|>`
(or `<|call|>` for a tool). The analysis channel is the model's reasoning; final (and
commentary) is the answer, and a commentary message to `functions.NAME` is a call of a tool
the request offered (its body the arguments' JSON). The control tokens are single
tokens of o200k_harmony, so the parser works on token ids, never on text: a user's text that
spells "<|channel|>" stays text.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from disagg_mesh.server.common.structured.gbnf import renamed

# The harmony chat template of a gpt-oss file that has none (Ollama keeps gpt-oss's template
# outside its GGUF blob). Renders what openai-harmony's render_conversation_for_completion
# renders (tests/test_harmony.py checks token for token): the system message with the knowledge
# cutoff, today's date and the reasoning effort ("low", "medium" or "high"; default medium), a
# system or developer turn as the developer's instructions, the tools offered as harmony's
# `namespace functions` (strings, enums, numbers, booleans, arrays of those, descriptions and
# defaults as openai-harmony writes them; other types as `any`), earlier assistant turns as
# final messages (their reasoning dropped, as harmony drops it), their calls as commentary
# messages to `functions.NAME` and the tools' results as messages from them, then
# `<|start|>assistant`.
HARMONY_TEMPLATE = """\
{%- macro ts_type(spec) -%}
{%- if spec.type == "array" -%}
{%- set item = spec["items"]["type"] if spec["items"] is defined and spec["items"] is mapping
    else "" -%}
{{- "number" if item == "integer" else (item if item in ("string", "number", "boolean")
    else "any") }}[]
{%- elif spec.type == "string" and spec.enum -%}"{{ spec.enum | join('" | "') }}"
{%- elif spec.type in ("number", "integer") -%}number
{%- elif spec.type in ("string", "boolean") -%}{{ spec.type }}
{%- else -%}any
{%- endif -%}
{%- endmacro -%}
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort
    else "medium" -%}
{%- set identity = model_identity if model_identity is defined and model_identity
    else "You are ChatGPT, a large language model trained by OpenAI." -%}
<|start|>system<|message|>{{ identity }}
Knowledge cutoff: 2024-06
Current date: {{ strftime_now("%Y-%m-%d") }}

Reasoning: {{ effort }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}{{ "\\n" }}Calls to these tools must go to the commentary channel: 'functions'.
{%- endif -%}
<|end|>
{%- set turns = messages -%}
{%- set instructions = "" -%}
{%- if messages and messages[0].role in ("system", "developer") -%}
{%- set instructions = messages[0].content -%}
{%- set turns = messages[1:] -%}
{%- endif -%}
{%- if instructions or tools -%}
{{- "<|start|>developer<|message|>" -}}
{%- if instructions -%}{{- "# Instructions\\n\\n" + instructions -}}{%- endif -%}
{%- if instructions and tools -%}{{- "\\n\\n" -}}{%- endif -%}
{%- if tools -%}
{{- "# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n" -}}
{%- for tool in tools -%}
{%- set f = tool.function -%}
{%- if f.description -%}{{- "// " + f.description + "\\n" -}}{%- endif -%}
{{- "type " + f.name + " = " -}}
{%- if f.parameters and f.parameters.properties -%}
{{- "(_: {\\n" -}}
{%- for name, spec in f.parameters.properties.items() -%}
{%- if spec.description -%}{{- "// " + spec.description + "\\n" -}}{%- endif -%}
{{- name + ("" if name in (f.parameters.required or []) else "?") + ": " + ts_type(spec) + "," -}}
{%- if spec.default is defined -%}{{- " // default: " + (spec.default | tojson) -}}{%- endif -%}
{{- "\\n" -}}
{%- endfor -%}
{{- "}) => any;\\n\\n" -}}
{%- else -%}
{{- "() => any;\\n\\n" -}}
{%- endif -%}
{%- endfor -%}
{{- "} // namespace functions" -}}
{%- endif -%}
{{- "<|end|>" -}}
{%- endif -%}
{%- for turn in turns -%}
{%- if turn.role == "assistant" and turn.tool_calls -%}
{%- for call in turn.tool_calls -%}
<|start|>assistant to=functions.{{ call.function.name }}<|channel|>commentary <|constrain|>json\
<|message|>{{ call.function.arguments | tojson }}<|call|>
{%- endfor -%}
{%- elif turn.role == "assistant" -%}
<|start|>assistant<|channel|>final<|message|>{{ turn.content }}<|end|>
{%- elif turn.role == "tool" -%}
<|start|>functions.{{ turn.name }} to=assistant<|channel|>commentary<|message|>\
{{ turn.content }}<|end|>
{%- elif turn.role in ("system", "developer") -%}
<|start|>developer<|message|>{{ turn.content }}<|end|>
{%- else -%}
<|start|>{{ turn.role }}<|message|>{{ turn.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}
"""

# What follows `<|start|>assistant` to open the answer's message (a prefilled answer goes on).
HARMONY_FINAL = "<|channel|>final<|message|>"

# A header holding more tokens than this is not a header: a model (or a prompt) that does not
# follow harmony; its generated text is the answer from there. Room for a call's header
# written a character a token (a grammar can make a model spell `commentary
# to=functions.NAME json`: up to ~100 characters with a 64-character name).
MAX_HEADER_TOKENS = 128


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of harmony's control tokens in a model's vocabulary."""

    start: int
    end: int
    message: int
    channel: int
    return_: int
    call: int
    constrain: int | None

    @classmethod
    def find(cls, token_of: Callable[[str], int | None]) -> HarmonyTokens | None:
        """This vocabulary's harmony tokens (token_of: the single control token a text is,
        or None), or None when it lacks any of them: not a harmony model."""
        names = ("start", "end", "message", "channel", "return", "call")
        ids = {name: token_of(f"<|{name}|>") for name in names}
        if any(i is None for i in ids.values()):
            return None
        return cls(
            start=ids["start"] or 0,
            end=ids["end"] or 0,
            message=ids["message"] or 0,
            channel=ids["channel"] or 0,
            return_=ids["return"] or 0,
            call=ids["call"] or 0,
            constrain=token_of("<|constrain|>"),
        )


class Part(enum.Enum):
    """Where a generated token's text goes."""

    HIDDEN = "hidden"  # a control token, or a header (role, channel, recipient)
    REASONING = "reasoning"
    ANSWER = "answer"
    TOOL_CALL = "tool_call"  # a call's arguments (a message to functions.NAME)


# A header's recipient that is one of the request's functions.
FUNCTION_RECIPIENT = re.compile(rb"to=functions\.([A-Za-z0-9_-]+)")


class HarmonyParser:
    """Follows a token sequence (the prompt, then what is generated) through harmony's
    messages; `feed` says where each token's text belongs.

    Before any harmony token the text is the answer (a raw prompt that is not harmony). A
    header runs from `<|start|>` (or the model's `<|channel|>` right after one) to
    `<|message|>`; the body that follows belongs to its channel until `<|end|>`,
    `<|return|>` or `<|call|>`. A header longer than MAX_HEADER_TOKENS is not one: its
    generated text is the answer. A generation that ends inside a short header (max_tokens
    right after `<|start|>assistant`) shows nothing of it."""

    def __init__(
        self, tokens: HarmonyTokens, piece: Callable[[int], bytes], tools: bool = False
    ) -> None:
        self._t = tokens
        self._piece = piece
        # With tools: a message to functions.NAME is a call; `calls` counts those begun (the
        # prompt's too), `call_name` is the last one's function.
        self._tools = tools
        self.calls = 0
        self.call_name = ""
        self._in_header = False
        self._header: list[int] = []
        self._body_header: list[int] = []
        # The header's tokens that were generated (not from the prompt), and their text.
        self._generated: list[tuple[int, bytes]] = []
        self._part = Part.ANSWER

    def follow(self, prompt: Iterable[int]) -> None:
        """Take in tokens that were not generated here (a prompt, or a continuation's
        tokens already delivered), so that the next generated token is placed right."""
        for token in prompt:
            self._step(token)
        self._generated = []

    @property
    def in_call(self) -> bool:
        """Inside a call's arguments (a parser placed there by an opening)."""
        return self._part is Part.TOOL_CALL and not self._in_header

    def opening(self) -> tuple[int, ...]:
        """Tokens that put a new parser where this one is (follow() them): the open
        header, or the header of the message being written, or where messages end."""
        t = self._t
        if self._in_header:
            return (t.start, *self._header)
        if self._part is Part.HIDDEN:
            return (t.end,)
        if self._part in (Part.REASONING, Part.TOOL_CALL):
            return (t.start, *self._body_header, t.message)
        return ()

    def feed(self, token: int, piece: bytes) -> list[tuple[Part, bytes]]:
        """Where this generated token's text goes: usually one (part, bytes); a header that
        turns out not to be one releases its text as the answer."""
        out = self._step(token, piece)
        if self._in_header:
            if token not in self._controls():
                self._generated.append((token, piece))
            if len(self._header) > MAX_HEADER_TOKENS:
                out = self._release()
                self._in_header = False
                self._header = []
                self._part = Part.ANSWER
        else:
            self._generated = []
        return out

    def _release(self) -> list[tuple[Part, bytes]]:
        text = b"".join(piece for _, piece in self._generated)
        self._generated = []
        return [(Part.ANSWER, text)] if text else []

    def _controls(self) -> tuple[int, ...]:
        t = self._t
        return (t.start, t.end, t.message, t.channel, t.return_, t.call)

    def _step(self, token: int, piece: bytes | None = None) -> list[tuple[Part, bytes]]:
        t = self._t
        if token == t.start:
            self._in_header, self._header = True, []
            return []
        if token == t.message and self._in_header:
            self._in_header, self._body_header = False, self._header
            self._part = self._channel_part()
            return []
        if token in (t.end, t.return_, t.call):
            self._in_header, self._header = False, []
            self._part = Part.HIDDEN  # between messages: nothing is text until the next
            return []
        if token == t.channel and not self._in_header:
            # A model that starts its message with the channel (no <|start|> since the
            # prompt's): a header from here.
            self._in_header, self._header = True, []
        if self._in_header:
            self._header.append(token)
            return []
        if self._part is Part.HIDDEN:
            # Text after <|end|> without a new header: not harmony, so the answer.
            self._part = Part.ANSWER
        if piece is None:
            return []
        return [(self._part, piece)] if piece else []

    def _channel_part(self) -> Part:
        """The channel of the header that just ended: analysis is reasoning; with tools, a
        message to functions.NAME is a call."""
        if self._tools:
            controls = (*self._controls(), self._t.constrain)
            text = b"".join(b" " if t in controls else self._piece(t) for t in self._header)
            recipient = FUNCTION_RECIPIENT.search(text)
            if recipient is not None:
                self.calls += 1
                self.call_name = recipient.group(1).decode()
                return Part.TOOL_CALL
        channel_at = [i for i, token in enumerate(self._header) if token == self._t.channel]
        if not channel_at:
            return Part.ANSWER
        name = b"".join(self._piece(token) for token in self._header[channel_at[-1] + 1 :])
        channel = name.split(b" ")[0].strip() if name.strip() else b""
        return Part.REASONING if channel == b"analysis" else Part.ANSWER


# The start rule of harmony_rules.
HARMONY_ROOT = "harmony-answer"


def harmony_rules(tokens: HarmonyTokens) -> str:
    """Rules for a harmony model (gpt-oss), start rule HARMONY_ROOT: its reasoning messages
    free, then the final channel's message constrained by `root` (as llama.cpp's own
    gpt-oss response-format grammar): token references, so a header is its control tokens,
    never text spelling them."""
    ch, msg = _reference(tokens.channel), _reference(tokens.message)
    constrain = f' (" " <[{tokens.constrain}]> [A-Za-z0-9_-]+)?' if tokens.constrain else ""
    return (
        f'{HARMONY_ROOT} ::= harmony-analysis* {ch} "final"{constrain} {msg} root\n'
        f"{_analysis_rule(tokens)}\n"
    )


def _reference(token: int) -> str:
    """A grammar's reference to one token by id."""
    return f"<[{token}]>"


def _analysis_rule(tokens: HarmonyTokens) -> str:
    """One reasoning message, free, then the next assistant message's start."""
    ch, msg, end, start = map(
        _reference, (tokens.channel, tokens.message, tokens.end, tokens.start)
    )
    return f'harmony-analysis ::= {ch} "analysis" {msg} !{end}* {end} {start} "assistant"'


def harmony_call_rules(tokens: HarmonyTokens, calls: Sequence[tuple[str, str]]) -> str:
    """Rules for a harmony model that must call one of these functions (name, the rules of
    its arguments' schema with start rule `root`), start rule HARMONY_ROOT: one reasoning
    message (free) or none, then a commentary message to functions.NAME holding JSON its
    schema allows, as openai-harmony writes a call. Each schema's rules are renamed apart
    (`call0-...`)."""
    ch, msg = _reference(tokens.channel), _reference(tokens.message)
    constrain = f' " " <[{tokens.constrain}]> "json"' if tokens.constrain else ' " json"'
    rules: list[str] = []
    branches: list[str] = []
    for i, (name, schema_rules) in enumerate(calls):
        rules.append(renamed(schema_rules, f"call{i}-"))
        branches.append(f'"{name}"{constrain} {msg} call{i}-root')
    return "\n".join(
        [
            *rules,
            # One reasoning message at most: a model that wants to answer in the final
            # channel, which the grammar forbids, would otherwise reason on and on.
            f'{HARMONY_ROOT} ::= harmony-analysis? {ch} "commentary to=functions." '
            f"( {' | '.join(branches)} )",
            _analysis_rule(tokens),
        ]
    )
