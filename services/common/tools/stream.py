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
from disagg_mesh.server.common.types import FinishReason, GenerationEnd, TextChunk


async def with_tool_calls(
    events: AsyncIterator[TextChunk | GenerationEnd],
    parser: ToolCallParser | None,
    delivered_text: str = "",
) -> AsyncGenerator[TextChunk | GenerationEnd, None]:
    if parser is None:
        async for event in events:
            yield event
        return
    called = any(isinstance(p, CallStart) for p in parser.feed(delivered_text))
    async for event in events:
        if isinstance(event, TextChunk):
            pieces = parser.feed(event.text)
            called = called or any(isinstance(p, CallStart) for p in pieces)
            yield _chunk(pieces, event)
            continue
        pieces = parser.finish()
        called = called or any(isinstance(p, CallStart) for p in pieces)
        if pieces:
            yield _chunk(pieces, TextChunk(""))
        if called and event.finish_reason is FinishReason.STOP:
            event = dataclasses.replace(event, finish_reason=FinishReason.TOOL_CALLS)
        yield event


def _chunk(pieces: list[Piece], chunk: TextChunk) -> TextChunk:
    return TextChunk(
        text="".join(p.text for p in pieces if isinstance(p, TextPiece)),
        token_ids=chunk.token_ids,
        reasoning=chunk.reasoning,
        tool_calls=[p for p in pieces if not isinstance(p, TextPiece)],
    )
