"""kv_wire reads FetchKvResponse exactly as protobuf does, without copying the data."""

from __future__ import annotations

import dataclasses

import pytest

from disagg_mesh.proto.v1 import prefill_pb2, types_pb2
from disagg_mesh.server.common.errors import DataLoss
from disagg_mesh.server.common.kv.store import KvChunk
from disagg_mesh.server.common.types import Fingerprint
from disagg_mesh.server.common.wire.kv_wire import encode_fetch_kv_response, parse_fetch_kv_response

FP = types_pb2.KvFingerprint(model_sha256="ab" * 32, n_ctx_tokens=4096, engine_version="x/1")


@pytest.mark.parametrize(
    "message",
    [
        prefill_pb2.FetchKvResponse(
            offset_bytes=0, data=b"\x00\xff" * 1000, total_size_bytes=1 << 40, fingerprint=FP
        ),
        prefill_pb2.FetchKvResponse(
            offset_bytes=(1 << 20) * 49, data=bytes(range(256)), total_size_bytes=7, sha256="f" * 64
        ),
        prefill_pb2.FetchKvResponse(),
    ],
)
def test_reads_what_protobuf_writes(message: prefill_pb2.FetchKvResponse) -> None:
    raw = message.SerializeToString()
    chunk = parse_fetch_kv_response(raw)
    assert chunk.offset == message.offset_bytes
    assert bytes(chunk.data) == message.data
    assert chunk.total_size == message.total_size_bytes
    assert chunk.sha256 == message.sha256
    if message.HasField("fingerprint"):
        assert chunk.fingerprint == Fingerprint(
            FP.model_sha256,
            FP.n_ctx_tokens,
            FP.engine_version,
            type_k="",
            type_v="",
            flash_attn=False,
            kv_unified=False,
        )
    else:
        assert chunk.fingerprint is None


def test_skips_unknown_fields_as_protobuf_does() -> None:
    known = prefill_pb2.FetchKvResponse(
        offset_bytes=5, data=b"abc", total_size_bytes=8
    ).SerializeToString()
    unknown = (
        bytes([0x30, 0x07])
        + bytes([0x3A, 0x02])
        + b"zz"
        + bytes([0x41])
        + bytes(8)
        + bytes([0x4D])
        + bytes(4)
    )
    chunk = parse_fetch_kv_response(unknown + known)
    assert (chunk.offset, bytes(chunk.data), chunk.total_size) == (5, b"abc", 8)


def test_data_is_a_view_not_a_copy() -> None:
    raw = prefill_pb2.FetchKvResponse(data=b"x" * 4096).SerializeToString()
    chunk = parse_fetch_kv_response(raw)
    assert isinstance(chunk.data, memoryview) and chunk.data.obj is raw


@pytest.mark.parametrize(
    "raw", [b"\x12\x05ab", b"\x08", b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x0b"]
)
def test_malformed_is_data_loss(raw: bytes) -> None:
    with pytest.raises(DataLoss):
        parse_fetch_kv_response(raw)


@pytest.mark.parametrize(
    "chunk",
    [
        KvChunk(
            offset=0,
            data=memoryview(b"\x00\x01" * 700),
            total_size=1400,
            fingerprint=Fingerprint("ab" * 32, 4096, "x/1"),
        ),
        KvChunk(offset=3 << 30, data=b"z" * 300, total_size=(3 << 30) + 300, sha256="0f" * 32),
        KvChunk(offset=0, data=b"", total_size=0),
    ],
)
def test_protobuf_reads_what_we_write(chunk: KvChunk) -> None:
    encoded = encode_fetch_kv_response(chunk)
    message = prefill_pb2.FetchKvResponse.FromString(encoded)
    assert message.offset_bytes == chunk.offset and message.data == bytes(chunk.data)
    assert message.total_size_bytes == chunk.total_size and message.sha256 == chunk.sha256
    assert message.HasField("fingerprint") == (chunk.fingerprint is not None)
    assert encoded == message.SerializeToString()
    assert parse_fetch_kv_response(encoded) == dataclasses.replace(
        chunk, data=parse_fetch_kv_response(encoded).data
    )
