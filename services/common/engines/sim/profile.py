"""Hardware profiles of the simulated engine: how long a machine takes to evaluate a prompt
and to make a decode step, for each model it serves, and its link to the other machines.

A profile is a TOML file (the shipped ones are in profiles/, each number citing its source):

    [profile]              name, description, gpu (true: every layer on the machine's GPU)
    [link]                 bandwidth_bytes_per_second, latency_seconds
    [models."NAME"]        kv_bytes_per_token (+ window_tokens, window_kv_bytes_per_token),
                           bytes_per_token (of prompt text, default 4)
    [models."NAME".prefill]  depth_tokens = [...], tokens_per_second = [...] (by depth),
                             pass_tokens, pass_tokens_per_second (by tokens in one pass:
                             one prompt's, or several prompts' evaluated together; optional)
    [models."NAME".decode]   depth_tokens, tokens_per_second (one stream by depth),
                             batch, batch_tokens_per_second (streams at once, shallow)

Times come from those tables by piecewise-linear interpolation, never one constant. Prompt
tokens are evaluated in passes of at most `ubatch` tokens (the node's n_ubatch: a compute
graph's rows), each pass at the rate of its tokens' mean depth times the pass factor: the
pass table's rate at the pass's size over its rate at the size the depth table was measured
with (`measured_prompt_tokens`, P), so a short prompt alone, which leaves most of a GPU's
pass idle, is slower per token than a long one or several together (llama-batched-bench's
S_PP); no pass table: every pass size at the same rate. Prompts evaluated together share
each pass evenly (llama.cpp's batch takes every slot's tokens), so the shorter ones finish
first. A depth table measured with prompts of P tokens gives the rate at depth d + P/2. A
decode step of b streams at mean depth d takes b / (batch rate(b) x depth factor(d)), the
depth factor being one stream's rate at d over its rate at depth 0. Beyond a table's last
depth a rate keeps the last segment's slope (floored at a tenth of the last value); no gain
is assumed beyond the largest batch or pass measured, nor below the smallest pass. Plain
Python: the sim engine and `disagg simulate` use it.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg_mesh.server.common.errors import MeshError
from disagg_mesh.server.common.types import ModelFacts, parameter_size

PROFILES = Path(__file__).resolve().parent / "profiles"
# What a sim node says of the model it stands for (sizes and abilities, with sources).
MODELS = Path(__file__).resolve().parent / "models.toml"
CAPABILITIES = ("completion", "tools", "insert", "thinking")


class ProfileError(MeshError):
    """A hardware profile that cannot be read: the message names the file and the key."""


@dataclass(frozen=True)
class Table:
    """y as a piecewise-linear function of x (x ascending)."""

    x: tuple[float, ...]
    y: tuple[float, ...]
    # Beyond the last point: keep the last segment's slope (floored), or stay flat.
    flat_beyond: bool = False

    def __call__(self, at: float) -> float:
        x, y = self.x, self.y
        if len(x) == 1:
            return y[0]
        if at <= x[0]:
            return y[0]
        i = bisect.bisect_right(x, at)
        if i >= len(x) and self.flat_beyond:
            return y[-1]
        if i >= len(x):  # beyond the last point: the last segment's slope, floored
            slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
            return max(y[-1] + slope * (at - x[-1]), y[-1] / 10)
        x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
        return y0 + (y1 - y0) * (at - x0) / (x1 - x0)


@dataclass(frozen=True)
class ModelSpeed:
    """One model on one machine."""

    kv_bytes_per_token: int
    prefill_rate: Table  # tokens/s by depth
    decode_rate: Table  # one stream's tokens/s by depth
    batch_rate: Table  # all streams' tokens/s by streams at once
    window_tokens: int = 0
    window_kv_bytes_per_token: int = 0
    estimate: bool = False  # some of these numbers are estimates (the file says which)
    # Bytes of prompt text a token stands for (the model's tokenizer on English and code;
    # `disagg calibrate` measures it): how many tokens the simulated engine counts.
    bytes_per_token: float = 4.0

    # Tokens/s by tokens in one pass (None: the same at every size), and the pass size of
    # the prefill table's runs (the pass factor is 1 there).
    pass_rate: Table | None = None
    reference_pass_tokens: float = 0.0

    def pass_factor(self, tokens: float) -> float:
        """A pass of this many tokens' speed against the prefill table's passes."""
        if self.pass_rate is None or self.reference_pass_tokens <= 0:
            return 1.0
        return self.pass_rate(tokens) / self.pass_rate(self.reference_pass_tokens)

    def prefill_seconds(
        self, new_tokens: int, cached_tokens: int = 0, ubatch: int | None = None
    ) -> float:
        """Seconds to evaluate new_tokens after cached_tokens already in the cache, alone, in
        passes of at most `ubatch` tokens (None: one pass)."""
        return self.prompts_seconds([(new_tokens, cached_tokens)], ubatch)[0]

    def prompts_seconds(
        self, prompts: Sequence[tuple[int, int]], ubatch: int | None = None
    ) -> list[float]:
        """Seconds until each of several prompts (new tokens, cached tokens) evaluated
        together is done: passes of at most `ubatch` tokens (None: as many as they have),
        each shared evenly among the prompts not yet done."""
        left = [max(new, 0) for new, _ in prompts]
        depth = [float(cached) for _, cached in prompts]
        done_at = [0.0] * len(prompts)
        clock = 0.0
        while True:
            live = [i for i, n in enumerate(left) if n > 0]
            if not live:
                return done_at
            room = ubatch if ubatch is not None and ubatch > 0 else sum(left[i] for i in live)
            share = _shares([left[i] for i in live], room)
            tokens = sum(share)
            mid = sum(s * (depth[i] + s / 2) for i, s in zip(live, share, strict=True)) / tokens
            clock += tokens / (self.prefill_rate(mid) * self.pass_factor(tokens))
            for i, s in zip(live, share, strict=True):
                left[i] -= s
                depth[i] += s
                if left[i] == 0:
                    done_at[i] = clock

    def decode_step_seconds(self, streams: int, mean_depth: float) -> float:
        """Seconds for one decode step of `streams` sequences at this mean context depth."""
        if streams <= 0:
            return 0.0
        factor = self.decode_rate(mean_depth) / self.decode_rate(0)
        return streams / (self.batch_rate(streams) * factor)

    def kv_bytes(self, tokens: int) -> int:
        """The KV state of a sequence of this many tokens: every position of the full
        layers, and at most the window of the sliding-window layers."""
        return tokens * self.kv_bytes_per_token + min(tokens, self.window_tokens) * (
            self.window_kv_bytes_per_token
        )


def _shares(left: Sequence[int], room: int) -> list[int]:
    """A pass of `room` tokens split evenly among prompts with `left` tokens each (what one
    does not need goes to the others; the first ones get the remainder)."""
    share = [0] * len(left)
    room = min(room, sum(left))
    while room > 0:
        wanting = [i for i, n in enumerate(left) if share[i] < n]
        each, extra = divmod(room, len(wanting))
        for k, i in enumerate(wanting):
            give = min(each + (k < extra), left[i] - share[i])
            share[i] += give
            room -= give
    return share


@dataclass(frozen=True)
class Link:
    bandwidth_bytes_per_second: float
    latency_seconds: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_seconds + nbytes / self.bandwidth_bytes_per_second


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    source: Path
    link: Link
    models: dict[str, ModelSpeed]
    # The machine runs every layer of its models on its GPU ([profile] gpu).
    gpu: bool = False

    def model(self, name: str) -> ModelSpeed:
        speed = self.models.get(name)
        if speed is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise ProfileError(f"{self.source}: no [models.{name!r}] (it has: {known})")
        return speed


def find_profile(spec: str, relative_to: Path | None = None) -> Path:
    """A shipped profile by name ("dgx-spark"), or a TOML file's path."""
    shipped = PROFILES / f"{spec}.toml"
    if shipped.is_file():
        return shipped
    path = Path(spec).expanduser()
    if not path.is_absolute() and relative_to is not None:
        path = relative_to / path
    if path.is_file():
        return path
    names = ", ".join(sorted(p.stem for p in PROFILES.glob("*.toml")))
    raise ProfileError(f"hardware profile {spec!r}: no such file, and no shipped one ({names})")


