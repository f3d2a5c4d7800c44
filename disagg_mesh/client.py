"""Sync and asyncio clients of the router, over the generated stubs.

One channel per client, reused for every call. Errors come out as the small set of
exceptions in `errors.py`. `gather` runs several requests at once (the grader's two calls)
and returns their results in order; one failing request does not cancel the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from disagg.v1 import router_pb2, router_pb2_grpc, types_pb2
from disagg_mesh.errors import MeshError, from_rpc_error
from disagg_mesh.metrics import Metrics

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 300.0
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the CA that signed the router's certificate, and for mutual TLS our own."""

    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: Path | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )


@dataclass(frozen=True)
class GenerateCall:
    """One request: a prompt or chat messages (dicts with role and content)."""

    model: str
    prompt: str = ""
    messages: Sequence[dict[str, str]] = ()
    max_tokens: int = 512
    temperature: float | None = None  # None: the server's default (0.8); 0: greedy
    top_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    ignore_eos: bool = False  # end tokens never sampled: the answer runs to max_tokens
    timeout: float | None = None  # seconds; None: the client's
    # How hard a reasoning model (gpt-oss) thinks: "low", "medium" or "high"; None: its default.
    reasoning_effort: str | None = None

    def __post_init__(self) -> None:
        if (self.reasoning_effort or "") not in _EFFORTS:
            raise ValueError(
                f"reasoning_effort must be 'low', 'medium' or 'high', got {self.reasoning_effort!r}"
            )

    def to_proto(self) -> router_pb2.GenerateRequest:
        return router_pb2.GenerateRequest(
            model=self.model,
            prompt=self.prompt,
            messages=[
                types_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in self.messages
            ],
            sampling=types_pb2.SamplingParams(
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                seed=self.seed,
                stop=list(self.stop),
                ignore_eos=self.ignore_eos or None,
            ),
            reasoning_effort=_EFFORTS[self.reasoning_effort or ""],
        )


_EFFORTS = {
    "": types_pb2.REASONING_EFFORT_UNSPECIFIED,
    "low": types_pb2.REASONING_EFFORT_LOW,
    "medium": types_pb2.REASONING_EFFORT_MEDIUM,
    "high": types_pb2.REASONING_EFFORT_HIGH,
}


class Reasoning(str):
    """A piece of the model's reasoning (gpt-oss's analysis channel), apart from the answer:
    what `stream(..., reasoning=True)` yields beside the answer's text."""


@dataclass(frozen=True)
class Result:
    text: str
    metrics: Metrics
    request_id: str = ""
    # The model's reasoning before its answer (gpt-oss); "" for other models.
    reasoning: str = ""


@dataclass
class _Settings:
    address: str
    timeout: float
    tls: TlsFiles | None
    token: str | None
    metadata: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.token:
            self.metadata = (("authorization", f"Bearer {self.token}"),)


def _call(
    model: str | GenerateCall,
    prompt: str,
    kwargs: dict[str, Any],
) -> GenerateCall:
    return (
        model
        if isinstance(model, GenerateCall)
        else GenerateCall(model=model, prompt=prompt, **kwargs)
    )


def _items(reply: router_pb2.GenerateResponse, reasoning: bool) -> list[str | Metrics]:
    if not reply.HasField("delta"):
        return [Metrics.from_summary(reply.summary)]
    thought = [Reasoning(reply.delta.reasoning)] if reasoning and reply.delta.reasoning else []
    if thought and not reply.delta.text:
        return list(thought)
    return [*thought, reply.delta.text]


