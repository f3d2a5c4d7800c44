"""Running a node: serving (server.py: gRPC server, health, signals; grpc_status.py:
exceptions → status; grpc_io.py: gRPC's I/O path, set before gRPC loads), readiness while
the model loads, NodeService (node_info.py), security (auth.py tokens, tls.py certificates),
observability (logs, metrics) and starting a topology's processes (processes.py: make run
and the tests)."""
