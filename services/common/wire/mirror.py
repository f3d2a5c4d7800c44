"""Plain dataclasses that mirror a protobuf message field for field, converted both ways by
one set of rules instead of a list of fields per message: a new field is written in the
proto, in its dataclass, and where it is used, never in a conversion.

The rules, for each field of the dataclass:
- a field of the message with the same name: the value as it is (a repeated field becomes a
  tuple, or a list where the dataclass says list);
- `<name>_seconds` (or `seconds`): the google.protobuf.Duration `<name>_duration`, or
  `<name>` itself (or `duration`);
- a name in the pair's `renames`: that field of the message;
- an enum: through the tables registered for its class (`register_enum`); a value the
  table does not know (an older or newer peer's) reads as the field's default;
- a mirrored dataclass, or a list of them: converted by the same rules.

Every message field must be the image of one dataclass field, and the other way round:
`register` refuses a pair that differs (at import), and tests/test_mirrors.py checks every pair.

One exception, for a mesh whose nodes run different versions: a sub-message that groups
values the message still repeats flat for peers of an earlier version (`grouped`: the
KvReference in PrefillResponse and KvSource, the PrefillStats in PrefillResponse). Both
are written; reading takes the group, or the flat copies from a peer that leaves the group
unset. The dataclass holds the group as a field of that name, or holds its values flat and
offers the group as a property. A field added to the group after its flat copies stopped
growing (`group_only`) has none: a peer sending only the flat copies leaves it its default."""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message

T = TypeVar("T")
DURATION = Duration.DESCRIPTOR.full_name


class MirrorError(Exception):
    """A dataclass and its message do not have the same fields."""


@dataclass(frozen=True)
class Pair:
    """A dataclass field and its message field, with what converting them needs (worked
    out once, when the pair is registered)."""

    name: str
    target: str
    hint: Any
    default: Any
    duration: bool
    repeated: bool


@dataclass(frozen=True)
class Group:
    """A sub-message (mirrored by `plain`) whose values the message repeats flat: each of
    its pairs with the message field of its flat copy (None: a group-only field). `nested`:
    the dataclass holds the group as a field; else it holds the values flat and the group is
    a property."""

    target: str
    plain: type
    flat: tuple[tuple[Pair, str | None], ...]
    nested: bool

    @property
    def copies(self) -> tuple[tuple[Pair, str], ...]:
        """The pairs that have a flat copy, with its message field."""
        return tuple((pair, name) for pair, name in self.flat if name is not None)


@dataclass(frozen=True)
class Mirror:
    plain: type
    message: type[Message]
    pairs: tuple[Pair, ...]
    groups: tuple[Group, ...] = ()


_MIRRORS: dict[type, Mirror] = {}
_ENUMS: dict[type[enum.Enum], tuple[Mapping[Any, Any], dict[Any, Any]]] = {}


def register(
    plain: type,
    message: type[Message],
    *,
    grouped: tuple[str, ...] = (),
    flat_renames: Mapping[str, str] | None = None,
    group_only: tuple[str, ...] = (),
    **renames: str,
) -> None:
    """Mirror `plain` on `message`; `renames`: dataclass field -> message field, where the
    rules above do not find it. `grouped`: sub-message fields whose values the message also
    repeats flat (under the group's field names, or `flat_renames`: group dataclass field ->
    flat message field), but for the groups' dataclass fields named in `group_only`.
    MirrorError unless their fields pair off exactly."""
    groups = tuple(
        _group(plain, message.DESCRIPTOR, g, flat_renames or {}, set(group_only)) for g in grouped
    )
    skip: set[str] = set()
    unpaired: set[str] = set()  # held flat, read and written in the group only
    for group in groups:
        skip |= {flat for _, flat in group.copies} if group.nested else {group.target}
        if not group.nested:
            unpaired |= {pair.name for pair, flat in group.flat if flat is None}
    pairs = _pairs(plain, message.DESCRIPTOR, renames, skip, unpaired)
    _MIRRORS[plain] = Mirror(plain, message, pairs, groups)


def _group(
    plain: type,
    descriptor: Any,
    target: str,
    flat_renames: Mapping[str, str],
    group_only: set[str],
) -> Group:
    fd = descriptor.fields_by_name.get(target)
    inner = next(
        (m for m in _MIRRORS.values() if fd and m.message.DESCRIPTOR is fd.message_type), None
    )
    if inner is None:
        raise MirrorError(f"{descriptor.full_name}.{target} is not a registered mirror's message")
    names = set(descriptor.fields_by_name)
    flat = tuple(
        (p, None if p.name in group_only else flat_renames.get(p.name, p.target))
        for p in inner.pairs
    )
    missing = [name for _, name in flat if name is not None and name not in names]
    if missing:
        raise MirrorError(f"{descriptor.full_name} lacks flat copies of {target}: {missing}")
    nested = target in {f.name for f in dataclasses.fields(plain)}
    if not nested:
        own = {f.name for f in dataclasses.fields(plain)}
        lacking = [p.name for p, _ in flat if p.name not in own]
        if lacking or not isinstance(getattr(plain, target, None), property):
            raise MirrorError(
                f"{plain.__name__} needs a property {target} and the fields {lacking} of "
                f"{inner.plain.__name__}"
            )
    return Group(target, inner.plain, flat, nested)


