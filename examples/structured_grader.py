"""The grader asking for scores it can parse: a pydantic model (criterion, score 0-4,
reason) instead of free text, through the router's HTTP doors with the clients the grader
already has.

    python examples/structured_grader.py [--host http://127.0.0.1:11435] [submission.py]

Code analysis from qwen3-coder:30b through the `ollama` client (format=the model's JSON
Schema) and written feedback from gpt-oss:120b through the `openai` client
(`chat.completions.parse` with response_format=the model), both at once; then one table.
Every answer is JSON the schema allows (a grammar constrains the sampling); only an answer
cut by --max-tokens fails to parse. Exit code 1 if either call failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import ollama
import openai
from pydantic import BaseModel, Field

SAMPLE = """def average(numbers):
    total = 0
    for n in numbers:
        total += n
    return total / len(numbers)
"""
CRITERIA = "correctness, edge cases and style"


class Criterion(BaseModel):
    criterion: Literal["correctness", "edge cases", "style"]
    score: int = Field(ge=0, le=4)
    reason: str = Field(min_length=10, max_length=160)


class Grade(BaseModel):
    criteria: list[Criterion] = Field(min_length=1, max_length=3)


def ask(code: str) -> str:
    return (
        f"Grade this submission on {CRITERIA}, each from 0 to 4, with a one-sentence "
        f"reason.\n\n{code}"
    )


def code_analysis(host: str, code: str, max_tokens: int) -> Grade:
    reply = ollama.Client(host=host).chat(
        model="qwen3-coder:30b",
        messages=[
            {"role": "system", "content": "You are a strict code reviewer."},
            {"role": "user", "content": ask(code)},
        ],
        format=Grade.model_json_schema(),
        options={"temperature": 0, "num_predict": max_tokens},
    )
    return Grade.model_validate_json(reply.message.content or "")


def feedback(host: str, code: str, max_tokens: int) -> Grade:
    client = openai.OpenAI(base_url=f"{host}/v1", api_key=os.environ.get("DISAGG_TOKEN", "-"))
    completion = client.chat.completions.parse(
        model="gpt-oss:120b",
        messages=[
            {"role": "system", "content": "You are a kind teaching assistant."},
            {"role": "user", "content": ask(code)},
        ],
        response_format=Grade,
        temperature=0,
        max_tokens=max_tokens,
    )
    parsed = completion.choices[0].message.parsed
    if parsed is None:
        raise ValueError(f"no parsed answer (finish_reason {completion.choices[0].finish_reason})")
    return parsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "submission", nargs="?", type=Path, help="a source file (default: a sample)"
    )
    parser.add_argument("--host", default="http://127.0.0.1:11435", help="router's HTTP door")
    parser.add_argument("--max-tokens", type=int, default=400)
    args = parser.parse_args()
    code = args.submission.read_text() if args.submission else SAMPLE

    with ThreadPoolExecutor(2) as pool:
        jobs = {
            "qwen3-coder:30b": pool.submit(code_analysis, args.host, code, args.max_tokens),
            "gpt-oss:120b": pool.submit(feedback, args.host, code, args.max_tokens),
        }
    rows = [("model", "criterion", "score", "reason")]
    failed = False
    for model, job in jobs.items():
        try:
            grade = job.result()
        except Exception as exc:  # an example: say what failed, go on with the other
            failed = True
            print(f"{model}: failed: {exc}", file=sys.stderr)
            continue
        rows += [(model, c.criterion, str(c.score), c.reason) for c in grade.criteria]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[3])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
