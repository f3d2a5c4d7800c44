"""Response formats' grammars as llama.cpp's grammar samplers, parsed once per format, off
the engine thread and on a large stack (structured/offload.py), within the schema limits'
time budget. A slot samples with a clone of the parsed one: the step loop never parses a
grammar, so a request with a large one does not stall the streams beside it, and a grammar
deep enough to overflow a thread's stack is refused by llama.cpp instead of killing the
process."""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from typing import Any

import llama_cpp

from disagg_mesh.server.common.config.topology import SchemaLimits
from disagg_mesh.server.common.engines.llama_cpp.harmony import (
    HARMONY_ROOT,
    HarmonyTokens,
    harmony_call_rules,
    harmony_rules,
)
from disagg_mesh.server.common.errors import InvalidArgument
from disagg_mesh.server.common.structured.gbnf import literal
from disagg_mesh.server.common.structured.offload import OverBudget, off_loop
from disagg_mesh.server.common.structured.response_format import DEFAULT_LIMITS, FIELD, grammar
from disagg_mesh.server.common.tools import qwen3_coder
from disagg_mesh.server.common.tools.calls import Tool
from disagg_mesh.server.common.types import ResponseFormat

TOOLS_FIELD = "tools"
# Parsed grammars kept per engine (the most recently used formats).
CACHED = 32


class Grammar:
    """A parsed grammar sampler, never sampled with itself: each slot takes a clone. Freed
    when the last holder lets it go (the cache, or a job that has not started yet)."""

    def __init__(self, sampler: Any) -> None:
        self._sampler = sampler
        weakref.finalize(self, llama_cpp.llama_sampler_free, sampler).atexit = False

    def clone(self) -> Any:
        return llama_cpp.llama_sampler_clone(self._sampler)


def parse(
    fmt: ResponseFormat,
    vocab: Any,
    harmony: HarmonyTokens | None,
    limits: SchemaLimits = DEFAULT_LIMITS,
) -> Grammar:
    """The format's grammar, parsed by llama.cpp (on the calling thread: give it a large
    stack); InvalidArgument naming the field when it cannot be enforced."""
    if fmt.calls_format == "harmony":
        if harmony is None:
            raise InvalidArgument("tools", "harmony calls asked of a model without harmony")
        calls = [
            (name, grammar(ResponseFormat(schema), TOOLS_FIELD, limits))
            for name, schema in fmt.calls
        ]
        rules, root = harmony_call_rules(harmony, calls), HARMONY_ROOT
    elif fmt.calls_format == "qwen3_coder":
        tools = [Tool(name, parameters=json.loads(schema)) for name, schema in fmt.calls]
        rules = qwen3_coder.call_rules(
            tools, lambda schema: grammar(ResponseFormat(json.dumps(schema)), TOOLS_FIELD, limits)
        )
        root = "root"
    else:
        rules, root = grammar(fmt, FIELD, limits), "root"
    if fmt.before or fmt.after:
        one = f"{literal(fmt.before)} root {literal(fmt.after)}"
        more = f' ("\\n" {one})*' if fmt.repeated else ""
        rules, root = f"{rules}\nwrapped-root ::= {one}{more}", "wrapped-root"
    if harmony is not None and not fmt.calls:
        # gpt-oss: the grammar constrains the final channel only
        rules, root = rules + "\n" + harmony_rules(harmony), HARMONY_ROOT
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, rules.encode(), root.encode())
    if not sampler:
        raise InvalidArgument(
            "sampling.response_format",
            "llama.cpp could not parse its grammar (its log says why: most often a "
            "repetition over its limit of 2,000)",
        )
    return Grammar(sampler)


class Grammars:
    """An engine's parsed grammars, by response format."""

    def __init__(
        self, vocab: Any, harmony: HarmonyTokens | None, limits: SchemaLimits = DEFAULT_LIMITS
    ) -> None:
        self._vocab = vocab
        self._harmony = harmony
        self._limits = limits
        self._cache: OrderedDict[ResponseFormat, Grammar] = OrderedDict()

    async def get(self, fmt: ResponseFormat | None) -> Grammar | None:
        """The format's parsed grammar (None without a format), parsed off the event loop;
        InvalidArgument when it cannot be enforced or parsing runs over the budget."""
        if fmt is None:
            return None
        found = self._cache.get(fmt)
        if found is not None:
            self._cache.move_to_end(fmt)
            return found
        limits = self._limits
        try:
            parsed = await off_loop(
                lambda: parse(fmt, self._vocab, self._harmony, limits), limits.check_budget_s
            )
        except OverBudget as exc:
            raise InvalidArgument(FIELD, f"parsing its grammar {exc}") from None
        self._cache[fmt] = parsed
        while len(self._cache) > CACHED:
            self._cache.popitem(last=False)
        return parsed
