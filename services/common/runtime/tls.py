"""TLS for every hop, from the topology's [security.tls]: the node's server credentials and
the credentials it uses when it calls other nodes (with its own certificate for mutual TLS)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from disagg_mesh.server.common.config.topology import Node, Topology, TopologyError


@dataclass(frozen=True)
class NodeTls:
    ca: bytes
    cert: bytes
    key: bytes
    mutual: bool

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca if self.mutual else None,
            require_client_auth=self.mutual,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """For this node's calls to other nodes: trusts the mesh's CA, and presents the
        node's own certificate when the mesh is mutual."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca,
            private_key=self.key if self.mutual else None,
            certificate_chain=self.cert if self.mutual else None,
        )


@dataclass(frozen=True)
class TlsPaths:
    ca_file: Path
    cert_file: Path
    key_file: Path
    mutual: bool


def tls_paths(topology: Topology, node: Node) -> TlsPaths | None:
    """Where the node's TLS files are, or None for a plaintext mesh."""
    settings = topology.security.tls
    if settings is None:
        return None

    def resolve(pattern: str) -> Path:
        path = Path(pattern.replace("{node}", node.name)).expanduser()
        return path if path.is_absolute() else topology.source.parent / path

    return TlsPaths(
        resolve(settings.ca_file),
        resolve(settings.cert_file),
        resolve(settings.key_file),
        settings.mutual,
    )


def tls_for(topology: Topology, node: Node) -> NodeTls | None:
    """The node's TLS material, or None for a plaintext mesh."""
    paths = tls_paths(topology, node)
    if paths is None:
        return None

    def read(key: str, path: Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError as exc:
            raise TopologyError(
                f"{topology.source}: security.tls.{key}: cannot read {path}: {exc.strerror}"
            ) from None

    return NodeTls(
        ca=read("ca_file", paths.ca_file),
        cert=read("cert_file", paths.cert_file),
        key=read("key_file", paths.key_file),
        mutual=paths.mutual,
    )
