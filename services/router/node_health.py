"""What the router knows about its nodes: health (active checks and passive cool-down) and
load.

Every node's `grpc.health.v1` is watched in the background (a Watch stream on a channel that
pings the node: a change or a hang is seen within about a second, an idle node costs
nothing); a node whose call failed is skipped for a cool-down. A dead node thus costs at
most one failed attempt, not one per request. When every candidate looks down, they are
tried anyway (health can lag).

Load: the router counts the calls it has in flight on each node, and learns each node's
slots (GetNodeInfo) with the health checks. Among the available nodes, those with a free
slot go first, in the topology's order of preference, then the busy ones, least loaded
first: a request no longer queues behind another on the first node while the next one idles.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import structlog

from disagg_mesh.server.common.config.topology import Node
from disagg_mesh.server.common.errors import ResourceExhausted
from disagg_mesh.server.common.types import ModelFacts
from disagg_mesh.server.common.wire.node_clients import (
    ChannelPool,
    EngineInfo,
    health_changes,
    health_status,
    node_engine,
)
from disagg_mesh.server.router.deaths import Deaths

log = structlog.get_logger("node_health")
CHECK_TIMEOUT_S = 1.0
# A node's running averages of its pace (seconds between its slots freeing, a prefill
# call's time alone): the weight of the newest sample.
DRAIN_WEIGHT = 0.3
# A prefill node's calls at once end within this share of their stage deadline at its pace
# (`_open`): the rest is margin for a slower prompt than the average.
STAGE_SHARE = 0.5
# Callers a node refuses at once (`Overloaded`) in a burst; then one more each time one of
# its slots frees, at its pace (`_may_refuse_at_once`). A caller refused at once is told
# when its turn would fit (retry-after); callers that come back sooner, as a closed-loop
# load tool does the moment its refusal arrives, would make at-once refusals a spin that
# takes the cores from the work: past the burst they wait in turn within their budget.
REFUSALS_AT_ONCE = 32


class Overloaded(ResourceExhausted):
    """Refused at once: the callers already waiting for the node would outlast this one's
    budget (the node's queue drains too slowly for it); retry_after_s says when it may
    not."""


class NodeHealth:
    def __init__(
        self,
        nodes: list[Node],
        pool: ChannelPool,
        every_s: float,
        cooldown_s: float,
        quarantine_s: float = 300.0,
    ) -> None:
        self._nodes = nodes
        self._pool = pool
        self._every_s = every_s
        self._cooldown_s = cooldown_s
        # None: not checked yet (given the benefit of the doubt).
        self._serving: dict[str, bool | None] = {n.name: None for n in nodes}
        self._cool_until: dict[str, float] = {}
        self._in_flight: dict[str, int] = {n.name: 0 for n in nodes}
        # Slots each node reports (0: not known yet).
        self._slots: dict[str, int] = {n.name: 0 for n in nodes}
        # What each node's engine and model are, as it last said (GetNodeInfo).
        self._engines: dict[str, EngineInfo] = {}
        # Which requests each node holds, and the nodes that died holding one.
        self.deaths = Deaths(quarantine_s)
        # Callers waiting for a free slot of each node, oldest first, and the slots freed
        # for the first of them but not taken yet.
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        self._reserved: dict[str, int] = {}
        # How fast each node's queue drains: seconds between its slots freeing while callers
        # wait (a running average), and when the wait for the next one began.
        self._drain_s: dict[str, float] = {}
        self._drain_mark: dict[str, float] = {}
        # Decode nodes: states being made for each (prefill stages under way), and the
        # callers waiting for room to make one (wait_for_room).
        self._promised: dict[str, int] = {}
        self._room_waiting: dict[str, deque[asyncio.Future[None]]] = {}
        # The queue budget of the route that last asked each node for a slot or for room
        # (`_open`: prefill nodes; `_waiting_room`: decode nodes), and its stage deadline
        # (`_open`: prefill nodes).
        self._budget_s: dict[str, float] = {}
        self._stage_s: dict[str, float] = {}
        self._prefill_nodes = {n.name for n in nodes if n.role == "prefill"}
        # How long each prefill node's calls took that had it to themselves (`_open`).
        self._alone_s: dict[str, float] = {}
        # At-once refusals each node may still answer, and when that was counted.
        self._refusals: dict[str, tuple[float, float]] = {}

    def available(self, node: Node) -> bool:
        """Serving (or not checked yet) and not cooling down."""
        return self.serving(node) and self._cool_until.get(node.name, 0.0) <= time.monotonic()

    def serving(self, node: Node) -> bool:
        return self._serving.get(node.name) is not False

    def pick(self, nodes: list[Node]) -> list[Node]:
        """The nodes worth trying, in order: the available ones, those with a free slot first
        (in the given order of preference), then the busy ones, least loaded first; if none
        is available, those only cooling down; if none is serving either (or not known to
        be yet), all of them. What the router knows of health orders and skips, but never
        fails a request untried."""
        available = [n for n in nodes if self.available(n)]
        if available:
            return sorted(available, key=self.load)  # stable: preference breaks ties
        return [n for n in nodes if self.serving(n)] or list(nodes)

    def has_free_slot(self, node: Node) -> bool:
        """As far as the router knows (its own calls in flight, the node's slots)."""
        return self.load(node) == 0.0

    def calls(self, node: Node) -> int:
        """This router's calls on the node, those given a slot and the states being made for
        it."""
        name = node.name
        return (
            self._in_flight.get(name, 0) + self._reserved.get(name, 0) + self._promised.get(name, 0)
        )

    def idle(self, node: Node) -> bool:
        """None of this router's calls on the node, nor callers waiting for it or states
        being made for it."""
        name = node.name
        return not (self.calls(node) or self._waiting.get(name) or self._room_waiting.get(name))

    def load(self, node: Node) -> float:
        """0 while the node has a free slot (or its slots are not known yet), else calls in
        flight per slot."""
        slots = self._slots.get(node.name, 0)
        in_flight = self._in_flight.get(node.name, 0)
        if slots <= 0 or in_flight < self._open(node.name):
            return 0.0
        return in_flight / slots

    def _open(self, name: str) -> int:
        """The calls the router lets a node have at once: its slots; a prefill node's (it
        evaluates long prompts in turn) no more than it finishes at the pace its calls have
        been ending (at least one) within the last caller's queue budget, so a prompt does
        not wait inside the node longer than a request may wait for admission, and within
        STAGE_SHARE of its stage deadline, so a call's stage deadline (the node's work on
        it) is not spent waiting inside the node for the calls before it. Before callers
        have waited for it, the pace is how long its calls took alone; before any call has
        ended, one call (a burst's first prompts would otherwise all be sent at once, and
        the last of them wait out its stage deadline inside a slow node)."""
        slots = self._slots.get(name, 0)
        if name not in self._prefill_nodes or name not in self._budget_s:
            return slots
        drain_s = self._drain_s.get(name) or self._alone_s.get(name)
        if not drain_s:
            return min(slots, 1)
        bound = min(self._budget_s[name], STAGE_SHARE * self._stage_s.get(name, math.inf))
        return max(1, min(slots, int(bound / drain_s)))

    async def free_slot(
        self,
        node: Node,
        budget_s: float,
        and_serve: bool = False,
        refuse_early: bool = True,
        queue_budget_s: float | None = None,
        stage_s: float | None = None,
    ) -> None:
        """Wait until the node has a slot free of this router's calls, in turn with the
        other callers waiting for it (oldest first). Slots not known yet: no wait.
        ResourceExhausted after budget_s (the node is busy, not failing), or at once
        (`Overloaded`, unless not refuse_early, and within REFUSALS_AT_ONCE) when the
        callers ahead would take longer than budget_s at the rate the node's slots have
        been freeing. The slot is the caller's when its busy() begins, at once after this.
        and_serve: budget_s must cover the call too (a caller's deadline), taken as long as
        the node's calls last lately (slots x that rate). queue_budget_s, stage_s: the
        request's route's queue budget and the node's stage deadline (`_open`)."""
        if queue_budget_s is not None:
            self._budget_s[node.name] = queue_budget_s
        if stage_s is not None:
            self._stage_s[node.name] = stage_s
        slots = self._slots.get(node.name, 0)
        waiting = self._waiting.setdefault(node.name, deque())
        taken = self._in_flight.get(node.name, 0) + self._reserved.get(node.name, 0)
        if slots <= 0 or (taken < self._open(node.name) and not waiting):
            return
        expected_s = self.expected_wait(node)
        if expected_s is not None and and_serve:
            expected_s += slots * self._drain_s[node.name]
        if (
            expected_s is not None
            and expected_s > budget_s
            and (and_serve or (refuse_early and self._may_refuse_at_once(node.name)))
        ):
            why = "the caller's deadline" if and_serve else "the request's queue_budget_s left"
            raise Overloaded(
                f"node {node.name} is over-full: {len(waiting)} calls already wait for its "
                f"{slots} slots, which free every {self._drain_s[node.name]:.2f} s lately: "
                f"about {expected_s:.1f} s{' and the call' if and_serve else ''}, over this "
                f"call's {budget_s:.1f} s ({why}); try later or add nodes",
                retry_after_s=expected_s - budget_s,
            )
        self._drain_mark.setdefault(node.name, time.monotonic())

        def pass_on() -> None:
            self._reserved[node.name] -= 1
            self._wake(node.name)

        if not await _turn(waiting, budget_s, pass_on):
            raise ResourceExhausted(
                f"node {node.name}: all {slots} slots busy with this router's calls for "
                f"{budget_s:g} s (the request's queue_budget_s left); try later or add slots"
            )
        self._reserved[node.name] -= 1  # busy() takes it now

    def _may_refuse_at_once(self, name: str) -> bool:
        """Whether the node may refuse one more caller at once (REFUSALS_AT_ONCE, then one
        for each of its slots freed since, at its pace: measured, or nobody is refused at
        once); counts it if so."""
        now = time.monotonic()
        left, at = self._refusals.get(name, (float(REFUSALS_AT_ONCE), now))
        left = min(float(REFUSALS_AT_ONCE), left + (now - at) / self._drain_s[name])
        if left < 1.0:
            self._refusals[name] = (left, now)
            return False
        self._refusals[name] = (left - 1.0, now)
        return True

    async def answers(self, node: Node) -> bool:
        """Whether the node answers a health check within CHECK_TIMEOUT_S (a hung one does
        not; one that is down or stopping answers, or its calls fail, at once)."""
        status, _ = await health_status(self._pool.get(node.address), CHECK_TIMEOUT_S)
        return status != "DEADLINE_EXCEEDED"

    def ahead_s(self, node: Node) -> float:
        """Seconds this router's own calls on the node keep a new one waiting inside it: its
        calls in flight at the node's pace (0 with none, or none measured yet)."""
        name = node.name
        pace = self._drain_s.get(name) or self._alone_s.get(name) or 0.0
        return self._in_flight.get(name, 0) * pace

    def expected_wait(self, node: Node) -> float | None:
        """Seconds a caller joining the node's queue now would wait for a slot: a slot for
        each caller ahead and one for it, at the rate they have been freeing (None: not
        measured yet)."""
        drain_s = self._drain_s.get(node.name)
        if drain_s is None:
            return None
        waiting = self._waiting.get(node.name, ())
        since = time.monotonic() - self._drain_mark.get(node.name, time.monotonic())
        return max(0.0, (len(waiting) + 1) * drain_s - since)

    def _freed(self, name: str) -> None:
        """A call on the node ended: while callers wait (for a slot or room), time how long
        the slot took to free (since the last one did, or since they were all taken)."""
        now = time.monotonic()
        mark = self._drain_mark.pop(name, None)
        if not (self._waiting.get(name) or self._room_waiting.get(name)):
            return
        _average(self._drain_s, name, now - (mark or now))
        self._drain_mark[name] = now

    def _wake(self, name: str, every: bool = False) -> None:
        """Give a freed slot to the oldest caller waiting for one (every: let every caller
        go, the node's slots being unknown now)."""
        waiting = self._waiting.get(name, deque())
        open_ = self._open(name)
        while waiting and (
            every or self._in_flight.get(name, 0) + self._reserved.get(name, 0) < open_
        ):
            turn = waiting.popleft()
            self._reserved[name] = self._reserved.get(name, 0) + 1
            turn.set_result(None)

    async def wait_for_room(self, node: Node, budget_s: float, queue_budget_s: float) -> None:
        """Room on a decode node for one more state, the caller's until leave_room (held
        while the state is made: the prefill stage): the node's calls, the callers waiting
        for its slots and the states being made for it stay under its slots and as many
        more as its slots free within the route's queue_budget_s at their pace (at most
        twice its slots; `_waiting_room`). So no more states are made than its streams take
        in about one round, nor than would wait for a slot longer than a request may wait
        for admission (more would wait, hold the prefill nodes' KV memory and expire, or
        overflow its queue: work thrown away, or first tokens late). Waits in turn;
        ResourceExhausted after budget_s. Slots not known: no wait."""
        name = node.name
        self._budget_s[name] = queue_budget_s
        waiting = self._room_waiting.setdefault(name, deque())
        if not waiting and self._has_room(name):
            self._promised[name] = self._promised.get(name, 0) + 1
            return
        self._drain_mark.setdefault(name, time.monotonic())

        def pass_on() -> None:
            self.leave_room(node)

        if not await _turn(waiting, budget_s, pass_on):
            raise ResourceExhausted(
                f"decode node {name}: its {self._slots.get(name, 0)} slots, and the states "
                f"that may wait for them, taken by this router's calls for {budget_s:g} s "
                "(the request's queue_budget_s left); try later or add decode nodes"
            )

    def leave_room(self, node: Node) -> None:
        self._promised[node.name] -= 1
        self._wake_room(node.name)

    def _has_room(self, name: str) -> bool:
        slots = self._slots.get(name, 0)
        used = (
            self._in_flight.get(name, 0)
            + self._reserved.get(name, 0)
            + len(self._waiting.get(name, ()))
            + self._promised.get(name, 0)
        )
        return slots <= 0 or used < slots + self._waiting_room(name, slots)

    def _waiting_room(self, name: str, slots: int) -> int:
        """How many calls beyond its slots a decode node takes (wait_for_room): as many as
        its slots free within the queue budget, at most its slots. Before a slot has freed
        while they were all taken, the time they have been taken stands for the pace."""
        drain_s = self._drain_s.get(name)
        mark = self._drain_mark.get(name)
        if drain_s is None and mark is not None:
            drain_s = time.monotonic() - mark
        if not drain_s:
            return slots
        return min(slots, int(self._budget_s.get(name, 0.0) / drain_s))

    def _wake_room(self, name: str) -> None:
        waiting = self._room_waiting.get(name, deque())
        while waiting and self._has_room(name):
            turn = waiting.popleft()
            self._promised[name] = self._promised.get(name, 0) + 1
            turn.set_result(None)

    @contextmanager
    def busy(self, node: Node, request_id: int = 0) -> Iterator[None]:
        """Count a call on the node while it lasts (for the request `request_id`); the one
        that takes its last free slot starts the clock of how fast its slots free
        (`_freed`, `_waiting_room`)."""
        name = node.name
        self._in_flight[name] = self._in_flight.get(name, 0) + 1
        began, alone = time.monotonic(), self._in_flight[name] == 1
        if 0 < self._open(name) <= self._in_flight[name]:
            self._drain_mark.setdefault(name, began)
        try:
            with self.deaths.holding(name, request_id):
                yield
            if alone and name in self._prefill_nodes:  # its own time: a prompt's pace
                _average(self._alone_s, name, time.monotonic() - began)
        finally:
            self._in_flight[name] -= 1
            self._freed(name)
            self._wake(name)
            self._wake_room(name)

    def failed(self, node: Node) -> None:
        self._cool_until[node.name] = time.monotonic() + self._cooldown_s
        log.warning("node cooling down", node=node.name, cooldown_s=self._cooldown_s)

    def succeeded(self, node: Node) -> None:
        self._cool_until.pop(node.name, None)

    async def watch(self) -> None:
        """Follow every node's health forever (run as a task)."""
        await asyncio.gather(*(self._follow_always(node) for node in self._nodes))

    async def _follow_always(self, node: Node) -> None:
        """_follow, begun again after anything it did not expect (logged), so no node's
        health freezes."""
        while True:
            try:
                await self._follow(node)
            except Exception:
                log.exception("following a node's health failed", node=node.name)
                await asyncio.sleep(self._every_s)

    async def _follow(self, node: Node) -> None:
        """The node's grpc.health.v1 Watch stream, on a channel of its own that pings the
        node every `every_s`: a change arrives as it happens, and a quiet node costs this
        router nothing (polling 200 nodes every second cost more CPU than the requests).
        When the stream ends (the node died, stopped, or left a ping unanswered for
        CHECK_TIMEOUT_S: hung), one Check says what it is; while it is not serving, it is
        tried again every `every_s`."""
        channel = self._pool.watch_channel(node.address, self._every_s, CHECK_TIMEOUT_S)
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            last = ""
            async for status in health_changes(channel, CHECK_TIMEOUT_S):
                if status == last == "SERVING":  # said again: what it says of itself changed
                    await self._learn(node, again=True)
                else:
                    await self._saw(node, status == "SERVING")
                last = status
            status, _ = await health_status(channel, CHECK_TIMEOUT_S)
            await self._saw(node, status == "SERVING")
            # Not sooner than every_s after the last stream began (a node that serves but
            # keeps ending its streams, or has no Watch, is polled, never spun on).
            if status != "SERVING":
                await asyncio.sleep(self._every_s)
            else:
                await asyncio.sleep(max(started + self._every_s - loop.time(), 0.0))

    def engine(self, name: str) -> EngineInfo | None:
        """What the node said of its engine and model when it last came up; None if it has
        not."""
        return self._engines.get(name)

    async def _saw(self, node: Node, serving: bool) -> None:
        if not serving:
            self._slots[node.name] = 0  # it may come back with other settings
            self._wake(node.name, every=True)  # their calls fail at once and move on
            self._wake_room(node.name)
        elif not self._slots.get(node.name):
            # The calls' own channel may still be waiting out a reconnect back-off (the
            # node was away): have it connect before the node is chosen again.
            with suppress(TimeoutError):
                await asyncio.wait_for(
                    self._pool.get(node.address).channel_ready(), CHECK_TIMEOUT_S
                )
            await self._learn(node)
            self._wake(node.name)
            self._wake_room(node.name)
        if serving != self._serving[node.name]:
            log.info("node health", node=node.name, serving=serving)
            self._serving[node.name] = serving

    async def _learn(self, node: Node, again: bool = False) -> None:
        """Read what the node says of its engine and model (GetNodeInfo): when it turns
        serving, and `again` when its health says SERVING twice (its Ollama's model was
        pulled again with another template, say)."""
        engine = await node_engine(self._pool.get(node.address), CHECK_TIMEOUT_S)
        if not again or engine.slots:  # again, one that could not say keeps its slots
            self._slots[node.name] = engine.slots
        if engine.facts != ModelFacts():  # one that could not say keeps what it said
            if again and self._engines.get(node.name, EngineInfo()).facts != engine.facts:
                log.info("node model facts changed", node=node.name)
            self._engines[node.name] = engine


def _average(averages: dict[str, float], name: str, sample: float) -> None:
    """Fold a node's new sample into its running average (DRAIN_WEIGHT: the newest's)."""
    last = averages.get(name)
    averages[name] = sample if last is None else last + DRAIN_WEIGHT * (sample - last)


async def _turn(
    waiting: deque[asyncio.Future[None]], budget_s: float, pass_on: Callable[[], None]
) -> bool:
    """Wait in line for a turn (set by whoever frees one); False after budget_s. A caller
    cancelled or out of time just as its turn came passes the turn on."""
    turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting.append(turn)
    try:
        await asyncio.wait_for(asyncio.shield(turn), budget_s)
    except (TimeoutError, asyncio.CancelledError) as exc:
        if turn.done():
            pass_on()
        else:
            waiting.remove(turn)
        if isinstance(exc, asyncio.CancelledError):
            raise
        return False
    return True
