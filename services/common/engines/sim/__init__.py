"""The simulated engine (`engine = "sim"`, issue #41): the mesh's own nodes with time taken
from hardware profiles instead of a model.

- `profile.py`   hardware profiles: prompt and decode-step times by tokens, depth and batch
                 (interpolated tables), KV bytes per token, links; the Ollama baseline's
                 serving assumptions
- `profiles/`    the shipped profiles: dgx-spark, m3-ultra and m4-max (estimates marked),
                 ollama
- `models.toml`  what a sim node says of its model (sizes, capabilities), with sources
- `answers.py`   what a sim node answers: words, JSON a response format's schema allows,
                 tool calls (the generic format), cut at stop strings
- `prefix.py`    its prompt caches: node-wide blocks, or each slot's last prompt (Ollama)
- `engine.py`    SimEngine: the engine interface, timed by a profile
- `timers.py`    the event loop of a process of sim nodes: timers that wake on time
"""
