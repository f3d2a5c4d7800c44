"""Topology files: the shipped ones load; a bad one fails naming the file, key and problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg_mesh.server.common.config.topology import Node, TopologyError, host_cores, load_topology
from disagg_mesh.server.common.engines.llama_cpp.host_threads import HostThreads
from disagg_mesh.server.common.types import Fingerprint

ROOT = Path(__file__).resolve().parent.parent


def test_local_topology() -> None:
    t = load_topology(ROOT / "topology/local.toml")
    assert {m.name for m in t.models} == {"qwen3-coder:30b", "gpt-oss:120b"}
    assert all(n.host == "127.0.0.1" for n in t.nodes)
    for m in t.models:
        assert (m.prefill_deadline_s, m.decode_deadline_s) == (60, 180)


def test_seed_topology_is_the_users_four_machines() -> None:
    t = load_topology(ROOT / "topology/seed.toml")
    nodes = {n.name: (n.role, n.host, n.engine, n.model) for n in t.nodes if n.role != "router"}
    assert nodes == {
        "dgx-spark-1": ("prefill", "169.254.150.103", "llama_cpp", "ollama:qwen3-coder:30b"),
        "dgx-spark-2": ("prefill", "169.254.150.104", "llama_cpp", "ollama:gpt-oss:120b"),
        "mac-studio-1": ("decode", "169.254.150.101", "llama_cpp", "ollama:gpt-oss:120b"),
        "mac-studio-2": ("decode", "169.254.150.102", "llama_cpp", "ollama:qwen3-coder:30b"),
    }
    for name in ("qwen3-coder:30b", "gpt-oss:120b"):
        route = t.route(name)
        assert route is not None
        assert route.chain == ["disaggregated", "decode_only", "direct_ollama"]
    qwen = t.route("qwen3-coder:30b")
    assert qwen is not None and (qwen.prefill, qwen.decode) == (["dgx-spark-1"], ["mac-studio-2"])
    # A router on each Mac Studio: losing one stops neither pipeline.
    assert [(r.name, r.host) for r in t.routers] == [
        ("router", "169.254.150.101"),
        ("router-2", "169.254.150.102"),
    ]
    assert t.router_addresses == "169.254.150.101:50051,169.254.150.102:50051"


def test_seed_ollama_topology_keeps_the_ollama_engine() -> None:
    t = load_topology(ROOT / "topology/seed-ollama.toml")
    nodes = {n.name: (n.engine, n.model) for n in t.nodes if n.role != "router"}
    assert nodes["dgx-spark-2"] == ("ollama", "gpt-oss:120b")
    assert all(engine == "ollama" for engine, _ in nodes.values())


GOOD = (ROOT / "topology/local.toml").read_text()


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("[[nodes]\nname = 1", ["not valid TOML", "line 1"]),
        (GOOD.replace("port = 50062", "port = 70000", 1), ["nodes[2].port", "65535", "70000"]),
        (GOOD.replace('role = "decode"', 'role = "decoder"', 1), ["nodes[2].role", "decoder"]),
        (
            GOOD.replace('decode = ["decode-qwen", "decode-gpt-oss"]', 'decode = ["nowhere"]'),
            ["models[0].decode", "nowhere"],
        ),
        (
            GOOD.replace(
                'prefill = ["prefill-qwen", "prefill-gpt-oss"]', 'prefill = ["decode-qwen"]'
            ),
            ["has role 'decode'"],
        ),
        (
            GOOD.replace("n_ctx = 4096", "n_ctx = 4096\ncolour = 1", 1),
            ["nodes[1].colour", "Extra inputs"],
        ),
        (GOOD.replace("port = 50062", "port = 50061", 1), ["two nodes listen on 127.0.0.1:50061"]),
        (GOOD.replace('engine = "llama_cpp"\n', "", 1), ["nodes[1]", "needs engine"]),
        (
            GOOD.replace(
                'chain = ["disaggregated", "decode_only"]', 'chain = ["direct_ollama"]', 1
            ),
            ["models[0]", "needs ollama_url"],
        ),
        (
            GOOD.replace('chain = ["disaggregated", "decode_only"]', 'chain = ["teleport"]', 1),
            ["models[0].chain[0]", "teleport"],
        ),
        (
            GOOD.replace("n_ctx = 4096", "n_ctx = 2048", 1),
            ["models[0]", "must agree on n_ctx", "prefill-qwen has 2048", "decode-qwen has 4096"],
        ),
        (
            GOOD.replace("n_ctx = 4096", "n_ctx = 4096\nflash_attn = false", 1),
            ["models[0]", "must agree on flash_attn", "prefill-qwen has False"],
        ),
        (
            GOOD.replace(
                'chain = ["disaggregated", "decode_only"]\n'
                'prefill = ["prefill-qwen", "prefill-gpt-oss"]',
                'chain = ["decode_only"]\nmigrate_via = "prefill"\nprefill = []',
                1,
            ),
            ["models[0]", "migrate_via 'prefill' needs prefill nodes"],
        ),
        (GOOD.replace("slots = 4 ", "slots = 0 ", 1), ["nodes[1].slots"]),
        (
            GOOD.replace("slots = 4 ", "n_batch = 2\nslots = 4 ", 1),
            ["nodes[1]", "n_batch = 2 must be at least slots = 4"],
        ),
    ],
)
def test_bad_topology_names_file_key_and_problem(
    tmp_path: Path, text: str, fragments: list[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    for fragment in fragments:
        assert fragment in message, message


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="no such topology file"):
        load_topology(tmp_path / "nope.toml")


def test_engine_nodes_of_one_host_share_its_cores(tmp_path: Path) -> None:
    """The local mesh's four engine nodes set no n_threads: each may use every core, and
    they share them at run time; a node with n_threads of its own keeps it."""
    topology = load_topology(ROOT / "topology/local.toml")
    engines = [n for n in topology.nodes if n.role != "router"]
    assert {topology.threads_for(n) for n in engines} == {host_cores()}
    assert all(topology.host_peers(n) == tuple(e.name for e in engines) for n in engines)
    fixed = engines[0].model_copy(update={"n_threads": 1})
    assert (topology.threads_for(fixed), topology.host_peers(fixed)) == (1, ())
    # The budget itself: a busy node takes the cores over the busy nodes.
    a, b = (HostThreads(["a", "b"], name, 4, folder=tmp_path) for name in "ab")
    assert a.path == b.path and a.threads() == 4
    b.set_busy(True)
    assert a.threads() == 2 and b.threads() == 4  # a counts itself busy, b sees a idle
    a.set_busy(True)
    assert b.threads() == 2
    b.close()
    assert a.threads() == 4
    a.close()


def test_the_kv_settings_a_topology_checks_are_the_fingerprints() -> None:
    """One list: what a model's nodes must agree on in the topology is the part of the KV
    fingerprint a node's settings make (the rest comes from the model file and the build)."""
    settings = Fingerprint("sha", 4096, "v").settings()
    assert set(Fingerprint.TOPOLOGY_KEYS) <= set(settings)
    assert set(Fingerprint.TOPOLOGY_KEYS) <= set(Node.model_fields)
    # The rest is not a node's to set.
    assert not (set(settings) - set(Fingerprint.TOPOLOGY_KEYS)) & set(Node.model_fields)
