"""Batch jobs: many requests in OpenAI's batch file format, through the routers' HTTP doors.

- `requests.py`  the input lines (BatchRequest), read and checked
- `results.py`   the output lines (BatchResult), and the output file a run resumes from
- `runner.py`    sending them: doors, retries, concurrency, prefix-sharing order, dry runs
- `progress.py`  the live bar or plain lines, and the summary

`disagg batch` (disagg_mesh/cli.py) and `MeshClient.batch` / `AsyncMeshClient.batch` use it.
"""

from disagg_mesh.batch.requests import (
    ENDPOINTS,
    BatchInputError,
    BatchRequest,
    parse_lines,
    read_requests,
    requests_from,
    to_request,
)
from disagg_mesh.batch.results import BatchResult, ResultsFile
from disagg_mesh.batch.runner import BatchRun, plan

__all__ = [
    "ENDPOINTS",
    "BatchInputError",
    "BatchRequest",
    "BatchResult",
    "BatchRun",
    "ResultsFile",
    "parse_lines",
    "plan",
    "read_requests",
    "requests_from",
    "to_request",
]
