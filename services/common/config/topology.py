"""The topology file: which nodes exist and which nodes serve which logical model.

A topology is a TOML file (see topology/local.toml). `load_topology` parses and checks it
and fails with `TopologyError`, whose message names the file, the key (or the line, for a
syntax error) and what is wrong.
"""

from __future__ import annotations

import os
import re
import tomllib
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from disagg_mesh.server.common.types import Fingerprint

Role = Literal["router", "prefill", "decode"]
EngineName = Literal["llama_cpp", "ollama", "sim"]
Step = Literal["disaggregated", "decode_only", "direct_ollama"]

NodeName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]*$", max_length=63)]
Port = Annotated[int, Field(ge=1, le=65535)]
PositiveSeconds = Annotated[float, Field(gt=0, le=3600)]
# K/V cache types a llama_cpp node may use (llama.cpp server's --cache-type-k/-v).
KvCacheTypeName = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
# Slots of a llama_cpp node whose topology sets none.
DEFAULT_SLOTS = {"prefill": 4, "decode": 8}


def host_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


class TopologyError(Exception):
    """The topology file cannot be used; the message says where and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SchemaLimits(_Strict):
    """[mesh.schema_limits]: how big and how complex a response format's JSON Schema (and
    the grammar it becomes) may be. Every request is checked against them by the router and
    again by each node, before llama.cpp's grammar parser sees it; anything over a limit is
    INVALID_ARGUMENT (HTTP 400) naming the keyword, where it is and the limit. The defaults
    come from measurements of llama.cpp 0.3.36's grammar code (README, "Limits on schemas")."""

    # The schema's JSON text, bytes.
    max_schema_bytes: Annotated[int, Field(ge=64, le=16 << 20)] = 65536
    # Schemas inside schemas (properties, items, anyOf, $defs, ...).
    max_depth: Annotated[int, Field(ge=1, le=512)] = 32
    # minItems, maxItems, minLength, maxLength, and a pattern's {m,n}: llama.cpp's grammar
    # parser refuses repetitions over 2,000 and overflows its stack on ~20,000 nested ones.
    max_repetition: Annotated[int, Field(ge=1, le=2000)] = 1000
    # Values of one enum (an integer range counts as the enum of its values): each is one
    # alternative the grammar tests every vocabulary token against.
    max_enum_values: Annotated[int, Field(ge=1, le=100_000)] = 1024
    # A pattern's characters, and the product of the bounds of repetitions nested in one
    # another (`(([a-z]{1,10}){1,10}){1,10}` is 1,000): the grammar then follows every way of
    # splitting the text, whose count grows with that product (1.7 s a token at 1,000).
    max_pattern_chars: Annotated[int, Field(ge=1, le=100_000)] = 1000
    max_nested_repetition: Annotated[int, Field(ge=1, le=1_000_000)] = 100
    # The grammar the schema becomes: its GBNF text, its rules (named rules and groups)
    # and how deep its groups nest (llama.cpp's parser recurses once per level).
    max_grammar_bytes: Annotated[int, Field(ge=1024, le=64 << 20)] = 1 << 20
    max_grammar_rules: Annotated[int, Field(ge=1, le=10_000_000)] = 65536
    max_grammar_nesting: Annotated[int, Field(ge=1, le=20_000)] = 2048
    # Checking and converting one schema (off the event loop) may take this long.
    check_budget_s: Annotated[float, Field(gt=0, le=600)] = 2.0


class MeshSettings(_Strict):
    """[mesh]: settings for the whole mesh."""

    # Largest max_tokens a request may ask for.
    max_tokens_limit: Annotated[int, Field(ge=1, le=1_000_000)] = 4096
    # A node that failed is skipped by the router for this long (passive health).
    cooldown_s: Annotated[float, Field(ge=0, le=3600)] = 10.0
    # How often the router checks grpc.health.v1 of every node.
    health_check_every_s: Annotated[float, Field(gt=0, le=3600)] = 1.0
    # A request whose node died holding it twice is refused this long (router/deaths.py).
    query_of_death_quarantine_s: Annotated[float, Field(ge=0, le=86400)] = 300.0
    # How big and complex a structured-output schema may be.
    schema_limits: SchemaLimits = SchemaLimits()
    # sim nodes only: every simulated wait is divided by this (`disagg simulate --speedup`).
    sim_speedup: Annotated[float, Field(gt=0, le=10_000)] = 1.0
    # sim nodes only: KV states travel as their header alone, the link between the machines
    # charged for the real size (`disagg simulate`: at a speedup, real bytes over loopback
    # would count speedup times).
    sim_compact_kv: bool = False


