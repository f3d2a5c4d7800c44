"""Tool calls (issue #43, in progress): the tools a request offers, and the calls a model
makes, parsed per model family as the answer streams.

- `calls.py`        the plain types (Tool, ToolCall, the streamed pieces) and assemble()
- `hermes.py`       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/3, ...)
- `qwen3_coder.py`  Qwen3-Coder's `<tool_call><function=NAME><parameter=P>...` format
- `generic.py`      templates without tools (SmolLM2): the tools in a system message, the
                    answer one JSON object (a call or a reply) held to a schema
- `requests.py`     `tools`, `tool_choice`, `parallel_tool_calls` read, every mistake a 400
                    naming its field
"""
