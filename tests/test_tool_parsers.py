"""Tool-call parsers (#43): Qwen3-Coder's XML-style calls and Hermes-style JSON calls, fed
whole, cut at every character, and token by token as Qwen's real vocabulary cuts the text;
what the pieces put together must be the same every way, and what does not parse is text.
llama.cpp's own cases for both formats are the oracle of what each text means."""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterator
from typing import Any

import llama_cpp
import pytest

from disagg_mesh.server.common.tools.calls import (
    ArgumentsPiece,
    CallStart,
    Piece,
    Tool,
    ToolCallParser,
    assemble,
)
from disagg_mesh.server.common.tools.hermes import HermesParser
from disagg_mesh.server.common.tools.qwen3_coder import Qwen3CoderParser
from tests.tiny_models import write_qwen3moe

RUN_TESTS = Tool(
    "run_tests",
    "Run the student's tests",
    {
        "type": "object",
        "properties": {
            "code": {"type": "string"},
            "timeout_s": {"type": "integer"},
            "verbose": {"type": "boolean"},
            "cases": {"type": "array"},
            "ratio": {"type": "number"},
        },
        "required": ["code"],
    },
)
LOOKUP = Tool("lookup_rubric", "", {"type": "object", "properties": {"item": {"type": "string"}}})
TOOLS = {t.name: t for t in (RUN_TESTS, LOOKUP)}

QWEN = (
    "Let me run the tests first.\n"
    "<tool_call>\n<function=run_tests>\n<parameter=code>\ndef add(a, b):\n"
    '    return a + b  # "<b>" & \\n\n</parameter>\n<parameter=timeout_s>\n30\n</parameter>\n'
    "<parameter=verbose>\ntrue\n</parameter>\n<parameter=cases>\n[[1, 2], [3, 4]]\n"
    "</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=lookup_rubric>\n<parameter=item>\nstyle\n</parameter>\n"
    "</function>\n</tool_call>"
)
QWEN_CALLS = [
    (
        "run_tests",
        {
            "code": 'def add(a, b):\n    return a + b  # "<b>" & \\n',
            "timeout_s": 30,
            "verbose": True,
            "cases": [[1, 2], [3, 4]],
            "ratio": 0.5,
        },
    ),
    ("lookup_rubric", {"item": "style"}),
]
HERMES = (
    "I will check.\n<tool_call>\n"
    '{"name": "run_tests", "arguments": {"code": "print(\\"<tool_call>\\")", "timeout_s": 5}}\n'
    '</tool_call>\n<tool_call>\n{"arguments": {"item": "style"}, "name": "lookup_rubric"}\n'
    "</tool_call>\nDone."
)
HERMES_CALLS = [
    ("run_tests", {"code": 'print("<tool_call>")', "timeout_s": 5}),
    ("lookup_rubric", {"item": "style"}),
]


def parse(make: Callable[[], ToolCallParser], pieces: Iterator[str] | list[str]) -> Any:
    parser = make()
    out: list[Piece] = []
    for piece in pieces:
        out += parser.feed(piece)
    out += parser.finish()
    text, calls = assemble(out)
    return text, [(c.name, c.parsed_arguments()) for c in calls], out


