"""Benchmark: what a bad request costs the mesh (#44).

    python -m bench.bad_requests [--repeats 20]

Starts a mesh of its own (a router with its HTTP door, a prefill and a decode node), then:

17. the time the router takes to answer the worst accepted schemas (checked and converted,
    asked as dry runs: `X-Disagg-Dry-Run`, so nothing is generated) and the worst refused
    ones (each made unique per repeat, so no cache answers), through the OpenAI door; and
    the TTFT of a plain streamed request alone against the same request sent while the
    worst refused schema is being refused: the time it adds. Goal: <= 10 ms added.

Writes JSON to bench/results/ when run alone; `make bench` (bench/run.py) runs it as row 17.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from typing import Any

import grpc
import httpx

from bench.common import median, run_alone, say, small_mesh
from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc, types_pb2
from disagg_mesh.server.common.runtime.processes import serving_mesh

GOAL_ADDED_TTFT_S = 0.010
_unique = itertools.count()


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _integers(low: int, high: int) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer"}, "minItems": low, "maxItems": high}


# Near every limit, and accepted.
ACCEPTED: dict[str, dict[str, Any]] = {
    "1,000 integers": _integers(1000, 1000),
    "enum of 1,024": {"enum": [f"value {i}" for i in range(1024)]},
    "31 levels deep": _deep(31),
    "300 properties": {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "maxLength": 40} for i in range(300)},
        "required": [f"p{i}" for i in range(300)],
    },
}
# The issue's probes and more, each refused.
REFUSED: dict[str, dict[str, Any]] = {
    "minItems 5,000": _integers(5000, 100_000),
    "enum of 100,000 (1 MB)": {"enum": [f"s{i}" for i in range(100_000)]},
    "nested repetition": {"type": "string", "pattern": "^(([a-z]{1,10}){1,10}){1,10}$"},
    "40 levels deep": _deep(40),
    "recursive $ref": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    unique = {**schema, "description": f"repeat {next(_unique)}"}  # no cache answers
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "Give me the data."}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": unique}},
    }


async def _answer_s(http: httpx.AsyncClient, schema: dict[str, Any], accepted: bool) -> float:
    body = _body(schema)
    started = time.perf_counter()
    reply = await http.post("/v1/chat/completions", json=body, headers={"X-Disagg-Dry-Run": "1"})
    seconds = time.perf_counter() - started
    assert reply.status_code == (200 if accepted else 400), (reply.status_code, reply.text[:300])
    return seconds


async def _ttft(stub: Any) -> float:
    request = router_pb2.GenerateRequest(
        model="m",
        prompt="Say hello.",
        sampling=types_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    started = time.perf_counter()
    first = None
    async for reply in stub.Generate(request, timeout=60):
        if first is None and reply.HasField("delta"):
            first = time.perf_counter() - started
    assert first is not None
    return first


async def measure(repeats: int) -> dict[str, Any]:
    async with serving_mesh(small_mesh(), "bench-bad-requests-") as mesh:
        router = mesh.topology.router
        base = f"http://127.0.0.1:{router.http_port}"
        async with (
            httpx.AsyncClient(base_url=base, timeout=60) as http,
            grpc.aio.insecure_channel(router.address) as channel,
        ):
            stub = router_pb2_grpc.RouterServiceStub(channel)
            await _ttft(stub)  # warm-up
            accepted = {
                name: [await _answer_s(http, s, True) for _ in range(repeats)]
                for name, s in ACCEPTED.items()
            }
            refused = {
                name: [await _answer_s(http, s, False) for _ in range(repeats)]
                for name, s in REFUSED.items()
            }
            worst_refused = max(REFUSED, key=lambda n: median(refused[n]))
            # One pathological request at a time, its body written beforehand (this process's
            # own JSON encoding is not the router's cost), the plain one sent just after it.
            bodies = [json.dumps(_body(REFUSED[worst_refused])).encode() for _ in range(repeats)]
            alone: list[float] = []
            beside: list[float] = []
            for body in bodies:  # the two take turns
                alone.append(await _ttft(stub))
                refusal = asyncio.create_task(
                    http.post(
                        "/v1/chat/completions",
                        content=body,
                        headers={"Content-Type": "application/json"},
                    )
                )
                await asyncio.sleep(0.002)
                beside.append(await _ttft(stub))
                assert (await refusal).status_code == 400
    worst_accepted = max(ACCEPTED, key=lambda n: median(accepted[n]))
    added = median(beside) - median(alone)
    for name, samples in {**accepted, **refused}.items():
        say(f"   {name}: {median(samples) * 1000:.1f} ms")
    say(
        f"   plain TTFT alone {median(alone) * 1000:.1f} ms, beside refusals "
        f"{median(beside) * 1000:.1f} ms: {added * 1000:+.1f} ms"
    )
    return {
        "accepted_s": accepted,
        "refused_s": refused,
        "worst_accepted": worst_accepted,
        "worst_accepted_s": median(accepted[worst_accepted]),
        "worst_refused": worst_refused,
        "worst_refused_s": median(refused[worst_refused]),
        "ttft_alone_s": alone,
        "ttft_beside_refusals_s": beside,
        "added_ttft_s": added,
        "goal_added_ttft_s": GOAL_ADDED_TTFT_S,
    }


def rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        (
            f"bad requests: worst accepted schema ({m['worst_accepted']}) answered in / worst "
            f"refused ({m['worst_refused']}) refused in",
            f"{m['worst_accepted_s'] * 1000:.0f} / {m['worst_refused_s'] * 1000:.0f} ms",
            "well under 1 s",
        ),
        (
            "bad requests: TTFT a plain request gains while the worst refused schema is being "
            "refused",
            f"{m['added_ttft_s'] * 1000:+.1f} ms",
            f"<= {GOAL_ADDED_TTFT_S * 1000:g} ms",
        ),
    ]


def main() -> int:
    return run_alone(__doc__, "bad_requests", measure, rows, {"repeats": 20}, repeats="repeats")


if __name__ == "__main__":
    sys.exit(main())
