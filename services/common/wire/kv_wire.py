"""FetchKvResponse on the wire, written and read without extra copies of the KV bytes.

Building a protobuf message copies its 1 MiB `data` field in, serializing copies it out, and
parsing copies it again; on loopback those copies cost over half of FetchKv's throughput
(measured by `make bench`). The prefill node encodes each message itself (one copy: the
state slice joined to its small header) and the decode node reads it as a view into the
received buffer. Exactly the fields of `disagg.v1.FetchKvResponse`, in protobuf's wire
format: the tests check both directions against protobuf itself, and unknown fields are
skipped as protobuf does.
"""

from __future__ import annotations

from disagg_mesh.proto.v1 import types_pb2
from disagg_mesh.server.common.errors import DataLoss
from disagg_mesh.server.common.kv.store import KvChunk, split_chunks
from disagg_mesh.server.common.types import Fingerprint
from disagg_mesh.server.common.wire import convert

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _encode_varint(field << 3 | wire)


def encode_fetch_kv_response(chunk: KvChunk) -> bytes:
    """The serialized FetchKvResponse for one chunk (fields in number order, as protobuf)."""
    parts: list[bytes | memoryview] = []
    if chunk.offset:
        parts += [_key(1, _VARINT), _encode_varint(chunk.offset)]
    if len(chunk.data):
        parts += [_key(2, _LEN), _encode_varint(len(chunk.data)), chunk.data]
    if chunk.total_size:
        parts += [_key(3, _VARINT), _encode_varint(chunk.total_size)]
    if chunk.sha256:
        digest = chunk.sha256.encode("ascii")
        parts += [_key(4, _LEN), _encode_varint(len(digest)), digest]
    if chunk.fingerprint is not None:
        fp = convert.fingerprint_to_proto(chunk.fingerprint).SerializeToString()
        parts += [_key(5, _LEN), _encode_varint(len(fp)), fp]
    return b"".join(parts)


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise DataLoss("malformed FetchKvResponse: bad varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def parse_fetch_kv_response(raw: bytes) -> KvChunk:
    buf = memoryview(raw)
    pos = 0
    offset = total = 0
    data: memoryview = buf[0:0]
    sha256 = ""
    fingerprint = None
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _varint(buf, pos)
            if field == 1:
                offset = value
            elif field == 3:
                total = value
        elif wire == _LEN:
            length, pos = _varint(buf, pos)
            end = pos + length
            if end > len(buf):
                raise DataLoss("malformed FetchKvResponse: field runs past the message")
            if field == 2:
                data = buf[pos:end]
            elif field == 4:
                sha256 = bytes(buf[pos:end]).decode("ascii", "replace")
            elif field == 5:
                message = types_pb2.KvFingerprint.FromString(bytes(buf[pos:end]))
                fingerprint = convert.fingerprint_from_proto(message)
            pos = end
        elif wire == _I64:
            pos += 8
        elif wire == _I32:
            pos += 4
        else:
            raise DataLoss(f"malformed FetchKvResponse: wire type {wire}")
    if pos != len(buf):
        raise DataLoss("malformed FetchKvResponse: truncated field")
    return KvChunk(
        offset=offset, data=data, total_size=total, sha256=sha256, fingerprint=fingerprint
    )


def encode_state(data: memoryview, sha256: str, fingerprint: Fingerprint) -> list[bytes]:
    """The whole FetchKv stream of a state, serialized: the one copy of its bytes."""
    return [encode_fetch_kv_response(c) for c in split_chunks(data, sha256, fingerprint)]
