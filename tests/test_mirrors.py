"""One definition per field: each dataclass that mirrors a protobuf message has exactly its
fields (services/common/wire/mirror.py), converts both ways without losing a value, and
every field of the router's summary reaches the client's Metrics."""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any

import pytest
from google.protobuf.duration_pb2 import Duration

from disagg_mesh.metrics import Metrics
from disagg_mesh.proto.v1 import router_pb2, types_pb2
from disagg_mesh.server.common.engines.base import PrefillOutput
from disagg_mesh.server.common.types import (
    Fingerprint,
    KvReference,
    KvSource,
    PrefillFigures,
    PrefillResult,
)
from disagg_mesh.server.common.wire import mirror
from disagg_mesh.server.prefill.node import REPORTED
from disagg_mesh.server.router import servicer  # noqa: F401  (registers the router's summary)

EXPECTED = {
    "Fingerprint": "disagg.v1.KvFingerprint",
    "ModelFacts": "disagg.v1.ModelFacts",
    "TokenChoice": "disagg.v1.TokenChoice",
    "TokenLogprob": "disagg.v1.TokenLogprob",
    "KvReference": "disagg.v1.KvReference",
    "PrefillStats": "disagg.v1.PrefillStats",
    "PrefillResult": "disagg.v1.PrefillResponse",
    "KvSource": "disagg.v1.KvSource",
    "DecodeStats": "disagg.v1.DecodeSummary",
    "RouteSummary": "disagg.v1.GenerateSummary",
    "FailedAttempt": "disagg.v1.FailedAttempt",
    "Migration": "disagg.v1.Migration",
}


def test_each_mirrored_dataclass_has_exactly_its_messages_fields() -> None:
    pairs = {m.plain.__name__: m.message.DESCRIPTOR.full_name for m in mirror.mirrors()}
    assert pairs == EXPECTED
    for m in mirror.mirrors():
        fields = mirror.field_map(m)
        # A group held flat: its group-only fields are read and written in the group alone.
        grouped = {p.name for g in m.groups if not g.nested for p, flat in g.flat if not flat}
        names = [f.name for f in dataclasses.fields(m.plain) if f.name not in grouped]
        assert list(fields) == names
        assert mirror.covered(m) == set(m.message.DESCRIPTOR.fields_by_name)


def test_a_field_added_on_one_side_only_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Wider(Fingerprint):
        rope_scaling: float = 1.0

    with pytest.raises(mirror.MirrorError, match=r"Wider.rope_scaling has no field in"):
        mirror.register(Wider, types_pb2.KvFingerprint)

    @dataclasses.dataclass(frozen=True)
    class Narrower:
        model_sha256: str = ""

    with pytest.raises(mirror.MirrorError, match=r"KvFingerprint has fields that Narrower lacks"):
        mirror.register(Narrower, types_pb2.KvFingerprint)


