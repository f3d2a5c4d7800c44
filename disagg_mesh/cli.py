"""`disagg`: the mesh from a terminal.

    disagg generate --model qwen3-coder:30b "Review this code: ..."   # streams, then metrics
    echo "prompt" | disagg generate --model gpt-oss:120b -            # prompt from stdin
    disagg batch class.jsonl -o graded.jsonl    # OpenAI's batch format; run again to resume
    disagg simulate --topology topology/seed.toml --workload class.jsonl  # vs Ollama today
    disagg calibrate --out profiles/this-machine.toml # this machine, for disagg simulate
    disagg status [--watch]                                           # every node's health
    disagg models                                                     # logical models, routes
    disagg doctor                              # can each prefill node hand KV to each decode node?
    disagg service install --node dgx-spark-1  # a systemd unit / launchd agent for one node

The routers' addresses (one, or several comma-separated: a call goes on through the next
when one fails): --router, else $DISAGG_ROUTER, else every router of --topology
(default topology/local.toml), else 127.0.0.1:50051.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from disagg_mesh.batch import BatchInputError, BatchRequest, ResultsFile, read_requests
from disagg_mesh.batch.progress import Display, Tally, summary_rows
from disagg_mesh.client import (
    CHANNEL_OPTIONS,
    DEFAULT_ADDRESS,
    AsyncMeshClient,
    GenerateCall,
    Logprobs,
    MeshClient,
    Reasoning,
    TlsFiles,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
)
from disagg_mesh.errors import MeshError
from disagg_mesh.metrics import Metrics
from disagg_mesh.proto.v1 import node_pb2, node_pb2_grpc
from disagg_mesh.service import ServiceSpec, this_os

HINTS = {
    grpc.StatusCode.UNAVAILABLE: "is the mesh running? `make run` starts the local one; "
    "`disagg status` shows which node is down",
    grpc.StatusCode.NOT_FOUND: "`disagg models` lists the models the router serves",
    grpc.StatusCode.DEADLINE_EXCEEDED: "raise --timeout, or lower --max-tokens",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the nodes are busy: retry in a moment",
    grpc.StatusCode.UNAUTHENTICATED: "pass --token",
}


class CliError(Exception):
    """One line for the user, and the exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = code


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args))
    except MeshError as exc:
        hint = HINTS.get(exc.code)
        print(f"error: {exc}" + (f" ({hint})" if hint else ""), file=sys.stderr)
        return 1
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disagg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--router", help="router address host:port, or several comma-separated (failover)"
    )
    # The server's config.DEFAULT_TOPOLOGY, written out: the client installs without the
    # server's package (tests/test_client.py).
    parser.add_argument("--topology", default="topology/local.toml", help="topology TOML file")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per call")
    parser.add_argument("--token", default=os.environ.get("DISAGG_TOKEN"), help="bearer token")
    parser.add_argument("--ca", type=Path, help="CA certificate (PEM): use TLS")
    parser.add_argument("--cert", type=Path, help="client certificate (PEM), for mutual TLS")
    parser.add_argument("--key", type=Path, help="client key (PEM), for mutual TLS")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    gen = commands.add_parser("generate", help="stream a generation, then its metrics")
    gen.add_argument("--model", "-m", required=True)
    gen.add_argument("prompt", help="the prompt, or - to read it from stdin")
    gen.add_argument("--max-tokens", type=int, default=512)
    gen.add_argument("--temperature", type=float, help="0 is greedy (default: server's, 0.8)")
    gen.add_argument("--top-p", type=float, help="nucleus mass (default: 0.95)")
    gen.add_argument("--top-k", type=int, help="the k most likely tokens, 0: any (default: 40)")
    gen.add_argument("--min-p", type=float, help="least probability, of the top's (default: 0.05)")
    gen.add_argument(
        "--repeat-penalty", type=float, help="a repeated token's logit divided (default: 1, none)"
    )
    gen.add_argument(
        "--frequency-penalty", type=float, help="lowered by its count times this (default: 0)"
    )
    gen.add_argument("--presence-penalty", type=float, help="lowered once by this (default: 0)")
    gen.add_argument(
        "--repeat-last-n", type=int, help="tokens the penalties look back over, -1: all (64)"
    )
    gen.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit (repeatable)",
    )
    gen.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="each token's log probability and the N (0-20) most likely at its place: a "
        'line a token on stderr after the answer (with --json, its "logprobs")',
    )
    gen.add_argument(
        "--seed", type=int, help="sampling seed: the same answer each time (-1 or unset: random)"
    )
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument(
        "--ignore-eos",
        action="store_true",
        help="never sample an end token: the answer runs to --max-tokens (benchmarks)",
    )
    gen.add_argument(
        "--format",
        metavar="json|SCHEMA",
        help='structured output: "json" (any JSON object), or a JSON Schema (the JSON '
        "itself or a file holding it)",
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user turn, rendered with the model's chat template",
    )
    gen.add_argument(
        "--suffix",
        default="",
        metavar="TEXT",
        help="fill in the middle: the prompt is the text before the gap, TEXT the text after "
        "it (a model with FIM tokens, e.g. Qwen3-Coder)",
    )
    gen.add_argument(
        "--reasoning-effort",
        choices=("low", "medium", "high"),
        help="how hard a reasoning model (gpt-oss) thinks; implies --chat",
    )
    gen.add_argument(
        "--tools",
        metavar="FILE",
        help="functions the model may call: a JSON file holding a list in OpenAI's shape "
        '([{"type": "function", "function": {"name", "description", "parameters"}}]); '
        "implies --chat; the calls are printed after the text, one JSON object a line",
    )
    gen.add_argument(
        "--tool-choice",
        default="auto",
        metavar="auto|none|required|NAME",
        help="with --tools: whether (and which function) the model must call (default auto)",
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help="one JSON object: text, reasoning, tool calls and metrics",
    )
    gen.set_defaults(run=_generate)

    batch = commands.add_parser(
        "batch",
        help="run a JSONL file of requests (OpenAI's batch format); run again to resume",
        description="Each line: {custom_id, method: POST, url, body}, url one of "
        "/v1/chat/completions, /v1/completions, /api/chat, /api/generate. Each result is "
        "appended to OUTPUT as it completes (OpenAI's batch output format); running the "
        "same command again skips every custom_id already there.",
    )
    batch.add_argument("input", type=Path, help="the requests, one JSON object per line")
    batch.add_argument("-o", "--output", type=Path, required=True, help="results file (JSONL)")
    batch.add_argument(
        "--concurrency",
        type=int,
        help="requests at once (default: the free slots of the models' decode nodes)",
    )
    batch.add_argument(
        "--retry-failed",
        action="store_true",
        help="run again the requests whose results in OUTPUT are failures",
    )
    batch.add_argument(
        "--dry-run", action="store_true", help="check every line with a router, run nothing"
    )
    batch.add_argument(
        "--file-order",
        action="store_true",
        help="send lines in file order (default: lines sharing a prompt prefix together, "
        "the first of each group ahead of the rest, so the prefix cache serves the others)",
    )
    batch.set_defaults(run=_batch)

    simulate = commands.add_parser(
        "simulate",
        help="how a batch would run on --topology's machines (simulated nodes timed by "
        "hardware profiles, the real router), against Ollama on the same machines",
        description="Every engine node of --topology becomes a simulated node on 127.0.0.1 "
        "(its `hardware` key, or --profile, times it; the topology's addresses are never "
        "dialled); the workload runs through the real routers as `disagg batch` runs it. "
        "Then the same workload on the same machines as Ollama serves it (profiles/ollama.toml "
        "states each assumption), and the ratio of the wall times.",
    )
    _topology_after(simulate)
    simulate.add_argument(
        "--workload", type=Path, required=True, help="the requests: a `disagg batch` JSONL file"
    )
    simulate.add_argument(
        "--profile", help="one hardware profile for every node (default: each node's hardware)"
    )
    simulate.add_argument(
        "--speedup",
        type=float,
        default=20.0,
        help="simulated seconds per real second (default 20; the router's own time counts "
        "this many times over, so lower is closer, higher is quicker)",
    )
    simulate.add_argument(
        "--concurrency", type=int, help="requests at once (default: as `disagg batch`)"
    )
    simulate.add_argument(
        "--ollama-parallel",
        type=int,
        help="the baseline's OLLAMA_NUM_PARALLEL, requests each model serves at once "
        "(default: Ollama's own, 1)",
    )
    simulate.add_argument("--logs", type=Path, help="keep the nodes' logs in this folder")
    simulate.add_argument("--json", action="store_true", help="one JSON object")
    simulate.set_defaults(run=_simulate)

    calibrate = commands.add_parser(
        "calibrate",
        help="a hardware profile of this machine for `disagg simulate`, measured with the "
        "embedded engine and --topology's llama_cpp models",
    )
    _topology_after(calibrate)
    calibrate.add_argument("--out", type=Path, required=True, help="the profile (TOML) to write")
    calibrate.set_defaults(run=_calibrate)

    status = commands.add_parser("status", help="health of every node of the topology")
    status.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS")
    status.add_argument("--json", action="store_true")
    status.set_defaults(run=_status)

    models = commands.add_parser("models", help="the logical models and their routes")
    models.add_argument("--json", action="store_true")
    models.set_defaults(run=_models)

    doctor = commands.add_parser(
        "doctor", help="will a KV handoff work between each model's prefill and decode nodes?"
    )
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(run=_doctor)

    prometheus = commands.add_parser(
        "prometheus-config",
        help="a Prometheus configuration scraping every node of --topology (its alert rules: "
        "deploy/prometheus/alerts.yml)",
    )
    _topology_after(prometheus)
    prometheus.add_argument("--out", type=Path, help="write it to this file (default: print it)")
    prometheus.add_argument(
        "--rules", default="alerts.yml", help="the rule file it names (default: alerts.yml)"
    )
    prometheus.add_argument(
        "--scrape-interval", type=float, default=5.0, metavar="SECONDS", help="default: 5"
    )
    prometheus.set_defaults(run=_prometheus_config)

    service = commands.add_parser(
        "service", help="run a node under systemd (Linux) or launchd (macOS): boot, restarts"
    )
    actions = service.add_subparsers(required=True, metavar="ACTION")
    for action, what in (("install", "write the unit"), ("uninstall", "remove the unit")):
        sub = actions.add_parser(action, help=what)
        sub.add_argument("--node", required=True, help="the node's name in --topology")
        sub.add_argument(
            "--os", choices=("linux", "macos"), help="for this OS (default: this machine's)"
        )
        sub.add_argument(
            "--system", action="store_true", help="Linux: a system unit in /etc (root)"
        )
        sub.add_argument("--print", action="store_true", help="show it, change nothing")
        sub.set_defaults(run=_service, action=action)
    return parser


