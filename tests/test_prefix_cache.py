"""The prefix cache: grader-shaped prompts (one long rubric, many submissions) evaluate the
rubric once; texts equal one process that evaluated each prompt in the same pieces; the
token budget evicts the least recently used prefix; the summary says what was cached."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import llama_cpp
import pytest
import pytest_asyncio

from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc
from disagg_mesh.server.common.engines.llama_cpp import EngineSettings, LlamaCppEngine
from disagg_mesh.server.common.engines.llama_cpp.prefix_cache import Entry, PrefixCache
from disagg_mesh.server.common.engines.prefix_keys import block_hashes
from disagg_mesh.server.common.types import DecodeCandidate, GenerationEnd, Prompt, Sampling
from tests.streams import collect, request
from tests.test_engine import PATH, drain, open_engine, source_of

RUBRIC = (
    "You grade Python homework. Rubric: correctness 40 points (every test passes, edge "
    "cases such as empty input and negative numbers handled), style 20 points (PEP 8, clear "
    "names, no dead code), tests 20 points (each function has unit tests that cover the edge "
    "cases), documentation 20 points (docstrings say what each function returns and raises). "
) * 13
SUBMISSIONS = [
    f"Submission {i}: def add(a, b):\n    return a {op} b\n\nGrade it and explain in one line."
    for i, op in enumerate(["+", "-", "*", "+ 0 +", "- -", "+ 1 - 1 +"] * 4)
]  # twenty
GREEDY = Sampling(max_tokens=16, temperature=0.0)
BLOCK = 64


async def run(engine: LlamaCppEngine, text: str) -> tuple[str, GenerationEnd]:
    return await drain(engine.generate(Prompt(text=text), GREEDY))


def tokens_of(llm: llama_cpp.Llama, text: str) -> list[int]:
    """The prompt's tokens as the nodes tokenize it (a leading BOS, special tokens read)."""
    return llm.tokenize(text.encode(), add_bos=True, special=True)


class SamePieces:
    """Greedy texts of one process that evaluates each prompt as the engine did: the cached
    positions as part of the prompt that put them in the cache (`first`, in 512-token
    pieces), then the rest of the prompt in 512-token pieces from there. `first` is
    evaluated again only when positions it left are needed again."""

    def __init__(self, llm: llama_cpp.Llama, first: list[int], max_tokens: int = 16) -> None:
        self.llm, self.first, self.max_tokens = llm, first, max_tokens
        self.intact = 0  # positions of `first` the context still holds

    def text(self, tokens: list[int], cached: int) -> str:
        llm = self.llm
        if cached > self.intact:
            llm.reset()  # type: ignore[no-untyped-call]
            llm.eval(self.first)
            self.intact = len(self.first)
        llm.n_tokens = cached  # the next eval drops every cell from here on
        ids: list[int] = []
        for token in llm.generate(tokens[cached:], temp=0.0, reset=False):
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token) or len(ids) >= self.max_tokens:
                break
            ids.append(token)
        self.intact = cached
        return llm.detokenize(ids).decode("utf-8", errors="replace")


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[LlamaCppEngine]:
    engine = await open_engine(n_ctx=2048, n_threads=2, prefix_cache_tokens=2048)
    yield engine
    await engine.close()


async def test_twenty_submissions_evaluate_the_rubric_once_with_same_piece_texts(
    engine: LlamaCppEngine, reference_llm: llama_cpp.Llama
) -> None:
    rubric = tokens_of(reference_llm, RUBRIC)
    assert 1000 <= len(rubric) < 1100
    reference = SamePieces(reference_llm, tokens_of(reference_llm, RUBRIC + SUBMISSIONS[0]))
    for i, submission in enumerate(SUBMISSIONS):
        tokens = tokens_of(reference_llm, RUBRIC + submission)
        text, end = await run(engine, RUBRIC + submission)
        assert end.prompt_tokens == len(tokens)
        if i == 0:
            assert end.cached_prompt_tokens == 0
        else:
            # The rubric's whole blocks (and any of the submission's that match), never the
            # prompt's last token.
            assert end.cached_prompt_tokens >= len(rubric) - len(rubric) % BLOCK - BLOCK
            assert end.cached_prompt_tokens % BLOCK == 0
            assert end.cached_prompt_tokens < len(tokens)
        # Every text equals one process that evaluated the prompt in the same pieces (the
        # cached positions came from the first prompt: every later one shares them).
        assert text == reference.text(tokens, end.cached_prompt_tokens), i
    load = engine.load()
    assert 0 < load.prefix_cache_tokens <= load.prefix_cache_max_tokens == 2048


