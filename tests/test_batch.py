"""`disagg batch` and MeshClient.batch against the session's mesh of real nodes: OpenAI's batch
file format in and out, through the router's HTTP door; killed and run again; bad lines;
the progress bar in a pseudo-terminal."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg_mesh import AsyncMeshClient, MeshClient
from disagg_mesh.batch import BatchInputError, BatchRequest, BatchRun, plan
from disagg_mesh.routers import Routers
from disagg_mesh.server.common.runtime.processes import free_port
from tests.conftest import ROOT, Mesh
from tests.test_http_api import http_url

QWEN, GPT_OSS = "qwen3-coder:30b", "gpt-oss:120b"
RUBRIC = (
    "You grade Python homework. Rubric: correctness 40 points (every test passes), style 20 "
    "points (clear names), tests 20 points (edge cases), documentation 20 points. "
) * 3


def submission(i: int) -> str:
    return f"def add_{i}(a, b):\n    return a + b + {i}\n"


def class_lines(n: int, max_tokens: int = 12) -> list[dict[str, Any]]:
    """n submissions, each graded by both models through all four endpoints in turn."""
    lines = []
    for i in range(n):
        chat = [
            {"role": "system", "content": RUBRIC},
            {"role": "user", "content": submission(i)},
        ]
        greedy = {"temperature": 0, "max_tokens": max_tokens}
        ollama_options = {"options": {"temperature": 0, "num_predict": max_tokens}}
        if i % 2:
            code = {
                "url": "/v1/chat/completions",
                "body": {"model": QWEN, "messages": chat, **greedy},
            }
            text = {
                "url": "/api/chat",
                "body": {"model": GPT_OSS, "messages": chat, **ollama_options},
            }
        else:
            prompt = RUBRIC + submission(i)
            code = {
                "url": "/api/generate",
                "body": {"model": QWEN, "prompt": prompt, **ollama_options},
            }
            text = {
                "url": "/v1/completions",
                "body": {"model": GPT_OSS, "prompt": prompt, **greedy},
            }
        lines.append({"custom_id": f"s{i}-code", "method": "POST", **code})
        lines.append({"custom_id": f"s{i}-feedback", "method": "POST", **text})
    return lines


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def disagg(mesh: Mesh, *args: str) -> list[str]:
    return [sys.executable, "-m", "disagg_mesh.cli", "--router", mesh.router_address, *args]


def run_cli(mesh: Mesh, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        disagg(mesh, *args), capture_output=True, text=True, timeout=600, cwd=ROOT, check=False
    )


def router_metric(mesh: Mesh, name: str) -> float:
    """The sum of a router metric's samples (all labels)."""
    router = mesh.topology.router
    with urllib.request.urlopen(f"http://{router.host}:{router.metrics_port}/metrics") as r:
        text = r.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


def generations(mesh: Mesh) -> float:
    """Requests the router has run (served or failed); dry runs are not among them."""
    return router_metric(mesh, "disagg_requests_total")


def wait_router_idle(mesh: Mesh) -> None:
    deadline = time.monotonic() + 120
    while router_metric(mesh, "disagg_http_requests_in_flight") > 0:
        assert time.monotonic() < deadline, "the router's HTTP requests never finished"
        time.sleep(0.2)


