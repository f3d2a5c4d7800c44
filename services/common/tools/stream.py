"""A generation's events with the model's tool calls read out of its text: each TextChunk's
text goes through the format's parser, which gives back the text outside calls and the
calls' pieces (TextChunk.tool_calls); the end flushes what the parser held, and an answer
that ended with calls ends with FinishReason.TOOL_CALLS.

A generation continued on another node (a migration) feeds the parser the text already
delivered first, without sending it again: the calls go on with the same indexes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator

from disagg_mesh.server.common.tools.calls import CallStart, Piece, TextPiece, ToolCallParser
from disagg_mesh.server.common.types import GenerationEnd, TextChunk


async def with_tool_calls(
    events: AsyncIterator[TextChunk | GenerationEnd],
    parser: ToolCallParser,
    delivered_text: str = "",
) -> AsyncGenerator[TextChunk | GenerationEnd, None]:
    called = _starts_call(parser.feed(delivered_text))
    async for event in events:
        if isinstance(event, TextChunk):
            pieces = parser.feed(event.text)
            called = _starts_call(pieces) or called
            yield _chunk(pieces, event)
            continue
        pieces = parser.finish()
        called = _starts_call(pieces) or called
        if pieces:
            yield _chunk(pieces, TextChunk(""))
        yield dataclasses.replace(event, finish_reason=event.finish_reason.with_calls(called))


def _starts_call(pieces: list[Piece]) -> bool:
    return any(isinstance(p, CallStart) for p in pieces)


def _chunk(pieces: list[Piece], chunk: TextChunk) -> TextChunk:
    return dataclasses.replace(
        chunk,
        text="".join(p.text for p in pieces if isinstance(p, TextPiece)),
        tool_calls=[p for p in pieces if not isinstance(p, TextPiece)],
    )
