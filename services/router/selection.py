"""The selection policy: which nodes serve a request, in one place.

- The chain's order (mode chain: as listed; mode auto: disaggregated or decode_only first
  by estimated time to first token, costs.py).
- The attempts of a step: the prefill/decode pair, or each decode node in turn.
- Among a role's nodes: health first (node_health.py), then those with a free slot, those
  that served prompts starting like this one the longest first (their prefix caches likely
  hold it), then the busy ones by load; the topology's order breaks ties, or (a route's
  prefix_placement = "hash") a rank per prompt start, so that at scale new prefixes spread
  over the nodes instead of piling onto the first ones and evicting one another there.
- The decode nodes a prefill node may hand its KV state to, and the one it chose (it knows
  which decode node's prefix cache saves the most; the policy takes its choice when the
  node belongs to the route): only those with a free slot and no more than BALANCE_CALLS
  calls over the least loaded of them (`balanced`).
- Who takes a generation over when its decode node fails mid-answer, and whether a prefill
  node evaluates the delivered tokens for it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

from disagg_mesh.server.common.config.topology import ModelRoute, Node, Step, Topology
from disagg_mesh.server.common.runtime.observability import metrics
from disagg_mesh.server.common.types import DecodeCandidate
from disagg_mesh.server.router.costs import Candidate
from disagg_mesh.server.router.knowledge import Knowledge
from disagg_mesh.server.router.node_health import NodeHealth
from disagg_mesh.server.router.prefixes import TEXT_BLOCK_CHARS
from disagg_mesh.server.router.request import Attempt, Delivered, Request
from disagg_mesh.server.router.summary import RouteMethod

# A decode node with more of this router's calls than the least loaded free one by more
# than this gets no new state while that one has room (`balanced`): what a decode node
# holds of a prompt saves only moving that part of its KV state (milliseconds), while a
# stream more slows the node's other streams (on a CPU in proportion: with both models'
# states on the decode node holding their shared system prompt, AIPerf at 8 at once put
# 37 of 38 requests there, inter-token 196 ms against 64 ms on the other, 2026-11-27).
BALANCE_CALLS = 1


class Selection:
    def __init__(self, topology: Topology, health: NodeHealth, knowledge: Knowledge) -> None:
        self.topology = topology
        self.health = health
        self.knowledge = knowledge

    def nodes(self, names: Sequence[str]) -> list[Node]:
        return [self.topology.node(n) for n in names]

    def order(self, request: Request) -> tuple[list[Step], str]:
        """The steps to try, in order, and why the first: the chain as listed, or (mode
        auto) disaggregated or decode_only first by estimated time to first token."""
        route = request.route
        if route.mode != "auto":
            metrics.route_decision(route.name, route.chain[0], "chain")
            return list(route.chain), f"chain: {route.chain[0]} is the chain's first step"
        prefill = self.ranked(route.prefill, request)[0]
        decode = self.ranked(route.decode, request)[0]
        on_decode = self.candidate(decode, request.blocks)
        if decode.machine != prefill.machine:  # its prompt would slow the streams there
            on_decode.streams = self.health.calls(decode)
        decision = self.knowledge.costs.decide(
            route.name, request.prompt_chars, self.candidate(prefill, request.blocks), on_decode
        )
        metrics.route_decision(route.name, decision.method, decision.basis)
        first: Step = "disaggregated" if decision.method == "disaggregated" else "decode_only"
        return [first, *(s for s in route.chain if s != first)], decision.reason

    def attempts(self, step: Step, request: Request) -> Iterator[Attempt]:
        """The attempts of one step, healthy nodes first (topology validation guarantees
        each step has the nodes it needs)."""
        route = request.route
        if step == "direct_ollama":
            yield Attempt(RouteMethod.DIRECT_OLLAMA)
            return
        decode = self.ranked(route.decode, request)
        if step == "disaggregated":
            prefill = self.ranked(route.prefill, request)
            yield Attempt(
                RouteMethod.DISAGGREGATED,
                prefill_candidates=prefill,
                prefill=prefill[0],
                decode=(self.balanced(decode) or decode)[0],
            )
        else:
            for node in decode:
                yield Attempt(RouteMethod.DECODE_ONLY, decode=node)

    def ranked(self, names: Sequence[str], request: Request) -> list[Node]:
        """These nodes of the request's route in the order they should serve it
        (by_prefix, with the route's prefix_placement)."""
        return self.by_prefix(self.nodes(names), request.blocks, request.route.prefix_placement)

    def by_prefix(
        self, nodes: list[Node], blocks: list[bytes], placement: str = "order"
    ) -> list[Node]:
        """Health first, then among the nodes with a free slot, those that served prompts
        starting like this one the longest first (ties: the topology's order, or with
        prefix_placement = "hash" each prompt start's own order of the nodes), then the
        busy ones by load."""
        picked = self.health.pick(nodes)
        free = [n for n in picked if self.health.has_free_slot(n)]
        busy = [n for n in picked if not self.health.has_free_slot(n)]
        overlap = self.knowledge.text_prefixes.overlap
        if placement == "hash" and blocks:
            free.sort(key=lambda n: (-overlap(n.name, blocks), _rendezvous(blocks[0], n.name)))
        else:
            free.sort(key=lambda n: -overlap(n.name, blocks))
        return free + busy

    def candidate(self, node: Node, blocks: list[bytes], held: int | None = None) -> Candidate:
        """What the estimate needs of a node: the prompt's characters it is believed to
        hold (`held`, else from the prompts it served) and its load."""
        if held is None:
            held = self.knowledge.text_prefixes.overlap(node.name, blocks) * TEXT_BLOCK_CHARS
        return Candidate(node.name, held, self.health.load(node))

    def decode_candidates(self, route: ModelRoute) -> list[DecodeCandidate]:
        """The decode nodes a prefill node may choose from by the prefixes they hold: the
        available ones with a free slot and not busier than the others (`balanced`, in
        order of preference and load, or the least loaded when none is free), each with
        what the router believes it holds."""
        nodes = self.health.pick(self.nodes(route.decode))
        chosen = self.balanced(nodes) or nodes[:1]
        held = self.knowledge.prefixes.held
        return [DecodeCandidate(n.name, frozenset(held(n.name))) for n in chosen]

    def balanced(self, nodes: list[Node]) -> list[Node]:
        """The nodes with a free slot and at most BALANCE_CALLS calls more than the least
        loaded of them, in the given order."""
        free = [n for n in nodes if self.health.has_free_slot(n)]
        least = min((self.health.calls(n) for n in free), default=0)
        return [n for n in free if self.health.calls(n) <= least + BALANCE_CALLS]

    def decode_after_prefill(self, route: ModelRoute, planned: Node, chosen: str) -> Node:
        """The decode node for a prompt a prefill node evaluated: the one it chose among
        `decode_candidates` (its KV state leaves out the prefix that node holds), else the
        one planned."""
        return self.topology.node(chosen) if chosen in route.decode else planned

    def takeover_targets(self, route: ModelRoute, failed: set[str]) -> list[Node | str]:
        """Who can take a generation over: the route's healthy decode nodes (by health and
        load), then its direct_ollama step (named by its URL), leaving out those that failed
        in this request."""
        nodes = self.health.pick(self.nodes(route.decode))
        targets: list[Node | str] = [n for n in nodes if n.name not in failed]
        if "direct_ollama" in route.chain and route.ollama_url not in failed:
            assert route.ollama_url is not None
            targets.append(route.ollama_url)
        return targets

    def resume_via(
        self, request: Request, attempt: Attempt, target: Node, prefilled: str
    ) -> tuple[Node | None, str]:
        """The prefill node that should evaluate the prompt and the delivered tokens for
        `target` (None: target evaluates them itself), and why. A prefill node can when both
        are llama_cpp nodes and every delivered token's id is known; route.migrate_via
        "auto" weighs both ways (costs.py). `prefilled`: the prefill node that evaluated
        this prompt (its prefix cache holds it)."""
        route, sent = request.route, attempt.sent
        if route.migrate_via == "decode":
            return None, "migrate_via = decode"
        if target.engine != "llama_cpp":
            return None, f"{target.name} is an Ollama node: it continues from the text"
        if not _ids_known(sent):
            return None, "the delivered tokens' ids are not known (Ollama streams text)"
        prefills = [
            n
            for n in self.ranked(route.prefill, request)
            if n.engine == "llama_cpp" and self.health.available(n)
        ]
        if not prefills:
            return None, f"{route.name} has no available llama_cpp prefill node"
        via = next((n for n in prefills if n.name == prefilled), prefills[0])
        if route.migrate_via == "prefill":
            return via, "migrate_via = prefill"
        held = request.prompt_chars if via.name == prefilled else None
        decision = self.knowledge.costs.resume(
            route.name,
            request.prompt_chars,
            attempt.summary.prompt_tokens,
            sent.tokens,
            self.candidate(via, request.blocks, held),
            self.candidate(target, request.blocks),
        )
        return (via if decision.via == "prefill" else None), f"auto: {decision.reason}"


def _rendezvous(first_block: bytes, node: str) -> bytes:
    """A node's rank for prompts starting with this block (rendezvous hashing): every router
    ranks the nodes the same way, and different starts spread evenly over them."""
    return hashlib.blake2b(first_block + node.encode(), digest_size=8).digest()


def _ids_known(sent: Delivered) -> bool:
    return sent.ids_complete and bool(sent.token_ids)