def results_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_killed_halfway_and_run_again_sends_only_what_is_missing(
    mesh: Mesh, tmp_path: Path
) -> None:
    lines = class_lines(20)  # 40 requests, both models, all four endpoints
    inp, out = write_jsonl(tmp_path / "class.jsonl", lines), tmp_path / "graded.jsonl"
    before = generations(mesh)
    first = subprocess.Popen(
        disagg(mesh, "batch", str(inp), "-o", str(out), "--concurrency", "6"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not out.exists() or out.read_text().count("\n") < 12:
        assert first.poll() is None and time.monotonic() < deadline, "the batch did not start"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    wait_router_idle(mesh)  # the killed run's requests in flight are cancelled or done
    kept = {r["custom_id"] for r in results_of(out) if r["response"]}
    assert 12 <= len(kept) < 40
    sent_first = generations(mesh) - before

    again = run_cli(mesh, "batch", str(inp), "-o", str(out))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{len(kept)} of 40 already in {out}" in again.stdout
    assert f"all 40 results are in {out}" in again.stdout
    # The second run sent exactly the requests the first left without a result.
    assert generations(mesh) - before - sent_first == 40 - len(kept)
    results = results_of(out)
    assert sorted(r["custom_id"] for r in results) == sorted(x["custom_id"] for x in lines)
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in results)
    assert all(r["id"].startswith("batch_req_") and r["response"]["request_id"] for r in results)
    by_id = {r["custom_id"]: r["response"]["body"] for r in results}
    assert by_id["s1-code"]["object"] == "chat.completion"
    assert by_id["s0-feedback"]["object"] == "text_completion"
    assert by_id["s1-feedback"]["message"]["role"] == "assistant"  # Ollama's /api/chat
    assert by_id["s0-code"]["done"] and by_id["s0-code"]["response"]  # Ollama's /api/generate
    # The summary: per model, requests, failures, latency, prompt tokens from the cache.
    assert re.search(
        r"qwen3-coder:30b\s+\d+\s+0\s+[\d.]+ s\s+[\d.]+ s\s+\d+\s+\d+ \(\d+%\)", again.stdout
    )
    # Running it once more sends nothing.
    done = generations(mesh)
    third = run_cli(mesh, "batch", str(inp), "-o", str(out))
    assert third.returncode == 0 and "40 of 40 already in" in third.stdout
    assert generations(mesh) == done


def test_answers_equal_the_openai_clients_and_carry_the_cache(mesh: Mesh, tmp_path: Path) -> None:
    """A batch line's body is what the endpoint answers that request with."""
    lines = class_lines(3)
    with MeshClient(mesh.router_address) as client:
        results = {r.custom_id: r for r in client.batch(lines, concurrency=2)}
    assert set(results) == {x["custom_id"] for x in lines} and all(r.ok for r in results.values())
    api = openai.OpenAI(base_url=http_url(mesh) + "/v1", api_key="unused")
    line = next(x for x in lines if x["custom_id"] == "s1-code")
    direct = api.chat.completions.create(**line["body"])
    body = results["s1-code"].body
    assert body is not None
    assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
    # The rubric is shared: the later requests of a model got it from the prefix cache.
    assert sum(r.cached_prompt_tokens for r in results.values()) > 0
    assert (
        body["usage"]["prompt_tokens_details"]["cached_tokens"]
        == results["s1-code"].cached_prompt_tokens
    )


async def test_async_batch_with_structured_output(mesh: Mesh) -> None:
    schema = {
        "type": "object",
        "properties": {"score": {"type": "integer"}, "comment": {"type": "string"}},
        "required": ["score", "comment"],
    }
    grade = {
        "model": QWEN,
        "messages": [{"role": "user", "content": "Grade: def f(): return 1"}],
        "max_tokens": 60,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "g", "schema": schema}},
    }
    requests: list[BatchRequest | dict[str, Any]] = [
        BatchRequest("openai", "/v1/chat/completions", grade),
        {
            "custom_id": "ollama",
            "url": "/api/chat",
            "body": {
                "model": GPT_OSS,
                "messages": grade["messages"],
                "format": schema,
                "options": {"temperature": 0, "num_predict": 60},
            },
        },
    ]
    async with AsyncMeshClient(mesh.router_address) as client:
        got = {r.custom_id: r async for r in client.batch(requests)}
    assert got["openai"].ok and got["ollama"].ok
    for result in got.values():
        body = result.body or {}
        text = (
            body["choices"][0]["message"]["content"]
            if "choices" in body
            else body["message"]["content"]
        )
        if body.get("done_reason", body.get("choices", [{}])[0].get("finish_reason")) == "stop":
            assert set(json.loads(text)) == {"score", "comment"}