class TlsSettings(_Strict):
    """[security.tls]: paths relative to the topology file; {node} is the node's name."""

    # The CA that signed every node's certificate (and, with mutual, every caller's).
    ca_file: str
    cert_file: str
    key_file: str
    # Require a client certificate signed by ca_file on every call (mutual TLS).
    mutual: bool = False


class SecuritySettings(_Strict):
    """[security]"""

    # TLS for every hop; without it the mesh is plaintext, which a topology must ask for
    # (plaintext = true) unless every node is on a loopback address.
    tls: TlsSettings | None = None
    plaintext: bool = False

    # Name of the environment variable holding a shared bearer token. When set, every node
    # requires `authorization: Bearer <token>` on every service but health.
    token_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")


# A web page's origin, "*" matching anything in it: "https://grader.example.edu:8443",
# "https://*.example.edu", or "*" alone (any page).
ORIGIN = re.compile(r"\*|[a-z][a-z0-9+.-]*://\S+")


def _origin(value: str) -> str:
    if not ORIGIN.fullmatch(value):
        raise ValueError(
            f"{value!r} is not an origin such as https://grader.example.edu, "
            "https://*.example.edu or *"
        )
    return value


Origin = Annotated[str, AfterValidator(_origin)]


class Node(_Strict):
    """One [[nodes]] entry: a process of the mesh."""

    name: NodeName
    role: Role
    host: str = Field(min_length=1)
    port: Port
    # Address the process listens on; defaults to host.
    listen_host: str | None = None
    # Prometheus metrics over HTTP on this port (same address), if set.
    metrics_port: Port | None = None
    # router only: Ollama's and OpenAI's HTTP APIs on this port (same address), if set.
    http_port: Port | None = None
    # router only: web pages (origins, "*" matching anything: "https://*.example.edu") that
    # may call the HTTP APIs from a browser, beyond Ollama's own (this machine's pages on
    # any port, app://, file://, tauri://, vscode-webview://, browser extensions); pages of
    # any other origin get 403, as in Ollama (router/http/origins.py).
    http_origins: list[Origin] = []
    # prefill and decode nodes only:
    engine: EngineName | None = None
    # llama_cpp: a GGUF path (relative to the topology file), "package:DIST/FILE", or
    # "ollama:NAME" (a model pulled into this machine's Ollama store, read without Ollama
    # running); ollama: the model tag on the Ollama server.
    model: str | None = None
    # llama_cpp "ollama:" models: the Ollama store's folder (default: $OLLAMA_MODELS,
    # ~/.ollama/models, /usr/share/ollama/.ollama/models, /var/lib/ollama, first found).
    ollama_models: str | None = None
    # Context, tokens, of every request: each slot holds this much, whatever the others hold.
    n_ctx: Annotated[int, Field(ge=256, le=1_048_576)] = 4096
    n_threads: Annotated[int, Field(ge=1, le=1024)] | None = None
    # llama_cpp only: sequences served at once from one context (continuous batching).
    # Default: 4 on a prefill node, 8 on a decode node, or fewer if kv_cache_max_bytes says so.
    slots: Annotated[int, Field(ge=1, le=255)] | None = None
    # KV cache memory the node may use (slots * n_ctx * the model's KV bytes per token);
    # a node whose slots do not fit refuses to start.
    kv_cache_max_bytes: Annotated[int, Field(ge=1 << 20)] | None = None
    # Most prompt tokens one pass (llama_decode) evaluates, and most rows in one compute
    # graph (llama.cpp's n_batch and n_ubatch; a sim node's passes take n_ubatch tokens).
    n_batch: Annotated[int, Field(ge=1, le=65_536)] = 512
    n_ubatch: Annotated[int, Field(ge=1, le=65_536)] = 512
    # Flash attention, set explicitly (it decides the V layout of a KV state, so the
    # prefill and decode nodes of a model must agree).
    flash_attn: bool = True
    # llama_cpp: layers on the GPU (-1 or unset: all of them when llama.cpp was built with
    # a GPU backend, 0: CPU only). The KV state's bytes do not depend on it: a GPU node
    # and a CPU node of the same model hand KV over to each other.
    n_gpu_layers: Annotated[int, Field(ge=-1, le=10_000)] | None = None
    # llama_cpp: K and V cache types (quantized V needs flash_attn); the prefill and decode
    # nodes of a model must agree, as on swa_full.
    type_k: KvCacheTypeName = "f16"
    type_v: KvCacheTypeName = "f16"
    # llama_cpp, sliding-window models (gpt-oss, gemma3): window caches as large as the
    # others. A handoff works either way (a state holds the window); with small window
    # caches llama.cpp reuses their cells in an order that depends on what ran before, so a
    # long answer's greedy text can drift after a handoff or a migration (measured:
    # README, "Architectures"). No effect on other models.
    swa_full: bool = True
    # While streams generate, a step that also evaluates prompt tokens takes at most this
    # many times as long as one that does not: a long prompt arriving slows the streams
    # down by this factor instead of stalling them.
    max_itl_slowdown: Annotated[float, Field(ge=1.0, le=1000.0)] = 2.0
    # llama_cpp: prompts evaluated at once, oldest first, beyond those short enough to share
    # a pass; the rest wait in the queue. Each prompt takes passes of its own, so more at
    # once finish no sooner in all, only each later: with 1 the first requests of a burst
    # answer first. sim: prompts evaluated together (sharing each pass, which a GPU runs
    # faster full: the profile's pass table).
    prompts_at_once: Annotated[int, Field(ge=1, le=255)] = 1
    # llama_cpp and sim: prompt tokens kept resident after their requests end, for later
    # prompts that start the same way (a prefix cache, in 64-token blocks; default n_ctx, 0: off).
    # Its KV memory comes on top of slots * n_ctx.
    prefix_cache_tokens: Annotated[int, Field(ge=0, le=16_777_216)] | None = None
    # The hardware profile of this node's machine (a shipped one's name, e.g. "dgx-spark",
    # "m3-ultra", "m4-max", or a profile file relative to the topology): it times an engine = "sim"
    # node (its `model` is the model whose sizes and speeds it simulates), and `disagg
    # simulate` simulates any node with it.
    hardware: str | None = None
    # sim only: the machine this node stands for (default: host); a KV state from a node
    # standing for another machine costs the profile's link time.
    sim_host: str | None = None
    # ollama only: the server's URL, and how long it keeps the model loaded after a request.
    ollama_url: str = "http://127.0.0.1:11434"
    ollama_keep_alive: str = "30m"
    # prefill only: how long a KV handle stays fetchable, and the KV store's size.
    kv_ttl_s: PositiveSeconds = 60.0
    kv_budget_bytes: Annotated[int, Field(ge=1 << 20)] = 2 << 30
    # Requests that may wait for the engine before new ones get RESOURCE_EXHAUSTED.
    max_queue: Annotated[int, Field(ge=0, le=10_000)] = 16

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def prefix_cache_capacity_tokens(self) -> int:
        """Prompt tokens its prefix cache may hold (prefix_cache_tokens, default n_ctx)."""
        return self.n_ctx if self.prefix_cache_tokens is None else self.prefix_cache_tokens

    @property
    def machine(self) -> str:
        """The machine whose compute serves the node: its host, or the one a sim node
        stands for."""
        return self.sim_host or self.host

    @property
    def bind_address(self) -> str:
        return f"{self.listen_host or self.host}:{self.port}"

    @property
    def default_slots(self) -> int:
        return DEFAULT_SLOTS.get(self.role, 1)

    @model_validator(mode="after")
    def _engine_for_workers(self) -> Node:
        if self.role != "router":
            if self.engine is None:
                raise ValueError(f"a {self.role} node needs engine (llama_cpp, ollama or sim)")
            if self.engine == "sim" and not self.hardware:
                raise ValueError(
                    'an engine = "sim" node needs hardware (a profile: "dgx-spark", '
                    '"m3-ultra", "m4-max", or a file)'
                )
            if not self.model:
                raise ValueError(f"a {self.role} node needs model")
        if self.http_port is not None and self.role != "router":
            raise ValueError("http_port: only the router serves the HTTP APIs")
        if self.http_origins and self.http_port is None:
            raise ValueError("http_origins: the node serves no HTTP APIs (no http_port)")
        if self.http_port is not None and self.http_port in (self.port, self.metrics_port):
            raise ValueError(
                f"http_port {self.http_port} is already this node's gRPC or metrics port"
            )
        if self.type_v not in ("f16", "f32", "bf16") and not self.flash_attn:
            raise ValueError(
                f"type_v = {self.type_v!r} (a quantized V cache) needs flash_attn = true"
            )
        if self.engine == "llama_cpp" and self.n_batch < (self.slots or self.default_slots):
            raise ValueError(
                f"n_batch = {self.n_batch} must be at least slots = "
                f"{self.slots or self.default_slots}: a step holds a token of every slot"
            )
        return self


