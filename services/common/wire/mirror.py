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
`field_map` refuses a pair that differs, and tests/test_protos.py checks every pair."""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message

T = TypeVar("T")
DURATION = Duration.DESCRIPTOR.full_name


class MirrorError(Exception):
    """A dataclass and its message do not have the same fields."""


@dataclass(frozen=True)
class Mirror:
    plain: type
    message: type[Message]
    # Dataclass field -> message field, where the rules above do not find it.
    renames: Mapping[str, str] = field(default_factory=dict)


_MIRRORS: dict[type, Mirror] = {}
_ENUMS: dict[type[enum.Enum], tuple[Mapping[Any, Any], dict[Any, Any]]] = {}


def register(plain: type, message: type[Message], **renames: str) -> None:
    mirror = Mirror(plain, message, renames)
    field_map(mirror)  # refuse a pair whose fields differ, at import
    _MIRRORS[plain] = mirror


def register_enum(plain: type[enum.Enum], to_proto: Mapping[Any, Any]) -> None:
    _ENUMS[plain] = (to_proto, {v: k for k, v in to_proto.items()})


def mirrors() -> list[Mirror]:
    return list(_MIRRORS.values())


def field_map(mirror: Mirror) -> dict[str, str]:
    """Each dataclass field's message field; MirrorError unless they pair off exactly."""
    return dict(_field_map(mirror.plain, mirror.message.DESCRIPTOR, tuple(mirror.renames.items())))


@functools.cache
def _field_map(
    plain: type, descriptor: Descriptor, renames: tuple[tuple[str, str], ...]
) -> tuple[tuple[str, str], ...]:
    names = set(descriptor.fields_by_name)
    given = dict(renames)
    pairs = []
    for f in dataclasses.fields(plain):
        target = given.get(f.name) or _by_rule(f.name, names)
        if target not in names:
            raise MirrorError(
                f"{plain.__name__}.{f.name} has no field in {descriptor.full_name} "
                f"(fields: {', '.join(sorted(names))})"
            )
        pairs.append((f.name, target))
    left = names - {target for _, target in pairs}
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


def to_proto(obj: Any) -> Any:
    """The message mirroring a registered dataclass's instance."""
    mirror = _MIRRORS[type(obj)]
    fields = mirror.message.DESCRIPTOR.fields_by_name
    values = {}
    for name, target in field_map(mirror).items():
        value = _to_wire(getattr(obj, name), fields[target])
        if value is not None:
            values[target] = value
    return mirror.message(**values)


def _to_wire(value: Any, fd: Any) -> Any:
    if fd.message_type is not None and fd.message_type.full_name == DURATION:
        duration = Duration()
        duration.FromNanoseconds(round(max(value, 0.0) * 1e9))
        return duration
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
    fields = message.DESCRIPTOR.fields_by_name
    hints = typing.get_type_hints(plain)
    defaults = {f.name: f.default for f in dataclasses.fields(typing.cast(Any, plain))}
    values = {}
    for name, target in field_map(mirror).items():
        fd = fields[target]
        raw = getattr(message, target)
        values[name] = _from_wire(raw, fd, hints[name], defaults[name])
    return plain(**values)


def _from_wire(raw: Any, fd: Any, hint: Any, default: Any) -> Any:
    if fd.message_type is not None and fd.message_type.full_name == DURATION:
        return raw.ToNanoseconds() / 1e9
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        known = _ENUMS[hint][1]
        if raw in known:
            return known[raw]
        return default if default is not dataclasses.MISSING else next(iter(hint))
    if isinstance(hint, type) and hint in _MIRRORS:
        return from_proto(raw, hint)
    if _repeated(fd):
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
