"""The embedded engine in this process, with the real model: admission and the bounded queue,
cancellation, a full KV cache, sequence ids out of range, and the KV memory a node may use."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
import pytest_asyncio

from disagg_mesh.server.common.engines.base import Generation, PrefillOutput
from disagg_mesh.server.common.engines.limits import LimitClock
from disagg_mesh.server.common.engines.llama_cpp import EngineSettings, LlamaCppEngine
from disagg_mesh.server.common.engines.llama_cpp.context import (
    ONE_THREAD,
    PAIRED,
    ContextSettings,
    Row,
    SlotContext,
)
from disagg_mesh.server.common.engines.llama_cpp.engine import _Handoff, plan_slots
from disagg_mesh.server.common.engines.llama_cpp.model import LlamaModel, ModelLoadError
from disagg_mesh.server.common.engines.llama_cpp.sampling import SlotSampler
from disagg_mesh.server.common.engines.llama_cpp.step_plan import (
    FIRST_PIECE,
    SlotPhase,
    plan_step,
    prompt_pieces,
)
from disagg_mesh.server.common.errors import DeadlineExceeded, MeshError, ResourceExhausted
from disagg_mesh.server.common.models import resolve_model_path
from disagg_mesh.server.common.types import (
    GenerationEnd,
    KvReference,
    Prompt,
    Sampling,
    StageLimits,
    TextChunk,
)
from tests.conftest import MODEL, ROOT, engine_node, node_refusing_to_start, route, router_node

PATH: Path = resolve_model_path(MODEL, ROOT)
# ignore_eos: the answers run to max_tokens on any CPU (greedy paths differ between them).
LONG = Sampling(max_tokens=400, temperature=0.0, ignore_eos=True)
SHORT = Sampling(max_tokens=4, temperature=0.0, ignore_eos=True)
# SmolLM2-135M: 30 layers x 3 KV heads x (64 + 64) dims x 2 bytes.
BYTES_PER_TOKEN = 23_040


async def open_engine(**settings: object) -> LlamaCppEngine:
    base: dict[str, object] = dict(n_ctx=512, n_threads=1, max_queue=1, slots=2)
    return await LlamaCppEngine.open(
        "test",
        PATH,
        EngineSettings(**{**base, **settings}),  # type: ignore[arg-type]
        model_sha256="0" * 64,
    )


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[LlamaCppEngine]:
    engine = await open_engine()
    yield engine
    await engine.close()


async def drain(generation: Generation) -> tuple[str, GenerationEnd]:
    text, end = "", None
    async for item in generation:
        if isinstance(item, TextChunk):
            text += item.text
        else:
            end = item
    assert end is not None
    return text, end


def source_of(engine: LlamaCppEngine, out: PrefillOutput) -> KvReference:
    """Where a decode engine finds a prefill's state (the state itself given alongside)."""
    return KvReference(
        kv_handle="-",
        first_token_id=out.first_token_id,
        prompt_tokens=out.prompt_tokens,
        fingerprint=engine.fingerprint,
        kv_size_bytes=len(out.kv_state),
        block_hashes=out.block_hashes,
        penalty_token_ids=out.penalty_token_ids,
    )


async def started(generation: Generation) -> Generation:
    """The generation once its first text came: it holds a slot."""
    first = await anext(generation)
    assert isinstance(first, TextChunk)
    return generation


