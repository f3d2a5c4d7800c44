"""What a router learns from the traffic it serves, and only from that (per router; rebuilt
after a restart): which prefixes each node holds (token blocks from prefill replies, text
blocks of the prompts it served) and what each way of serving costs (costs.py).

The selection policy reads it; the chain and the migrations write it as requests end."""

from __future__ import annotations

from collections.abc import Sequence

from disagg_mesh.server.common.config.topology import Node
from disagg_mesh.server.common.engines.prefix_keys import PREFIX_BLOCK_TOKENS
from disagg_mesh.server.common.types import DecodeStats, KvTransferKind, PrefillResult
from disagg_mesh.server.router.costs import Costs, Observation
from disagg_mesh.server.router.prefixes import PrefixTable
from disagg_mesh.server.router.request import Attempt, Request
from disagg_mesh.server.router.summary import RouteMethod, RouteSummary


class Knowledge:
    def __init__(self, nodes: Sequence[Node] = ()) -> None:
        # Token block hashes each decode node holds (from prefill replies), and text block
        # hashes of the prompts each node served (any method); no more than its prefix
        # cache holds (a belief beyond that is stale: a delta sent on it comes back ABORTED).
        capacity = {n.name: n.prefix_cache_capacity_tokens // PREFIX_BLOCK_TOKENS for n in nodes}
        self.prefixes = PrefixTable(capacity=capacity)
        self.text_prefixes = PrefixTable()
        self.costs = Costs()

    def served(self, request: Request, attempt: Attempt) -> None:
        """A request ended well: its nodes now hold its prompt's prefix, and its figures say
        what its way of serving costs."""
        s = attempt.summary
        for node in (attempt.prefill, attempt.decode):
            if node is not None and node.name not in attempt.sent.failed_nodes:
                self.text_prefixes.learn(node.name, request.blocks)
        if not s.migrations and attempt.decode is not None:
            self.costs.learn_steps(attempt.decode.name, s.completion_tokens, s.decode_seconds)
        self._learn_costs(request, s)

    def evaluating(self, node: Node, request: Request) -> None:
        """The node is about to evaluate the request's prompt: the next prompt starting the
        same way prefers it (while it has a free slot), and waits there for the shared
        blocks instead of evaluating them on another node as well."""
        self.text_prefixes.learn(node.name, request.blocks)

    def kept(self, decode: Node, result: PrefillResult, stats: DecodeStats) -> None:
        """What a decode node says it keeps of a prompt handed to it."""
        blocks = stats.kept_prefix_tokens // PREFIX_BLOCK_TOKENS
        self.prefixes.learn(decode.name, result.block_hashes[:blocks])

    def forget(self, decode: Node) -> None:
        """What the router believed of the node is stale (it let a prefix go)."""
        self.prefixes.forget(decode.name)

    def replayed(self, via: Node, result: PrefillResult) -> None:
        """A prefill node evaluated a prompt and a migration's delivered tokens."""
        self.costs.learn_steps(via.name, result.replayed_tokens, result.replay_seconds)
        self.costs.learn_prompt(
            via.name,
            result.prompt_tokens - result.cached_prompt_tokens,
            result.prefill_seconds - result.replay_seconds,
        )

    def took_over(self, target: Node, stats: DecodeStats, delivered: int, replayed: int) -> None:
        """A decode node went on with a generation: `replayed` of the `delivered` tokens it
        evaluated itself, after the prompt (0: a prefill node handed their state over)."""
        if replayed:
            uncached = stats.prompt_tokens - stats.cached_prompt_tokens
            self.costs.learn_prompt(target.name, uncached, stats.prompt_eval_seconds)
        generated = stats.completion_tokens - (delivered - replayed)
        self.costs.learn_steps(target.name, generated, stats.decode_seconds)

    def _learn_costs(self, request: Request, s: RouteSummary) -> None:
        """A request served at the first try, without migrating, by the embedded engine's
        KV handoff or on a decode node alone: its figures say what each mode costs."""
        if s.failed_attempts or s.migrations:
            return
        handoff = s.method == RouteMethod.DISAGGREGATED and s.kv_transfer == KvTransferKind.STATE
        if not handoff and s.method != RouteMethod.DECODE_ONLY:
            return
        self.costs.learn(
            request.route.name,
            Observation(
                method=s.method.value,
                prefill_node=s.prefill_node,
                decode_node=s.decode_node,
                prompt_chars=request.prompt_chars,
                prompt_tokens=s.prompt_tokens,
                cached_prompt_tokens=s.cached_prompt_tokens,
                prompt_seconds=s.prefill_seconds,
                handoff_seconds=s.kv_transfer_seconds + s.kv_load_seconds,
                kv_transfer_bytes=s.kv_transfer_bytes,
                kv_state_bytes=s.kv_state_bytes,
                time_to_first_token_seconds=s.time_to_first_token_seconds,
            ),
        )
