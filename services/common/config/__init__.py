"""A mesh's configuration: the topology file (nodes, models, mesh settings) and its checks."""

# The topology a node or `make run` starts from when none is named. Here, not in
# topology.py, so that a node's process reads it before gRPC loads (runtime/grpc_io.py).
DEFAULT_TOPOLOGY = "topology/local.toml"