async def test_full_slots_queue_then_refuse_at_once(engine: LlamaCppEngine) -> None:
    count = "Count: 1, 2, 3,"
    loop = asyncio.get_running_loop()
    before, measured_from = engine.load(), loop.time()
    running = [await started(engine.generate(Prompt(count), LONG)) for _ in range(2)]
    both_from = loop.time()
    assert engine.load().slots_busy == 2
    queued = asyncio.create_task(drain(engine.generate(Prompt("Hi"), SHORT)))
    await asyncio.sleep(0.2)
    assert engine.load().queue_depth == 1
    began = loop.time()
    with pytest.raises(ResourceExhausted, match="all 2 slots in use and 1 requests already"):
        await drain(engine.generate(Prompt("Hi"), SHORT))
    assert loop.time() - began < 0.5  # at once, not after a wait
    # A caller going away frees its slot at the next step: the queued request runs.
    both = loop.time() - both_from
    await running[0].aclose()
    _, end = await asyncio.wait_for(queued, 30)
    assert end.completion_tokens == 4
    await running[1].aclose()
    for _ in range(50):
        if engine.load().slots_busy == 0:
            break
        await asyncio.sleep(0.05)
    after = engine.load()
    assert (after.slots_busy, after.queue_depth) == (0, 0)
    # The slots' time, counted as they were taken and given back: both slots in use for at
    # least `both`, never more than 2 at once, nothing counted before or after.
    busy = after.busy_seconds - before.busy_seconds
    slot_busy = after.slot_busy_seconds - before.slot_busy_seconds
    assert both <= busy <= loop.time() - measured_from
    assert 2 * both <= slot_busy <= 2 * busy + 1e-6


async def test_a_generations_own_bounds_count_the_wait_for_a_slot_apart_from_its_work(
    engine: LlamaCppEngine,
) -> None:
    """A decode node's own bounds on a stream (StageLimits): with both slots busy, a stream
    waiting past queue_s is answered busy; one that waits 1.5 s for a slot is then served
    within a work_s of 1 s (the bound starts with its turn); a stream whose own generation
    passes work_s ends with DeadlineExceeded."""
    count = "Count: 1, 2, 3,"
    running = [await started(engine.generate(Prompt(count), LONG)) for _ in range(2)]
    with pytest.raises(ResourceExhausted, match="queue_timeout"):
        await drain(engine.generate(Prompt("Hi"), SHORT, limits=StageLimits(queue_s=0.3)))
    bounded = StageLimits(queue_s=30.0, work_s=1.0)
    waiting = asyncio.create_task(drain(engine.generate(Prompt("Hi"), SHORT, limits=bounded)))
    await asyncio.sleep(1.5)
    await running[0].aclose()
    _, end = await asyncio.wait_for(waiting, 30)
    assert end.completion_tokens == 4
    with pytest.raises(DeadlineExceeded, match="work_timeout"):
        await drain(engine.generate(Prompt(count), LONG, limits=StageLimits(work_s=0.5)))
    await running[1].aclose()


async def test_a_bound_alarm_puts_its_error_once_and_a_replaced_bounds_is_stale() -> None:
    """A stream's bounds as one timer each (BoundAlarm): the wait's bound puts its
    ResourceExhausted among the events when it passes; armed again on admission, the work's
    bound replaces it, the wait's error already queued reads as stale, and the work's
    DeadlineExceeded comes when its own time passes; cancelled, nothing more comes."""
    clock = LimitClock(StageLimits(queue_s=0.05, work_s=0.2), "generation", "decode-x")
    events: list[MeshError] = []
    alarm = clock.alarm(events.append)
    alarm.arm()
    await asyncio.sleep(0.15)
    (waited,) = events
    assert isinstance(waited, ResourceExhausted) and alarm.passed(waited)
    assert not alarm.stale(waited)
    clock.admitted()  # the admission was queued before the wait's error: it wins
    alarm.arm()
    assert alarm.stale(waited) and not alarm.passed(waited)
    assert not alarm.stale(ResourceExhausted("another"))
    await asyncio.sleep(0.1)
    assert len(events) == 1  # the work's bound runs from the admission
    await asyncio.sleep(0.2)
    worked = events[-1]
    assert isinstance(worked, DeadlineExceeded) and "work_timeout" in str(worked)
    assert alarm.passed(worked) and not alarm.stale(worked) and alarm.stale(waited)
    alarm.arm()  # passed: armed again at once
    alarm.cancel()
    await asyncio.sleep(0.05)
    assert len(events) == 2


