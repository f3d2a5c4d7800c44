"""The grader as an agent: the model calls `run_tests(code)`, this script runs the
assignment's tests on that code and sends the result back, and the model writes its grade.

    python examples/tool_grader.py [--host http://127.0.0.1:11435] [--model M] [submission.py]

Through the router's OpenAI door with the `openai` client: the first turn must call
run_tests (tool_choice names it), later turns may call it again (auto) up to --rounds
times, and the last turn writes the grade (tool_choice none). The tests run in a separate
Python process with a time limit. Exit code 1 if a call failed or no call was made.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai

SAMPLE = """def average(numbers):
    total = 0
    for n in numbers:
        total += n
    return total / len(numbers)
"""
TESTS = [
    ("average([1, 2, 3])", 2.0),
    ("average([5])", 5.0),
    ("average([-1, 1])", 0.0),
    ("average([])", 0.0),
]
RUN_TESTS = {
    "type": "function",
    "function": {
        "name": "run_tests",
        "description": "Run the assignment's unit tests on a Python function `average` and "
        "return which passed and which failed.",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "the Python code to test"},
            },
            "required": ["code"],
        },
    },
}


def run_tests(code: str, timeout_s: float = 5.0) -> str:
    """The assignment's tests on `code`, in a fresh Python process."""
    checks = "\n".join(
        f"try:\n    got = {call}\n    print('PASS' if got == {want!r} else 'FAIL', {call!r}, got)\n"
        f"except Exception as exc:\n    print('FAIL', {call!r}, type(exc).__name__)"
        for call, want in TESTS
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", f"{code}\n{checks}"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"the tests did not finish in {timeout_s:g} s"
    lines = out.stdout.splitlines()
    passed = sum(line.startswith("PASS") for line in lines)
    if not lines:
        error = out.stderr.strip().splitlines() or ["no output"]
        return f"the code did not run: {error[-1]}"
    return f"{passed} of {len(TESTS)} passed:\n" + "\n".join(lines)


def grade(client: openai.OpenAI, model: str, code: str, rounds: int, max_tokens: int) -> int:
    messages: list[Any] = [
        {
            "role": "system",
            "content": "You grade Python homework. Run the tests on the student's code "
            "before you grade it.",
        },
        {"role": "user", "content": f"Grade this submission out of 10:\n\n{code}"},
    ]
    calls = 0
    for turn in range(rounds + 1):
        choice: Any = "none" if turn == rounds else "auto"
        if turn == 0:
            choice = {"type": "function", "function": {"name": "run_tests"}}
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[RUN_TESTS],  # type: ignore[list-item]
            tool_choice=choice,
            temperature=0,
            max_tokens=max_tokens,
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            print(f"grade: {message.content}")
            return 0 if calls else 1
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            if call.type != "function":
                continue
            arguments = json.loads(call.function.arguments)
            calls += 1
            result = (
                run_tests(str(arguments.get("code", "")))
                if call.function.name == "run_tests"
                else f"no tool named {call.function.name}"
            )
            print(f"call: {call.function.name}({json.dumps(arguments)[:120]})")
            print("  " + result.replace("\n", "\n  "))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("submission", nargs="?", help="a .py file (default: a sample)")
    parser.add_argument("--host", default="http://127.0.0.1:11435")
    parser.add_argument("--model", default="qwen3-coder:30b")
    parser.add_argument("--rounds", type=int, default=2, help="turns that may call a tool")
    parser.add_argument("--max-tokens", type=int, default=300)
    args = parser.parse_args()
    code = Path(args.submission).read_text() if args.submission else SAMPLE
    client = openai.OpenAI(
        base_url=f"{args.host}/v1", api_key=os.environ.get("DISAGG_TOKEN", "-"), max_retries=4
    )
    try:
        return grade(client, args.model, code, args.rounds, args.max_tokens)
    except openai.APIError as exc:
        print(f"{args.model}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
