"""Clients for calls between nodes (router → prefill/decode, decode → prefill).

They speak protobuf on the wire and plain Python to their callers. A failed call becomes an
`UpstreamError` that keeps the gRPC code and says which node answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disagg_mesh.proto.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from disagg_mesh.server.common.errors import UpstreamError
from disagg_mesh.server.common.kv.store import KvChunk
from disagg_mesh.server.common.runtime.observability.logging import outgoing_metadata
from disagg_mesh.server.common.types import (
    Continuation,
    DecodeCandidate,
    DecodeStats,
    KvSource,
    ModelFacts,
    NodeReport,
    PrefillResult,
    Prompt,
    Sampling,
    StageLimits,
    TextChunk,
)
from disagg_mesh.server.common.wire import convert
from disagg_mesh.server.common.wire.convert import host_from_proto
from disagg_mesh.server.common.wire.kv_wire import parse_fetch_kv_response
from disagg_mesh.server.common.wire.mirror import from_proto, to_proto

MAX_MESSAGE_BYTES = 8 * 1024 * 1024
FETCH_KV_METHOD = "/disagg.v1.PrefillService/FetchKv"
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # Reach a node that starts listening (still loading its model, or restarted) within
    # half a second, not after gRPC's back-off (1 s growing to 2 minutes): a channel that
    # failed while the node was not up tries again after 0.1 s, growing to 0.5 s. Calls and
    # health checks share the channel, so the first request after the node came up no
    # longer fails fast on it. A refused connection on a LAN costs next to nothing.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)


def health_channel_options(ping_every_s: float, ping_timeout_s: float) -> tuple[Any, ...]:
    """A channel that only carries a node's grpc.health.v1 Watch stream: HTTP/2 pings every
    `ping_every_s`, the connection dropped (and the stream failed) when one goes unanswered
    for `ping_timeout_s`, which is how a hung node (SIGSTOP, a frozen host) is noticed
    while its stream says nothing. Pings are answered by gRPC's core, never by Python, and
    the nodes accept them this often (runtime/server.py SERVER_OPTIONS)."""
    keepalive = {"grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms"}
    return (
        *(option for option in CHANNEL_OPTIONS if option[0] not in keepalive),
        ("grpc.keepalive_time_ms", max(100, round(1000 * ping_every_s))),
        ("grpc.keepalive_timeout_ms", max(100, round(1000 * ping_timeout_s))),
        # The timeout that ends the connection in gRPC 1.85 (keepalive_timeout_ms alone left
        # a SIGSTOPped node's stream open: its pings waited out the default 60 s).
        ("grpc.http2.ping_timeout_ms", max(100, round(1000 * ping_timeout_s))),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # A connection of its own: gRPC would otherwise share one subchannel (and its
        # pings) between this channel and the calls' channel to the same address.
        ("grpc.use_local_subchannel_pool", 1),
    )


def open_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS,
) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


class ChannelPool:
    """One channel per address, reused for every call; and, apart, one per address for its
    health stream (`watch_channel`), whose pings must not drop the calls' connection."""

    def __init__(self, credentials: grpc.ChannelCredentials | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._watch_channels: dict[str, grpc.aio.Channel] = {}
        self._credentials = credentials

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = open_channel(address, self._credentials)
            self._channels[address] = channel
        return channel

    def watch_channel(
        self, address: str, ping_every_s: float, ping_timeout_s: float
    ) -> grpc.aio.Channel:
        channel = self._watch_channels.get(address)
        if channel is None:
            options = health_channel_options(ping_every_s, ping_timeout_s)
            channel = open_channel(address, self._credentials, options)
            self._watch_channels[address] = channel
        return channel

    async def close(self) -> None:
        for channel in (*self._channels.values(), *self._watch_channels.values()):
            await channel.close()
        self._channels.clear()
        self._watch_channels.clear()


def _fail(role: str, address: str, exc: grpc.aio.AioRpcError) -> NoReturn:
    details = exc.details() or ""
    raise UpstreamError(exc.code(), f"{role} node {address}: {details}", details) from exc


class PrefillClient:
    def __init__(self, pool: ChannelPool, address: str) -> None:
        self.address = address
        channel = pool.get(address)
        self._stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        self._fetch_kv_raw: Any = channel.unary_stream(
            FETCH_KV_METHOD,
            request_serializer=prefill_pb2.FetchKvRequest.SerializeToString,
            response_deserializer=None,
        )

    async def prefill(
        self,
        model: str,
        prompt: Prompt,
        sampling: Sampling,
        timeout_s: float,
        candidates: Sequence[DecodeCandidate] = (),
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> PrefillResult:
        """timeout_s: the call's deadline; limits: the node's own bounds within it."""
        request = prefill_pb2.PrefillRequest(
            model=model,
            sampling=convert.sampling_to_proto(sampling),
            decode_candidates=[
                prefill_pb2.DecodeCandidate(node=c.node, block_hashes=sorted(c.block_hashes))
                for c in candidates
            ],
        )
        convert.prompt_to_proto(prompt, request)
        if continuation is not None:
            request.continuation.CopyFrom(convert.continuation_to_proto(continuation))
        if limits is not None:
            convert.limits_to_proto(limits, request)
        try:
            reply = await self._stub.Prefill(
                request, timeout=timeout_s, metadata=outgoing_metadata()
            )
        except grpc.aio.AioRpcError as exc:
            _fail("prefill", self.address, exc)
        return from_proto(reply, PrefillResult)

    async def fetch_kv(
        self, kv_handle: str, timeout_s: float | None
    ) -> AsyncGenerator[KvChunk, None]:
        # Raw replies, read by kv_wire without copying the KV bytes again.
        call = self._fetch_kv_raw(
            prefill_pb2.FetchKvRequest(kv_handle=kv_handle),
            timeout=timeout_s,
            metadata=outgoing_metadata(),
        )
        try:
            async for raw in call:
                yield parse_fetch_kv_response(raw)
        except grpc.aio.AioRpcError as exc:
            _fail("prefill", self.address, exc)
        finally:
            call.cancel()


class DecodeClient:
    def __init__(self, pool: ChannelPool, address: str) -> None:
        self.address = address
        self._stub = decode_pb2_grpc.DecodeServiceStub(pool.get(address))

    async def generate(
        self,
        model: str,
        source: KvSource | Prompt,
        sampling: Sampling,
        timeout_s: float,
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> AsyncGenerator[TextChunk | DecodeStats, None]:
        """timeout_s: the call's deadline; limits: the node's own bounds within it."""
        request = decode_pb2.DecodeServiceGenerateRequest(
            model=model, sampling=convert.sampling_to_proto(sampling)
        )
        if continuation is not None:
            request.continuation.CopyFrom(convert.continuation_to_proto(continuation))
        if limits is not None:
            convert.limits_to_proto(limits, request)
        if isinstance(source, KvSource):
            request.kv.CopyFrom(to_proto(source))
        else:
            convert.prompt_to_proto(source, request)
        call = self._stub.Generate(request, timeout=timeout_s, metadata=outgoing_metadata())
        try:
            async for reply in call:
                if reply.HasField("delta"):
                    yield convert.text_chunk_from_proto(reply.delta)
                else:
                    yield convert.decode_stats_from_proto(reply.summary)
        except grpc.aio.AioRpcError as exc:
            _fail("decode", self.address, exc)
        finally:
            call.cancel()


@dataclass(frozen=True)
class EngineInfo:
    """What a prefill or decode node says of its engine that the router keeps: the slots it
    serves at once, what its model is, and the share of the model's layers on a GPU."""

    slots: int = 0
    facts: ModelFacts = field(default_factory=ModelFacts)
    gpu_share: float = 0.0


async def _node_info(channel: grpc.aio.Channel, timeout_s: float) -> Any | None:
    """The node's GetNodeInfoResponse; None if it does not answer."""
    stub: Any = node_pb2_grpc.NodeServiceStub(channel)
    try:
        return await stub.GetNodeInfo(
            node_pb2.GetNodeInfoRequest(), timeout=timeout_s, metadata=outgoing_metadata()
        )
    except grpc.aio.AioRpcError:
        return None


async def node_engine(channel: grpc.aio.Channel, timeout_s: float) -> EngineInfo:
    """The node's EngineInfo (GetNodeInfo); an empty one if it cannot say."""
    info = await _node_info(channel, timeout_s)
    if info is None:
        return EngineInfo()
    return EngineInfo(
        slots=int(info.slots),
        facts=from_proto(info.model_facts, ModelFacts),
        gpu_share=info.gpu_layers / info.model_layers if info.model_layers else 0.0,
    )


async def node_report(channel: grpc.aio.Channel, timeout_s: float) -> NodeReport | None:
    """What a node says of itself (GetNodeInfo) in plain values; None if it does not answer."""
    info = await _node_info(channel, timeout_s)
    if info is None:
        return None
    return NodeReport(
        name=info.name,
        role=info.role,
        engine=info.engine,
        engine_model=info.engine_model,
        backend=info.backend,
        gpu_layers=info.gpu_layers,
        model_layers=info.model_layers,
        ready=info.ready,
        problem=info.problem,
        slots=info.slots,
        slots_busy=info.slots_busy,
        queue_depth=info.queue_depth,
        restarts=info.restarts,
        uptime_seconds=info.uptime_seconds,
        host=host_from_proto(info.host) if info.HasField("host") else None,
    )


async def health_status(channel: grpc.aio.Channel, timeout_s: float) -> tuple[str, str]:
    """(status, detail) of a node's overall grpc.health.v1 check: "SERVING" or
    "NOT_SERVING", or the gRPC code of a failed check with its message."""
    stub: Any = health_pb2_grpc.HealthStub(channel)  # the stubs type it for sync channels
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or ""
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)), ""


async def health_changes(channel: grpc.aio.Channel, first_within_s: float) -> AsyncIterator[str]:
    """A node's overall grpc.health.v1 status each time it changes ("SERVING",
    "NOT_SERVING"; the first at once), from its Watch stream. Ends when the stream does:
    the node went away or stopped (its last word NOT_SERVING), its connection dropped (an
    unanswered ping), or it sent nothing within `first_within_s` of the call (a node not
    up, or hung)."""
    stub: Any = health_pb2_grpc.HealthStub(channel)
    call = stub.Watch(health_pb2.HealthCheckRequest())
    try:
        reply = await asyncio.wait_for(call.read(), first_within_s)
        while reply is not grpc.aio.EOF:
            yield str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            reply = await call.read()
    except (grpc.aio.AioRpcError, TimeoutError):
        return
    finally:
        call.cancel()
