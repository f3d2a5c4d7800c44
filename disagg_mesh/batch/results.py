"""A batch's output: OpenAI's batch output format, one result per line.

    {"id": "batch_req_...", "custom_id": "alice-code",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

`body` is exactly what the endpoint answered (an error answer too, with its status code);
`error` ({"code", "message"}) is set instead of `response` when no router answered at all.
The file is appended to and flushed as each result comes, so a run killed at any moment
keeps every result it had; a run started again reads it to skip what is done.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


@dataclass(frozen=True)
class BatchResult:
    custom_id: str
    model: str
    # The HTTP status the endpoint answered with; 0 when no router answered (see error).
    status_code: int
    body: dict[str, Any] | None
    request_id: str = ""
    # {"code", "message"} when no router answered; None otherwise.
    error: dict[str, str] | None = None
    # Seconds from the first attempt to the answer, retries included.
    latency_s: float = 0.0
    id: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and self.status_code == 200

    @property
    def failure(self) -> str:
        """How a failure is counted: its HTTP status, or the error's code; "" when ok."""
        if self.ok:
            return ""
        return self.error["code"] if self.error else str(self.status_code)

    @property
    def message(self) -> str:
        """What went wrong, as the router said it."""
        if self.error:
            return self.error["message"]
        got = (self.body or {}).get("error")
        if isinstance(got, dict):  # OpenAI's error object
            return str(got.get("message", got))
        return str(got or "")

    def record(self) -> dict[str, Any]:
        response = (
            None
            if self.error
            else {"status_code": self.status_code, "request_id": self.request_id, "body": self.body}
        )
        return {
            "id": self.id or f"batch_req_{uuid.uuid4().hex}",
            "custom_id": self.custom_id,
            "response": response,
            "error": self.error,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> BatchResult:
        response = record.get("response") or {}
        body = response.get("body")
        return cls(
            custom_id=str(record["custom_id"]),
            model=str(body.get("model", "")) if isinstance(body, dict) else "",
            status_code=int(response.get("status_code") or 0),
            body=body if isinstance(body, dict) else None,
            request_id=str(response.get("request_id") or ""),
            error=record.get("error"),
            id=str(record.get("id", "")),
        )

    # -- figures of a successful answer, from either API's body ----------------------------

    def _figure(self, openai: tuple[str, ...], ollama: str) -> int:
        body = self.body or {}
        if ollama in body:
            return int(body.get(ollama) or 0)
        value: Any = body
        for key in openai:
            value = value.get(key, {}) if isinstance(value, dict) else {}
        return int(value) if isinstance(value, int) else 0

    @property
    def prompt_tokens(self) -> int:
        return self._figure(("usage", "prompt_tokens"), "prompt_eval_count")

    @property
    def completion_tokens(self) -> int:
        return self._figure(("usage", "completion_tokens"), "eval_count")

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens the mesh served from its prefix cache (both APIs' disagg fields)."""
        disagg = (self.body or {}).get("disagg")
        return int(disagg.get("cached_prompt_tokens", 0)) if isinstance(disagg, dict) else 0


class ResultsFile:
    """The output file: what earlier runs left in it, and appending new results, each
    flushed to the disk before the next."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[str, BatchResult] = {}
        self._file: IO[str] | None = None
        self._lock = self._take_lock()
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    def _take_lock(self) -> IO[str]:
        """One run per output file: a second would send the same requests again and mix
        its lines with the first's (the lock goes with the process, even killed)."""
        path = self.path.with_name(self.path.name + ".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise ValueError(
                f"{self.path} is being written by another run (it holds {path}): wait for "
                "it, or stop it first"
            ) from None
        return lock

    def _load(self) -> None:
        """Read earlier results. A last line cut short (the run was killed while writing
        it) is dropped; any other unreadable line is an error: this is not our file."""
        if not self.path.exists():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = []
        for number, line in enumerate(lines, 1):
            try:
                result = BatchResult.from_record(json.loads(line))
            except (ValueError, KeyError, TypeError, AttributeError):
                if number == len(lines) and not line.endswith("\n"):
                    break
                raise ValueError(
                    f"{self.path}: line {number} is not a batch result: is -o the right file?"
                ) from None
            self.done[result.custom_id] = result
            kept.append(line)
        if len(kept) < len(lines):
            self._rewrite(kept)

    @property
    def failed(self) -> list[BatchResult]:
        return [r for r in self.done.values() if not r.ok]

    def forget_failed(self) -> int:
        """Drop the failed results from the file (to run them again); how many."""
        failed = {r.custom_id for r in self.failed}
        if failed:
            lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
            self._rewrite([x for x in lines if json.loads(x)["custom_id"] not in failed])
            for custom_id in failed:
                del self.done[custom_id]
        return len(failed)

    def _rewrite(self, lines: list[str]) -> None:
        """Replace the file's lines at once (a new file renamed over it): a kill while
        rewriting leaves the old file or the new one, never half of each."""
        new = self.path.with_name(self.path.name + ".tmp")
        with new.open("w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        new.replace(self.path)

    def append(self, result: BatchResult) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(result.record(), ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done[result.custom_id] = result

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if not self._lock.closed:
            Path(self._lock.name).unlink(missing_ok=True)
            self._lock.close()
