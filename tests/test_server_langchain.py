"""langchain-openai against the server, as an application uses it: with_structured_output with
each of its methods (json_schema, json_mode, function_calling) returns the pydantic model, and
bind_tools with a required call returns tool calls whose arguments fit the tool."""
from typing import Literal

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the 'structured' extra)")
langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
pydantic = pytest.importorskip("pydantic")

from serving import KEY, chat_server  # noqa: E402

NAME = "tiny-langchain"


class Person(pydantic.BaseModel):
    """A person."""
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from chat_server(tmp_path_factory, NAME)


@pytest.fixture(scope="module")
def chat(server):
    return langchain_openai.ChatOpenAI(model=NAME, base_url=server.url + "/v1", api_key=KEY, temperature=0.7,
                                       max_tokens=200, max_retries=0, seed=1)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output(chat, method):
    structured = chat.with_structured_output(Person, method=method)
    if method == "json_mode":  # (the schema reaches the model through the prompt alone: any JSON object, which
        values = []             # random weights may write past max_tokens: some seeds finish)
        for seed in range(8):
            model = chat.model_copy(update={"seed": seed, "max_tokens": 800})
            try:
                values.append(model.with_structured_output(None, method=method).invoke("Describe a person as JSON."))
            except Exception as e:
                assert "length" in str(e), e
        assert values and all(isinstance(value, dict) for value in values)
        return
    person = structured.invoke("Describe a person.")
    assert isinstance(person, Person)


def test_bind_tools_with_a_required_call(chat):
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        return "sunny"
    reply = chat.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).invoke(
        "What is the weather in Paris?")
    assert len(reply.tool_calls) == 1 and reply.tool_calls[0]["name"] == "get_weather"
    assert reply.tool_calls[0]["args"]["city"] in ("Paris", "Rome", "Oslo")
