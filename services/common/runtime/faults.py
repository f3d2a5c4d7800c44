"""Fault injection for the tests of what the mesh does when a node dies holding a request
(router/deaths.py): with DISAGG_FAULT_CRASH_MARKER set in a node's environment, a prompt
containing that text kills the node with SIGSEGV, as a crash in native code would. Unset (as
everywhere but those tests), nothing happens."""

from __future__ import annotations

import os
import signal

from disagg_mesh.server.common.types import Prompt

ENV = "DISAGG_FAULT_CRASH_MARKER"


def crash_if_marked(prompt: Prompt) -> None:
    marker = os.environ.get(ENV)
    if not marker:
        return
    text = prompt.text + "".join(m.content for m in prompt.messages)
    if marker in text:
        os.kill(os.getpid(), signal.SIGSEGV)