def load_profile(spec: str, relative_to: Path | None = None) -> HardwareProfile:
    path = find_profile(spec, relative_to)
    data = _toml(path)
    reader = _Reader(path)
    link = data.get("link", {})
    about = data.get("profile", {})
    gpu = about.get("gpu", False)
    if not isinstance(gpu, bool):
        raise reader.fail("profile.gpu", f"true or false, got {gpu!r}")
    return HardwareProfile(
        name=str(about.get("name", path.stem)),
        gpu=gpu,
        source=path,
        link=Link(
            reader.positive(link, "link", "bandwidth_bytes_per_second", 1.15e9),
            reader.number(link, "link", "latency_seconds", 0.0002),
        ),
        models={name: reader.model(name, table) for name, table in data.get("models", {}).items()},
    )


def _toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: {exc}") from None


@functools.cache
def _listed(path: Path) -> dict[str, Any]:
    models = _toml(path).get("models", {})
    return models if isinstance(models, dict) else {}


def load_model_facts(model: str, path: Path = MODELS) -> ModelFacts:
    """What a sim node of this model says of it (models.toml): its sizes and capabilities as
    an embedded node would read them from the model's file; empty for a model not listed."""
    data = _listed(path).get(model)
    if data is None:
        return ModelFacts()
    reader, where = _Reader(path), f"models.{model!r}"
    capabilities = data.get("capabilities", [])
    if not isinstance(capabilities, list) or any(c not in CAPABILITIES for c in capabilities):
        raise reader.fail(
            f"{where}.capabilities", f"a list of {', '.join(CAPABILITIES)}; got {capabilities!r}"
        )
    count = int(reader.positive(data, where, "parameter_count", 1))
    return ModelFacts(
        architecture=reader.text(data, where, "architecture"),
        parameter_count=count,
        parameter_size=parameter_size(count),
        quantization=reader.text(data, where, "quantization"),
        file_size_bytes=int(reader.positive(data, where, "file_size_bytes", 1)),
        trained_context_tokens=int(reader.positive(data, where, "trained_context_tokens", 1)),
        embedding_length=int(reader.positive(data, where, "embedding_length", 1)),
        capabilities=tuple(str(c) for c in capabilities),
    )