async def test_the_token_budget_evicts_the_least_recently_used_prefix() -> None:
    engine = await open_engine(n_ctx=1024, n_threads=2, prefix_cache_tokens=2 * 192)
    try:
        # Three different prompts of 3 whole blocks and some: 192 tokens each in the cache.
        a, b, c = (RUBRIC[k * 40 :] for k in range(3))
        prompts = [p[:900] for p in (a, b, c)]
        for prompt in prompts[:2]:
            _, end = await run(engine, prompt)
            assert end.cached_prompt_tokens == 0
        assert engine.load().prefix_cache_tokens == 2 * 192
        _, end = await run(engine, prompts[1])  # b is now the most recently used
        assert end.cached_prompt_tokens == 192
        _, end = await run(engine, prompts[2])  # c pushes out the least recently used: a
        assert end.cached_prompt_tokens == 0
        assert engine.load().prefix_cache_tokens == 2 * 192
        _, end = await run(engine, prompts[0])
        assert end.cached_prompt_tokens == 0  # a was evicted
        _, end = await run(engine, prompts[2])
        assert end.cached_prompt_tokens == 192  # c stayed
    finally:
        await engine.close()


async def test_a_prefix_held_under_another_fingerprint_is_never_used() -> None:
    """Two nodes of one file but other KV settings (here: another model digest): the hashes
    one holds never match the other's prompt, so the whole state moves."""
    prompt = Prompt(text=RUBRIC + SUBMISSIONS[0])
    here = await open_engine(n_ctx=2048, n_threads=2, prefix_cache_tokens=2048)
    other = await LlamaCppEngine.open(
        "other",
        PATH,
        EngineSettings(n_ctx=2048, n_threads=2, max_queue=1, slots=2, prefix_cache_tokens=2048),
        model_sha256="1" * 64,
    )
    try:
        theirs = await other.prefill(prompt, GREEDY)
        held = DecodeCandidate("other-decode", frozenset(theirs.block_hashes))
        ours = await here.prefill(prompt, GREEDY, [held])
        assert len(theirs.block_hashes) == len(ours.block_hashes) > 10
        assert not set(theirs.block_hashes) & set(ours.block_hashes)
        assert ours.kv_prefix_tokens == 0 and ours.kv_prefix_node == ""
        assert len(ours.kv_state) == ours.kv_state_bytes  # the whole state
        # Under its own fingerprint the same blocks do match: only the rest is kept.
        mine = DecodeCandidate("my-decode", frozenset(ours.block_hashes))
        again = await here.prefill(prompt, GREEDY, [held, mine])
        assert again.kv_prefix_node == "my-decode" and again.kv_prefix_tokens >= 1024
        assert len(again.kv_state) < 0.2 * again.kv_state_bytes
    finally:
        await here.close()
        await other.close()


def test_block_hashes_chain_every_token_before_them_and_the_fingerprint() -> None:
    tokens = list(range(200))
    hashes = block_hashes("model-a", tokens, 64)
    assert all(len(h) == 16 for h in hashes)
    assert len(hashes) == 3  # whole blocks only
    assert block_hashes("model-a", tokens[:128], 64) == hashes[:2]
    changed = tokens.copy()
    changed[3] = 999  # a token of the first block changes every hash after it
    assert all(x != y for x, y in zip(block_hashes("model-a", changed, 64), hashes, strict=True))
    assert block_hashes("model-b", tokens, 64)[0] != hashes[0]  # another model: no match


def test_a_lookup_always_leaves_a_token_to_evaluate() -> None:
    class Nothing:
        def copy_prefix(self, source: int, target: int, tokens: int) -> None:
            pass

        def drop(self, seq: int) -> None:
            pass

        def pos_min(self, seq: int) -> int:
            return 0

        def export_state(self, seq: int) -> memoryview:
            return memoryview(b"")

        def import_state(self, seq: int, state: memoryview) -> int:
            return len(state)

    cache = PrefixCache(Nothing(), [10, 11], budget_tokens=1000, block_tokens=4)
    hashes = block_hashes("m", list(range(12)), 4)
    cache.keep(0, hashes[:2])  # 8 tokens
    assert cache.lookup(hashes[:2], 8)[1] == 4  # all 8 cached, but the last is evaluated
    assert cache.lookup(hashes, 12)[1] == 8
    assert cache.lookup(block_hashes("m", [0, 1, 2, 9, 9], 4), 5)[1] == 0  # other tokens
    entry = cache.find(hashes, 8)
    assert entry is not None and cache.find(hashes, 12) is None  # only 2 blocks held
    assert cache.find(hashes, 6) is None  # not whole blocks