def test_bad_lines_are_named_and_nothing_runs(mesh: Mesh, tmp_path: Path) -> None:
    good = class_lines(1)
    chat = {"model": QWEN, "messages": [{"role": "user", "content": "hi"}]}
    malformed = write_jsonl(
        tmp_path / "malformed.jsonl",
        [
            *good,
            '{"custom_id": "cut", "url": "/v1/chat/completions"',
            {"custom_id": "s0-code", "method": "POST", "url": "/v1/chat/completions", "body": chat},
            {"custom_id": "get", "method": "GET", "url": "/v1/chat/completions", "body": chat},
            {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": chat},
            {"custom_id": "", "method": "POST", "url": "/v1/chat/completions", "body": chat},
            {"custom_id": "s", "url": "/v1/chat/completions", "body": {**chat, "stream": True}},
        ],
    )
    out = tmp_path / "out.jsonl"
    before = generations(mesh)
    got = run_cli(mesh, "batch", str(malformed), "-o", str(out))
    assert got.returncode == 2 and "Traceback" not in got.stderr
    said = got.stderr
    assert "nothing was run" in said
    assert "line 3: not valid JSON" in said
    assert "line 4: custom_id 's0-code' is already used on line 1" in said
    assert 'line 5: method: must be "POST"' in said
    assert "line 6: url: must be one of /v1/chat/completions" in said
    assert "line 7: custom_id: must be a non-empty string" in said
    assert "line 8: body.stream" in said
    # Lines whose shape is right, checked by the router before anything runs.
    refused = write_jsonl(
        tmp_path / "refused.jsonl",
        [
            *good,
            {
                "custom_id": "m",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {**chat, "model": "llama3:8b"},
            },
            {
                "custom_id": "t",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {**chat, "temperature": "hot"},
            },
            {
                "custom_id": "f",
                "method": "POST",
                "url": "/api/generate",
                "body": {
                    "model": QWEN,
                    "prompt": "x",
                    "format": {"type": "string", "format": "email"},
                },
            },
        ],
    )
    got = run_cli(mesh, "batch", str(refused), "-o", str(out))
    assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr
    assert "line 3 (m): model 'llama3:8b' is not served here" in got.stderr
    assert "line 4 (t): temperature: must be a number" in got.stderr
    assert "line 5 (f): format: format 'email' is not supported" in got.stderr
    assert not out.exists() and generations(mesh) == before
    # --dry-run checks a good file and runs nothing.
    fine = write_jsonl(tmp_path / "fine.jsonl", good)
    got = run_cli(mesh, "batch", str(fine), "-o", str(out), "--dry-run")
    assert got.returncode == 0 and "2 requests valid; 0 already in" in got.stdout
    assert not out.exists() and generations(mesh) == before
    # The Python API refuses the same way, before running anything.
    with MeshClient(mesh.router_address) as client, pytest.raises(BatchInputError) as caught:
        list(
            client.batch(
                [
                    *good,
                    {
                        "custom_id": "x",
                        "url": "/v1/chat/completions",
                        "body": {**chat, "model": "nope"},
                    },
                ]
            )
        )
    assert "custom_id 'x'" in str(caught.value) and "'nope' is not served here" in str(caught.value)
    assert generations(mesh) == before


def test_failures_are_kept_until_retry_failed(mesh: Mesh, tmp_path: Path) -> None:
    """A request that fails when it runs (a decode deadline of 0.5 s) is recorded with its
    status and message; run again it is kept, with --retry-failed it runs again."""
    slow = {
        "custom_id": "slow",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "test/tight-decode",
            "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 2000,
            "ignore_eos": True,
        },
    }
    inp = write_jsonl(tmp_path / "in.jsonl", [*class_lines(1), slow])
    out = tmp_path / "out.jsonl"
    got = run_cli(mesh, "batch", str(inp), "-o", str(out))
    assert got.returncode == 1 and "1 failed" in got.stdout and "--retry-failed" in got.stdout
    failed = next(r for r in results_of(out) if r["custom_id"] == "slow")
    assert failed["response"]["status_code"] == 504
    assert "decode" in failed["response"]["body"]["error"]["message"]
    before = generations(mesh)
    got = run_cli(mesh, "batch", str(inp), "-o", str(out))
    assert got.returncode == 1 and "3 of 3 already in" in got.stdout
    assert generations(mesh) == before
    got = run_cli(mesh, "batch", str(inp), "-o", str(out), "--retry-failed")
    assert got.returncode == 1 and "running 1 requests" in got.stdout
    assert generations(mesh) == before + 1
    assert sorted(r["custom_id"] for r in results_of(out)) == ["s0-code", "s0-feedback", "slow"]


def test_ctrl_c_stops_and_says_how_to_resume(mesh: Mesh, tmp_path: Path) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", class_lines(6, max_tokens=48))
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        disagg(mesh, "batch", str(inp), "-o", str(out), "--concurrency", "2"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not out.exists() or not out.read_text().count("\n"):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stdout + stderr
    done = len(results_of(out))
    assert 1 <= done < 12 and "Traceback" not in stderr
    assert f"interrupted: {done} of 12 results are in {out}; run the same command again" in stderr
    assert not Path(f"{out}.lock").exists()
    wait_router_idle(mesh)
    got = run_cli(mesh, "batch", str(inp), "-o", str(out))
    assert got.returncode == 0 and f"{done} of 12 already in" in got.stdout
    assert len(results_of(out)) == 12


def test_progress_bar_in_a_terminal(mesh: Mesh, tmp_path: Path) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", class_lines(3))
    out = tmp_path / "out.jsonl"
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    proc = subprocess.Popen(
        disagg(mesh, "batch", str(inp), "-o", str(out)),
        cwd=ROOT,
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "140"},
    )
    os.close(terminal)
    seen = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed: the process ended
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=60) == 0
    os.close(controller)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.decode())
    frames = [f.strip() for f in re.split(r"[\r\n]", text) if f.strip()]
    bars = [f for f in frames if f.startswith("batch ")]
    assert len(bars) >= 2, frames
    # The last frame: all done, counts, rate and ETA, readable once the colours are gone.
    assert re.search(
        r"6/6 6 ok, 0 failed, 0 in flight, \d+ tok/s \d:\d\d:\d\d ETA 0:00:00", bars[-1]
    )
    assert any("in flight" in b and not b.startswith("batch: ") for b in bars)
    assert "MODEL" in text and "all 6 results are in" in text