class ModelRoute(_Strict):
    """One [[models]] entry: a logical model and the nodes that serve it."""

    name: str = Field(min_length=1)
    # The steps the router tries in order until one serves the request:
    # disaggregated (a prefill node, then a decode node), decode_only (whole generation on a
    # decode node), direct_ollama (the router calls ollama_url itself, bypassing the mesh).
    chain: list[Step] = Field(default=["disaggregated", "decode_only"], min_length=1)
    # chain: the steps in the order listed. auto: per request, disaggregated or
    # decode_only first, whichever the router estimates from measured figures to give the
    # first token sooner (services/router/costs.py); the rest of the chain follows in order.
    mode: Literal["chain", "auto"] = "chain"
    # Nodes in order of preference; unhealthy or cooling-down ones are skipped.
    prefill: list[NodeName] = []
    decode: list[NodeName] = []
    # A prompt whose start no node holds goes to the first free node in the order above
    # ("order"), or to the first free one in an order of the nodes drawn from its start
    # ("hash", rendezvous hashing: the same on every router): with many nodes, different
    # prefixes (assignments, rubrics) then spread over them instead of piling onto the
    # first ones, whose prefix caches would evict one another's.
    prefix_placement: Literal["order", "hash"] = "order"
    # Stage limits: a node's work on the request (the router sends it a prompt only when
    # the node has a free slot, so waiting for one does not count: queue_budget_s; and a
    # prefill node no more prompts at once than end within half this at its pace). The
    # node counts it (and decode_deadline_s) itself from the request's turn, so a wait
    # there behind other routers' requests does not count either (it draws from
    # queue_budget_s).
    prefill_deadline_s: PositiveSeconds = 60.0
    # How long a request may wait at the router, in all, for room and free slots before
    # any work is done for it (on every node and chain step tried; within the caller's own
    # deadline); past it, RESOURCE_EXHAUSTED (only a node with a free slot is tried next),
    # at once where the nodes' measured pace says it would pass; never a cool-down: a busy
    # node is not a failing one. Set below a time-to-first-token goal, the requests that
    # would miss it by waiting are refused at once instead of served late (README: goodput).
    # It also bounds the states made for a decode node beyond its slots, and the calls a
    # prefill node gets at once, to what they serve within it at their measured pace.
    queue_budget_s: PositiveSeconds = 600.0
    # A decode node that fails after text was delivered hands the generation over to
    # another decode node of this model (from the prompt and the tokens delivered), at most
    # max_migrations times per request.
    migrate: bool = True
    max_migrations: Annotated[int, Field(ge=0, le=10)] = 2
    # Who evaluates the prompt and the delivered tokens for the node taking over: "decode"
    # (that node itself), "prefill" (a llama_cpp prefill node of this model, which hands
    # their KV state over), or "auto" (whichever the router estimates sooner from measured
    # figures; services/router/costs.py).
    migrate_via: Literal["auto", "decode", "prefill"] = "auto"
    decode_deadline_s: PositiveSeconds = 180.0
    # direct_ollama: the Ollama server and model tag (default: this logical model's name).
    ollama_url: str | None = None
    ollama_model: str | None = None

    @model_validator(mode="after")
    def _steps_have_what_they_need(self) -> ModelRoute:
        if len(set(self.chain)) != len(self.chain):
            raise ValueError("chain: a step is listed twice")
        if "disaggregated" in self.chain and not (self.prefill and self.decode):
            raise ValueError("chain step 'disaggregated' needs prefill and decode nodes")
        if "decode_only" in self.chain and not self.decode:
            raise ValueError("chain step 'decode_only' needs decode nodes")
        if "direct_ollama" in self.chain and not self.ollama_url:
            raise ValueError("chain step 'direct_ollama' needs ollama_url")
        if self.migrate_via == "prefill" and not self.prefill:
            raise ValueError("migrate_via 'prefill' needs prefill nodes")
        if self.mode == "auto" and not {"disaggregated", "decode_only"} <= set(self.chain):
            raise ValueError(
                "mode 'auto' chooses between chain steps 'disaggregated' and "
                "'decode_only': list both in chain"
            )
        return self