def _topology_after(command: argparse.ArgumentParser) -> None:
    """--topology accepted after the command too (`disagg simulate --topology T ...`)."""
    command.add_argument(
        "--topology", default=argparse.SUPPRESS, help="as the global --topology, after the command"
    )


def _prometheus_config(args: argparse.Namespace) -> int:
    from disagg_mesh.server.common.runtime.observability.prometheus_config import (
        prometheus_config,
    )

    if not args.scrape_interval > 0:
        raise CliError(f"--scrape-interval: must be above 0, got {args.scrape_interval}", 2)
    topology = _topology(args)
    text = prometheus_config(topology, str(args.topology), args.rules, args.scrape_interval)
    if all(n.metrics_port is None for n in topology.nodes):
        print(
            f"note: no node of {args.topology} has a metrics_port, so there is nothing to "
            "scrape: give each node one (e.g. metrics_port = 9100) and start them again",
            file=sys.stderr,
        )
    if args.out is None:
        print(text, end="")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}: {text.count('- targets:')} targets; rules: {args.rules}")
    return 0


def _service(args: argparse.Namespace) -> int:
    topology = _topology(args)
    node = next((n for n in topology.nodes if n.name == args.node), None)
    if node is None:
        names = ", ".join(n.name for n in topology.nodes)
        raise CliError(f"--node: no node named {args.node!r} in {args.topology}; nodes: {names}", 2)
    spec = ServiceSpec(
        node=node.name,
        role=node.role,
        topology=Path(args.topology).resolve(),
        workdir=Path(__file__).resolve().parent.parent,
        python=Path(sys.executable),
        os=args.os or this_os(),
        system=args.system,
    )
    home = Path.home()
    path = spec.path(home)
    if args.action == "uninstall":
        if args.print:
            print(f"would remove {path}; then: " + "; ".join(spec.disable_commands(home)))
            return 0
        if not path.exists():
            raise CliError(f"{path} does not exist: nothing to uninstall")
        path.unlink()
        print(f"removed {path}")
        print("stop it with: " + "; ".join(spec.disable_commands(home)))
        return 0
    text = spec.render(home)
    if args.print:
        print(f"# {path}")
        print(text, end="")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    if spec.os == "macos":
        spec.log_file(home).parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    print("start it now and at every boot with: " + "; ".join(spec.enable_commands(home)))
    return 0