class _Collector:
    """Builds a Result from a stream's items."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.reasoning: list[str] = []
        self.metrics: Metrics | None = None

    def add(self, item: str | Metrics) -> None:
        if isinstance(item, Metrics):
            self.metrics = item
        elif isinstance(item, Reasoning):
            self.reasoning.append(item)
        else:
            self.parts.append(item)

    def result(self, address: str) -> Result:
        if self.metrics is None:
            raise MeshError(grpc.StatusCode.DATA_LOSS, "stream ended without metrics", address)
        return Result("".join(self.parts), self.metrics, reasoning="".join(self.reasoning))


class AsyncMeshClient:
    """asyncio client. Use `async with AsyncMeshClient(...) as mesh:` or call close()."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        tls: TlsFiles | None = None,
        token: str | None = None,
    ) -> None:
        self._settings = _Settings(address, timeout, tls, token)
        if tls is not None:
            self._channel = grpc.aio.secure_channel(
                address, tls.credentials(), options=CHANNEL_OPTIONS
            )
        else:
            self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub: Any = router_pb2_grpc.RouterServiceStub(self._channel)

    async def __aenter__(self) -> AsyncMeshClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def stream(
        self, model: str | GenerateCall, prompt: str = "", reasoning: bool = False, **kwargs: Any
    ) -> AsyncIterator[str | Metrics]:
        """Text deltas as they arrive, then the Metrics. reasoning: the model's reasoning
        too, as `Reasoning` pieces (a str subclass) before the answer's."""
        call = _call(model, prompt, kwargs)
        s = self._settings
        rpc = self._stub.Generate(
            call.to_proto(), timeout=call.timeout or s.timeout, metadata=s.metadata
        )
        try:
            async for reply in rpc:
                for item in _items(reply, reasoning):
                    yield item
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, s.address) from None
        finally:
            rpc.cancel()

    async def generate(self, model: str | GenerateCall, prompt: str = "", **kwargs: Any) -> Result:
        """The whole text and its metrics."""
        collector = _Collector()
        async for item in self.stream(model, prompt, reasoning=True, **kwargs):
            collector.add(item)
        return collector.result(self._settings.address)

    async def gather(
        self, *calls: GenerateCall, cancel_on_error: bool = False
    ) -> list[Result | MeshError]:
        """Run calls at once; results in order. A failed call's slot holds its MeshError,
        unless cancel_on_error, which cancels the others and raises the first error."""
        if cancel_on_error:
            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(self.generate(c)) for c in calls]
            except BaseExceptionGroup as errors:
                raise errors.exceptions[0] from None
            return [t.result() for t in tasks]
        results = await asyncio.gather(*(self.generate(c) for c in calls), return_exceptions=True)
        out: list[Result | MeshError] = []
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, MeshError):
                raise r
            out.append(r)
        return out

    async def list_models(self) -> list[router_pb2.ModelRoute]:
        s = self._settings
        try:
            reply = await self._stub.ListModels(
                router_pb2.ListModelsRequest(), timeout=10, metadata=s.metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, s.address) from None
        return list(reply.models)


class MeshClient:
    """Blocking client. Use `with MeshClient(...) as mesh:` or call close()."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        tls: TlsFiles | None = None,
        token: str | None = None,
    ) -> None:
        self._settings = _Settings(address, timeout, tls, token)
        if tls is not None:
            self._channel = grpc.secure_channel(address, tls.credentials(), options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub: Any = router_pb2_grpc.RouterServiceStub(self._channel)

    def __enter__(self) -> MeshClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def stream(
        self, model: str | GenerateCall, prompt: str = "", reasoning: bool = False, **kwargs: Any
    ) -> Iterator[str | Metrics]:
        """Text deltas as they arrive, then the Metrics. reasoning: the model's reasoning
        too, as `Reasoning` pieces (a str subclass) before the answer's."""
        call = _call(model, prompt, kwargs)
        s = self._settings
        rpc = self._stub.Generate(
            call.to_proto(), timeout=call.timeout or s.timeout, metadata=s.metadata
        )
        try:
            for reply in rpc:
                yield from _items(reply, reasoning)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, s.address) from None
        finally:
            rpc.cancel()

    def generate(self, model: str | GenerateCall, prompt: str = "", **kwargs: Any) -> Result:
        """The whole text and its metrics."""
        collector = _Collector()
        for item in self.stream(model, prompt, reasoning=True, **kwargs):
            collector.add(item)
        return collector.result(self._settings.address)

    def gather(self, *calls: GenerateCall) -> list[Result | MeshError]:
        """Run calls at once on threads; results in order, a failed call's slot holds its
        MeshError (the others go on)."""

        def one(call: GenerateCall) -> Result | MeshError:
            try:
                return self.generate(call)
            except MeshError as exc:
                return exc

        with ThreadPoolExecutor(max_workers=max(len(calls), 1)) as pool:
            return list(pool.map(one, calls))

    def list_models(self) -> list[router_pb2.ModelRoute]:
        s = self._settings
        try:
            reply = self._stub.ListModels(
                router_pb2.ListModelsRequest(), timeout=10, metadata=s.metadata
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, s.address) from None
        return list(reply.models)