def test_a_window_model_uses_an_entry_only_while_its_window_layers_hold_enough() -> None:
    """Sliding-window layers keep a sequence's last positions only (llama.cpp reuses the
    others' cells): an entry serves a prompt from position n only while they still hold
    every position a token at n attends to (n - window + 1 .. n - 1)."""

    class Windowed:
        def __init__(self) -> None:
            self.lowest: dict[int, int] = {}  # sequence -> lowest position its window holds

        def copy_prefix(self, source: int, target: int, tokens: int) -> None:
            self.lowest[target] = self.lowest.get(source, 0)

        def drop(self, seq: int) -> None:
            self.lowest.pop(seq, None)

        def pos_min(self, seq: int) -> int:
            return self.lowest.get(seq, -1)

        def export_state(self, seq: int) -> memoryview:
            raise AssertionError("a window model's entries stay resident")

        def import_state(self, seq: int, state: memoryview) -> int:
            raise AssertionError("a window model's entries stay resident")

    ctx = Windowed()
    cache = PrefixCache(ctx, [10, 11, 12], budget_tokens=1000, block_tokens=4, window=8)
    hashes = block_hashes("m", list(range(40)), 4)
    cache.keep(0, hashes[:6])  # 24 tokens; its window layers hold them all
    (entry,) = cache._entries
    assert cache.lookup(hashes, 40) == (entry, 24)
    ctx.lowest[entry.seq] = 16  # llama.cpp reused the cells of positions 0..15
    assert cache.lookup(hashes, 40) == (entry, 24)  # a token at 24 attends to 17..24
    assert cache.lookup(hashes[:4], 17) == (None, 0)  # one at 16 needs 9..15
    ctx.lowest[entry.seq] = 18
    assert cache.lookup(hashes, 40) == (None, 0)
    ctx.lowest[entry.seq] = -1  # nothing left in the window layers
    assert cache.lookup(hashes, 40) == (None, 0)
    # Kept again, the same blocks get an entry of their own; a shorter entry is not folded
    # into a longer one (the longer one's window is elsewhere), and an entry made from a
    # state whose window starts late (window_from) serves only from there.
    assert cache.keep(0, hashes[:6]) == 24
    assert cache.keep(1, hashes[:8], window_from=28) == 32
    assert len(cache._entries) == 3
    # A token at 32 attends to 25..32, which the 32-token entry does not hold: the new
    # 24-token entry serves.
    assert cache.lookup(hashes, 40) == (cache._entries[1], 24)
    cache._entries[2].window_from = 25
    assert cache.lookup(hashes, 40) == (cache._entries[2], 32)


class Cells:
    """A context whose sequences hold a set of positions each, exported as bytes."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}  # sequence -> positions 0..n-1
        self.refuse = False

    def copy_prefix(self, source: int, target: int, tokens: int) -> None:
        self.held[target] = min(tokens, self.held.get(source, 0))

    def drop(self, seq: int) -> None:
        self.held.pop(seq, None)

    def pos_min(self, seq: int) -> int:
        return 0 if self.held.get(seq) else -1

    def export_state(self, seq: int) -> memoryview:
        return memoryview(self.held[seq].to_bytes(4, "little"))

    def import_state(self, seq: int, state: memoryview) -> int:
        if self.refuse:
            return 0
        self.held[seq] = int.from_bytes(state, "little")
        return len(state)


def resident(entry: Entry) -> bool:
    """Whether the entry's cells are in the context (not kept outside as its bytes)."""
    return entry.stored is None