def _topology(args: argparse.Namespace) -> Any:
    from disagg_mesh.server.common.config.topology import TopologyError, load_topology

    try:
        return load_topology(args.topology)
    except TopologyError as exc:
        raise CliError(str(exc), 2) from None


def _router_address(args: argparse.Namespace) -> str:
    if args.router:
        return str(args.router)
    if os.environ.get("DISAGG_ROUTER"):
        return os.environ["DISAGG_ROUTER"]
    if Path(args.topology).is_file():
        return str(_topology(args).router_addresses)
    return DEFAULT_ADDRESS


def _tls(args: argparse.Namespace) -> TlsFiles | None:
    return TlsFiles(args.ca, args.cert, args.key) if args.ca else None


def _client(args: argparse.Namespace) -> MeshClient:
    return MeshClient(_router_address(args), timeout=args.timeout, tls=_tls(args), token=args.token)


# -- generate ------------------------------------------------------------------------------


def _generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    chat = args.chat or args.reasoning_effort is not None or args.tools is not None
    if chat and args.suffix:
        raise CliError(
            "--suffix fills in the middle of prompt text: leave out --chat, "
            "--reasoning-effort and --tools",
            2,
        )
    try:
        call = _generate_call(args, prompt, chat)
    except ValueError as exc:  # a value the request cannot carry
        raise CliError(str(exc), 2) from None
    with _client(args) as mesh:
        if args.json:
            result = mesh.generate(call)
            out = {
                "text": result.text,
                "reasoning": result.reasoning,
                "tool_calls": [_call_json(c) for c in result.tool_calls],
            }
            if args.logprobs is not None:
                out["logprobs"] = [_logprob_json(lp) for lp in result.logprobs]
            print(json.dumps({**out, "metrics": result.metrics.as_dict()}, indent=2))
            return 0
        metrics: Metrics | None = None
        calls: dict[int, ToolCall] = {}
        scores: list[TokenLogprob] = []
        for item in mesh.stream(call, reasoning=True):
            if isinstance(item, Metrics):
                metrics = item
            elif isinstance(item, ToolCallDelta):
                calls.setdefault(item.index, ToolCall(item.id, item.name))
                calls[item.index].arguments += item.arguments
            elif isinstance(item, Reasoning):  # on stderr: stdout is the answer alone
                sys.stderr.write(item)
                sys.stderr.flush()
            elif isinstance(item, Logprobs):  # shown after the answer
                scores.extend(item)
            else:
                sys.stdout.write(item)
                sys.stdout.flush()
        sys.stdout.write("\n")
        for index in sorted(calls):
            print(json.dumps(_call_json(calls[index])))
        for score in scores:
            print(_logprob_line(score), file=sys.stderr)
        if metrics is not None:
            print(metrics.one_line(), file=sys.stderr)
    return 0


