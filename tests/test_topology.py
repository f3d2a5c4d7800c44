"""Topology files: the shipped ones load; a bad one fails naming the file, key and problem."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from disagg_mesh.server.common.config.topology import Node, TopologyError, host_cores, load_topology
from disagg_mesh.server.common.engines.llama_cpp.host_threads import (
    ENGINE_NICENESS,
    LEAVE_CORE_AT,
    LOAD_SAMPLE_S,
    RECENT_S,
    HostThreads,
    OtherLoad,
    yield_to_io,
)
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
        (GOOD.replace("slots = 8 ", "slots = 0 ", 1), ["nodes[1].slots"]),
        # TOML's types are kept: nothing converted behind the user's back.
        (GOOD.replace("slots = 8 ", "slots = true ", 1), ["nodes[1].slots", "integer", "True"]),
        (GOOD.replace("port = 50062", 'port = "50062"', 1), ["nodes[2].port", "'50062'"]),
        (GOOD.replace("n_ctx = 4096", "n_ctx = 4096.0", 1), ["nodes[1].n_ctx", "4096.0"]),
        (
            GOOD.replace("n_ctx = 4096", 'n_ctx = 4096\nflash_attn = "no"', 1),
            ["nodes[1].flash_attn", "boolean", "'no'"],
        ),
        (
            GOOD.replace("slots = 8 ", "n_batch = 2\nslots = 8 ", 1),
            ["nodes[1]", "n_batch = 2 must be at least slots = 8"],
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
    # The lease itself: a busy node takes its share of the free cores, at least one.
    a, b = (HostThreads(["a", "b"], name, 4, folder=tmp_path, others=_no_load) for name in "ab")
    assert a.path == b.path
    a.set_busy(True)
    assert a.acquire(max_wait_s=0) == 4  # alone
    a.release()
    b.set_busy(True)
    assert a.acquire(max_wait_s=0) == 2  # two busy nodes: half each
    assert b.acquire(max_wait_s=0) == 2
    a.release()
    b.release()
    b.close()  # idle (its record stays): a alone again
    assert a.acquire(max_wait_s=0) == 4
    a.release()
    a.close()


def test_a_step_on_several_threads_holds_its_cores_alone(tmp_path: Path) -> None:
    """A node that would start beside a step on several threads waits for it to end; one
    step of a single thread each may share a core; a dead node's record holds nothing."""
    a, b, c = (
        HostThreads(["a", "b", "c"], name, 2, folder=tmp_path, others=_no_load) for name in "abc"
    )
    a.set_busy(True)
    assert a.acquire(max_wait_s=0) == 2
    b.set_busy(True)
    started = time.perf_counter()
    release = threading.Timer(0.3, a.release)
    release.start()
    assert b.acquire(max_wait_s=0) == 1  # waited for a's step
    assert time.perf_counter() - started >= 0.25
    assert a.acquire(max_wait_s=0) == 1  # beside b's single thread
    c.set_busy(True)
    assert c.acquire(max_wait_s=0) == 1  # three single threads on 2 cores
    for node in (a, b, c):
        node.release()
    # A record left by a process that is gone (here: b's, rewritten with a dead pid).
    b.set_busy(True)
    assert b.acquire(max_wait_s=0) == 1
    b._pid = dead_pid()
    b._write()
    c.set_busy(False)
    assert a.acquire(max_wait_s=0) == 2
    for node in (a, b, c):
        node.close()


def test_prompts_go_first_on_a_host_with_more_busy_nodes_than_cores(tmp_path: Path) -> None:
    """A step of generated tokens waits for a node with prompt tokens while more nodes are
    busy than there are cores (unless a core is free beside the prompt step) and those
    prompts serve more requests than the step has streams, at most its max_wait_s times the
    prompts' requests over its streams; prompts never wait for it."""
    decode, prefill, other = (
        HostThreads(["d", "p", "o"], name, 2, folder=tmp_path, others=_no_load) for name in "dpo"
    )
    decode.set_busy(True)
    other.set_busy(True)
    prefill.set_prompts(2)
    started = time.perf_counter()
    assert decode.acquire(max_wait_s=0.1) == 1  # waited out 0.1 s x 2 requests / 1 stream
    assert time.perf_counter() - started >= 0.2
    decode.release()
    assert prefill.acquire(max_wait_s=0) == 1
    prefill.release()
    # The prompt step runs on one thread and a core is free: no reason to wait.
    assert prefill.acquire(max_wait_s=0) == 1
    started = time.perf_counter()
    assert decode.acquire(max_wait_s=5) == 1
    assert time.perf_counter() - started < 0.1
    # No core free (the other node's step holds the second): the decode step would share
    # the prompt step's core, so it waits.
    decode.release()
    assert other.acquire(max_wait_s=0) == 1
    started = time.perf_counter()
    assert decode.acquire(max_wait_s=0.1) == 1
    assert time.perf_counter() - started >= 0.2
    # The longer the more requests over the step's streams (its streams wait, or those
    # requests' first tokens would); not at all for as many streams as requests or more
    # (under steady load a stream would otherwise wait at every token, and no prompt end
    # sooner for it: AIPerf's inter-token latency was twice what it is).
    decode.release()
    prefill.set_prompts(4)
    started = time.perf_counter()
    assert decode.acquire(max_wait_s=0.05, streams=1) == 1
    assert time.perf_counter() - started >= 0.2
    decode.release()
    started = time.perf_counter()
    assert decode.acquire(max_wait_s=0.05, streams=2) == 1
    assert 0.1 <= time.perf_counter() - started < 0.2
    decode.release()
    started = time.perf_counter()
    assert decode.acquire(max_wait_s=5, streams=4) == 1
    assert time.perf_counter() - started < 0.1
    for node in (decode, prefill, other):
        node.release()
    other.set_busy(False)  # two busy nodes on 2 cores: nobody waits
    started = time.perf_counter()
    assert decode.acquire(max_wait_s=5) == 1
    assert time.perf_counter() - started < 0.1
    for node in (decode, prefill, other):
        node.close()