def test_an_entry_no_slot_shares_leaves_the_context_and_comes_back_when_used() -> None:
    """While a slot shares an entry's cells it stays; once none does, the next work moves it
    out as its state's bytes (its cells freed), and a prompt starting with it loads it back.
    A state llama.cpp refuses to load back (no room) drops the entry: the prompt evaluates
    those tokens itself."""
    ctx = Cells()
    cache = PrefixCache(ctx, [10, 11], budget_tokens=1000, block_tokens=4)
    hashes = block_hashes("m", list(range(12)), 4)
    ctx.held[0] = 12  # slot 0 evaluated 12 tokens
    assert cache.keep(0, hashes[:3]) == 12
    (entry,) = cache._entries
    assert cache.unshared() == []  # slot 0 shares its cells
    cache.release(0)
    assert cache.unshared() == [entry] and cache.unshared(keep=entry) == []
    # A prompt running or starting with half its blocks or more keeps it in: its cells are
    # mostly that prompt's too.
    other = block_hashes("m", [0, 1, 2, 3, 9, 9, 9, 9], 4)
    assert cache.unshared(live=[hashes[:2] + other[2:]]) == []
    assert cache.unshared(live=[other]) == [entry]  # 1 block of 3 in common
    cache.store(cache.unshared())
    assert not resident(entry) and entry.seq not in ctx.held  # its cells are free
    assert cache.stored_tokens == cache.tokens == 12
    assert cache.lookup(hashes, 12) == (entry, 8)  # still held, outside the context
    assert cache.use(entry, 1, 8)
    assert resident(entry) and ctx.held[entry.seq] == 12 and ctx.held[1] == 8
    assert entry.users == {1} and cache.unshared() == []
    cache.release(1)
    assert cache.free_cells()  # a pass without room: out of the context, not dropped
    assert not resident(entry) and cache.lookup(hashes, 12) == (entry, 8)
    assert not cache.free_cells()  # no entry holds cells any more
    # A slot that holds the same blocks (a whole state loaded) shares them with the entry
    # instead of the entry loading its bytes back later.
    ctx.held[2] = 12
    assert cache.keep(2, hashes[:3]) == 12
    assert resident(entry) and entry.users == {2} and ctx.held[entry.seq] == 12
    assert cache.stored_tokens == 0 and len(cache._entries) == 1
    cache.release(2)
    cache.store(cache.unshared())
    ctx.refuse = True
    ctx.held.pop(1)  # slot 1 ended
    assert not cache.use(entry, 1, 8)
    assert cache._entries == [] and cache.tokens == cache.stored_tokens == 0
    assert 1 not in ctx.held
    # A window model's entries never leave: their window layers hold other positions.
    windowed = PrefixCache(Cells(), [10], budget_tokens=1000, block_tokens=4, window=8)
    windowed.keep(0, hashes[:3])
    windowed.release(0)
    assert windowed.unshared() == []


async def test_a_rubric_kept_outside_the_context_comes_back_with_same_piece_texts(
    reference_llm: llama_cpp.Llama,
) -> None:
    """Two rubrics in turn: each prompt's start moves the other rubric's entry out of the
    context (its cells freed) and loads its own back; every text equals one process that
    evaluated the prompt in the same pieces."""

    rubrics = [RUBRIC[:2400], "Grade the essay below for argument and evidence. " * 40]
    engine = await open_engine(n_ctx=2048, n_threads=2, prefix_cache_tokens=2048)
    try:
        cache = engine._scheduler._cache
        assert cache is not None
        for turn in range(4):
            rubric = rubrics[turn % 2]
            prompt = rubric + SUBMISSIONS[turn]
            text, end = await run(engine, prompt)
            tokens = tokens_of(reference_llm, prompt)
            if turn < 2:
                assert end.cached_prompt_tokens == 0
            else:
                assert end.cached_prompt_tokens >= len(tokens_of(reference_llm, rubric)) - 2 * BLOCK
            # Its rubric's entries resident, the other rubric's outside, their cells free.
            first_block = block_hashes(engine._salt, tokens, BLOCK)[0]
            assert {e.hashes[0] == first_block for e in cache._entries} == {True, turn == 0}
            for e in cache._entries:
                assert (e.stored is None) == (e.hashes[0] == first_block)
                held = llama_cpp.llama_memory_seq_pos_max(engine._context._mem, e.seq)
                assert (held == -1) == (e.stored is not None)
            stored = sum(len(e.hashes) * BLOCK for e in cache._entries if e.stored is not None)
            assert engine.load().prefix_cache_stored_tokens == stored > 0 or turn == 0
            first = tokens_of(reference_llm, rubrics[turn % 2] + SUBMISSIONS[turn % 2])
            assert text == SamePieces(reference_llm, first).text(tokens, end.cached_prompt_tokens)
    finally:
        await engine.close()


