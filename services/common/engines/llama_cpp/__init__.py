"""Embedded llama.cpp (llama-cpp-python's low-level API): the engine that runs anywhere.

One llama.cpp context per node holds `slots` sequences in a unified KV cache, and one
thread runs a step loop over them (continuous batching, as llama.cpp's own server does):

- `model.py`      the GGUF file: tokenizer, chat template, KV bytes per token
- `context.py`    the context and its slots: decode a batch, free a slot, export/import state
- `sampling.py`   one sampler chain per request
- `text.py`       tokens to text: UTF-8, stop strings, limits
- `scheduler.py`  the step loop: admission, batching, sampling, freeing slots
- `step_plan.py` what a step does, a pure function of the slots (phases; prompt tokens a
  step may take while streams generate)
- `host_threads.py` the cores of a machine shared by the engine nodes on it
- `prefix_cache.py` prompt prefixes kept resident for later prompts (keys: ../prefix_keys.py)
- `engine.py`     the asynchronous `Engine` nodes use
"""

from disagg_mesh.server.common.engines.llama_cpp.engine import EngineSettings, LlamaCppEngine

__all__ = ["EngineSettings", "LlamaCppEngine"]