def _no_load(pids: object) -> float:
    """The host's other processes keep no core busy (the lease's tests are about its nodes)."""
    return 0.0


def test_cores_the_hosts_other_processes_keep_busy_are_left_to_them(tmp_path: Path) -> None:
    """A step runs on the cores the host's other processes leave: from 0.4 of a core of
    their load on, one fewer; never none."""
    load = {"cores": 0.0}
    a, b = (
        HostThreads(["a", "b"], name, 4, folder=tmp_path, others=lambda _: load["cores"])
        for name in "ab"
    )
    a.set_busy(True)
    for cores, threads in ((0.0, 4), (0.3, 4), (0.5, 3), (1.0, 3), (1.5, 2), (3.9, 1), (8, 1)):
        load["cores"] = cores
        assert a.acquire(max_wait_s=0) == threads, cores
        a.release()
    load["cores"] = 2.0  # two cores left: two busy nodes get one each
    b.set_busy(True)
    assert a.acquire(max_wait_s=0) == 1
    assert b.acquire(max_wait_s=0) == 1
    for node in (a, b):
        node.release()
        node.close()


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="the host's load is read from /proc")
def test_the_hosts_other_load_is_measured_without_the_engine_nodes() -> None:
    """A process spinning on a core counts as a busy core of the host's other load, unless
    it is one of the engine nodes' processes."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for engines, low, high in (([os.getpid()], 0.6, 2.5), ([spinner.pid], 0.0, 0.5)):
            load = OtherLoad()
            assert load(engines.copy) == 0.0  # the first sample: nothing to compare
            time.sleep(LOAD_SAMPLE_S + 0.5)
            measured = load(engines.copy)
            assert low <= measured <= high, (engines, measured)
            assert load(engines.copy) == measured  # until the next sample is due
    finally:
        spinner.kill()
        spinner.wait()


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="the host's load is read from /proc")
def test_load_that_ended_before_a_long_window_closed_is_not_counted() -> None:
    """A node idle for a while: a process that kept a core busy for most of its window but
    has ended is not counted at the next step; one still running is."""
    for still_running in (False, True):
        load = OtherLoad()
        assert load([os.getpid()].copy) == 0.0
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(RECENT_S + 0.5)
            if not still_running:
                spinner.kill()
                spinner.wait()
            measured = load([os.getpid()].copy)
        finally:
            spinner.kill()
            spinner.wait()
        if still_running:
            assert measured >= 0.6, measured
        else:
            assert measured < LEAVE_CORE_AT, measured


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
def test_the_engine_thread_yields_its_cores_to_the_nodes_io() -> None:
    """The engine thread, and threads it starts (llama.cpp's OpenMP workers), run at a
    lower priority than the process's other threads; never back up from a lower one."""
    if os.getpriority(os.PRIO_PROCESS, 0) >= ENGINE_NICENESS:
        pytest.skip("the tests run at a niceness the engine thread keeps")
    seen: dict[str, int] = {}

    def niceness(name: str) -> None:
        seen[name] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def engine() -> None:
        yield_to_io()
        niceness("engine")
        worker = threading.Thread(target=niceness, args=("worker",))
        worker.start()
        worker.join()
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ENGINE_NICENESS + 5)
        yield_to_io()
        niceness("lower already")

    thread = threading.Thread(target=engine)
    thread.start()
    thread.join()
    niceness("io")
    assert seen == {
        "engine": ENGINE_NICENESS,
        "worker": ENGINE_NICENESS,
        "lower already": ENGINE_NICENESS + 5,
        "io": os.getpriority(os.PRIO_PROCESS, 0),
    }
    assert seen["io"] < ENGINE_NICENESS


def dead_pid() -> int:
    """The id of a process that has exited."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_the_kv_settings_a_topology_checks_are_the_fingerprints() -> None:
    """One list: what a model's nodes must agree on in the topology is the part of the KV
    fingerprint a node's settings make (the rest comes from the model file and the build)."""
    settings = Fingerprint("sha", 4096, "v").settings()
    assert set(Fingerprint.TOPOLOGY_KEYS) <= set(settings)
    assert set(Fingerprint.TOPOLOGY_KEYS) <= set(Node.model_fields)
    # The rest is not a node's to set.
    assert not (set(settings) - set(Fingerprint.TOPOLOGY_KEYS)) & set(Node.model_fields)