def sample(hint: Any, n: int) -> Any:
    """A value of the type, other than its default, varying with n."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (tuple, list):
        items = [sample(args[0], n + i) for i in range(2)]
        return items if origin is list else tuple(items)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        members = list(hint)
        return members[1 + n % (len(members) - 1)]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return instance(hint, n)
    if hint is bool:
        return True
    if hint is int:
        return 1000 + n
    if hint is float:
        return 0.25 * (n + 1)
    if hint is str:
        return f"text {n}"
    if hint is bytes:
        return bytes([n % 256]) * 16
    raise AssertionError(f"no sample for {hint}")


def instance(plain: type, n: int = 0) -> Any:
    hints = typing.get_type_hints(plain)
    values = {f.name: sample(hints[f.name], n + i) for i, f in enumerate(dataclasses.fields(plain))}
    return plain(**values)


@pytest.mark.parametrize("m", mirror.mirrors(), ids=lambda m: m.plain.__name__)
def test_every_field_survives_the_wire(m: mirror.Mirror) -> None:
    original = instance(m.plain)
    message = mirror.to_proto(original)
    assert isinstance(message, m.message)
    # Every field of the message was set (no default left behind).
    set_fields = {fd.name for fd, _ in message.ListFields()}
    assert set_fields == mirror.covered(m)
    assert mirror.from_proto(m.message.FromString(message.SerializeToString()), m.plain) == (
        original
    )


def test_every_summary_field_reaches_the_clients_metrics() -> None:
    """The client reads GenerateSummary by hand (it imports no server code): a unique value
    in each field must show up in Metrics."""
    summary = router_pb2.GenerateSummary()
    seen: dict[str, Any] = {}
    fields: list[Any] = list(summary.DESCRIPTOR.fields)
    for i, fd in enumerate(fields, start=1):
        if (
            fd.message_type is not None
            and fd.message_type.full_name == Duration.DESCRIPTOR.full_name
        ):
            getattr(summary, fd.name).FromNanoseconds(i * 1_000_000_007)
            seen[fd.name] = i * 1_000_000_007 / 1e9
        elif fd.enum_type is not None:
            setattr(summary, fd.name, fd.enum_type.values[-1].number)
            seen[fd.name] = fd.enum_type.values[-1].name.rsplit("_", 1)[-1].lower()
        elif fd.message_type is not None:
            getattr(summary, fd.name).add()
            seen[fd.name] = 1  # one entry
        elif fd.type == fd.TYPE_STRING:
            setattr(summary, fd.name, f"value {i}")
            seen[fd.name] = f"value {i}"
        else:
            setattr(summary, fd.name, 100 + i)
            seen[fd.name] = 100 + i
    metrics = dataclasses.asdict(Metrics.from_summary(summary))
    flat = list(metrics.values())
    for name, value in seen.items():
        if value == 1:
            assert any(isinstance(v, tuple | list) and len(v) == 1 for v in flat), name
        elif isinstance(value, str) and not value.startswith("value"):
            assert any(isinstance(v, str) and v.endswith(value) for v in flat), name
        else:
            assert value in flat, f"GenerateSummary.{name} does not reach Metrics"


def test_a_prefill_figure_goes_from_the_engine_to_the_wire_by_its_name() -> None:
    """What a prefill engine reports (PrefillFigures, which PrefillOutput is) reaches
    PrefillResult, and from there PrefillResponse, by field name: a new figure is written in
    PrefillFigures and the proto, and nowhere in between."""
    figures = {f.name for f in dataclasses.fields(PrefillFigures)}
    assert issubclass(PrefillOutput, PrefillFigures) and issubclass(PrefillResult, PrefillFigures)
    assert set(REPORTED) == figures
    node_adds = {"kv_handle", "kv_size_bytes", "fingerprint", "kv_ttl_seconds", "kv_transfer"}
    assert {f.name for f in dataclasses.fields(PrefillResult)} - figures == node_adds


@pytest.mark.parametrize(
    ("plain", "target", "changed"),
    [
        (KvSource, "reference", ("kv_handle", "from the group")),
        (PrefillResult, "reference", ("kv_handle", "from the group")),
        (PrefillResult, "stats", ("cached_prompt_tokens", 4096)),
    ],
)
def test_a_group_is_written_grouped_and_flat_and_read_from_either(
    plain: type, target: str, changed: tuple[str, Any]
) -> None:
    """PrefillResponse and KvSource carry the KvReference as `reference` (PrefillResponse
    its PrefillStats as `stats`) and, for nodes of an earlier version, their values flat: a
    message from such a node (no group) reads the same, and one from this version reads the
    same with its flat copies cleared. A field added to the group since (group_only) has no
    flat copy: from an earlier node it reads as its default."""
    original = instance(plain)
    message = mirror.to_proto(original)
    group = next(
        g for m in mirror.mirrors() if m.plain is plain for g in m.groups if g.target == target
    )
    assert message.HasField(target)
    earlier = type(message)()
    earlier.CopyFrom(message)
    earlier.ClearField(target)
    newer = {pair.name for pair, flat in group.flat if flat is None}
    defaults = {f.name: f.default for f in dataclasses.fields(group.plain) if f.name in newer}
    if group.nested:
        expected = dataclasses.replace(
            original, **{target: dataclasses.replace(getattr(original, target), **defaults)}
        )
    else:
        expected = dataclasses.replace(original, **defaults)
    assert mirror.from_proto(earlier, plain) == expected
    grouped_only = type(message)()
    grouped_only.CopyFrom(message)
    for _, flat in group.copies:
        grouped_only.ClearField(flat)
    assert mirror.from_proto(grouped_only, plain) == original
    # The group wins where the two disagree (a router of this version reads the group).
    name, value = changed
    setattr(getattr(message, target), name, value)
    got: Any = mirror.from_proto(message, plain)
    assert isinstance(getattr(got, target), group.plain)
    assert getattr(getattr(got, target), name) == value


def test_the_router_hands_on_the_prefill_nodes_reference_unchanged() -> None:
    """What a prefill node said of its state reaches the decode node as it is: a new KV
    reference field is written in the proto and KvReference, and nowhere in between."""
    result = instance(PrefillResult)
    assert mirror.to_proto(KvSource("p:1", result.reference)).reference == (
        mirror.to_proto(result).reference
    )
    assert {f.name for f in dataclasses.fields(KvReference)} <= {
        f.name for f in dataclasses.fields(PrefillResult)
    }
