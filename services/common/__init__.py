"""Code shared by every node: topology, engines, KV transfer, logging, serving."""