def register_enum(plain: type[enum.Enum], to_proto: Mapping[Any, Any]) -> None:
    _ENUMS[plain] = (to_proto, {v: k for k, v in to_proto.items()})


def mirrors() -> list[Mirror]:
    return list(_MIRRORS.values())


def field_map(mirror: Mirror) -> dict[str, str]:
    """Each dataclass field's message field."""
    return {p.name: p.target for p in mirror.pairs}


def covered(mirror: Mirror) -> set[str]:
    """The message fields the mirror writes: its pairs', and a group's other side."""
    names = set(field_map(mirror).values())
    for group in mirror.groups:
        names |= {flat for _, flat in group.copies} | {group.target}
    return names


def _pairs(
    plain: type,
    descriptor: Any,
    renames: Mapping[str, str],
    skip: set[str],
    unpaired: set[str],
) -> tuple[Pair, ...]:
    names = set(descriptor.fields_by_name) - skip
    hints = typing.get_type_hints(plain)
    pairs = []
    for f in dataclasses.fields(plain):
        if f.name in unpaired:
            continue
        target = renames.get(f.name) or _by_rule(f.name, names)
        if target not in names:
            raise MirrorError(
                f"{plain.__name__}.{f.name} has no field in {descriptor.full_name} "
                f"(fields: {', '.join(sorted(names))})"
            )
        fd = descriptor.fields_by_name[target]
        is_duration = fd.message_type is not None and fd.message_type.full_name == DURATION
        pairs.append(Pair(f.name, target, hints[f.name], f.default, is_duration, _repeated(fd)))
    left = names - {p.target for p in pairs}
    if left:
        raise MirrorError(
            f"{descriptor.full_name} has fields that {plain.__name__} lacks: "
            f"{', '.join(sorted(left))}"
        )
    return tuple(pairs)


def _by_rule(name: str, names: set[str]) -> str:
    if name in names:
        return name
    if name == "seconds":
        return "duration"
    base = name.removesuffix("_seconds")
    if base != name:
        return f"{base}_duration" if f"{base}_duration" in names else base
    return name


def duration(seconds: float) -> Duration:
    msg = Duration()
    msg.FromNanoseconds(round(max(seconds, 0.0) * 1e9))
    return msg


def to_proto(obj: Any) -> Any:
    """The message mirroring a registered dataclass's instance."""
    mirror = _MIRRORS[type(obj)]
    values = {}
    for pair in mirror.pairs:
        value = _to_wire(getattr(obj, pair.name), pair)
        if value is not None:
            values[pair.target] = value
    for group in mirror.groups:
        inner = getattr(obj, group.target)
        if group.nested:  # the flat copies
            for pair, flat in group.copies:
                values[flat] = _to_wire(getattr(inner, pair.name), pair)
        else:
            values[group.target] = to_proto(inner)
    return mirror.message(**values)


def _to_wire(value: Any, pair: Pair) -> Any:
    if pair.duration:
        return duration(value)
    if isinstance(value, enum.Enum):
        return _ENUMS[type(value)][0][value]
    if isinstance(value, list | tuple) and value and type(value[0]) in _MIRRORS:
        return [to_proto(v) for v in value]
    if type(value) in _MIRRORS:
        return to_proto(value)
    return value


def from_proto(message: Any, plain: type[T]) -> T:
    """The registered dataclass mirroring a message."""
    mirror = _MIRRORS[plain]
    values = {p.name: _from_wire(getattr(message, p.target), p) for p in mirror.pairs}
    for group in mirror.groups:
        if message.HasField(group.target) == group.nested:
            continue
        if group.nested:  # an earlier peer's message: the flat copies only
            flat = {p.name: _from_wire(getattr(message, name), p) for p, name in group.copies}
            values[group.target] = group.plain(**flat)
        else:  # the group's values, over their flat copies
            inner = getattr(message, group.target)
            values.update({p.name: _from_wire(getattr(inner, p.target), p) for p, _ in group.flat})
    return plain(**values)


def _from_wire(raw: Any, pair: Pair) -> Any:
    hint = pair.hint
    if pair.duration:
        return raw.ToNanoseconds() / 1e9
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        known = _ENUMS[hint][1]
        if raw in known:
            return known[raw]
        return pair.default if pair.default is not dataclasses.MISSING else next(iter(hint))
    if isinstance(hint, type) and hint in _MIRRORS:
        return from_proto(raw, hint)
    if pair.repeated:
        origin = typing.get_origin(hint)
        (item, *_) = typing.get_args(hint) or (None,)
        items = [from_proto(v, item) for v in raw] if item in _MIRRORS else list(raw)
        return items if origin is list else tuple(items)
    return raw


def _repeated(fd: Any) -> bool:
    repeated = getattr(fd, "is_repeated", None)  # protobuf >= 6.31; `label` before, gone in 7
    if repeated is None:
        return bool(fd.label == FieldDescriptor.LABEL_REPEATED)
    return bool(repeated)