async def test_a_full_kv_cache_ends_only_the_newest_stream() -> None:
    # Two slots of 512 tokens but only 512 cells in all: two long generations cannot both fit.
    engine = await open_engine(kv_cells=512, max_queue=0)
    try:
        older = await started(engine.generate(Prompt("Count: 1, 2, 3,"), LONG))
        newer = await started(engine.generate(Prompt("List: a, b, c,"), LONG))
        with pytest.raises(ResourceExhausted, match="KV cache full"):
            await drain(newer)
        _, end = await drain(older)
        assert end.completion_tokens > 250  # it went on past the point where the cache filled
        text, end = await drain(engine.generate(Prompt("def add(a, b):"), SHORT))
        assert end.completion_tokens == 4 and text
    finally:
        await engine.close()


async def test_short_prompts_admitted_together_share_a_pass_and_keep_their_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prompts admitted at one step go through llama.cpp in one pass while it stays under
    ALIKE_ROWS rows (one pass each cost ~1.1-1.25x more here), and each gives the tokens it
    gives alone."""
    prompts = ["The capital of France is", "def add(a, b):", "Name a prime:", "SELECT * FROM"]
    engine = await open_engine(slots=5, max_queue=4)
    try:
        alone = [await drain(engine.generate(Prompt(p), SHORT)) for p in prompts]
        passes: list[list[Row]] = []
        real = SlotContext._decode

        def counted(self: SlotContext, rows: list[Row]) -> int:
            passes.append(list(rows))
            return real(self, rows)

        monkeypatch.setattr(SlotContext, "_decode", counted)
        # A stream generating meanwhile: the four arrive during one of its steps and are
        # admitted together at the next (each prompt is under the first piece's 8 tokens,
        # so it is cut as alone: whole).
        running = await started(engine.generate(Prompt("Count: 1, 2, 3,"), LONG))
        together = await asyncio.gather(
            *(drain(engine.generate(Prompt(p), SHORT)) for p in prompts)
        )
        await running.aclose()
    finally:
        await engine.close()
    assert [t for t, _ in together] == [t for t, _ in alone]
    shared = [rows for rows in passes if sum(1 for r in rows if not r.logits) >= 2 * 2]
    slots_per_pass = [len({r.slot for r in rows}) for rows in shared]
    assert max(slots_per_pass, default=0) >= 2, slots_per_pass


async def test_a_steps_tokens_go_to_their_callers_right_before_the_next_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The event loop is woken once a step's rows are all sampled and its bookkeeping done,
    right before the next llama_decode, which leaves the interpreter's lock for the whole
    pass. Woken after the first row, its thread took the lock turn about with the engine's
    for the rest of the step (on an H200, one decode node at 16 streams made 2,500 instead
    of 3,100 tokens/s); woken before the bookkeeping (the KV cells' bound, llama.cpp calls
    that each leave the lock), it took the lock in between (docs/batching.md)."""
    seen: list[str] = []
    decode, pos_max = llama_cpp.llama_decode, llama_cpp.llama_memory_seq_pos_max
    sample, put = SlotSampler.sample, _Handoff.put

    def passed(ctx: object, batch: object) -> int:
        seen.append("pass")
        return int(decode(ctx, batch))

    def asked(memory: object, seq: int) -> int:
        seen.append("call")
        return int(pos_max(memory, seq))

    def sampled(self: SlotSampler, ctx: object, row: int) -> int:
        seen.append("sample")
        return sample(self, ctx, row)

    def handed(self: _Handoff, queue: asyncio.Queue[object], event: object) -> None:
        seen.append("event")
        put(self, queue, event)  # type: ignore[arg-type]

    monkeypatch.setattr(llama_cpp, "llama_decode", passed)
    monkeypatch.setattr(llama_cpp, "llama_memory_seq_pos_max", asked)
    monkeypatch.setattr(SlotSampler, "sample", sampled)
    monkeypatch.setattr(_Handoff, "put", handed)
    engine = await open_engine(slots=4, max_queue=4)
    try:
        count = Sampling(max_tokens=24, temperature=0.0, ignore_eos=True)
        prompts = ["Count: 1, 2, 3,", "def add(a, b):", "Name a prime:", "SELECT * FROM"]
        await asyncio.gather(*(drain(engine.generate(Prompt(p), count)) for p in prompts))
    finally:
        await engine.close()
    # Between two llama.cpp passes: the rows sampled, the bookkeeping, then the events.
    passes = " ".join(seen).split("pass")
    assert sum(p.count("sample") >= 2 for p in passes) >= 20, passes
    assert sum("call" in p for p in passes) >= 20, passes  # the bound is kept here
    assert all("event sample" not in p and "event call" not in p for p in passes), passes


