"""KV state transfer: the prefill node's store of states, chunking, and checked reassembly.

Bytes only, with explicit metadata: nothing here is pickled. A state is kept under a random
handle until it is fetched once or its time-to-live ends; the store never holds more than
its byte budget (store.py). The decode node reassembles chunks into one buffer and checks
offsets, size, SHA-256 and fingerprint before anything reaches the engine (assembler.py).
The wire format of the chunks is wire/kv_wire.py's.
"""