class Topology(_Strict):
    mesh: MeshSettings = MeshSettings()
    security: SecuritySettings = SecuritySettings()
    nodes: list[Node] = Field(min_length=1)
    models: list[ModelRoute] = Field(min_length=1)
    # Where the file was read from; model paths are relative to its folder.
    source: Path = Path(".")

    @cached_property
    def _by_name(self) -> dict[str, Node]:
        """Nodes by name (the router looks nodes up on every request)."""
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> Node:
        node = self._by_name.get(name)
        if node is not None:
            return node
        known = ", ".join(n.name for n in self.nodes)
        raise TopologyError(f"{self.source}: no node named {name!r} (nodes: {known})")

    def route(self, model: str) -> ModelRoute | None:
        return next((m for m in self.models if m.name == model), None)

    def threads_for(self, node: Node) -> int:
        """n_threads when the topology sets none: every core of this machine. Engine nodes
        sharing a host with no n_threads of their own then share its cores at run time
        (`host_peers`, engines/llama_cpp/host_threads.py): a busy node takes the cores
        divided by the busy nodes, so a request alone uses every core and many at once do
        not oversubscribe them."""
        if node.n_threads:
            return node.n_threads
        return host_cores()

    def host_peers(self, node: Node) -> tuple[str, ...]:
        """The embedded engine nodes on this node's host that share its cores at run time
        (no n_threads of their own), this one included; () when the node sets n_threads."""
        if node.n_threads:
            return ()
        return tuple(
            n.name
            for n in self.nodes
            if n.role != "router"
            and n.engine == "llama_cpp"
            and n.host == node.host
            and not n.n_threads
        )

    def models_served_by(self, node_name: str) -> list[str]:
        return [m.name for m in self.models if node_name in (*m.prefill, *m.decode)]

    @property
    def routers(self) -> list[Node]:
        """Every router, in the topology's order. Each serves the whole topology: a client
        given all their addresses goes on through another when one fails."""
        return [n for n in self.nodes if n.role == "router"]

    @property
    def router(self) -> Node:
        """The first router (the one a single address means)."""
        return self.routers[0]

    @property
    def router_addresses(self) -> str:
        """Every router's address, comma-separated (a client's or --router's form)."""
        return ",".join(n.address for n in self.routers)

    @model_validator(mode="after")
    def _cross_references(self) -> Topology:
        names = [n.name for n in self.nodes]
        for dup in sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"nodes: the name {dup!r} is used twice")
        addresses = [n.bind_address for n in self.nodes]
        for dup in sorted({a for a in addresses if addresses.count(a) > 1}):
            raise ValueError(f"nodes: two nodes listen on {dup}")
        loopback = all(n.host in ("127.0.0.1", "localhost", "::1") for n in self.nodes)
        if self.security.tls is None and not self.security.plaintext and not loopback:
            raise ValueError(
                "security: nodes listen beyond this machine: set [security.tls], or "
                "[security] plaintext = true to run without TLS on a trusted network"
            )
        if self.security.tls is not None and self.security.plaintext:
            raise ValueError("security: plaintext = true contradicts [security.tls]")
        if not any(n.role == "router" for n in self.nodes):
            raise ValueError("nodes: need at least one node with role 'router', found none")
        by_name = {n.name: n for n in self.nodes}
        seen: set[str] = set()
        for i, route in enumerate(self.models):
            if route.name in seen:
                raise ValueError(f"models[{i}].name: {route.name!r} is listed twice")
            seen.add(route.name)
            for stage in ("prefill", "decode"):
                for name in getattr(route, stage):
                    node = by_name.get(name)
                    if node is None:
                        raise ValueError(f"models[{i}].{stage}: no node named {name!r}")
                    if node.role != stage:
                        raise ValueError(
                            f"models[{i}].{stage}: node {name!r} has role {node.role!r}"
                        )
            _check_kv_compatible(i, [by_name[n] for n in (*route.prefill, *route.decode)])
        return self


