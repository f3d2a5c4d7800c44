"""Running a node: serving (server.py: gRPC server, health, signals; grpc_status.py:
exceptions → status), readiness while the model loads, NodeService (node_info.py), security
(auth.py tokens, tls.py certificates), observability (logs, metrics) and starting a
topology's processes (processes.py: make run and the tests)."""