async def test_a_burst_of_long_prompts_is_evaluated_oldest_first_each_as_alone() -> None:
    """Four long prompts at once on a prefill node's four slots: one is evaluated at a time
    (prompts_at_once = 1), the others wait in the queue, so the first is done after about a
    quarter of the burst's prompt work instead of all four at its end; no more than one long
    prompt is ever being evaluated; each state's first token is the one it has alone."""
    fox = "the quick brown fox jumps over the lazy dog "
    prompts = [Prompt(f"Essay {i}: " + fox * 60) for i in range(4)]
    engine = await open_engine(n_ctx=2048, n_threads=2, slots=4, max_queue=4)
    scheduler = engine._scheduler  # the engine thread's own record of its slots
    seen: list[int] = []

    async def watch() -> None:
        while True:
            slots = list(scheduler._slots)
            seen.append(
                sum(1 for s in slots if s and s.phase is SlotPhase.PROMPT and scheduler._long(s))
            )
            await asyncio.sleep(0.002)

    async def timed(prompt: Prompt) -> tuple[float, int]:
        began = time.perf_counter()
        out = await engine.prefill(prompt, SHORT)
        return time.perf_counter() - began, out.first_token_id

    try:
        alone = [(await engine.prefill(p, SHORT)).first_token_id for p in prompts]
        watcher = asyncio.create_task(watch())
        together = await asyncio.gather(*(timed(p) for p in prompts))
        watcher.cancel()
    finally:
        await engine.close()
    done = sorted(took for took, _ in together)
    assert done[0] < 0.5 * done[-1], done  # all at the end: ~1.0; oldest first: ~0.25
    assert max(seen) == 1, seen
    assert [token for _, token in together] == alone


async def test_a_prefills_own_bounds_count_the_wait_for_its_turn_apart_from_its_work() -> None:
    """A prefill node's own bounds on a prompt (StageLimits, as the router sends them): a
    prompt kept waiting behind other callers' long prompts past queue_s is answered busy
    (ResourceExhausted), nothing done for it; the wait does not count against work_s, which
    starts with the prompt's turn (one waiting two prompts long is served within a work_s of
    two); a prompt whose own evaluation passes work_s ends with DeadlineExceeded, its slot
    freed."""
    fox = "the quick brown fox jumps over the lazy dog "
    prompts = [Prompt(f"Essay {i}: " + fox * 60) for i in range(6)]
    engine = await open_engine(n_ctx=2048, n_threads=2, slots=4, max_queue=4)
    scheduler = engine._scheduler

    async def timed(prompt: Prompt, limits: StageLimits | None = None) -> float:
        began = time.perf_counter()
        await engine.prefill(prompt, SHORT, limits=limits)
        return time.perf_counter() - began

    try:
        alone_s = await timed(prompts[0])
        ahead = [asyncio.create_task(timed(p)) for p in prompts[1:3]]
        while not any(scheduler._slots):  # noqa: ASYNC110 (polls the engine thread)
            await asyncio.sleep(0.005)
        began = time.perf_counter()
        with pytest.raises(ResourceExhausted, match=r"waited its 0\.3 s queue_timeout"):
            await engine.prefill(prompts[3], SHORT, limits=StageLimits(queue_s=0.3))
        assert time.perf_counter() - began < 0.3 + alone_s / 2
        took_s = await timed(prompts[4], StageLimits(queue_s=60.0, work_s=2 * alone_s))
        await asyncio.gather(*ahead)
        assert took_s > 2 * alone_s  # waited, then worked: longer than work_s in all
        with pytest.raises(DeadlineExceeded, match="work_timeout"):
            await engine.prefill(prompts[5], SHORT, limits=StageLimits(work_s=alone_s / 4))
        for _ in range(100):
            if engine.load().slots_busy == 0:
                break
            await asyncio.sleep(0.05)
        assert (engine.load().slots_busy, engine.load().queue_depth) == (0, 0)
    finally:
        await engine.close()