def _logprob_json(lp: TokenLogprob) -> dict[str, Any]:
    out: dict[str, Any] = {"token_id": lp.token_id, "text": lp.text, "logprob": lp.logprob}
    if lp.top:
        out["top"] = [_logprob_json(t) for t in lp.top]
    return out


def _logprob_line(lp: TokenLogprob) -> str:
    """A token's log probability as --logprobs prints it: its text (quoted, as Python
    writes it), the log probability and the probability, then the most likely tokens at
    its place."""
    line = f"{lp.text!r:>16} {lp.logprob:9.4f} {100 * math.exp(lp.logprob):6.2f} %"
    if lp.top:
        line += "   " + "  ".join(f"{t.text!r} {100 * math.exp(t.logprob):.2f} %" for t in lp.top)
    return line


def _generate_call(args: argparse.Namespace, prompt: str, chat: bool) -> GenerateCall:
    return GenerateCall(
        model=args.model,
        prompt="" if chat else prompt,
        messages=[{"role": "user", "content": prompt}] if chat else [],
        reasoning_effort=args.reasoning_effort,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        repeat_last_n=args.repeat_last_n,
        logit_bias=_logit_bias(args.logit_bias),
        logprobs=args.logprobs,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        stop=args.stop,
        format=_format(args.format),
        tools=_tools(args.tools),
        tool_choice=args.tool_choice,
        suffix=args.suffix,
    )