def model_layers(model: str, path: Path = MODELS) -> int:
    """The model's layers as llama.cpp counts them (its blocks and the output layer), from
    models.toml's block_count; 0 for a model not listed."""
    data = _listed(path).get(model)
    if data is None:
        return 0
    return int(_Reader(path).positive(data, f"models.{model!r}", "block_count", 1)) + 1


class _Reader:
    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, why: str) -> ProfileError:
        return ProfileError(f"{self.path}: {key}: {why}")

    def number(self, table: dict[str, Any], where: str, key: str, default: float) -> float:
        value = table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(f"{where}.{key}", f"a number, got {value!r}")
        return float(value)

    def text(self, table: dict[str, Any], where: str, key: str) -> str:
        value = table.get(key, "")
        if not isinstance(value, str):
            raise self.fail(f"{where}.{key}", f"a string, got {value!r}")
        return value

    def positive(self, table: dict[str, Any], where: str, key: str, default: float) -> float:
        value = self.number(table, where, key, default)
        if value <= 0:
            raise self.fail(f"{where}.{key}", f"must be above 0, got {value}")
        return value

    def table(
        self,
        data: dict[str, Any],
        where: str,
        xs: str,
        ys: str,
        shift: float = 0.0,
        flat_beyond: bool = False,
    ) -> Table:
        x, y = data.get(xs), data.get(ys)
        if not isinstance(x, list) or not isinstance(y, list) or not x or len(x) != len(y):
            raise self.fail(f"{where}.{xs}/{ys}", "two lists of numbers of the same length")
        if any(not isinstance(v, int | float) or isinstance(v, bool) for v in [*x, *y]):
            raise self.fail(f"{where}.{xs}/{ys}", "numbers only")
        if any(b <= a for a, b in itertools.pairwise(x)):
            raise self.fail(f"{where}.{xs}", f"must rise, got {x}")
        if any(v <= 0 for v in y):
            raise self.fail(f"{where}.{ys}", f"rates must be above 0, got {y}")
        return Table(tuple(float(v) + shift for v in x), tuple(float(v) for v in y), flat_beyond)

    def model(self, name: str, data: dict[str, Any]) -> ModelSpeed:
        where = f"models.{name!r}"
        prefill, decode = data.get("prefill"), data.get("decode")
        if not isinstance(prefill, dict) or not isinstance(decode, dict):
            raise self.fail(where, "needs [prefill] and [decode] tables")
        kv = self.positive(data, where, "kv_bytes_per_token", 0)
        # A rate measured over a prompt of P tokens from depth d is the rate halfway, d + P/2.
        measured = self.number(prefill, f"{where}.prefill", "measured_prompt_tokens", 0)
        passes = None
        if "pass_tokens" in prefill or "pass_tokens_per_second" in prefill:
            passes = self.table(
                prefill,
                f"{where}.prefill",
                "pass_tokens",
                "pass_tokens_per_second",
                flat_beyond=True,
            )
            if measured <= 0:
                raise self.fail(
                    f"{where}.prefill.measured_prompt_tokens",
                    "needed with pass_tokens: the pass size the depth table was measured with",
                )
        return ModelSpeed(
            kv_bytes_per_token=int(kv),
            prefill_rate=self.table(
                prefill, f"{where}.prefill", "depth_tokens", "tokens_per_second", measured / 2
            ),
            decode_rate=self.table(decode, f"{where}.decode", "depth_tokens", "tokens_per_second"),
            batch_rate=self.table(
                decode, f"{where}.decode", "batch", "batch_tokens_per_second", flat_beyond=True
            ),
            window_tokens=int(self.number(data, where, "window_tokens", 0)),
            window_kv_bytes_per_token=int(self.number(data, where, "window_kv_bytes_per_token", 0)),
            estimate=bool(prefill.get("estimate") or decode.get("estimate")),
            bytes_per_token=self.positive(data, where, "bytes_per_token", 4.0),
            pass_rate=passes,
            reference_pass_tokens=measured,
        )


