"""Tool calls (issue #43, in progress): the tools a request offers, and the calls a model
makes, parsed per model family as the answer streams.

- `calls.py`        the plain types (Tool, ToolCall, the streamed pieces) and assemble()
- `hermes.py`       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/3, ...)
- `qwen3_coder.py`  Qwen3-Coder's `<tool_call><function=NAME><parameter=P>...` format
"""