async def test_an_entry_dropped_while_a_slot_generates_leaves_no_cells_before_its_own(
    reference_llm: llama_cpp.Llama,
) -> None:
    """The token budget drops the first submission's entry when the second's prompt is kept,
    while the second generates. The entry's own cells (its submission's blocks, below the
    second's) are parked, not freed: freed, they would take the second's next tokens ahead
    of its earlier ones, and its text would part from the one it has alone."""

    first = RUBRIC[:2400] + SUBMISSIONS[0] * 6
    second = RUBRIC[:2400] + "Explain what this code does:\nfor i in range(10):\n    print(i * i)"
    first_tokens = tokens_of(reference_llm, first)
    budget = len(first_tokens) // BLOCK * BLOCK + BLOCK  # one submission's blocks
    engine = await open_engine(n_ctx=2048, n_threads=2, prefix_cache_tokens=budget)
    try:
        cache = engine._scheduler._cache
        assert cache is not None
        await run(engine, first)
        (dropped,) = cache._entries
        sampling = Sampling(max_tokens=96, temperature=0.0)
        text, end = await drain(engine.generate(Prompt(text=second), sampling))
        assert end.cached_prompt_tokens >= len(tokens_of(reference_llm, RUBRIC[:2400])) - BLOCK
        assert len(first_tokens) - end.cached_prompt_tokens >= 2 * BLOCK  # its own blocks
        assert dropped not in cache._entries and len(cache._entries) == 1
        same = SamePieces(reference_llm, first_tokens, max_tokens=96)
        assert text == same.text(tokens_of(reference_llm, second), end.cached_prompt_tokens)
    finally:
        await engine.close()


async def test_a_decode_nodes_prefix_kept_outside_comes_back_for_the_delta() -> None:
    """A decode node holds a rubric's blocks from a whole state; another rubric's state
    moves them out of its context; a state of the first rubric that leaves them out (the
    delta) loads them back and answers as a node that kept them in its context all along."""
    other = RUBRIC.replace("Python", "Go").replace("PEP 8", "gofmt")
    prefill = await open_engine(n_ctx=2048, n_threads=2, prefix_cache_tokens=2048)
    decode = await open_engine(n_ctx=2048, n_threads=2, prefix_cache_tokens=2048)
    kept = await open_engine(n_ctx=2048, n_threads=2, prefix_cache_tokens=2048)
    try:
        first = await prefill.prefill(Prompt(text=RUBRIC + SUBMISSIONS[0]), GREEDY)
        second = await prefill.prefill(Prompt(text=other + SUBMISSIONS[1]), GREEDY)
        for engine, outs in ((decode, (first, second)), (kept, (first,))):
            for out in outs:
                await drain(
                    engine.continue_from_state(out.kv_state, source_of(engine, out), GREEDY)
                )
        assert decode.load().prefix_cache_stored_tokens >= 960  # the first rubric's, outside
        assert kept.load().prefix_cache_stored_tokens == 0
        holder = DecodeCandidate("decode", frozenset(first.block_hashes))
        delta = await prefill.prefill(Prompt(text=RUBRIC + SUBMISSIONS[2]), GREEDY, [holder])
        assert delta.kv_prefix_tokens >= 960 and len(delta.kv_state) < 0.2 * delta.kv_state_bytes
        texts = []
        for engine in (decode, kept):
            reference = dataclasses.replace(
                source_of(engine, delta), kv_prefix_tokens=delta.kv_prefix_tokens
            )
            text, end = await drain(engine.continue_from_state(delta.kv_state, reference, GREEDY))
            assert end.cached_prompt_tokens == delta.kv_prefix_tokens
            texts.append(text)
        assert texts[0] == texts[1]
        # The first rubric's entry came back; the other's went out in its turn.
        cache = decode._scheduler._cache
        assert cache is not None
        assert {e.hashes[0] == first.block_hashes[0]: e.stored is None for e in cache._entries} == {
            True: True,
            False: False,
        }
    finally:
        for engine in (prefill, decode, kept):
            await engine.close()


