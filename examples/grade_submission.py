"""Grade one submission with both models at once, as the AI homework grader does.

    python examples/grade_submission.py [--router HOST:PORT[,HOST:PORT...]] [submission.py]

Code analysis goes to qwen3-coder:30b and written feedback to gpt-oss:120b, in parallel;
the script prints both results and their timings. Exit code 1 if either call failed.
Given several routers (one on each Mac Studio), a call goes on through another when one
fails, mid-answer included; $DISAGG_ROUTER is the default.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from disagg_mesh import GenerateCall, MeshClient, MeshError

SAMPLE = """def average(numbers):
    total = 0
    for n in numbers:
        total += n
    return total / len(numbers)
"""


def grading_calls(code: str, max_tokens: int) -> list[GenerateCall]:
    return [
        GenerateCall(
            model="qwen3-coder:30b",
            messages=[
                {"role": "system", "content": "You are a strict code reviewer."},
                {"role": "user", "content": f"List the bugs in this submission:\n\n{code}"},
            ],
            max_tokens=max_tokens,
            temperature=0.2,
        ),
        GenerateCall(
            model="gpt-oss:120b",
            messages=[
                {"role": "system", "content": "You are a kind teaching assistant."},
                {"role": "user", "content": f"Write short feedback for the student:\n\n{code}"},
            ],
            max_tokens=max_tokens,
            temperature=0.2,
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "submission", nargs="?", type=Path, help="a source file (default: a sample)"
    )
    parser.add_argument(
        "--router",
        default=os.environ.get("DISAGG_ROUTER", "127.0.0.1:50051"),
        help="router address, or several comma-separated (failover)",
    )
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    code = args.submission.read_text() if args.submission else SAMPLE

    started = time.perf_counter()
    with MeshClient(args.router) as mesh:
        analysis, feedback = mesh.gather(*grading_calls(code, args.max_tokens))
    wall = time.perf_counter() - started

    failed = False
    for title, result in (("Code analysis", analysis), ("Feedback", feedback)):
        print(f"== {title}")
        if isinstance(result, MeshError):
            failed = True
            print(f"failed: {result}")
            continue
        print(result.text.strip())
        m = result.metrics
        print(
            f"-- {m.method} via {m.prefill_server or '-'} -> {m.decode_server}: "
            f"prefill {m.prefill_time:.2f} s, decode {m.decode_time:.2f} s "
            f"({m.decode_speed:.0f} tok/s), total {m.total_time:.2f} s"
        )
    print(f"== both in parallel: {wall:.2f} s wall")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