def _call_json(call: ToolCall) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.arguments or "{}")
    except ValueError:
        arguments = call.arguments  # as the model wrote it
    return {"id": call.id, "name": call.name, "arguments": arguments}


def _tools(path: str | None) -> list[dict[str, Any]]:
    """--tools: a JSON file holding a list of tools in OpenAI's shape."""
    if path is None:
        return []
    try:
        tools = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise CliError(f"--tools: {exc}", 2) from None
    if not isinstance(tools, list):
        raise CliError(f"--tools: {path} must hold a JSON list of tools", 2)
    return tools


def _logit_bias(values: list[str]) -> dict[int, float]:
    """--logit-bias ID=BIAS, repeated."""
    biases = {}
    for value in values:
        token, _, bias = value.partition("=")
        try:
            biases[int(token)] = float(bias)
        except ValueError:
            raise CliError(f"--logit-bias: ID=BIAS, e.g. 42=-100, got {value!r}", 2) from None
    return biases


def _format(value: str | None) -> str | dict[str, Any] | None:
    """--format: "json", a JSON Schema's text, or a file holding one."""
    if value is None or value == "json":
        return value
    text = value
    if not value.lstrip().startswith("{"):
        try:
            text = Path(value).read_text()
        except OSError as exc:
            raise CliError(f'--format: "json", a JSON Schema or a schema file; {exc}', 2) from None
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise CliError(f"--format: {value} is not valid JSON: {exc}", 2) from None
    if not isinstance(schema, dict):
        raise CliError(f"--format: a JSON Schema is an object, got {text[:60]!r}", 2)
    return schema


# -- simulate ------------------------------------------------------------------------------


def _simulate(args: argparse.Namespace) -> int:
    from disagg_mesh.server.common.config.topology import TopologyError
    from disagg_mesh.server.common.errors import MeshError as ServerError
    from disagg_mesh.server.simulation.run import simulate

    if not 0 < args.speedup <= 10_000:
        raise CliError(f"--speedup: between 0 and 10000, got {args.speedup}", 2)
    if args.concurrency is not None and args.concurrency < 1:
        raise CliError(f"--concurrency: must be at least 1, got {args.concurrency}", 2)
    if args.ollama_parallel is not None and args.ollama_parallel < 1:
        raise CliError(f"--ollama-parallel: must be at least 1, got {args.ollama_parallel}", 2)

    def progress(line: str) -> None:
        if not args.json:
            print(f"... {line}", file=sys.stderr, flush=True)

    try:
        got = simulate(
            Path(args.topology),
            args.workload,
            profile=args.profile,
            speedup=args.speedup,
            concurrency=args.concurrency,
            keep_logs=args.logs,
            progress=progress,
            ollama_parallel=args.ollama_parallel,
        )
    except (ServerError, TopologyError) as exc:
        raise CliError(str(exc), 2) from None
    except BatchInputError as exc:
        raise CliError(f"{args.workload}: nothing was simulated:\n{exc}", 2) from None
    print(json.dumps(got.data, indent=2) if args.json else got.text())
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """In a process of its own: llama.cpp loads before grpc there (services/node.py)."""
    import subprocess

    command = [sys.executable, "-m", "disagg_mesh.server.simulation.calibrate"]
    command += ["--topology", str(args.topology), "--out", str(args.out)]
    return subprocess.run(command, check=False).returncode


# -- batch ---------------------------------------------------------------------------------


def _batch(args: argparse.Namespace) -> int:
    if args.concurrency is not None and args.concurrency < 1:
        raise CliError(f"--concurrency: must be at least 1, got {args.concurrency}", 2)
    try:
        requests = read_requests(args.input)
    except BatchInputError as exc:
        raise CliError(f"{args.input}: nothing was run:\n{exc}", 2) from None
    try:
        results = ResultsFile(args.output)
    except ValueError as exc:
        raise CliError(str(exc), 2) from None
    try:
        return asyncio.run(_run_batch(args, requests, results))
    except KeyboardInterrupt:
        done = sum(r.custom_id in results.done for r in requests)
        print(
            f"\ninterrupted: {done} of {len(requests)} results are in {args.output}; run the "
            "same command again to go on with the rest",
            file=sys.stderr,
        )
        return 130
    finally:
        results.close()


