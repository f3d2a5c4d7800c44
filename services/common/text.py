"""Turning generated tokens into text deltas: UTF-8 across token boundaries, stop strings,
end tokens and token limits. Runs on the engine thread; no protobuf here."""

from __future__ import annotations

import codecs
from collections.abc import Iterator

from services.common.engines.base import GeneratedToken
from services.common.types import FinishReason, GenerationEnd, TextChunk


class TextAssembler:
    """Feeds token bytes in, gets text out; holds back text that may begin a stop string."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self._pending = ""
        self._pending_ids: list[int] = []
        self.stopped = False

    def feed(self, token_id: int, piece: bytes) -> TextChunk | None:
        text = self._pending + self._decoder.decode(piece)
        self._pending_ids.append(token_id)
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._emit(text[:cut], keep="", final=True)
        hold = self._held_suffix(text)
        return self._emit(text[: len(text) - hold], keep=text[len(text) - hold :], final=False)

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
        self._pending_ids = []
        return chunk


def assemble(
    tokens: Iterator[GeneratedToken], max_tokens: int, stop: tuple[str, ...]
) -> Iterator[TextChunk | GenerationEnd]:
    """Text chunks as tokens come, then one GenerationEnd. The end token is not counted."""
    assembler = TextAssembler(stop)
    count = 0
    finish = FinishReason.LENGTH  # the engine ran out of context
    for token in tokens:
        if token.is_end:
            finish = FinishReason.STOP
            break
        count += 1
        chunk = assembler.feed(token.token_id, token.piece)
        if chunk is not None:
            yield chunk
        if assembler.stopped:
            finish = FinishReason.STOP
            break
        if count >= max_tokens:
            finish = FinishReason.LENGTH
            break
    tail = assembler.flush()
    if tail is not None:
        yield tail
    yield GenerationEnd(completion_tokens=count, finish_reason=finish)
