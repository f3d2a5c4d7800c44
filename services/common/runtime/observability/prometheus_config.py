"""A Prometheus configuration for a topology: one scrape job per role, each node with a
`metrics_port` a target labelled with its node, role and host, and the mesh's alert rules.

`disagg prometheus-config --topology FILE` prints it; deploy/prometheus/ holds the one for
topology/local.toml and the rules (alerts.yml). Written as plain YAML text: no YAML library.
"""

from __future__ import annotations

import json

from disagg_mesh.server.common.config.topology import Topology

ROLES = ("router", "prefill", "decode")


def prometheus_config(
    topology: Topology,
    source: str,
    rules: str = "alerts.yml",
    scrape_interval_s: float = 5.0,
) -> str:
    """prometheus.yml for this topology; source: how to name the topology in its header."""

    def q(text: str) -> str:  # a YAML double-quoted string (JSON's quoting is YAML's)
        return json.dumps(text)

    lines = [
        f"# Prometheus for the disagg-mesh topology {source}, written by",
        f"# `disagg prometheus-config --topology {source}`. Alert rules: {rules}",
        "# (deploy/prometheus/alerts.yml); Grafana: deploy/grafana/disagg-mesh.json.",
        "global:",
        f"  scrape_interval: {_duration(scrape_interval_s)}",
        f"  evaluation_interval: {_duration(max(scrape_interval_s, 15.0))}",
        "rule_files:",
        f"  - {q(rules)}",
    ]
    jobs: list[str] = []
    unscraped = [n.name for n in topology.nodes if n.metrics_port is None]
    for role in ROLES:
        nodes = [n for n in topology.nodes if n.role == role and n.metrics_port is not None]
        if not nodes:
            continue
        jobs += [f"  - job_name: {q('disagg-' + role)}", "    static_configs:"]
        for node in nodes:
            jobs += [
                f"      - targets: [{q(f'{node.host}:{node.metrics_port}')}]",
                "        labels:",
                f"          node: {q(node.name)}",
                f"          role: {q(role)}",
                f"          host: {q(node.host)}",
            ]
    lines += ["scrape_configs:", *jobs] if jobs else ["scrape_configs: []"]
    if unscraped:
        lines.append("# Not scraped (no metrics_port in the topology): " + ", ".join(unscraped))
    return "\n".join(lines) + "\n"


def _duration(seconds: float) -> str:
    return (
        f"{int(seconds * 1000)}ms" if seconds < 1 or seconds != int(seconds) else f"{int(seconds)}s"
    )
