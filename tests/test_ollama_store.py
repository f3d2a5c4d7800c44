"""Models pulled with Ollama, read from a real store layout built here; the KV fingerprint
across real nodes; `disagg doctor`.

The store is what `ollama pull` leaves on disk: manifests/<host>/<namespace>/<model>/<tag>
(JSON with model, template, params and license layers) and blobs/sha256-<hex>, the model
layer being the real SmolLM2 GGUF file.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import struct
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import grpc
import llama_cpp
import numpy as np
import pytest
import pytest_asyncio

from disagg_mesh import cli
from disagg_mesh.proto.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2_grpc,
)
from disagg_mesh.server.common.config.topology import load_topology
from disagg_mesh.server.common.models import ModelFileError, locate_model, ollama_store
from disagg_mesh.server.common.models.files import cached_sha256, resolve_model_path
from disagg_mesh.server.common.runtime.processes import MeshProcesses
from tests.conftest import MODEL, ROOT, engine_node, node_refusing_to_start, route, router_node
from tests.streams import collect, greedy, kv_request, reference_tokens, request
from tests.test_errors import expect_error
from tests.tiny_models import write_gpt_oss

GGUF = resolve_model_path(MODEL, ROOT)
LIBRARY_NAME = "smollm2:135m"
HF_NAME = "hf.co/HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"
PROMPT = "The three primary colors are"


def _blob(store: Path, data: bytes) -> dict[str, object]:
    digest = hashlib.sha256(data).hexdigest()
    (store / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def write_manifest(store: Path, name: str, layers: list[dict[str, object]]) -> Path:
    parsed = ollama_store.parse_name(name)
    config = _blob(store, json.dumps({"model_format": "gguf", "model_family": "llama"}).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **config},
        "layers": layers,
    }
    path = parsed.manifest(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


def make_store(root: Path) -> Path:
    """A store holding SmolLM2 under a library name and an hf.co name (one blob, as Ollama
    shares blobs between names)."""
    store = root / "models"
    (store / "blobs").mkdir(parents=True)
    digest = cached_sha256(GGUF)
    blob = store / "blobs" / f"sha256-{digest}"
    try:
        os.link(GGUF, blob)  # a hard link where the file system allows, else a copy
    except OSError:
        shutil.copyfile(GGUF, blob)
    model = {
        "mediaType": ollama_store.MODEL_MEDIA_TYPE,
        "digest": f"sha256:{digest}",
        "size": blob.stat().st_size,
    }
    small = [
        {"mediaType": "application/vnd.ollama.image.template", **_blob(store, b"{{ .Prompt }}")},
        {"mediaType": "application/vnd.ollama.image.params", **_blob(store, b'{"stop":[]}')},
        {"mediaType": "application/vnd.ollama.image.license", **_blob(store, b"Apache 2.0")},
    ]
    for name in (LIBRARY_NAME, HF_NAME):
        write_manifest(store, name, [model, *small])
    return store


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_store(tmp_path_factory.mktemp("ollama"))


# -- finding the file ------------------------------------------------------------------------


def test_names_follow_ollamas_defaults() -> None:
    assert ollama_store.parse_name("qwen3-coder:30b") == ollama_store.OllamaName(
        "registry.ollama.ai", "library", "qwen3-coder", "30b"
    )
    assert ollama_store.parse_name("gpt-oss") == ollama_store.OllamaName(
        "registry.ollama.ai", "library", "gpt-oss", "latest"
    )
    assert ollama_store.parse_name("me/grader:v2").namespace == "me"
    assert ollama_store.parse_name(HF_NAME) == ollama_store.OllamaName(
        "hf.co", "HuggingFaceTB", "SmolLM2-135M-Instruct-GGUF", "Q4_1"
    )
    with pytest.raises(ModelFileError, match="not a valid name"):
        ollama_store.parse_name("../etc/passwd")


@pytest.mark.parametrize("name", [LIBRARY_NAME, HF_NAME, "SmolLM2:135M"])
def test_a_pulled_model_is_its_gguf_blob_and_its_digest(store: Path, name: str) -> None:
    found = locate_model(f"ollama:{name}", ROOT, str(store))
    assert found.sha256 == cached_sha256(GGUF)
    assert found.path.parent == store / "blobs"
    assert found.architecture == "llama"


def test_the_store_comes_from_ollama_models(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    assert locate_model(f"ollama:{LIBRARY_NAME}", ROOT).sha256 == cached_sha256(GGUF)


def test_no_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "nowhere"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(ollama_store, "STANDARD_STORES", ("~/.ollama/models",))
    with pytest.raises(ModelFileError) as info:
        locate_model("ollama:qwen3-coder:30b", ROOT)
    said = str(info.value)
    assert "no Ollama model store found" in said
    assert str(tmp_path / "nowhere") in said and str(tmp_path / ".ollama/models") in said


def test_not_pulled(store: Path) -> None:
    with pytest.raises(ModelFileError, match=r"is not pulled .* run `ollama pull qwen3-coder:30b`"):
        locate_model("ollama:qwen3-coder:30b", ROOT, str(store))


def test_permission_denied(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests may run as root, whom file modes do not stop: the refusal is simulated.
    def refuse(self: Path, *args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(ModelFileError, match=r"permission denied .* ollama group"):
        locate_model(f"ollama:{LIBRARY_NAME}", ROOT, str(store))


def test_no_gguf_layer(store: Path) -> None:
    write_manifest(
        store,
        "mlx-model:4bit",
        [{"mediaType": "application/vnd.ollama.image.tensor", **_blob(store, b"safetensors")}],
    )
    with pytest.raises(ModelFileError, match=r"has no GGUF layer .*image\.tensor"):
        locate_model("ollama:mlx-model:4bit", ROOT, str(store))


def test_blob_missing_or_truncated(tmp_path: Path) -> None:
    store = tmp_path / "models"
    (store / "blobs").mkdir(parents=True)
    data = GGUF.read_bytes()[: 1 << 20]
    layer = {"mediaType": ollama_store.MODEL_MEDIA_TYPE, **_blob(store, data)}
    write_manifest(store, "gone:1b", [{**layer, "digest": "sha256:" + "0" * 64}])
    with pytest.raises(
        ModelFileError, match="is missing from the store: run `ollama pull gone:1b`"
    ):
        locate_model("ollama:gone:1b", ROOT, str(store))
    write_manifest(store, "short:1b", [{**layer, "size": len(data) + 4096}])
    with pytest.raises(ModelFileError, match=r"is 1048576 bytes, the manifest says 1052672"):
        locate_model("ollama:short:1b", ROOT, str(store))


def tiny_gguf(path: Path, architecture: str) -> Path:
    import gguf  # a test-only import: see gguf_header.py

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def ollama_gpt_oss_store(root: Path) -> Path:
    """A store holding a tiny gpt-oss in Ollama's own layout as gpt-oss:120b (its weights are
    those of write_gpt_oss's llama.cpp layout)."""
    store = root / "models"
    (store / "blobs").mkdir(parents=True)
    data = write_gpt_oss(root / "ollama-gpt-oss.gguf", ollama_layout=True).read_bytes()
    write_manifest(
        store, "gpt-oss:120b", [{"mediaType": ollama_store.MODEL_MEDIA_TYPE, **_blob(store, data)}]
    )
    return store