async def test_a_finished_prefills_state_takes_a_free_slot_before_a_queued_prompt() -> None:
    """A decode node with one slot, busy: a prompt (decode_only) queues, then a prefill
    node's state. When the slot frees, the state goes first: a finished prefill's decode is
    never starved by new prompts."""
    decode = await open_engine(n_ctx=1024, slots=1, max_queue=2)
    prefill = await open_engine(n_ctx=1024, slots=1)
    try:
        out = await prefill.prefill(Prompt("Name a prime:"), SHORT)
        reference = source_of(decode, out)
        holder = await started(decode.generate(Prompt("Count: 1, 2, 3,"), LONG))
        order: list[str] = []

        async def first_text(name: str, generation: Generation) -> None:
            await anext(generation)
            order.append(name)
            await drain(generation)

        prompt = asyncio.create_task(first_text("prompt", decode.generate(Prompt("Hi"), SHORT)))
        while not decode._scheduler._pending:  # noqa: ASYNC110 (polls the engine thread)
            await asyncio.sleep(0.005)
        state = asyncio.create_task(
            first_text("state", decode.continue_from_state(out.kv_state, reference, SHORT))
        )
        while len(decode._scheduler._pending) < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        await holder.aclose()
        await asyncio.wait_for(asyncio.gather(prompt, state), 60)
    finally:
        await decode.close()
        await prefill.close()
    assert order == ["state", "prompt"]


def test_sequence_ids_are_checked_before_llama_cpp_sees_them() -> None:
    """llama.cpp aborts the whole process on a sequence id at or over n_seq_max."""
    model = LlamaModel(PATH)
    context = SlotContext(
        model, ContextSettings(slots=2, n_ctx=256, n_batch=32, n_ubatch=32, n_threads=1)
    )
    try:
        for bad in (-1, 2, 3, 1000):
            with pytest.raises(ValueError, match=r"outside 0\.\.1"):
                context.park(bad)
            with pytest.raises(ValueError, match=r"neither a slot nor a prefix cache entry"):
                context.export_state(bad)
        assert context.pos_max(1) == -1  # the process is still here
    finally:
        context.close()
        model.close()


