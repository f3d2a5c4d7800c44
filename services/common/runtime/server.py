"""Running a node: one grpc.aio server with our services, health and reflection.

The skeleton follows vllm's gRPC server: the port opens at once with every service
NOT_SERVING, the model loads on a worker thread, services turn SERVING, and SIGTERM/SIGINT
sets an event on which health goes NOT_SERVING, in-flight calls get a grace period, and the
engine is closed.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from disagg_mesh.server.common.config.topology import Node
from disagg_mesh.server.common.runtime.auth import TokenInterceptor, configured_token
from disagg_mesh.server.common.runtime.grpc_status import RequestScopeInterceptor
from disagg_mesh.server.common.runtime.node_info import SERVICE_NAME as NODE_SERVICE_NAME
from disagg_mesh.server.common.runtime.observability import metrics
from disagg_mesh.server.common.runtime.observability.metrics import serve_metrics
from disagg_mesh.server.common.runtime.processes import restarts
from disagg_mesh.server.common.runtime.readiness import Ready
from disagg_mesh.server.common.runtime.tls import NodeTls
from disagg_mesh.server.common.wire.node_clients import MAX_MESSAGE_BYTES

log = structlog.get_logger("server")

SERVER_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # Routers ping each node's health stream every health_check_every_s, with no data
    # between (wire/node_clients.py health_channel_options): accept that, where
    # gRPC's default would count a strike per ping under 5 minutes and hang up.
    ("grpc.http2.min_ping_interval_without_data_ms", 100),
    ("grpc.http2.max_ping_strikes", 0),
)
GRACE_S = 10.0
HEALTH_PROBE_EVERY_S = 2.0
HEALTH_PROBE_TIMEOUT_S = 5.0


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1's Check and Watch, as grpc_health's own aio servicer serves them,
    with two more things:
    - Watch streams end (NOT_SERVING their last word) once the node shuts down: a
      router's stream never ends by itself, and the server's stop would otherwise wait
      out its whole grace period for them;
    - `say_again` writes every Watch stream its status once more, unchanged: what the
      node says of itself (GetNodeInfo) changed, and a router reads it again (the
      protocol writes on a change; the same status twice is harmless to any watcher).
    No stream holds the lock while it writes, so a slow watcher delays no other."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._said = 0  # how many times say_again was called
        self._changed = asyncio.Condition()
        self._closing = asyncio.Event()

    async def set(self, service: str, status: int) -> None:
        if self._closing.is_set():
            return
        async with self._changed:
            self._status[service] = status
            self._changed.notify_all()

    async def say_again(self) -> None:
        async with self._changed:
            self._said += 1
            self._changed.notify_all()

    async def Check(self, request: Any, context: Any) -> Any:
        metrics.HEALTH_CHECKS.inc()
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: Any) -> None:
        metrics.HEALTH_WATCHERS.inc()
        try:
            await self._watch(request, context)
        finally:
            metrics.HEALTH_WATCHERS.dec()

    async def _watch(self, request: Any, context: Any) -> None:
        watching = asyncio.ensure_future(self._statuses(request.service, context))
        # Once this call is over (the watcher cancelled it, or the server stopped), what the
        # stream's own task ends with is nobody's to hear.
        watching.add_done_callback(retrieved)
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({watching, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            if not watching.done():
                watching.cancel()
        try:
            if not watching.cancelled():
                watching.result()  # it ended by itself: its error, if any
                return
            await context.write(
                health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
            )
        except Exception:
            # A watcher that went away as this node stopped (a router stopping with it)
            # cannot be told: that is no error of the node's.
            if not self._closing.is_set():
                raise
            log.debug("health watcher gone at shutdown")

    async def _statuses(self, service: str, context: Any) -> None:
        """The service's status at once, then each time it changes or is said again."""
        last: tuple[int, int] | None = None
        while True:
            async with self._changed:
                while (now := self._now(service)) == last:
                    await self._changed.wait()
            await context.write(health_pb2.HealthCheckResponse(status=now[0]))
            last = now

    def _now(self, service: str) -> tuple[int, int]:
        unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        return self._status.get(service, unknown), self._said

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good; the Watch streams end."""
        if self._closing.is_set():
            return
        async with self._changed:
            for service in self._status:
                self._status[service] = health_pb2.HealthCheckResponse.NOT_SERVING
            self._changed.notify_all()
        self._closing.set()


def retrieved(task: asyncio.Future[Any]) -> None:
    """Read a task's end (a done callback), so an error it ended with after it was let go
    is not logged as never retrieved."""
    if not task.cancelled():
        task.exception()


class BindError(Exception):
    """The node's address could not be bound."""


# Every node served by this process (several simulated nodes may share one): a signal
# stops them all.
_STOPS: set[asyncio.Event] = set()


def _stop_all() -> None:
    for stop in _STOPS:
        stop.set()


