"""What travels between processes, and the one place it is translated: protobuf ↔ plain
Python types (convert.py), the KV stream's bytes (kv_wire.py) and the clients for
node-to-node calls (node_clients.py)."""
