"""Structured output: response formats (JSON Schemas) checked against the mesh's limits and
converted to llama.cpp grammars, off the event loop."""