async def test_the_router_summary_says_how_many_prompt_tokens_were_cached(
    router: router_pb2_grpc.RouterServiceAsyncStub,
) -> None:
    model = "qwen3-coder:30b"
    summaries: list[router_pb2.GenerateSummary] = []
    for submission in SUBMISSIONS[:2]:
        got = await collect(router.Generate(request(model, RUBRIC + submission, 4)))
        assert got.summary is not None
        summaries.append(got.summary)
    assert summaries[1].method == router_pb2.ROUTE_METHOD_DISAGGREGATED
    assert summaries[1].route_reason == "chain: disaggregated is the chain's first step"
    assert summaries[1].cached_prompt_tokens >= 832  # on the prefill node
    assert summaries[1].cached_prompt_tokens < summaries[1].prompt_tokens


async def test_a_burst_sharing_a_rubric_evaluates_it_once_with_the_texts_of_one_at_a_time() -> None:
    """Four grader prompts at once on one engine: the first evaluates the rubric, the other
    three wait for its blocks to be cached, then evaluate their submissions only (SGLang's
    in-batch prefix caching). Their texts and prompt tokens evaluated equal those of the same
    prompts one at a time on another engine of the same settings, where the cache serves
    the rubric from the second on; without the wait the burst evaluates it four times."""
    settings: dict[str, object] = dict(n_ctx=2048, n_threads=2, slots=4, prefix_cache_tokens=2048)
    burst_engine = await open_engine(**settings)
    apart_engine = await open_engine(**settings)
    try:
        prompts = [RUBRIC + s for s in SUBMISSIONS[:4]]
        first = asyncio.create_task(run(burst_engine, prompts[0]))
        while not burst_engine.load().slots_busy:  # noqa: ASYNC110 (polls the engine thread)
            await asyncio.sleep(0.01)
        rest = await asyncio.gather(*(run(burst_engine, p) for p in prompts[1:]))
        together = [await first, *rest]
        apart = [await run(apart_engine, p) for p in prompts]
    finally:
        await burst_engine.close()
        await apart_engine.close()
    evaluated = [end.prompt_tokens - end.cached_prompt_tokens for _, end in together]
    assert evaluated == [end.prompt_tokens - end.cached_prompt_tokens for _, end in apart]
    assert sorted(end.cached_prompt_tokens for _, end in together)[0] == 0
    assert sum(1 for _, end in together if end.cached_prompt_tokens >= 960) == 3
    assert [text for text, _ in together] == [text for text, _ in apart]


async def test_a_prompt_cut_short_leaves_its_evaluated_blocks_for_the_retry() -> None:
    """A caller that goes away (cancelled, or its deadline passed) while its prompt is being
    evaluated: the whole blocks evaluated so far stay in the prefix cache, and the same
    prompt sent again starts from them instead of from its first token."""
    engine = await open_engine(n_ctx=4096, n_threads=2, prefix_cache_tokens=4096)
    try:
        prompt = RUBRIC * 3 + SUBMISSIONS[0]
        cut = asyncio.create_task(run(engine, prompt))
        scheduler = engine._scheduler  # the engine thread's own record of the slot

        def evaluated() -> int:
            return max((s.evaluated for s in scheduler._slots if s is not None), default=0)

        while evaluated() < 1024:  # noqa: ASYNC110 (polls the engine thread)
            await asyncio.sleep(0.005)
        cut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cut
        _, end = await run(engine, prompt)
        assert end.cached_prompt_tokens >= 1024
        assert end.cached_prompt_tokens % BLOCK == 0
        assert end.cached_prompt_tokens < end.prompt_tokens
    finally:
        await engine.close()


async def test_a_burst_through_the_router_evaluates_the_rubric_once_on_the_prefill_node(
    router: router_pb2_grpc.RouterServiceAsyncStub,
) -> None:
    """Six grader requests sharing a rubric no node has seen, all at once through the
    router: the prefill node evaluates the rubric for the first only; the other five take it
    from its cache (they waited for it rather than evaluating it beside the first)."""
    rubric = "Fresh rubric for this burst only. " + RUBRIC.replace("Python", "Rust")
    calls = [
        collect(router.Generate(request("gpt-oss:120b", rubric + s, 4))) for s in SUBMISSIONS[:6]
    ]
    got = await asyncio.gather(*calls)
    cached = sorted(g.summary.cached_prompt_tokens for g in got)
    assert cached[0] < BLOCK * 2, cached  # the first evaluated it
    shortest = min(g.summary.prompt_tokens for g in got)
    assert all(c >= shortest - 3 * BLOCK for c in cached[1:]), cached
    assert {g.summary.prefill_node for g in got} == {"prefill-gpt-oss"}