def test_token_pieces_and_ends_are_llama_cpps_for_every_token() -> None:
    """LlamaModel keeps each token's bytes once asked for, and knows the end tokens from
    the vocabulary at load (a llama.cpp call each leaves the interpreter's lock in the
    middle of a step): every token of the vocabulary, twice, plain and special, against
    llama.cpp's own answer."""
    model = LlamaModel(PATH)
    vocab = model.vocab
    for special in (False, True):
        for _ in range(2):  # asked, then kept
            for token in range(model.n_vocab):
                piece = bytes(model._model.detokenize([token], special=special))
                assert model.piece(token, special) == piece, (token, special)
    ends = [t for t in range(model.n_vocab) if model.is_end(t)]
    assert ends == [t for t in range(model.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    assert ends  # SmolLM2 has its end tokens (<|endoftext|>, <|im_end|>)
    model.close()


def test_the_cells_bound_counts_every_sequence_holding_cells() -> None:
    """SlotContext asks llama.cpp only about the sequences that may hold cells: after each
    way cells are placed, moved or freed (a pass, a lone row with its scratch company, a
    prefix shared, a state loaded, a slot parked, an entry dropped, the parked cells
    freed), its count equals the count over every sequence."""
    model = LlamaModel(PATH)
    context = SlotContext(
        model,
        ContextSettings(
            slots=2,
            n_ctx=256,
            n_batch=64,
            n_ubatch=64,
            n_threads=1,
            prefix_cache_seqs=2,
            prefix_cache_tokens=256,
        ),
    )
    mem = llama_cpp.llama_get_memory(context.ptr)
    entry = context.cache_seqs[0]

    def every() -> int:
        seqs = range(int(llama_cpp.llama_n_seq_max(context.ptr)))
        return sum(int(llama_cpp.llama_memory_seq_pos_max(mem, s)) + 1 for s in seqs)

    def check(step: str) -> None:
        assert context._held() == every(), step

    try:
        tokens = model.tokenize(Prompt(text="The capital of France is Paris, and"), 256)
        assert context.decode([Row(t, p, 0, True) for p, t in enumerate(tokens)]) == 0
        check("a prompt in slot 0")
        context.copy_prefix(0, entry, len(tokens))
        check("its prefix shared with a cache entry")
        state = context.export_state(0)
        assert context.import_state(1, state) > 0
        check("its state loaded into slot 1")
        assert context.decode([Row(tokens[0], len(tokens), 1, True)]) == 0
        check("a lone row")
        scratch = context._scratch
        company = [Row(tokens[1], len(tokens) + 1, 1, True), Row(tokens[0], 0, scratch, False)]
        assert context._decode(company) == 0
        check("a lone row with the scratch row's company")
        llama_cpp.llama_memory_seq_rm(mem, scratch, -1, -1)
        check("the scratch row removed")
        context.forget_prefix(1, 4)
        check("slot 1 let go of its first positions")
        context.park(0)
        check("slot 0 parked")
        context.drop(entry)
        check("the entry dropped while slot 1 holds cells (parked)")
        context.park(1)
        context.free_parked()
        check("every slot parked, the parked cells freed")
        assert every() == 0
    finally:
        context.close()
        model.close()


def test_greedy_picks_what_llama_cpps_greedy_chain_picks() -> None:
    """SlotSampler's greedy pick (numpy's argmax over the row's logits) against llama.cpp's
    own chain (a -inf logit bias on end tokens for ignore_eos, then its greedy sampler),
    on the same rows: real logits, then the row changed so that an end token and then two
    tokens at once are the most likely."""
    model = LlamaModel(PATH)
    context = SlotContext(
        model, ContextSettings(slots=2, n_ctx=256, n_batch=32, n_ubatch=32, n_threads=1)
    )
    chains = []
    try:
        tokens = model.tokenize(Prompt(text="The capital of France is"), 256)
        rows = [Row(t, p, slot, True) for slot in (0, 1) for p, t in enumerate(tokens)]
        assert context.decode(rows) == 0
        end = model.end_tokens[0]
        for ignore_eos in (False, True):
            sampling = Sampling(max_tokens=1, temperature=0.0, ignore_eos=ignore_eos)
            ours = SlotSampler(sampling, 0, model.end_tokens, model.n_vocab)
            chain = llama_cpp.llama_sampler_chain_init(
                llama_cpp.llama_sampler_chain_default_params()
            )
            chains.append(chain)
            if ignore_eos:
                ends = model.end_tokens
                biases = (llama_cpp.llama_logit_bias * len(ends))(
                    *(llama_cpp.llama_logit_bias(token=t, bias=-math.inf) for t in ends)
                )
                bias = llama_cpp.llama_sampler_init_logit_bias(model.n_vocab, len(ends), biases)
                llama_cpp.llama_sampler_chain_add(chain, bias)
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
            for row in range(len(rows)):
                logits = np.ctypeslib.as_array(
                    llama_cpp.llama_get_logits_ith(context.ptr, row), shape=(model.n_vocab,)
                )
                for case in ("real", "end first", "a tie"):
                    if case == "end first":
                        logits[end] = logits.max() + 1
                    if case == "a tie":
                        logits[[7, 9]] = logits.max() + 2
                    theirs = llama_cpp.llama_sampler_sample(chain, context.ptr, row)
                    assert ours.sample(context.ptr, row) == theirs, (ignore_eos, row, case)
            ours.close()
    finally:
        for chain in chains:
            llama_cpp.llama_sampler_free(chain)
        context.close()
        model.close()


@pytest.mark.parametrize("type_k", ["f16", "q8_0"])
def test_a_lone_row_over_a_wide_view_has_its_numbers_in_company_either_way(type_k: str) -> None:
    """Two threads, a ~700-token stream (its view past 512 cells, where llama.cpp would split
    a lone row's attention between the threads): its lone steps on one thread, and with a
    scratch row of company, give every logit it has beside another stream; the node times
    both ways and takes the faster. With a q8_0 K cache llama.cpp has no split path: the
    lone row runs on both threads as it is, with every logit it has in company."""
    model = LlamaModel(PATH)
    settings = ContextSettings(
        slots=2, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2, type_k=type_k
    )
    tokens = model.tokenize(Prompt(text="Count: 1, 2, 3, 4, 5, 6, 7, 8, 9," * 24), 1024)
    other = model.tokenize(Prompt(text="The capital of France is"), 64)

    def steps(how: str, n: int = 12, tokens: list[int] = tokens) -> list[np.ndarray]:
        context = SlotContext(model, settings)
        try:
            for start in range(0, len(tokens) - 1, 512):
                piece = tokens[start : min(start + 512, len(tokens) - 1)]
                rows = [Row(t, start + p, 0, False) for p, t in enumerate(piece)]
                assert context.decode(rows) == 0
            if how == "company":
                rows = [Row(t, p, 1, False) for p, t in enumerate(other[:-1])]
                assert context.decode(rows) == 0
            elif how == "plain":
                context.lone_rows.way = lambda threads: pytest.fail("a lone row was guarded")  # type: ignore[method-assign]
            elif how != "chosen":
                context.lone_rows.way = lambda threads: how  # type: ignore[method-assign]
            token, out = tokens[-1], []
            for k in range(n):
                rows = [Row(token, len(tokens) - 1 + k, 0, True)]
                if how == "company":
                    rows.append(Row(other[-1], len(other) - 1 + k, 1, True))
                assert context.decode(rows) == 0
                logits = np.ctypeslib.as_array(
                    llama_cpp.llama_get_logits_ith(context.ptr, 0), shape=(model.n_vocab,)
                ).copy()
                out.append(logits)
                token = int(np.argmax(logits))
            if how == "chosen":
                timed = context.lone_rows._seconds
                assert set(timed) == {(2, ONE_THREAD), (2, PAIRED)}, timed
            return out
        finally:
            context.close()

    try:
        company = steps("company")
        for how in (ONE_THREAD, PAIRED, "chosen") if type_k == "f16" else ("plain",):
            lone = steps(how)
            assert all(np.array_equal(a, b) for a, b in zip(company, lone, strict=True)), how
        # A ~150-token stream stays within a 256-cell view (llama.cpp's split path starts at
        # 512): its lone rows need neither way, and have their numbers in company all the same.
        short = tokens[:150]
        company = steps("company", 60, short)
        lone = steps("plain", 60, short)
        assert all(np.array_equal(a, b) for a, b in zip(company, lone, strict=True))
    finally:
        model.close()


def test_slots_follow_the_kv_memory_a_node_may_use() -> None:
    per_slot = 4096 * BYTES_PER_TOKEN
    settings = EngineSettings(n_ctx=4096, n_threads=1, max_queue=16, default_slots=8)
    assert plan_slots(settings, BYTES_PER_TOKEN) == 8
    capped = EngineSettings(**{**settings.__dict__, "kv_cache_max_bytes": 3 * per_slot + 1})
    assert plan_slots(capped, BYTES_PER_TOKEN) == 3
    too_many = EngineSettings(**{**capped.__dict__, "slots": 4})
    with pytest.raises(ModelLoadError, match=r"slots = 4 .* over kv_cache_max_bytes .*room for 3"):
        plan_slots(too_many, BYTES_PER_TOKEN)
    # The prefix cache's tokens come out of the same memory.
    cached = EngineSettings(**{**capped.__dict__, "prefix_cache_tokens": 4096})
    assert plan_slots(cached, BYTES_PER_TOKEN) == 2
    none_fit = EngineSettings(**{**settings.__dict__, "kv_cache_max_bytes": per_slot - 1})
    with pytest.raises(ModelLoadError, match="holds no slot"):
        plan_slots(none_fit, BYTES_PER_TOKEN)


def test_kv_bytes_per_token_from_the_model() -> None:
    model = LlamaModel(PATH)
    try:
        assert model.kv_bytes_per_token() == BYTES_PER_TOKEN
        # q8_0: blocks of 32 values in 34 bytes, so a 64-value head takes 68 bytes.
        assert model.kv_bytes_per_token("q8_0", "q8_0") == 30 * 3 * (68 + 68)
        assert model.placement.backend == "CPU" and model.placement.layers == 31
    finally:
        model.close()


def test_prompt_share_keeps_a_step_within_the_slowdown() -> None:
    # Nothing timed yet: a first piece of 8 tokens each (fewer if the prompt is shorter).
    assert prompt_pieces([100, 3], [None, None], None, 2.0, 512) == [FIRST_PIECE, 3]
    # A 30 ms decode pass and max_slowdown 2: 30 ms of prompt work in all. At 5 ms a token
    # for one prompt and 2 ms for the other, an equal 15 ms each: 3 and 7 tokens.
    assert prompt_pieces([100, 100], [0.005, 0.002], 0.030, 2.0, 512) == [3, 7]
    # A short prompt leaves its share to the next one.
    assert prompt_pieces([1, 100], [0.005, 0.005], 0.030, 2.0, 512) == [1, 5]
    # Every prompt moves, however tight; none more than n_batch.
    assert prompt_pieces([50, 50], [1.0, 1.0], 0.030, 2.0, 512) == [1, 1]
    assert prompt_pieces([5000], [1e-6], 0.030, 3.0, 512) == [512]


@dataclass
class PlannedSlot:
    phase: SlotPhase
    order: int
    prompt_tokens_total: int = 0
    evaluated: int = 0
    cached: int = 0
    prompt_token_s: float | None = None


def test_a_step_plan_is_a_function_of_the_slots() -> None:
    gen = PlannedSlot(SlotPhase.GENERATE, order=0)
    replay = PlannedSlot(SlotPhase.REPLAY, order=1)
    # Admitted later but listed first: prompts go oldest first.
    late = PlannedSlot(SlotPhase.PROMPT, order=5, prompt_tokens_total=2000)
    # 100 tokens from the prefix cache: its pieces are cut from there.
    early = PlannedSlot(
        SlotPhase.PROMPT, order=2, prompt_tokens_total=700, cached=100, evaluated=100
    )
    loading = PlannedSlot(SlotPhase.LOAD, order=6)
    # Nothing streams (a replaying prefill streams nothing): whole n_batch pieces, cut on
    # each prompt's own grid, the last one short.
    alone = plan_step([late, replay, early, loading], 512, 0.03, 2.0)
    assert alone.decode == [replay]
    assert alone.prompts == [(early, 612), (late, 512)]
    early.evaluated = 612
    assert plan_step([early], 512, None, 2.0).prompts == [(early, 700)]
    # A stream generates: the prompts share what keeps the step within the slowdown
    # (prompt_pieces: 30 ms; at 5 ms a token, 3 in its half and 3 of the half the new
    # prompt, its cost unknown, leaves past its first piece), and the generating slots all
    # get their token.
    early.evaluated, early.prompt_token_s = 100, 0.005
    shared = plan_step([late, gen, replay, early], 512, 0.03, 2.0)
    assert shared.decode == [gen, replay]
    assert shared.prompts == [(early, 100 + 6), (late, FIRST_PIECE)]
    assert plan_step([loading], 512, 0.03, 2.0) == type(shared)([], [])


def test_a_node_whose_slots_do_not_fit_its_kv_memory_refuses_to_start(tmp_path: Path) -> None:
    topology = tmp_path / "topology.toml"
    topology.write_text(
        router_node()
        + engine_node("decode", "decode", slots=8, kv_cache_max_bytes=200_000_000)
        + route("m", [], ["decode"], chain=["decode_only"])
    )
    said = node_refusing_to_start(topology, "decode")
    assert "slots = 8" in said and "kv_cache_max_bytes = 200000000" in said
    # Each slot holds n_ctx tokens, and so does the prefix cache by default.
    assert "less the prefix cache's" in said and "room for 1 slots" in said
