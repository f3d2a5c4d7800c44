"""Writes deploy/grafana/disagg-mesh.json, the Grafana dashboard of a disagg-mesh's metrics.

    python deploy/grafana/build_dashboard.py      # after changing a panel here

Laid out as NVIDIA Dynamo's disaggregated dashboard: the router (the frontend), prefill
against decode per node, KV transfer, cache. Every expression returns data from a mesh with
traffic (tests/test_deploy.py runs them against a real Prometheus scraping a test mesh):
counters that may never have moved end in `or vector(0)`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "disagg-mesh.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
FETCH_KV = "/disagg.v1.PrefillService/FetchKv"


def q(percent: int, stage: str, by: str = "model") -> str:
    return (
        f"histogram_quantile(0.{percent:02d}, sum by ({by}, le) "
        f'(rate(disagg_request_stage_seconds_bucket{{stage="{stage}"}}[1m])))'
    )


# (row title, [(panel title, unit, [(expr, legend)])]); four panels a row.
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    (
        "Router: requests",
        [
            (
                "Requests/s by model",
                "reqps",
                [("sum by (model) (rate(disagg_requests_total[1m]))", "{{model}}")],
            ),
            (
                "Time to first token (p50, p95, p99)",
                "s",
                [(q(p, "ttft"), f"{{{{model}}}} p{p}") for p in (50, 95, 99)],
            ),
            (
                "End-to-end (p50, p95, p99)",
                "s",
                [(q(p, "total"), f"{{{{model}}}} p{p}") for p in (50, 95, 99)],
            ),
            (
                "Tokens/s by model",
                "short",
                [("sum by (model, kind) (rate(disagg_tokens_total[1m]))", "{{model}} {{kind}}")],
            ),
        ],
    ),
    (
        "Router: failures",
        [
            (
                "Errors/s by code",
                "reqps",
                [
                    (
                        'sum by (code) (rate(disagg_requests_total{code!="OK"}[1m])) or vector(0)',
                        "{{code}}",
                    )
                ],
            ),
            (
                "Failed attempts/s (failovers) by step and code",
                "short",
                [
                    (
                        "sum by (method, code) (rate(disagg_failed_attempts_total[5m]))"
                        " or vector(0)",
                        "{{method}} {{code}}",
                    )
                ],
            ),
            (
                "Migrations/s",
                "short",
                [("sum by (code) (rate(disagg_migrations_total[5m])) or vector(0)", "{{code}}")],
            ),
            (
                "Calls in flight by node",
                "short",
                [("sum by (node) (disagg_rpcs_in_flight)", "{{node}}")],
            ),
        ],
    ),
    (
        "Prefill vs decode, per node",
        [
            (
                "Prompt tokens/s per prefill node",
                "short",
                [
                    (
                        'sum by (node) (disagg_engine_tokens_per_second{role="prefill",'
                        'kind="prompt"})',
                        "{{node}}",
                    )
                ],
            ),
            (
                "Decode tokens/s per decode node",
                "short",
                [
                    (
                        'sum by (node) (disagg_engine_tokens_per_second{role="decode",'
                        'kind="decode"})',
                        "{{node}}",
                    )
                ],
            ),
            (
                "Slots busy and queue per node",
                "short",
                [
                    ("sum by (node) (disagg_engine_slots_busy)", "{{node}} busy"),
                    ("sum by (node) (disagg_engine_queue_depth)", "{{node}} queued"),
                ],
            ),
            (
                "Prefill and decode stages p95 (router), engine step p95 (node)",
                "s",
                [
                    (q(95, "prefill"), "{{model}} prefill"),
                    (q(95, "decode"), "{{model}} decode"),
                    (
                        "histogram_quantile(0.95, sum by (node, le) "
                        "(rate(disagg_engine_step_seconds_bucket[1m])))",
                        "{{node}} step",
                    ),
                ],
            ),
        ],
    ),
    (
        "KV transfer",
        [
            (
                "KV bytes/s moved, and without the decode node's cache",
                "Bps",
                [("sum by (model, kind) (rate(disagg_kv_bytes_total[1m]))", "{{model}} {{kind}}")],
            ),
            (
                "KV handoff time (p50, p95)",
                "s",
                [(q(p, "kv_transfer"), f"{{{{model}}}} p{p}") for p in (50, 95)],
            ),
            (
                "FetchKv failures (5 min)",
                "short",
                [
                    (
                        f'sum by (node) (increase(disagg_rpcs_total{{method="{FETCH_KV}",'
                        'code!="OK"}[5m])) or vector(0)',
                        "{{node}}",
                    )
                ],
            ),
            (
                "KV states held on prefill nodes",
                "bytes",
                [("sum by (node) (disagg_kv_store_bytes)", "{{node}}")],
            ),
        ],
    ),
    (
        "Cache",
        [
            (
                "Prefix-cache hit rate (prompt tokens from the cache)",
                "percentunit",
                [
                    (
                        '(sum(rate(disagg_engine_tokens_total{kind="cached"}[5m])) or vector(0))'
                        ' / (sum(rate(disagg_engine_tokens_total{kind=~"cached|prompt"}[5m])) > 0)',
                        "hit rate",
                    )
                ],
            ),
            (
                "KV cache in use (vLLM's gauge)",
                "percentunit",
                [("max by (node) (vllm:kv_cache_usage_perc)", "{{node}}")],
            ),
            (
                "Prefix cache tokens held, and the most",
                "short",
                [
                    (
                        "sum by (node, state) (disagg_engine_prefix_cache_tokens)",
                        "{{node}} {{state}}",
                    )
                ],
            ),
            (
                "Nodes up, and restarts",
                "short",
                [
                    ('sum by (role) (up{job=~"disagg-.*"})', "{{role}} up"),
                    ("max by (node) (disagg_node_restarts)", "{{node}} restarts"),
                ],
            ),
        ],
    ),
]


def expressions() -> list[str]:
    """Every PromQL expression of the dashboard."""
    return [expr for _, panels in ROWS for _, _, targets in panels for expr, _ in targets]


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y, ids = 0, 1
    for title, row in ROWS:
        panels.append(
            {
                "type": "row",
                "title": title,
                "id": ids,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        ids, y = ids + 1, y + 1
        for i, (panel, unit, targets) in enumerate(row):
            panels.append(
                {
                    "type": "timeseries",
                    "title": panel,
                    "id": ids,
                    "datasource": DS,
                    "gridPos": {"h": 8, "w": 6, "x": 6 * i, "y": y},
                    "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                    "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                    "targets": [
                        {
                            "refId": chr(ord("A") + k),
                            "datasource": DS,
                            "expr": expr,
                            "legendFormat": legend,
                        }
                        for k, (expr, legend) in enumerate(targets)
                    ],
                }
            )
            ids += 1
        y += 8
    return {
        "title": "disagg-mesh",
        "uid": "disagg-mesh",
        "description": "A disagg-mesh: router, prefill vs decode per node, KV transfer, cache "
        "(github: disagg-mesh, deploy/grafana).",
        "tags": ["disagg-mesh", "llm", "inference"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "5s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                }
            ]
        },
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {OUT}: {len(expressions())} expressions")
