"""Tool calling through the chat endpoint: tools reach the chat template; tool_choice "required"
or a named function is enforced by a grammar (the output is always a valid call of an allowed
tool, its arguments valid against the tool's schema), returned as message.tool_calls with
finish_reason "tool_calls", streamed as delta.tool_calls; "none" parses nothing; tool-result
turns render; bad tool_choice values are 400s. The hermes parser itself on written text."""
import json

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("xgrammar", reason="tool_choice required needs xgrammar (the 'structured' extra)")
pytest.importorskip("openai", reason="the openai client is not installed")
jsonschema = pytest.importorskip("jsonschema")

from nanovllm.entrypoints.tool_parsers import HermesToolParser  # noqa: E402
from serving import chat_server, error_of, http, openai_client  # noqa: E402

NAME = "tiny-tools"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from chat_server(tmp_path_factory, NAME)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def check_calls(calls, allowed=SCHEMAS):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])


def test_tools_reach_the_template(client):
    plain = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1)
    with_tools = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_are_always_valid(client, parallel):
    for seed in range(6):
        out = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=parallel, temperature=1.0, seed=seed,
                                             max_tokens=300)
        choice = out.choices[0]
        if choice.finish_reason == "length":  # (parallel calls may go on to max_tokens: those before count)
            assert parallel
        else:
            assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_a_named_function_is_the_one_called(client):
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=3,
                                         tool_choice={"type": "function", "function": {"name": "add"}})
    calls = out.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"] and out.choices[0].finish_reason == "tool_calls"
    check_calls(calls, {"add": ADD})


def test_streamed_tool_calls_equal_the_whole_response(client):
    body = dict(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                temperature=0.8, seed=5, max_tokens=200)
    whole = client.chat.completions.create(**body).choices[0]
    calls, reasons, content = {}, [], ""
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert reasons == ["tool_calls"] and not content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tool_choice_none_parses_nothing_and_auto_parses_what_is_there(client):
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                         max_tokens=20, temperature=0)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason != "tool_calls"
    auto = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=20, temperature=0)
    assert auto.choices[0].message.content == out.choices[0].message.content  # (random weights: no call written)


def test_a_tool_result_turn_renders(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    out = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, max_tokens=3)
    first = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=3)
    assert out.usage.prompt_tokens > first.usage.prompt_tokens + 10


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
])
def test_bad_tool_requests_are_400s(server, body, param, words):
    error = error_of(http(server, "POST", "/v1/chat/completions", json={"messages": MESSAGES, **body}), 400)
    assert error["param"] == param and words in error["message"], error


def test_the_hermes_parser():
    parser = HermesToolParser()
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    content, calls = parser.parse(text)
    assert content == "Let me check.\n\n" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    assert parser.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parser.parse("<tool_call>[1]</tool_call> x") == ("<tool_call>[1]</tool_call> x", [])
    assert parser.parse("") == (None, [])
    assert parser.held_back("Sure <tool") == 5 and parser.held_back("Sure") == 4
    assert parser.held_back("a <tool_call>{") == 2 and parser.held_back("<") == 0


BAD_CALL = '<tool_call>\n{"name": "get_weather", "arguments": "{bad json"}\n</tool_call>'


def test_a_call_whose_arguments_do_not_parse_stays_in_the_content(server, client):
    """Whatever the model writes is never a 500 nor a cut stream: a call that does not parse (its
    arguments JSON text that is not JSON) is content, whole and streamed. The text is forced with
    a choice constraint."""
    body = dict(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=300,
                extra_body={"structured_outputs": {"choice": [BAD_CALL]}})
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.message.content == BAD_CALL and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    content, reasons = "", []
    for chunk in client.chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            content += c.delta.content or ""
            assert not c.delta.tool_calls
            reasons += [c.finish_reason] if c.finish_reason else []
    assert content == BAD_CALL and reasons == ["stop"]
    raw = http(server, "POST", "/v1/chat/completions", json={
        "messages": MESSAGES, "tools": TOOLS, "max_tokens": 300, "stream": True,
        "structured_outputs": {"choice": [BAD_CALL]}})
    assert raw.status_code == 200 and raw.text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("arguments", ['[1]', '"x"', '1', 'null', '"[1]"', 'true'])
def test_a_call_whose_arguments_are_not_an_object_stays_in_the_content(arguments):
    """OpenAI's arguments are a JSON object (as text): a block whose arguments are anything else
    is no call (a client parsing them as an object would crash); it stays in the text, where it
    was, and the good calls around it are still calls."""
    parser = HermesToolParser()
    bad = f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'
    assert parser.parse(bad) == (bad, [])
    good = '<tool_call>{"name": "g", "arguments": {"a": 1}}</tool_call>'
    content, calls = parser.parse(f"{good}\n{bad} after")
    assert content == f"\n{bad} after" and [(c.name, json.loads(c.arguments)) for c in calls] == [("g", {"a": 1})]


def test_a_required_tool_whose_parameters_use_defs(client):
    """Pydantic writes nested models as $defs with "$ref": "#/$defs/City" (what langchain's
    bind_tools sends): the refs point into the tool's own parameters, wherever the call's grammar
    puts them."""
    city = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
            "additionalProperties": False}
    parameters = {"$defs": {"City": city}, "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
                  "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
             {"type": "function", "function": {"name": "visit", "parameters": parameters}}]
    for seed in range(3):
        out = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=tools, temperature=1.0, seed=seed,
                                             tool_choice={"type": "function", "function": {"name": "visit"}},
                                             max_tokens=200)
        check_calls(out.choices[0].message.tool_calls, {"visit": parameters})


DEEP = "[" * 100_000 + "]" * 100_000  # (JSON nested far past Python's recursion limit: json.loads raises RecursionError)


@pytest.mark.parametrize("bad", [f"<tool_call>{DEEP}</tool_call>",
                                 f'<tool_call>{{"name": "f", "arguments": "{DEEP}"}}</tool_call>'],
                         ids=["block", "arguments"])
def test_a_call_nested_past_the_recursion_limit_stays_in_the_content(bad):
    """A block (or its arguments' JSON text) nested too deeply to parse is no call, as one that
    is not JSON: it stays in the text, the good call beside it is still a call; and the chat
    endpoint's message and its stream end as for any text (not a 500, nor a stream cut before [DONE])."""
    from nanovllm.entrypoints.api_server import ChatChoices
    from nanovllm.entrypoints.protocol import ChatCompletionRequest
    parser = HermesToolParser()
    assert parser.parse(bad) == (bad, [])
    good = '<tool_call>{"name": "g", "arguments": {"a": 1}}</tool_call>'
    content, calls = parser.parse(f"{good}\n{bad}")
    assert content == f"\n{bad}" and [(c.name, json.loads(c.arguments)) for c in calls] == [("g", {"a": 1})]

    def choices():
        request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS})
        request.use_parsers(HermesToolParser())
        return ChatChoices([], request, NAME, None)
    whole, finish_reason = choices().final(bad, "stop")
    assert whole["message"]["content"] == bad and "tool_calls" not in whole["message"] and finish_reason == "stop"
    stream = choices()
    pieces = [stream.stream_piece(0, bad[:50], False, None), stream.stream_piece(0, bad[50:], True, "stop")]
    assert "".join(text for text, _, _ in pieces) == bad
    assert not any(extra.get("tool_calls") for _, extra, _ in pieces) and pieces[-1][2] == "stop"
