"""Structured outputs through the server: OpenAI's response_format (json_object, json_schema, as
the official client's `chat.completions.parse(PydanticModel)` sends it) and vLLM's
structured_outputs extra (json, regex, choice, grammar), on both endpoints, streamed or not; an
unknown response_format type, a bad schema or regex, or both fields at once are 400s naming the
field, and the server keeps serving."""
import json
import re

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the 'structured' extra)")
pytest.importorskip("openai", reason="the openai client is not installed")
pydantic = pytest.importorskip("pydantic")

from serving import chat_server, error_of, http, openai_client  # noqa: E402

NAME = "tiny-structured"
MESSAGES = [{"role": "user", "content": "Give me a person as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from chat_server(tmp_path_factory, NAME)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    tags: list[str] = pydantic.Field(max_length=3)


def test_parse_a_pydantic_model(client):
    """client.chat.completions.parse(Person): response_format json_schema (strict), the message
    parsed back into a Person by the client."""
    for seed in range(3):
        completion = client.chat.completions.parse(model=NAME, messages=MESSAGES, response_format=Person,
                                                   temperature=1.0, seed=seed, max_tokens=300)
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, Person), message.content


def test_json_object_and_streamed_json_schema(client):
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, response_format={"type": "json_object"},
                                         temperature=0, max_tokens=400)
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content, strict=False), dict)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    chunks = client.chat.completions.create(
        model=NAME, messages=MESSAGES, stream=True, temperature=0.7, seed=1, max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": schema, "strict": True}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    value = json.loads(text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9


@pytest.mark.parametrize("constraint, check", [
    ({"regex": r"\d{3}-[a-z]{2,4}"}, lambda text: re.fullmatch(r"\d{3}-[a-z]{2,4}", text)),
    ({"choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ({"grammar": 'root ::= "(" [0-9] ("," [0-9])* ")"'}, lambda text: re.fullmatch(r"\(\d(,\d)*\)", text)),
    ({"json": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 5}, "maxItems": 4}},
     lambda text: all(0 <= v <= 5 for v in json.loads(text))),
])
def test_vllms_structured_outputs_extra_on_completions(client, constraint, check):
    outs = client.completions.create(model=NAME, prompt="Answer:", n=4, temperature=1.0, seed=3, max_tokens=60,
                                     extra_body={"structured_outputs": constraint})
    finished = [c.text for c in outs.choices if c.finish_reason == "stop"]
    assert len(finished) >= 3 and all(check(text) for text in finished), finished


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "bogus"}}, "response_format", "type"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "not a valid JSON schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "not a valid regular expression"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "not supported"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param, words):
    response = http(server, "POST", "/v1/chat/completions", json={"model": NAME, "messages": MESSAGES, **body})
    error = error_of(response, 400)
    assert error["param"] == param and words in error["message"], error
    ok = http(server, "POST", "/v1/chat/completions", json={"model": NAME, "messages": MESSAGES, "max_tokens": 2})
    assert ok.status_code == 200


TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                  "maxItems": 3, "uniqueItems": True}},
        "required": ["tags"], "additionalProperties": False}


def test_a_schema_keyword_xgrammar_would_not_enforce_is_a_400_naming_it(client, server):
    """uniqueItems (which xgrammar ignores: its outputs could repeat items) through the official
    client: response_format json_schema and the structured_outputs extra are 400s naming the
    keyword and where it stands, not 200s whose output breaks the schema."""
    import openai
    for kwargs in ({"response_format": {"type": "json_schema", "json_schema": {"name": "tags", "schema": TAGS}}},
                   {"extra_body": {"structured_outputs": {"json": TAGS}}}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=50, **kwargs)
        error = caught.value.body
        assert error["param"] in ("response_format", "structured_outputs"), error
        assert "the keyword 'uniqueItems' (at /properties/tags) is not supported" in error["message"], error
    ok = http(server, "POST", "/v1/chat/completions", json={"model": NAME, "messages": MESSAGES, "max_tokens": 2})
    assert ok.status_code == 200


def test_a_required_tool_whose_parameters_xgrammar_would_not_enforce_is_a_400_on_tools(client):
    import openai
    tools = [{"type": "function", "function": {"name": "tag", "parameters": TAGS}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, messages=MESSAGES, tools=tools, tool_choice="required",
                                       max_tokens=50)
    error = caught.value.body
    assert error["param"] == "tools", error
    assert "tools: the parameters of 'tag': the keyword 'uniqueItems' (at /properties/tags)" in error["message"], error