async def serve(
    *,
    bind_address: str,
    service_names: Sequence[str],
    register: Callable[[grpc.aio.Server], None],
    load: Callable[[], Coroutine[Any, Any, None]],
    close: Callable[[], Awaitable[None]],
    problem: Callable[[], Awaitable[str | None]] | None = None,
    says: Callable[[], object] | None = None,
    credentials: grpc.ServerCredentials | None = None,
    metrics_address: tuple[str, int] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT. `register` adds our servicers; `load` readies the node
    (health stays NOT_SERVING until it returns); `problem`, polled every few seconds once
    loaded, turns health NOT_SERVING while it returns a reason (e.g. Ollama down); when
    `says` (what GetNodeInfo tells a router once) gives another value after a poll while
    serving, health says SERVING again for routers to read it again; `close` runs after
    the server stopped."""
    interceptors: list[grpc.aio.ServerInterceptor] = [RequestScopeInterceptor()]
    token = configured_token()
    if token is not None:
        interceptors.insert(0, TokenInterceptor(token))  # refused calls go no further
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    register(server)
    reflection.enable_server_reflection(
        (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        if credentials is None:
            server.add_insecure_port(bind_address)
        else:
            server.add_secure_port(bind_address, credentials)
    except RuntimeError as exc:
        raise BindError(f"cannot listen on {bind_address}: {exc}") from None
    await server.start()
    if metrics_address is not None:
        serve_metrics(*metrics_address, restarts())
        log.info("metrics", url=f"http://{metrics_address[0]}:{metrics_address[1]}/metrics")

    stop = asyncio.Event()
    _STOPS.add(stop)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _stop_all)
    log.info("listening", address=bind_address, status="NOT_SERVING")

    started = time.perf_counter()
    loading = asyncio.create_task(load())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done():
        if loading.exception() is not None:  # a failed load ends the process with its error
            stopping.cancel()
            await server.stop(None)
            loading.result()
        log.info("loaded", address=bind_address, load_s=round(time.perf_counter() - started, 2))
        watching = asyncio.create_task(
            _watch_health(health_servicer, [*service_names], problem or _no_problem, says)
        )
        await stopping
        watching.cancel()
    else:
        loading.cancel()

    log.info("shutting down", grace_s=GRACE_S)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(GRACE_S)
    await close()
    log.info("stopped")


async def _no_problem() -> str | None:
    return None


class _Engine(Protocol):
    @property
    def model_facts(self) -> object: ...

    async def problem(self) -> str | None: ...

    async def close(self) -> None: ...


class _EngineNode(Protocol):
    @property
    def engine(self) -> _Engine: ...


N = TypeVar("N", bound=_EngineNode)


async def serve_node(
    node: Node,
    tls: NodeTls | None,
    service_name: str,
    register: Callable[[grpc.aio.Server], None],
    load: Callable[[], Coroutine[Any, Any, None]],
    close: Callable[[], Awaitable[None]],
    problem: Callable[[], Awaitable[str | None]] | None = None,
    says: Callable[[], object] | None = None,
) -> None:
    """`serve` for a topology's node: its service and NodeService, at its address, with its
    TLS and metrics port."""
    await serve(
        bind_address=node.bind_address,
        service_names=[service_name, NODE_SERVICE_NAME],
        register=register,
        load=load,
        problem=problem,
        says=says,
        close=close,
        credentials=tls.server_credentials() if tls else None,
        metrics_address=metrics_address(node),
    )


async def serve_engine_node(
    node: Node,
    tls: NodeTls | None,
    service_name: str,
    ready: Ready[N],
    register: Callable[[grpc.aio.Server], None],
    load: Callable[[], Coroutine[Any, Any, None]],
    release: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """`serve_node` for a prefill or decode node: health follows its engine's problem; on
    the way out `release` (what the node opened beside its engine), then the engine closed."""

    async def problem() -> str | None:
        return await ready.get().engine.problem()

    def says() -> object:  # what the router keeps of GetNodeInfo (wire/node_clients.py)
        return ready.get().engine.model_facts

    async def close() -> None:
        if release is not None:
            await release()
        if ready.is_set():
            await ready.get().engine.close()

    await serve_node(node, tls, service_name, register, load, close, problem, says)


async def _watch_health(
    health_servicer: HealthServicer,
    service_names: list[str],
    problem: Callable[[], Awaitable[str | None]],
    says: Callable[[], object] | None = None,
) -> None:
    """Keep health in step with what the engine can do; log every change. While serving,
    a change in what the node `says` of itself (its model re-pulled into Ollama with
    another template) is said again (HealthServicer.say_again)."""
    serving: bool | None = None
    said: object = None
    while True:
        try:
            reason = await asyncio.wait_for(problem(), HEALTH_PROBE_TIMEOUT_S)
        except Exception as exc:  # a probe that fails is a problem, not a crash
            reason = f"health probe failed: {type(exc).__name__}: {exc}"
        if (reason is None) != serving:
            serving = reason is None
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in ("", *service_names):
                await health_servicer.set(name, status)
            log.info("health", status="SERVING" if serving else "NOT_SERVING", reason=reason)
            said = says() if says is not None else None
        elif serving and says is not None and (now := says()) != said:
            said = now
            log.info("health said again: what the node says of itself changed")
            await health_servicer.say_again()
        await asyncio.sleep(HEALTH_PROBE_EVERY_S)


def metrics_address(node: Node) -> tuple[str, int] | None:
    if node.metrics_port is None:
        return None
    return (node.listen_host or node.host, node.metrics_port)
