"""Token bytes to text: UTF-8 split across tokens, stop strings, end tokens, limits."""

from __future__ import annotations

from disagg_mesh.server.common.engines.llama_cpp.text import (
    GeneratedToken,
    TextAssembler,
    TextStream,
)
from disagg_mesh.server.common.types import FinishReason, GenerationEnd, TextChunk


def tokens(*pieces: bytes, end: bool = False) -> list[GeneratedToken]:
    out = [GeneratedToken(i, p, False) for i, p in enumerate(pieces)]
    if end:
        out.append(GeneratedToken(99, b"", True))
    return out


def run(
    pieces: list[GeneratedToken], max_tokens: int = 100, stop: tuple[str, ...] = ()
) -> tuple[str, GenerationEnd]:
    stream = TextStream(max_tokens, stop)
    items = [item for token in pieces if not stream.done for item in stream.push(token)]
    if not stream.done:  # the tokens ran out first (a full context)
        items += stream.end(FinishReason.LENGTH)
    end = items[-1]
    assert isinstance(end, GenerationEnd)
    text = "".join(i.text for i in items[:-1] if isinstance(i, TextChunk))
    return text, end


def test_a_character_split_across_tokens_comes_out_whole() -> None:
    euro = "€".encode()
    assembler = TextAssembler(())
    assert assembler.feed(0, euro[:1]) is None
    assert assembler.feed(1, euro[1:2]) is None
    chunk = assembler.feed(2, euro[2:] + b"!")
    assert chunk is not None and chunk.text == "€!" and chunk.token_ids == [0, 1, 2]


def test_stop_string_across_tokens_is_cut_and_never_sent() -> None:
    text, end = run(tokens(b"Hello ", b"wor", b"ld and more"), stop=("world",))
    assert text == "Hello "
    assert end.finish_reason == FinishReason.STOP and end.completion_tokens == 3


def test_the_tokens_only_of_a_stop_string_are_marked_as_such() -> None:
    """The chunk that ends on a stop string carries every token fed since the last chunk
    (a migration replays them) and says how many of the last are the stop string's alone;
    one that began before it (" wor" of "Hello world") is not."""
    assembler = TextAssembler(("world",))
    first = assembler.feed(0, b"Hello wor")
    assert first is not None and first.text == "Hello " and first.token_ids == [0]
    assert assembler.feed(1, b"l") is None
    last = assembler.feed(2, b"d!")
    assert last is not None and last.text == "" and last.token_ids == [1, 2]
    assert last.stop_tokens == 2
    assembler = TextAssembler(("world",))
    assert assembler.feed(0, b"w") is None and assembler.feed(1, b"or") is None
    chunk = assembler.feed(2, b"ld")
    assert chunk is not None and chunk.token_ids == [0, 1, 2] and chunk.stop_tokens == 3
    assembler = TextAssembler(("world",))
    assert assembler.feed(0, b"a wo") is not None  # "a " out, "wo" held
    chunk = assembler.feed(1, b"rld")
    assert chunk is not None and chunk.text == "" and chunk.stop_tokens == 1


def test_text_that_only_looks_like_a_stop_string_is_sent() -> None:
    text, end = run(tokens(b"a wo", b"rm"), stop=("world",))
    assert text == "a worm"
    assert end.finish_reason == FinishReason.LENGTH


def test_end_token_is_not_text_and_not_counted() -> None:
    text, end = run(tokens(b"a", b"b", end=True))
    assert text == "ab" and end.completion_tokens == 2 and end.finish_reason == FinishReason.STOP


def test_max_tokens() -> None:
    text, end = run(tokens(b"a", b"b", b"c"), max_tokens=2)
    assert text == "ab" and end.completion_tokens == 2 and end.finish_reason == FinishReason.LENGTH