def test_ollamas_own_gpt_oss_is_rewritten_once_for_llama_cpp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = ollama_gpt_oss_store(tmp_path)
    blobs = {p: p.stat().st_mtime_ns for p in (store / "blobs").iterdir()}
    seen: list[tuple[int, int]] = []
    found = locate_model("ollama:gpt-oss:120b", ROOT, str(store), lambda d, t: seen.append((d, t)))
    assert found.architecture == "gpt-oss"
    assert found.path.parent == tmp_path / "cache" / "disagg-mesh" / "gguf"
    assert found.sha256 == hashlib.sha256(found.path.read_bytes()).hexdigest()
    assert seen and seen[-1][0] == seen[-1][1]  # progress up to the whole data section
    # The same tensors, types and bytes as llama.cpp's own layout; Ollama's store untouched.
    native = gguf.GGUFReader(write_gpt_oss(tmp_path / "native.gguf"))
    converted = gguf.GGUFReader(found.path)
    assert {k: f.contents() for k, f in converted.fields.items() if not k.startswith("GGUF")} == {
        k: f.contents() for k, f in native.fields.items() if not k.startswith("GGUF")
    }
    for mine, theirs in zip(converted.tensors, native.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (theirs.name, theirs.tensor_type)
        assert np.array_equal(mine.data, theirs.data)
    assert {p: p.stat().st_mtime_ns for p in (store / "blobs").iterdir()} == blobs
    # Written once: the next node start reuses it.
    written = found.path.stat().st_mtime_ns
    seen.clear()
    again = locate_model("ollama:gpt-oss:120b", ROOT, str(store), lambda d, t: seen.append((d, t)))
    assert again == found and not seen and found.path.stat().st_mtime_ns == written


def test_an_ollama_gpt_oss_blob_that_a_header_cannot_fix_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # MXFP4 as ggml type 4, as Ollama stored it before its 2025-10 re-publish (gguf-py has
    # no name for that type any more: written as MXFP4, then the type patched).
    old = tmp_path / "old.gguf"
    name = "blk.0.ffn_gate_exps.weight"
    writer = gguf.GGUFWriter(str(old), "gptoss")
    writer.add_block_count(1)
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    writer.add_tensor_info(name, [4, 64, 64], np.dtype(np.float32), 34 * 512, mxfp4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    data = bytearray(old.read_bytes())
    at = data.index(name.encode()) + len(name) + 4 + 3 * 8  # past n_dims and the dims
    assert data[at : at + 4] == struct.pack("<I", mxfp4)
    data[at : at + 4] = struct.pack("<I", 4)
    old.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=r"MXFP4 as ggml type 4 .* run `ollama pull`"):
        locate_model(str(old), ROOT)
    # No experts at all: not a gpt-oss model.
    with pytest.raises(ModelFileError, match=r"is not a gpt-oss model llama\.cpp can load"):
        locate_model(str(tiny_gguf(tmp_path / "gptoss.gguf", "gptoss")), ROOT)


def test_an_architecture_llama_cpp_does_not_know(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path / "odd.gguf", "not-a-real-arch")
    with pytest.raises(ModelFileError, match="architecture 'not-a-real-arch' is not one llama"):
        locate_model(str(path), ROOT)


def test_the_sha256_of_a_file_is_hashed_once(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"x" * 1000)
    cache = tmp_path / "cache"
    first = cached_sha256(path, cache)
    assert first == hashlib.sha256(b"x" * 1000).hexdigest()
    entry = next((cache / "sha256").iterdir())
    saved = json.loads(entry.read_text())
    entry.write_text(json.dumps({**saved, "sha256": "f" * 64}))  # the cache is what is read
    assert cached_sha256(path, cache) == "f" * 64
    path.write_bytes(b"y" * 1000)  # a changed file is hashed again
    assert cached_sha256(path, cache) == hashlib.sha256(b"y" * 1000).hexdigest()


# -- a node refuses to start with one line -----------------------------------------------------


@pytest.mark.parametrize(
    ("model", "said"),
    [
        ("ollama:qwen3-coder:30b", "run `ollama pull qwen3-coder:30b`"),
        ("ollama:gpt-oss:120b", "is not a gpt-oss model llama.cpp can load"),
    ],
)
def test_a_node_with_an_unusable_model_exits_with_one_line(
    tmp_path: Path, model: str, said: str
) -> None:
    store = tmp_path / "models"
    (store / "blobs").mkdir(parents=True)
    data = tiny_gguf(tmp_path / "gptoss.gguf", "gptoss").read_bytes()
    write_manifest(
        store, "gpt-oss:120b", [{"mediaType": ollama_store.MODEL_MEDIA_TYPE, **_blob(store, data)}]
    )
    path = tmp_path / "topology.toml"
    path.write_text(
        router_node()
        + engine_node("decode-x", "decode", model=model, ollama_models=str(store)).replace(
            f'model = "{MODEL}"\n', ""
        )
        + route("x", [], ["decode-x"], chain=["decode_only"])
    )
    assert said in node_refusing_to_start(path, "decode-x")


# -- a mesh of ollama: nodes ---------------------------------------------------------------------


@dataclass
class StoreMesh:
    processes: MeshProcesses
    odd: MeshProcesses  # decode-q8, started from a topology of its own (type_k = "q8_0")
    doctor_topology: Path

    def address(self, name: str) -> str:
        for p in (self.processes, self.odd):
            if name in p.procs:
                return p.topology.node(name).address
        raise KeyError(name)


@pytest.fixture(scope="module")
def store_mesh(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreMesh]:
    folder = tmp_path_factory.mktemp("store-mesh")
    common = {"ollama_models": str(store), "slots": 2}
    prefill = engine_node("prefill-s", "prefill", 1, **common).replace(
        f'model = "{MODEL}"', f'model = "ollama:{LIBRARY_NAME}"'
    )
    decode = engine_node("decode-s", "decode", 1, **common).replace(
        f'model = "{MODEL}"', f'model = "ollama:{HF_NAME}"'
    )
    q8_f16 = engine_node("decode-q8", "decode", 1, **common).replace(
        f'model = "{MODEL}"', f'model = "ollama:{HF_NAME}"'
    )
    router = router_node()
    parts = [
        "[mesh]\nhealth_check_every_s = 0.5\n",
        router,
        prefill,
        decode,
        q8_f16,
        route("smol", ["prefill-s"], ["decode-s", "decode-q8"]),
    ]
    (folder / "odd").mkdir()
    odd_path = folder / "odd" / "topology.toml"
    # The same node as this machine's own topology file has it: another K cache type.
    odd_path.write_text(
        "\n".join(
            [
                router,
                q8_f16 + 'type_k = "q8_0"\n',
                route("smol", [], ["decode-q8"], chain=["decode_only"]),
            ]
        )
    )
    odd = MeshProcesses(load_topology(odd_path), folder / "odd" / "logs")
    main_path = folder / "topology.toml"
    main_path.write_text("\n".join(parts))
    processes = MeshProcesses(load_topology(main_path), folder / "logs")
    processes.start([n for n in processes.topology.nodes if n.name != "decode-q8"])
    odd.start([odd.topology.node("decode-q8")])
    try:
        asyncio.run(processes.wait_serving(timeout_s=240))
        asyncio.run(odd.wait_serving(timeout_s=240))
        time.sleep(1.5)  # the router's own health checks see every node serving
        yield StoreMesh(processes, odd, main_path)
    finally:
        odd.stop()
        processes.stop()


@pytest_asyncio.fixture
async def smol_router(
    store_mesh: StoreMesh,
) -> AsyncIterator[router_pb2_grpc.RouterServiceAsyncStub]:
    address = store_mesh.processes.topology.router.address
    async with grpc.aio.insecure_channel(address) as channel:
        yield router_pb2_grpc.RouterServiceStub(channel)


async def test_ollama_store_nodes_match_the_file_given_by_path(
    store_mesh: StoreMesh,
    smol_router: router_pb2_grpc.RouterServiceAsyncStub,
    reference_llm: llama_cpp.Llama,
) -> None:
    got = await collect(smol_router.Generate(request("smol", PROMPT, 24)))
    expected = reference_tokens(reference_llm, PROMPT, 24)
    assert got.text == reference_llm.detokenize(expected).decode()
    assert got.summary.prefill_node == "prefill-s" and got.summary.decode_node == "decode-s"
    assert got.summary.kv_transfer_bytes > 0  # a real KV handoff, named two ways in one store


async def test_a_node_reports_its_backend_and_fingerprint(store_mesh: StoreMesh) -> None:
    async with grpc.aio.insecure_channel(store_mesh.address("decode-q8")) as channel:
        stub = node_pb2_grpc.NodeServiceStub(channel)
        info = await stub.GetNodeInfo(node_pb2.GetNodeInfoRequest())
    assert (info.backend, info.gpu_layers, info.model_layers) == ("CPU", 0, 31)
    fp = info.fingerprint
    assert fp.model_sha256 == cached_sha256(GGUF)
    assert (fp.type_k, fp.type_v, fp.flash_attn, fp.kv_unified, fp.swa_full) == (
        "q8_0",
        "f16",
        True,
        True,
        True,  # the topology's default
    )
    assert fp.engine_version.startswith("llama-cpp-python/0.3.36 (llama.cpp ")


async def test_a_state_with_another_k_cache_type_is_refused_and_the_node_serves_on(
    store_mesh: StoreMesh,
) -> None:
    async with (
        grpc.aio.insecure_channel(store_mesh.address("prefill-s")) as p_channel,
        grpc.aio.insecure_channel(store_mesh.address("decode-q8")) as d_channel,
    ):
        prefill = prefill_pb2_grpc.PrefillServiceStub(p_channel)
        decode = decode_pb2_grpc.DecodeServiceStub(d_channel)
        reply = await prefill.Prefill(
            prefill_pb2.PrefillRequest(model="smol", prompt=PROMPT, sampling=greedy(4))
        )
        await expect_error(
            decode.Generate(kv_request("smol", store_mesh.address("prefill-s"), reply)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "type_k is 'f16' where the state was made, 'q8_0' on this node",
        )
        after = await collect(
            decode.Generate(
                decode_pb2.DecodeServiceGenerateRequest(
                    model="smol", prompt=PROMPT, sampling=greedy(4, ignore_eos=True)
                )
            )
        )
    assert after.summary.completion_tokens == 4


def test_doctor_tells_a_working_pair_from_a_broken_one(
    store_mesh: StoreMesh, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["--topology", str(store_mesh.doctor_topology), "doctor", "--json"])
    found = {(v["prefill"], v["decode"]): v for v in json.loads(capsys.readouterr().out)}
    assert code == 1
    assert found["prefill-s", "decode-s"]["ok"] is True
    assert (
        "KV handoff works (CPU, 0/31 layers on GPU -> CPU" in found["prefill-s", "decode-s"]["says"]
    )
    assert found["prefill-s", "decode-q8"]["ok"] is False
    assert found["prefill-s", "decode-q8"]["says"] == (
        "no KV handoff: type_k is 'f16' on prefill-s, 'q8_0' on decode-q8"
    )
    cli.main(["--topology", str(store_mesh.doctor_topology), "doctor"])
    table = capsys.readouterr().out
    assert "1 of 2 prefill/decode pairs can hand KV over" in table