@pytest.fixture(scope="module")
def qwen_vocabulary(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Qwen3's (and Qwen3-Coder's) real vocabulary, in which <tool_call> and </tool_call>
    are tokens of their own."""
    path = write_qwen3moe(tmp_path_factory.mktemp("qwen") / "tiny.gguf", vocabulary="qwen")
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def token_pieces(vocabulary: Any, text: str) -> list[str]:
    """The text as the engine streams it when a model writes it: this vocabulary's tokens,
    each token's bytes decoded as they come (a character cut between tokens waits for the
    token that ends it)."""
    tokens = vocabulary.tokenize(text.encode(), add_bos=False, special=True)
    decoder = codecs.getincrementaldecoder("utf-8")()
    pieces = [decoder.decode(vocabulary.detokenize([t])) for t in tokens]
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize(
    ("make", "text", "expected_text", "expected_calls"),
    [
        (lambda: Qwen3CoderParser(TOOLS), QWEN, "Let me run the tests first.\n", QWEN_CALLS),
        (HermesParser, HERMES, "I will check.\nDone.", HERMES_CALLS),
    ],
    ids=["qwen3-coder", "hermes"],
)
def test_calls_are_the_same_whole_cut_anywhere_and_token_by_token(
    qwen_vocabulary: Any,
    make: Callable[[], ToolCallParser],
    text: str,
    expected_text: str,
    expected_calls: list[tuple[str, dict[str, Any]]],
) -> None:
    whole_text, calls, pieces = parse(make, [text])
    assert (whole_text, calls) == (expected_text, expected_calls)
    # OpenAI's order: each call's start (index, id, name) before its arguments.
    started: set[int] = set()
    for piece in pieces:
        if isinstance(piece, CallStart):
            started.add(piece.index)
            assert piece.id.startswith("call_")
        elif isinstance(piece, ArgumentsPiece):
            assert piece.index in started
    for cut in range(len(text) + 1):
        assert parse(make, [text[:cut], text[cut:]])[:2] == (expected_text, expected_calls), cut
    assert parse(make, iter(text))[:2] == (expected_text, expected_calls)  # a character at a time
    assert parse(make, token_pieces(qwen_vocabulary, text))[:2] == (expected_text, expected_calls)


def test_qwen3_coder_streams_each_parameter_as_it_ends() -> None:
    parser = Qwen3CoderParser(TOOLS)
    first = parser.feed("<tool_call>\n<function=run_tests>\n<parameter=code>\nx")
    assert [type(p).__name__ for p in first] == ["CallStart"]  # the name at once
    second = parser.feed("\n</parameter>\n<parameter=timeout_s>\n")
    assert second == [ArgumentsPiece(0, '{"code": "x"')]
    third = parser.feed("7\n</parameter>\n</function>\n</tool_call>")
    assert third == [ArgumentsPiece(0, ', "timeout_s": 7'), ArgumentsPiece(0, "}")]
    assert parser.finish() == []


def test_qwen3_coder_edge_cases() -> None:
    def q(*parts: str) -> Any:
        return parse(lambda: Qwen3CoderParser(TOOLS), list(parts))[:2]

    # No <tool_call> wrapper, and no parameters.
    assert q("<function=lookup_rubric>\n</function>") == ("", [("lookup_rubric", {})])
    # Cut off inside a value (max_tokens): the call is closed with what came.
    assert q("<tool_call>\n<function=run_tests>\n<parameter=code>\nprint(") == (
        "",
        [("run_tests", {"code": "print("})],
    )
    # A value that does not convert stays text; a parameter the schema lacks is text.
    assert q(
        "<function=run_tests><parameter=timeout_s>soon</parameter>"
        "<parameter=extra>5</parameter></function>"
    ) == (
        "",
        [("run_tests", {"timeout_s": "soon", "extra": "5"})],
    )
    # An unknown function is still a call (the door decides what to do with it).
    assert q("<function=rm_rf><parameter=path>/</parameter></function>")[1] == [
        ("rm_rf", {"path": "/"})
    ]
    # Not a call: text, whole.
    for text in ("<tool_call>hello", "a <function=not a name\nreally", "x <tool_ca", "<tool_call>"):
        assert q(text) == (text, []), text


# llama.cpp's own cases for Qwen3-Coder's format (tests/test-chat.cpp, its Qwen3-Coder block,
# in the llama.cpp this project builds): the model's text, the tools offered, and the answer's
# text and calls llama.cpp's parser reads from it (arguments in the order written).
def _tool(name: str, properties: dict[str, Any], required: list[str]) -> Tool:
    return Tool(name, "", {"type": "object", "properties": properties, "required": required})


INTEGER, STRING = {"type": "integer"}, {"type": "string"}
LLAMA_CPP_TOOLS = {
    t.name: t
    for t in (
        _tool("special_function", {"arg1": INTEGER}, ["arg1"]),
        _tool("special_function_with_opt", {"arg1": INTEGER, "arg2": INTEGER}, ["arg1"]),
        _tool("python", {"code": STRING}, ["code"]),
        _tool("html", {"markup": STRING}, ["markup"]),
        _tool("todo_list", {"todos": {"type": "array"}}, ["todos"]),
        _tool("edit", {"filename": STRING, "oldString": STRING, "newString": STRING}, []),
        _tool(
            "tool_2req_4opt",
            {"req1": STRING, "req2": INTEGER, "opt1": STRING, "opt2": INTEGER},
            ["req1", "req2"],
        ),
        _tool("set_nullable_str", {"name": {"type": ["string", "null"]}}, ["name"]),
        _tool("set_nullable_int", {"count": {"type": ["integer", "null"]}}, ["count"]),
        _tool(
            "set_union",
            {"value": {"type": ["string", "object"]}, "amount": {"type": ["string", "integer"]}},
            ["value", "amount"],
        ),
        _tool("set_unit", {"unit": {"enum": ["celsius", "fahrenheit"]}}, ["unit"]),
    )
}
SPECIAL = "<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n"
WITH_OPT = (
    "<function=special_function_with_opt>\n<parameter=arg1>\n1\n</parameter>\n"
    "<parameter=arg2>\n2\n</parameter>\n</function>\n"
)


CONTENT = "Hello, world!\nWhat's up?"
SPECIAL_CALL = ("special_function", '{"arg1": 1}')


def _call(function: str, *parameters: tuple[str, str]) -> str:
    written = "".join(f"<parameter={p}>\n{v}\n</parameter>\n" for p, v in parameters)
    return f"<tool_call>\n<function={function}>\n{written}</function>\n</tool_call>"


LLAMA_CPP_CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    (CONTENT, CONTENT, []),
    (f"<tool_call>\n{SPECIAL}</tool_call>", "", [SPECIAL_CALL]),
    # Some models leave out the opening <tool_call>.
    (f"{SPECIAL}</tool_call>", "", [SPECIAL_CALL]),
    (
        f"Let me call it.\n{SPECIAL}</tool_call>",
        "Let me call it.\n",
        [SPECIAL_CALL],
    ),
    (
        f"{SPECIAL}</tool_call>\n<tool_call>\n{WITH_OPT}</tool_call>",
        "",
        [
            SPECIAL_CALL,
            ("special_function_with_opt", '{"arg1": 1, "arg2": 2}'),
        ],
    ),
    (
        f"<tool_call>\n{SPECIAL}</tool_call>\n<tool_call>\n{WITH_OPT}</tool_call>",
        "",
        [
            SPECIAL_CALL,
            ("special_function_with_opt", '{"arg1": 1, "arg2": 2}'),
        ],
    ),
    (
        _call("python", ("code", 'def hello():\n    print("Hello, world!")\n\nhello()')),
        "",
        [("python", '{"code": "def hello():\\n    print(\\"Hello, world!\\")\\n\\nhello()"}')],
    ),
    (_call("python", ("code", "格")), "", [("python", '{"code": "格"}')]),
    (
        _call("html", ("markup", "<html>\n <head>\n  <title>Hello!</title>\n </head>\n</html>")),
        "",
        [("html", '{"markup": "<html>\\n <head>\\n  <title>Hello!</title>\\n </head>\\n</html>"}')],
    ),
    (
        _call(
            "todo_list",
            (
                "todos",
                '[{"item": "Check stuff", "selected": false}, '
                '{"item": "Prepare stuff", "selected": true}]',
            ),
        ),
        "",
        [
            (
                "todo_list",
                '{"todos": [{"item": "Check stuff", "selected": false}, '
                '{"item": "Prepare stuff", "selected": true}]}',
            )
        ],
    ),
    (
        _call("edit", ("newString", "#include"), ("filename", "foo.c"), ("oldString", "#iclunde")),
        "",
        [("edit", '{"newString": "#include", "filename": "foo.c", "oldString": "#iclunde"}')],
    ),
    (
        _call("tool_2req_4opt", ("req2", "42"), ("req1", "hello"), ("opt2", "200")),
        "",
        [("tool_2req_4opt", '{"req2": 42, "req1": "hello", "opt2": 200}')],
    ),
    (
        _call("set_nullable_str", ("name", "hello world")),
        "",
        [("set_nullable_str", '{"name": "hello world"}')],
    ),
    (_call("set_nullable_int", ("count", "42")), "", [("set_nullable_int", '{"count": 42}')]),
    (_call("set_nullable_str", ("name", "null")), "", [("set_nullable_str", '{"name": null}')]),
    (
        _call("set_union", ("value", '{"a": 1}'), ("amount", "2 dollars")),
        "",
        [("set_union", '{"value": {"a": 1}, "amount": "2 dollars"}')],
    ),
    (
        _call("set_union", ("value", "{not valid json"), ("amount", "42")),
        "",
        [("set_union", '{"value": "{not valid json", "amount": 42}')],
    ),
    (_call("set_unit", ("unit", "celsius")), "", [("set_unit", '{"unit": "celsius"}')]),
]


# llama.cpp's cases for the <tool_call> JSON format of Qwen2.5's template (and Hermes 2 Pro's).
HERMES_CALL = '{"name": "special_function", "arguments": {"arg1": 1}}'
LLAMA_CPP_HERMES_CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    (CONTENT, CONTENT, []),
    (f"<tool_call>\n{HERMES_CALL}\n</tool_call>", "", [SPECIAL_CALL]),
    (f"<tool_call>\n{HERMES_CALL}</tool_call>", "", [SPECIAL_CALL]),
    (
        f"{CONTENT}<tool_call>\n{HERMES_CALL}</tool_call>",
        CONTENT,
        [SPECIAL_CALL],
    ),
]


@pytest.mark.parametrize(
    ("make", "text", "expected_text", "expected_calls"),
    [(lambda: Qwen3CoderParser(LLAMA_CPP_TOOLS), *case) for case in LLAMA_CPP_CASES]
    + [(HermesParser, *case) for case in LLAMA_CPP_HERMES_CASES],
    ids=[f"qwen3-coder-{i}" for i in range(len(LLAMA_CPP_CASES))]
    + [f"hermes-{i}" for i in range(len(LLAMA_CPP_HERMES_CASES))],
)
def test_the_qwen_formats_read_llama_cpps_own_cases_token_by_token(
    qwen_vocabulary: Any,
    make: Callable[[], ToolCallParser],
    text: str,
    expected_text: str,
    expected_calls: list[tuple[str, str]],
) -> None:
    """Each of llama.cpp's cases gives llama.cpp's answer (its text, each call's name and
    arguments, in the order written): whole, cut at every character, and streamed as the
    real Qwen vocabulary cuts it, where <tool_call> is one token."""
    expected = (expected_text, [(n, json.loads(a)) for n, a in expected_calls])

    pieces = token_pieces(qwen_vocabulary, text)
    assert (text.count("<tool_call>") == 0) or "<tool_call>" in pieces
    for feed in ([text], iter(text), pieces):
        got_text, calls, _ = parse(make, feed)
        assert (got_text, calls) == expected
        assert [list(args) for _, args in calls] == [list(args) for _, args in expected[1]]
    for cut in range(len(text) + 1):
        assert parse(make, [text[:cut], text[cut:]])[:2] == expected, cut


def test_hermes_edge_cases() -> None:
    def h(*parts: str) -> Any:
        return parse(HermesParser, list(parts))[:2]

    assert h('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>') == (
        "",
        [("f", {"a": 1})],
    )
    assert h('<tool_call>{"name": "f"}</tool_call>') == ("", [("f", {})])
    # Ended before </tool_call>: a whole call is still one.
    assert h('<tool_call>{"name": "f", "arguments": {"a": [1]}}') == ("", [("f", {"a": [1]})])
    for text in (
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": {"a": ',  # cut off
        "plain text with a < sign and <tool_ at the end <tool_",
    ):
        assert h(text) == (text, []), text
    assert json.loads(json.dumps(h("x")[0])) == "x"


# -- what a request offers, and the generic format -------------------------------------------


def offered(**extra: Any) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": "run_tests", "description": "Run them", **extra},
    }


def test_a_requests_tools_are_read_and_every_mistake_names_its_field() -> None:
    from disagg_mesh.server.common.errors import InvalidArgument
    from disagg_mesh.server.common.tools.requests import read_tools

    assert read_tools(None) is None and read_tools([], "auto") is None
    params = {"type": "object", "properties": {"code": {"type": "string"}}}
    request = read_tools(
        [offered(parameters=params)], {"type": "function", "function": {"name": "run_tests"}}, False
    )
    assert request is not None and request.forced and not request.parallel
    assert request.function == "run_tests" and request.offered()[0].parameters == params
    auto = read_tools([offered()])
    assert auto is not None and auto.choice == "auto" and not auto.forced
    assert auto.parallel is None  # not said: as the format does by default
    for tools, choice, parallel, field in (
        ("run_tests", None, None, "tools"),
        ([42], None, None, "tools[0]"),
        ([{"type": "retrieval"}], None, None, "tools[0].type"),
        ([{"type": "function"}], None, None, "tools[0].function"),
        ([offered(name="bad name!")], None, None, "tools[0].function.name"),
        ([offered(), offered()], None, None, "tools[1].function.name"),
        ([offered(description=3)], None, None, "tools[0].function.description"),
        ([offered(parameters={"type": "array"})], None, None, "tools[0].function.parameters.type"),
        ([offered()], "sometimes", None, "tool_choice"),
        (
            [offered()],
            {"type": "function", "function": {"name": "nope"}},
            None,
            "tool_choice.function.name",
        ),
        ([offered()], 7, None, "tool_choice"),
        ([offered()], None, "yes", "parallel_tool_calls"),
        (None, "required", None, "tool_choice"),
    ):
        with pytest.raises(InvalidArgument) as caught:
            read_tools(tools, choice, parallel)
        assert caught.value.field == field, (tools, choice, caught.value)


def test_the_generic_format_holds_calls_to_the_schema_and_reads_them_back() -> None:
    import jsonschema

    from disagg_mesh.server.common.tools import generic

    tools = [RUN_TESTS, LOOKUP]
    required = generic.schema(tools, required=True, parallel=False)
    call = {"tool_call": {"name": "run_tests", "arguments": {"code": "x", "timeout_s": 3}}}
    jsonschema.validate(call, required)
    for wrong in (
        {"tool_call": {"name": "other", "arguments": {}}},
        {"tool_call": {"name": "run_tests", "arguments": {"timeout_s": 3}}},  # code required
        {"response": "hi"},  # required: a call
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, required)
    free = generic.schema(tools, required=False, parallel=True)
    jsonschema.validate({"response": "hi"}, free)
    jsonschema.validate(
        {"tool_calls": [call["tool_call"], {"name": "lookup_rubric", "arguments": {}}]}, free
    )
    assert "run_tests" in generic.system_text(tools, required=True)

    def read(text: str) -> Any:
        return parse(generic.GenericParser, list(text))[:2]

    assert read(json.dumps(call)) == ("", [("run_tests", {"code": "x", "timeout_s": 3})])
    assert read('{"response": "All good."}') == ("All good.", [])
    both = {"tool_calls": [call["tool_call"], {"name": "lookup_rubric", "arguments": {}}]}
    assert [c[0] for c in read(json.dumps(both))[1]] == ["run_tests", "lookup_rubric"]
    for text in ("not json", '{"tool_call": {"arguments": {}}}', "[1, 2]", '{"tool_calls": []}'):
        assert read(text) == (text, []), text


def test_the_generic_formats_reply_streams_as_it_comes_from_any_cut() -> None:
    """A reply's text goes out as its JSON string arrives (escapes decoded, a surrogate pair
    whole), the same cut anywhere; calls still wait for the object's end."""
    from disagg_mesh.server.common.tools import generic

    reply = 'Line one\nsaid "hi" \\ done é 🙂 \t end'
    for answer in (json.dumps({"response": reply}), json.dumps({"response": reply}, indent=1)):
        for cut in range(len(answer) + 1):
            parser = generic.GenericParser()
            first = parser.feed(answer[:cut])
            rest = parser.feed(answer[cut:]) + parser.finish()
            assert assemble(first + rest)[0] == reply, (answer, cut)
        parser = generic.GenericParser()
        early = parser.feed(answer[: answer.index("said")])
        assert assemble(early)[0] == "Line one\n"  # before the answer ends
    call = json.dumps({"tool_call": {"name": "run_tests", "arguments": {"code": "x"}}})
    parser = generic.GenericParser()
    assert parser.feed(call) == [] and assemble(parser.finish())[1][0].name == "run_tests"