async def _run_batch(
    args: argparse.Namespace, requests: list[BatchRequest], results: ResultsFile
) -> int:
    out = sys.stdout
    async with AsyncMeshClient(
        _router_address(args), timeout=args.timeout, tls=_tls(args), token=args.token
    ) as mesh:
        print(f"checking {len(requests)} requests with the router", file=out, flush=True)
        try:
            # Every line checked by a router, the done ones too, before anything runs.
            await (await mesh.batch_run(requests, concurrency=1)).validate()
        except BatchInputError as exc:
            raise CliError(f"{args.input}: nothing was run:\n{exc}", 2) from None
        failed_before = len(results.failed)
        if args.retry_failed:
            results.forget_failed()
        todo = [r for r in requests if r.custom_id not in results.done]
        kept = len(requests) - len(todo)
        if args.dry_run:
            print(
                f"{len(requests)} requests valid; {kept} already in {args.output}, "
                f"{len(todo)} to run",
                file=out,
            )
            return 0
        failed_kept = 0 if args.retry_failed else failed_before
        if kept:
            note = f" ({failed_kept} failed: --retry-failed runs them again)" if failed_kept else ""
            print(f"{kept} of {len(requests)} already in {args.output}{note}", file=out)
        if not todo:
            return 1 if failed_kept else 0
        run = await mesh.batch_run(
            todo, concurrency=args.concurrency, group_prefixes=not args.file_order
        )
        at_once = min(run.concurrency, len(todo))
        print(f"running {len(todo)} requests, {at_once} at once", file=out, flush=True)
        tally = Tally(len(todo))
        with Display(tally, out) as display:

            async def tick() -> None:
                while True:
                    display.show(run.in_flight)
                    await asyncio.sleep(0.25)

            ticker = asyncio.create_task(tick())
            try:
                async for result in run.results():
                    results.append(result)
                    tally.add(result)
                    display.show(run.in_flight)
            finally:
                ticker.cancel()
    print(_table(summary_rows(tally.results)), file=out)
    failed = tally.failed + failed_kept
    if failed:
        print(
            f"{failed} failed (their errors are in {args.output}); `--retry-failed` runs "
            "them again",
            file=out,
        )
        return 1
    print(f"all {len(requests)} results are in {args.output}", file=out)
    return 0


# -- models --------------------------------------------------------------------------------


def _models(args: argparse.Namespace) -> int:
    with _client(args) as mesh:
        routes = mesh.list_models()
    rows = [
        {
            "model": r.model,
            "prefill": ", ".join(f"{n.name} ({n.address})" for n in r.prefill_nodes) or "-",
            "decode": ", ".join(f"{n.name} ({n.address})" for n in r.decode_nodes) or "-",
            "deadlines": f"{r.prefill_deadline.ToSeconds()} s / {r.decode_deadline.ToSeconds()} s",
        }
        for r in routes
    ]
    print(json.dumps(rows, indent=2) if args.json else _table(rows))
    return 0


# -- status --------------------------------------------------------------------------------


@dataclass
class NodeRow:
    node: str
    role: str
    address: str
    engine: str
    model: str
    health: str
    latency_ms: float | None
    note: str


def _status(args: argparse.Namespace) -> int:
    topology = _topology(args)
    while True:
        rows = asyncio.run(_check_all(topology, args))
        down = [r for r in rows if r.health != "SERVING"]
        if args.json:
            print(json.dumps([r.__dict__ for r in rows], indent=2))
        else:
            if args.watch:
                print("\033[2J\033[H", end="")
                print(f"{time.strftime('%H:%M:%S')}  {args.topology}  (Ctrl-C to stop)")
            print(_table([_status_cells(r) for r in rows]))
            print(f"{len(rows) - len(down)} of {len(rows)} nodes SERVING")
        if not args.watch:
            return 1 if down else 0
        time.sleep(args.watch)


def _status_cells(r: NodeRow) -> dict[str, str]:
    return {
        "node": r.node,
        "role": r.role,
        "address": r.address,
        "engine": r.engine or "-",
        "model": r.model or "-",
        "health": r.health,
        "latency": f"{r.latency_ms:.1f} ms" if r.latency_ms is not None else "-",
        "note": r.note,
    }


