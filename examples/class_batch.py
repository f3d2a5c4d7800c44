"""Write a batch file that grades a whole class with both models, for `disagg batch`.

    python examples/class_batch.py [SUBMISSIONS_DIR] -o class.jsonl [--max-tokens 400]
    disagg batch class.jsonl -o graded.jsonl          # run again to resume

Every `*.py` file of SUBMISSIONS_DIR (without one: a few sample submissions) becomes two
lines: code analysis by qwen3-coder:30b through OpenAI's /v1/chat/completions, written
feedback by gpt-oss:120b through Ollama's /api/chat. Both start with the same rubric, so
`disagg batch` sends each model's first request ahead and the prefix cache serves the rubric
to the rest. custom_id is the file's name and the task: `alice.py/code`,
`alice.py/feedback`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RUBRIC = """You grade first-year Python homework. Rubric:
- correctness (40 points): the function returns the right value for every input, empty
  input, negative numbers and very large values included;
- style (20 points): PEP 8, clear names, no dead code, no needless loops;
- tests (20 points): unit tests cover the edge cases above;
- documentation (20 points): a docstring that says what the function takes and returns.
Give points per part, then the total out of 100, then what to fix first."""

SAMPLES = {
    "alice.py": "def average(xs):\n    return sum(xs) / len(xs)\n",
    "bob.py": "def average(numbers):\n    total = 0\n    for n in numbers:\n"
    "        total += n\n    return total / len(numbers)\n",
    "carol.py": 'def average(xs):\n    """Mean of xs; 0.0 when empty."""\n'
    "    return sum(xs) / len(xs) if xs else 0.0\n",
    "dave.py": "def average(l):\n    x = 0\n    for i in range(len(l)):\n        x = x + l[i]\n"
    "    return x / len(l)\n",
}


def lines(submissions: dict[str, str], max_tokens: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for name, code in sorted(submissions.items()):
        turns = [
            {"role": "system", "content": RUBRIC},
            {"role": "user", "content": f"Submission {name}:\n\n{code}"},
        ]
        out.append(
            {
                "custom_id": f"{name}/code",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "qwen3-coder:30b",
                    "messages": turns,
                    "max_tokens": max_tokens,
                    "temperature": 0.2,
                },
            }
        )
        out.append(
            {
                "custom_id": f"{name}/feedback",
                "method": "POST",
                "url": "/api/chat",
                "body": {
                    "model": "gpt-oss:120b",
                    "messages": turns,
                    "options": {"num_predict": max_tokens, "temperature": 0.2},
                },
            }
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, help="a folder of *.py submissions")
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=400)
    args = parser.parse_args()
    if args.folder is None:
        submissions = SAMPLES
    else:
        submissions = {p.name: p.read_text() for p in sorted(args.folder.glob("*.py"))}
        if not submissions:
            print(f"error: no *.py files in {args.folder}", file=sys.stderr)
            return 2
    batch = lines(submissions, args.max_tokens)
    args.output.write_text("".join(json.dumps(line) + "\n" for line in batch))
    print(f"{len(batch)} requests for {len(submissions)} submissions in {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
