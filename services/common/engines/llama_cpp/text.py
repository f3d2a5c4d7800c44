"""Turning generated tokens into text deltas: UTF-8 across token boundaries, stop strings,
end tokens, token limits, and (gpt-oss) harmony's reasoning and answer. Runs on the engine
thread, one `TextStream` per slot; no protobuf here."""

from __future__ import annotations

import codecs
from dataclasses import dataclass

from disagg_mesh.server.common.engines.llama_cpp.harmony import HarmonyParser, Part
from disagg_mesh.server.common.tools.calls import ArgumentsPiece, CallStart, Piece, new_call_id
from disagg_mesh.server.common.types import FinishReason, GenerationEnd, TextChunk


@dataclass(frozen=True)
class GeneratedToken:
    token_id: int
    # The token's bytes: a piece of UTF-8 that can end inside a character.
    piece: bytes
    # True for an end-of-generation token (its piece is not part of the text).
    is_end: bool


class TextAssembler:
    """Feeds token bytes in, gets text out; holds back text that may begin a stop string."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self._pending = ""
        self._pending_ids: list[int] = []
        # Where each pending token's text begins in the pending text (it grows from the
        # same start until a chunk is emitted).
        self._pending_starts: list[int] = []
        self.stopped = False

    def feed(self, token_id: int, piece: bytes) -> TextChunk | None:
        self._pending_starts.append(len(self._pending))
        text = self._pending + self._decoder.decode(piece)
        self._pending_ids.append(token_id)
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            inside = sum(start >= cut for start in self._pending_starts)
            chunk = self._emit(text[:cut], keep="", final=True)
            if chunk is not None:
                chunk.stop_tokens = inside
            return chunk
        hold = self._held_suffix(text)
        return self._emit(text[: len(text) - hold], keep=text[len(text) - hold :], final=False)

    def take_ids(self) -> list[int]:
        """The tokens fed since the last chunk, to travel with text that is not from here."""
        ids, self._pending_ids = self._pending_ids, []
        self._pending_starts = []
        return ids

    def flush(self) -> TextChunk | None:
        if self.stopped:
            return None
        return self._emit(
            self._pending + self._decoder.decode(b"", final=True), keep="", final=True
        )

    def _held_suffix(self, text: str) -> int:
        longest = max((len(s) for s in self._stop), default=0)
        for k in range(min(len(text), longest - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self._stop):
                return k
        return 0

    def _emit(self, text: str, keep: str, final: bool) -> TextChunk | None:
        """A chunk of text and the tokens fed since the last chunk; token ids whose text is
        still held back travel with the next chunk."""
        self._pending = keep
        if not text and not (final and self._pending_ids):
            return None
        chunk = TextChunk(text=text, token_ids=self._pending_ids)
        self._pending_ids, self._pending_starts = [], []
        return chunk


class TextStream:
    """One generation's tokens in, its text chunks and then one GenerationEnd out.

    `push` returns what a token produced; once the generation is over (end token, stop
    string, max_tokens) that list ends with the GenerationEnd and `done` is true. `end`
    closes a generation that stops for another reason (the context is full). The end
    token is not counted.

    With a harmony parser (gpt-oss), the analysis channel's text is the chunks' `reasoning`,
    headers and control tokens are neither, and stop strings apply to the answer only; a
    parser that knows of tools makes a message to functions.NAME the chunks' `tool_calls`
    (its start, then its arguments' text), and an answer that ended with calls ends
    FinishReason.TOOL_CALLS."""

    def __init__(
        self, max_tokens: int, stop: tuple[str, ...], harmony: HarmonyParser | None = None
    ) -> None:
        self._assembler = TextAssembler(stop)
        self._harmony = harmony
        self._reasoning = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._arguments = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Calls the prompt made (earlier turns') are not this answer's; a stream placed inside
        # a call (an opening: another node gave its start) goes on with its arguments.
        inside = harmony is not None and harmony.in_call
        self._calls_before = 0 if harmony is None else harmony.calls - inside
        self._started = 0 if inside else -1  # the last call whose start was given
        self._max_tokens = max_tokens
        self.count = 0
        self.done = False
        # Whether the last token pushed was the answer's (harmony: its final channel's or a
        # call's arguments; not a control token, a header or reasoning), whose log
        # probability goes with the answer's.
        self.answered = False

    def push(self, token: GeneratedToken) -> list[TextChunk | GenerationEnd]:
        assert not self.done, "a finished TextStream takes no more tokens"
        self.answered = False
        if token.is_end:
            return self.end(FinishReason.STOP)
        self.count += 1
        if self._harmony is None:
            self.answered = True
            chunk = self._assembler.feed(token.token_id, token.piece)
        else:
            parts = self._harmony.feed(token.token_id, token.piece)
            self.answered = any(part in (Part.ANSWER, Part.TOOL_CALL) for part, _ in parts)
            chunk = self._split(token.token_id, parts)
        out: list[TextChunk | GenerationEnd] = [chunk] if chunk is not None else []
        if self._assembler.stopped:
            out += self.end(FinishReason.STOP)
        elif self.count >= self._max_tokens:
            out += self.end(FinishReason.LENGTH)
        return out

    def _split(self, token_id: int, parts: list[tuple[Part, bytes]]) -> TextChunk | None:
        answer = b"".join(piece for part, piece in parts if part is Part.ANSWER)
        thought = b"".join(piece for part, piece in parts if part is Part.REASONING)
        chunk = self._assembler.feed(token_id, answer)
        reasoning = self._reasoning.decode(thought)
        calls = self._call_pieces(parts)
        if (reasoning or calls) and not self._assembler.stopped:
            if chunk is None:
                chunk = TextChunk(text="", token_ids=self._assembler.take_ids())
            chunk.reasoning = reasoning
            chunk.tool_calls = calls
        return chunk

    def _call_pieces(self, parts: list[tuple[Part, bytes]]) -> list[Piece]:
        """A call that began (its message's header ended) and its arguments' new text."""
        assert self._harmony is not None
        index = self._harmony.calls - self._calls_before - 1
        pieces: list[Piece] = []
        if index > self._started:
            self._started = index
            pieces.append(CallStart(index, new_call_id(), self._harmony.call_name))
        text = self._arguments.decode(b"".join(p for part, p in parts if part is Part.TOOL_CALL))
        if text:
            pieces.append(ArgumentsPiece(index, text))
        return pieces

    def end(self, finish: FinishReason) -> list[TextChunk | GenerationEnd]:
        self.done = True
        out: list[TextChunk | GenerationEnd] = []
        if self._harmony is not None and not self._assembler.stopped:
            reasoning = self._reasoning.decode(b"", final=True)
            if reasoning:
                ids = self._assembler.take_ids()
                out.append(TextChunk(text="", token_ids=ids, reasoning=reasoning))
        tail = self._assembler.flush()
        if self._harmony is not None:
            finish = finish.with_calls(self._harmony.calls > self._calls_before)
        return [*out, *([tail] if tail is not None else []), GenerationEnd(self.count, finish)]