async def _check_all(topology: Any, args: argparse.Namespace) -> list[NodeRow]:
    return list(await asyncio.gather(*(_check(node, args) for node in topology.nodes)))


async def _check(node: Any, args: argparse.Namespace) -> NodeRow:
    row = NodeRow(
        node.name, node.role, node.address, node.engine or "", node.model or "", "", None, ""
    )
    if args.ca:
        creds = TlsFiles(args.ca, args.cert, args.key).credentials()
        channel = grpc.aio.secure_channel(node.address, creds, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.aio.insecure_channel(node.address, options=CHANNEL_OPTIONS)
    async with channel:
        from disagg_mesh.server.common.wire.node_clients import health_status

        started = time.perf_counter()
        status, detail = await health_status(channel, timeout_s=2.0)
        if status not in ("SERVING", "NOT_SERVING"):  # the check itself failed
            row.health = "DOWN" if status == "UNAVAILABLE" else status
            row.note = detail[:80]
            return row
        row.latency_ms = (time.perf_counter() - started) * 1000
        row.health = status
        figures = await asyncio.to_thread(_headline_figures, node)
        info_stub: Any = node_pb2_grpc.NodeServiceStub(channel)
        try:
            info = await info_stub.GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            # A router from before routers served NodeService: its figures, as before.
            old_router = node.role == "router" and exc.code() == grpc.StatusCode.UNIMPLEMENTED
            row.note = figures if old_router else f"node info: {exc.code().name}"
            return row
        # A router's info has no engine fields: only its restarts and figures show.
        notes = []
        if info.problem:
            notes.append(info.problem)
        if info.restarts:
            notes.append(f"restarted {info.restarts}x")
        if node.engine == "ollama":
            notes.append("model in memory" if info.model_loaded_in_memory else "model not loaded")
        if info.backend:
            notes.append(f"{info.backend}, {info.gpu_layers}/{info.model_layers} layers on GPU")
        if info.slots:
            notes.append(
                f"slots {info.slots_busy}/{info.slots}, queue {info.queue_depth}/"
                f"{info.max_queue}, {info.prompt_tokens_per_second:.0f} prompt + "
                f"{info.decode_tokens_per_second:.0f} decode tok/s"
            )
        if info.prefix_cache_max_tokens:
            notes.append(
                f"prefix cache {info.prefix_cache_tokens}/{info.prefix_cache_max_tokens} tokens"
            )
        if node.role == "prefill":
            notes.append(f"kv {info.kv_store_handles} held, {info.kv_store_bytes / 1e6:.1f} MB")
        if figures:
            notes.append(figures)
        row.note = "; ".join(notes)
    return row


def _headline_figures(node: Any) -> str:
    """From the node's Prometheus metrics (when it has a metrics_port): calls served, failed
    and in flight. Empty when there are none to read."""
    if not node.metrics_port:
        return ""
    url = f"http://{node.host}:{node.metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return "metrics unreachable"
    served = failed = in_flight = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "disagg_rpcs_total":
                served += sample.value
                failed += sample.value if sample.labels.get("code") != "OK" else 0
            elif sample.name == "disagg_rpcs_in_flight":
                in_flight += sample.value
    return f"{served:.0f} calls, {failed:.0f} failed, {in_flight:.0f} in flight"


# -- doctor --------------------------------------------------------------------------------


def _doctor(args: argparse.Namespace) -> int:
    from disagg_mesh import doctor

    topology = _topology(args)
    credentials = TlsFiles(args.ca, args.cert, args.key).credentials() if args.ca else None
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    found = asyncio.run(doctor.run(topology, credentials, metadata))
    if args.json:
        print(json.dumps([v.__dict__ for v in found], indent=2))
    else:
        rows = [
            {
                "model": v.model,
                "prefill": v.prefill,
                "decode": v.decode,
                "handoff": "ok" if v.ok else "NO",
                "why": v.says,
            }
            for v in found
        ]
        print(_table(rows))
        bad = sum(not v.ok for v in found)
        print(f"{len(found) - bad} of {len(found)} prefill/decode pairs can hand KV over")
    return 1 if any(not v.ok for v in found) else 0


def _table(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "(none)"
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    lines = ["  ".join(k.upper().ljust(widths[k]) for k in keys)]
    lines += ["  ".join(str(r[k]).ljust(widths[k]) for k in keys) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


if __name__ == "__main__":
    sys.exit(main())