def test_plain_lines_when_not_a_terminal(mesh: Mesh, tmp_path: Path) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", class_lines(1))
    got = run_cli(mesh, "batch", str(inp), "-o", str(tmp_path / "out.jsonl"))
    assert got.returncode == 0
    assert "\x1b[" not in got.stdout
    assert re.search(
        r"^batch: 2/2 done \(2 ok, 0 failed, 0 in flight, \d+ tok/s\), ETA 0:00:00$",
        got.stdout,
        re.M,
    )


async def test_a_router_that_cannot_be_reached_is_passed_over(mesh: Mesh) -> None:
    """Router doors in order: the first refuses connections, every request goes on to the next."""
    dead = f"http://127.0.0.1:{free_port()}"
    requests = [
        BatchRequest(
            f"r{i}", "/v1/completions", {"model": QWEN, "prompt": f"{i} +", "max_tokens": 4}
        )
        for i in range(4)
    ]
    run = BatchRun(
        requests,
        Routers((dead, http_url(mesh)), cooldown_s=30),
        4,
        headers={},
        ssl_context=None,
        timeout_s=120,
    )
    results = [r async for r in run.results()]
    assert sorted(r.custom_id for r in results) == ["r0", "r1", "r2", "r3"]
    assert all(r.ok for r in results)


def test_plan_groups_shared_prompts_and_alternates_models() -> None:
    def req(cid: str, model: str, prompt: str) -> BatchRequest:
        return BatchRequest(cid, "/v1/completions", {"model": model, "prompt": prompt})

    rubric = "R" * 300
    order = plan(
        [
            req("a1", "a", rubric + "1"),
            req("x", "a", "short"),
            req("a2", "a", rubric + "2"),
            req("b1", "b", rubric + "1"),
            req("b2", "b", rubric + "2"),
        ]
    )
    got = [(r.custom_id, after) for r, after in order]
    assert got == [("a1", None), ("b1", None), ("a2", "a1"), ("b2", "b1"), ("x", None)]


def test_class_batch_example_writes_a_batch_the_router_accepts(mesh: Mesh, tmp_path: Path) -> None:
    folder = tmp_path / "submissions"
    folder.mkdir()
    (folder / "alice.py").write_text("def f(x):\n    return x * 2\n")
    (folder / "bob.py").write_text("def f(x):\n    return x + x\n")
    batch = tmp_path / "class.jsonl"
    made = subprocess.run(
        [sys.executable, "examples/class_batch.py", str(folder), "-o", str(batch)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=60,
    )
    assert made.returncode == 0 and "4 requests for 2 submissions" in made.stdout
    ids = [json.loads(line)["custom_id"] for line in batch.read_text().splitlines()]
    assert ids == ["alice.py/code", "alice.py/feedback", "bob.py/code", "bob.py/feedback"]
    got = run_cli(mesh, "batch", str(batch), "-o", str(tmp_path / "out.jsonl"), "--dry-run")
    assert got.returncode == 0 and "4 requests valid" in got.stdout, got.stderr


async def test_each_model_has_its_own_number_at_once() -> None:
    """With model_concurrency, a slow model's requests take only its own places: the fast
    model's requests go on beside them (one shared gate filled with the slow model's
    requests, which then waited at the router while the other model's nodes idled)."""
    from aiohttp import web

    in_flight: dict[str, int] = {"slow": 0, "fast": 0}
    most: dict[str, int] = {"slow": 0, "fast": 0}
    fast_done_while_slow_ran = 0

    async def answer(request: web.Request) -> web.Response:
        nonlocal fast_done_while_slow_ran
        model = (await request.json())["model"]
        in_flight[model] += 1
        most[model] = max(most[model], in_flight[model])
        await asyncio.sleep(0.5 if model == "slow" else 0.02)
        in_flight[model] -= 1
        if model == "fast" and in_flight["slow"]:
            fast_done_while_slow_ran += 1
        return web.json_response({"model": model, "choices": []})

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        requests = [
            BatchRequest(f"{m}{i}", "/v1/completions", {"model": m, "prompt": f"{m} {i}"})
            for i in range(8)
            for m in ("slow", "fast")
        ]
        run = BatchRun(
            requests,
            Routers((f"http://127.0.0.1:{port}",), cooldown_s=30),
            4,
            headers={},
            ssl_context=None,
            timeout_s=30,
            group_prefixes=False,
            model_concurrency={"slow": 2, "fast": 2},
        )
        results = [r async for r in run.results()]
    finally:
        await runner.cleanup()
    assert len(results) == 16 and all(r.ok for r in results)
    assert most == {"slow": 2, "fast": 2}
    assert fast_done_while_slow_ran == 8  # every fast request while slow ones still ran
