"""Small pieces of GBNF that the response-format grammars are put together from: a literal,
rules renamed apart (to hold several schemas' rules in one grammar), and text that never
contains a given closing string."""

from __future__ import annotations


def literal(text: str) -> str:
    """A GBNF string literal of this text."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def renamed(rules: str, prefix: str) -> str:
    """GBNF rules (one a line, as llama.cpp's schema converter writes them) with every rule
    name prefixed, in definitions and references, literals and character classes left as
    they are."""
    names = {line.split(" ::= ", 1)[0] for line in rules.splitlines() if " ::= " in line}
    out = []
    for line in rules.splitlines():
        if " ::= " not in line:
            continue
        name, body = line.split(" ::= ", 1)
        out.append(f"{prefix}{name} ::= {_renamed_body(body, names, prefix)}")
    return "\n".join(out)


def _renamed_body(body: str, names: set[str], prefix: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c in '"[':  # a literal or a character class, escapes included
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < len(body) and body[j] != close:
                j += 2 if body[j] == "\\" else 1
            out.append(body[i : j + 1])
            i = j + 1
        elif c.isalnum() or c == "-":
            j = i
            while j < len(body) and (body[j].isalnum() or body[j] == "-"):
                j += 1
            word = body[i:j]
            out.append(prefix + word if word in names else word)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def text_without(end: str) -> str:
    """A rule body for text in which `end` does not begin at any character (so the text
    stops before `end`): each character either differs from end's first, or starts a
    partial match that then differs."""
    branches = []
    for k in range(len(end)):
        prefix = literal(end[:k]) + " " if k else ""
        branches.append(f"{prefix}{_not_char(end[k])}")
    return "( " + " | ".join(branches) + " )*"


def _not_char(c: str) -> str:
    escaped = {"\n": "\\n", "\\": "\\\\", "]": "\\]", "^": "\\^", "-": "\\-"}.get(c, c)
    return f"[^{escaped}]"
