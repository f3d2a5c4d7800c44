"""The grader as it talks to Ollama today, unchanged but for the host: point it at the
router's HTTP port and both grading calls go through the mesh.

    python examples/ollama_grader.py [--host http://127.0.0.1:11435] [submission.py]

It uses only the `ollama` package, as the grader does: code analysis from qwen3-coder:30b
and written feedback from gpt-oss:120b, both at once (two threads), each streamed, then
Ollama's own timing fields. Exit code 1 if either call failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ollama

SAMPLE = """def average(numbers):
    total = 0
    for n in numbers:
        total += n
    return total / len(numbers)
"""


def ask(client: ollama.Client, model: str, system: str, user: str) -> str:
    parts = []
    last = None
    for part in client.chat(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        stream=True,
        options={"temperature": 0.2, "num_predict": 120},
    ):
        parts.append(part.message.content or "")
        last = part
    assert last is not None and last.done
    seconds = (last.total_duration or 0) / 1e9
    rate = (last.eval_count or 0) / max((last.eval_duration or 1) / 1e9, 1e-9)
    return (
        "".join(parts).strip()
        + f"\n   [{last.prompt_eval_count} prompt tokens, {last.eval_count} generated at "
        f"{rate:.0f} tok/s, {seconds:.2f} s in all, {last.done_reason}]"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("submission", nargs="?", type=Path)
    parser.add_argument("--host", default=os.environ.get("OLLAMA_HOST", "http://127.0.0.1:11435"))
    args = parser.parse_args()
    code = args.submission.read_text() if args.submission else SAMPLE
    client = ollama.Client(host=args.host)
    jobs = {
        "code analysis (qwen3-coder:30b)": (
            "qwen3-coder:30b",
            "You are a strict code reviewer.",
            f"List the bugs in this submission:\n\n{code}",
        ),
        "written feedback (gpt-oss:120b)": (
            "gpt-oss:120b",
            "You are a kind teaching assistant.",
            f"Write short feedback for the student:\n\n{code}",
        ),
    }
    failed = False
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {title: pool.submit(ask, client, *job) for title, job in jobs.items()}
        for title, future in futures.items():
            try:
                print(f"== {title}\n{future.result()}\n")
            except (ollama.ResponseError, ConnectionError) as exc:
                print(f"== {title}: failed: {exc}", file=sys.stderr)
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