@dataclass(frozen=True)
class OllamaBaseline:
    """How Ollama serves the grader today (profiles/ollama.toml): requests each model's
    server runs at once (OLLAMA_NUM_PARALLEL, or a model's own), and the flow (no KV
    handoff: the decode machine evaluates the whole prompt again)."""

    parallel: dict[str, int]
    max_queue: int
    batch_tokens: int  # prompt tokens one pass evaluates (all parallel requests' together)
    prompt_evaluated_on_decode_host: bool
    kv_handoff: bool
    prefix_cache: str
    num_parallel: int = 1  # OLLAMA_NUM_PARALLEL: a model not in `parallel`

    def parallel_for(self, model: str) -> int:
        return self.parallel.get(model, self.num_parallel)

    def with_num_parallel(self, n: int) -> OllamaBaseline:
        """Served with OLLAMA_NUM_PARALLEL = n for every model."""
        return dataclasses.replace(self, parallel={}, num_parallel=n)


def _at_once(value: object) -> bool:
    """Whether a profile's value is a number of requests at once (an integer, 1 or more)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def load_baseline(spec: str = "ollama") -> OllamaBaseline:
    path = find_profile(spec)
    serving = _toml(path).get("serving")
    if not isinstance(serving, dict):
        raise ProfileError(f"{path}: no [serving] table")
    reader = _Reader(path)
    parallel = serving.get("parallel", {})
    if not isinstance(parallel, dict) or not all(map(_at_once, parallel.values())):
        raise reader.fail(
            "serving.parallel", f"model = requests at once (1 or more), got {parallel!r}"
        )
    num_parallel = serving.get("num_parallel", 1)
    if not _at_once(num_parallel):
        raise reader.fail("serving.num_parallel", f"1 or more, got {num_parallel!r}")
    return OllamaBaseline(
        parallel={str(k): int(v) for k, v in parallel.items()},
        num_parallel=num_parallel,
        max_queue=int(reader.positive(serving, "serving", "max_queue", 512)),
        batch_tokens=int(reader.positive(serving, "serving", "batch_tokens", 512)),
        prompt_evaluated_on_decode_host=bool(serving.get("prompt_evaluated_on_decode_host", True)),
        kv_handoff=bool(serving.get("kv_handoff", False)),
        prefix_cache=str(serving.get("prefix_cache", "per-slot")),
    )
