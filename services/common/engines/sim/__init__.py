"""The simulated engine (`engine = "sim"`, issue #41): the mesh's own nodes with time taken
from hardware profiles instead of a model.

- `profile.py`   hardware profiles: prompt and decode-step times by tokens, depth and batch
                 (interpolated tables), KV bytes per token, links; the Ollama baseline's
                 serving assumptions
- `profiles/`    the shipped profiles: dgx-spark, m3-ultra (estimates marked), ollama
"""