def _check_kv_compatible(index: int, nodes: list[Node]) -> None:
    """A model's embedded prefill and decode nodes must write and read the same KV layout."""
    embedded = [n for n in nodes if n.engine == "llama_cpp"]
    for key in Fingerprint.TOPOLOGY_KEYS:
        values = {getattr(n, key) for n in embedded}
        if len(values) > 1:
            listed = ", ".join(f"{n.name} has {getattr(n, key)}" for n in embedded)
            raise ValueError(
                f"models[{index}]: its llama_cpp nodes must agree on {key} "
                f"(KV states move between them): {listed}"
            )


def load_topology(path: str | Path) -> Topology:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TopologyError(f"{path}: no such topology file") from None
    except tomllib.TOMLDecodeError as exc:  # the message carries "(at line N, column M)"
        raise TopologyError(f"{path}: not valid TOML: {exc}") from None
    try:
        # Strict: TOML has its own types, so `slots = true`, `port = "50061"` or
        # `flash_attn = "no"` is a mistake to name, not a value to convert.
        return Topology.model_validate({**raw, "source": path.resolve()}, strict=True)
    except ValidationError as exc:
        raise TopologyError(f"{path}: {_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        message = err["msg"].removeprefix("Value error, ")
        where = f"{key}: " if key else ""
        got = f" (got {err['input']!r})" if err["type"] not in ("missing", "value_error") else ""
        problems.append(f"{where}{message}{got}")
    return "; ".join(problems)
