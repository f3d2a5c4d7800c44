"""TLS on every hop with mutual TLS: callers with a certificate from the mesh's CA get
through end to end; plaintext callers, callers without a certificate, and callers with a
certificate from another authority are refused."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import ollama
import pytest

from disagg_mesh import MeshClient, TlsFiles, Unavailable
from disagg_mesh.server.common.config.topology import Topology, load_topology
from disagg_mesh.server.common.runtime.processes import free_port
from tests.certs import Authority
from tests.conftest import engine_node, route, router_node, running_mesh

MODEL = "qwen3-coder:30b"


@dataclass
class TlsMesh:
    topology: Topology
    ca: Path
    client: TlsFiles
    stranger: TlsFiles


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsMesh]:
    folder: Path = tmp_path_factory.mktemp("tls")
    ca = Authority("disagg-mesh test CA")
    ca_file = ca.write_ca(folder / "ca.pem")
    for node in ("router", "prefill-a", "decode-a"):
        ca.issue(node, folder / f"{node}.pem", folder / f"{node}-key.pem")
    client_cert, client_key = ca.issue("grader", folder / "grader.pem", folder / "grader-key.pem")
    other = Authority("another CA")
    other.write_ca(folder / "other-ca.pem")
    stranger_cert, stranger_key = other.issue("stranger", folder / "s.pem", folder / "s-key.pem")
    parts = [
        '[security.tls]\nca_file = "ca.pem"\ncert_file = "{node}.pem"\n'
        'key_file = "{node}-key.pem"\nmutual = true\n',
        router_node(http_port=free_port()),
        engine_node("prefill-a", "prefill"),
        engine_node("decode-a", "decode"),
        route(MODEL, ["prefill-a"], ["decode-a"], chain=["disaggregated"]),
    ]
    with running_mesh(folder, parts) as processes:
        yield TlsMesh(
            processes.topology,
            ca_file,
            TlsFiles(ca_file, client_cert, client_key),
            TlsFiles(ca_file, stranger_cert, stranger_key),
        )


def test_a_caller_with_a_certificate_from_the_mesh_ca_gets_through(tls_mesh: TlsMesh) -> None:
    with MeshClient(tls_mesh.topology.router.address, tls=tls_mesh.client, timeout=30) as mesh:
        result = mesh.generate(
            MODEL, "def add(a, b):", max_tokens=6, temperature=0.0, ignore_eos=True
        )
    # router -> prefill, router -> decode and decode -> prefill (FetchKv) all went over TLS.
    assert result.metrics.completion_tokens == 6 and result.metrics.kv_transfer == "state"


@pytest.mark.parametrize("who", ["plaintext", "no certificate", "another authority"])
def test_other_callers_are_refused(tls_mesh: TlsMesh, who: str) -> None:
    address = tls_mesh.topology.router.address
    tls = {
        "plaintext": None,
        "no certificate": TlsFiles(tls_mesh.ca),
        "another authority": tls_mesh.stranger,
    }[who]
    with MeshClient(address, tls=tls, timeout=5) as client, pytest.raises(Unavailable):
        client.generate(MODEL, "hi", max_tokens=2)


def test_the_http_apis_serve_tls_with_the_mesh_certificates(tls_mesh: TlsMesh) -> None:
    router = tls_mesh.topology.router
    url = f"https://127.0.0.1:{router.http_port}"
    context = ssl.create_default_context(cafile=str(tls_mesh.ca))
    assert tls_mesh.client.cert_file is not None and tls_mesh.client.key_file is not None
    context.load_cert_chain(tls_mesh.client.cert_file, tls_mesh.client.key_file)
    got = ollama.Client(host=url, verify=context).generate(
        model=MODEL, prompt="def add(a, b):", raw=True, options={"temperature": 0, "num_predict": 4}
    )
    # Greedy text differs between CPUs: the answer may end at an end token before its 4.
    assert got.done and got.eval_count is not None and 0 < got.eval_count <= 4
    assert got.done_reason == ("length" if got.eval_count == 4 else "stop")
    # Plain HTTP, and HTTPS without a client certificate (mutual TLS), get nothing.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{router.http_port}/api/tags", timeout=5)
    with pytest.raises((httpx.HTTPError, ssl.SSLError)):
        httpx.get(
            f"{url}/api/tags", verify=ssl.create_default_context(cafile=str(tls_mesh.ca)), timeout=5
        )


def test_a_topology_beyond_loopback_must_choose(tmp_path: Path) -> None:
    from disagg_mesh.server.common.config.topology import TopologyError

    text = (Path(__file__).parent.parent / "topology/seed.toml").read_text()
    bare = tmp_path / "bare.toml"
    bare.write_text(text.replace("[security]\nplaintext = true\n", ""))
    with pytest.raises(TopologyError, match=r"set \[security.tls\], or \[security\] plaintext"):
        load_topology(bare)
