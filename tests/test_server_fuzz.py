"""Schema-driven fuzzing of the server: request bodies generated from the server's own OpenAPI
document (openapi_strategy.py), the same bodies with one field replaced by arbitrary JSON, and
arbitrary JSON; each is sent to a real `nanovllm serve` and must get a status below 500 (a 200
stream must end with `data: [DONE]`). Afterwards the server is healthy, has no work left, and
still answers as the engine does. NANOVLLM_FUZZ_EXAMPLES sets the examples per endpoint (500:
1,000 requests in all, the issue's target); they are derandomized, so CI sends the same requests
every run, unless NANOVLLM_FUZZ_RANDOM is set.

The model's side: whatever text a model writes (tool-call tags and JSON, reasoning tags, broken
and nested, cut anywhere) goes through the chat parsers (tool calls, reasoning, both) whole and
streamed cut at every position, never raises, and streams what the whole response holds; through
the server (the text forced with a choice), it is a 200 both ways, the stream ending in [DONE]."""
import json
import os

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
httpx = pytest.importorskip("httpx", reason="httpx is not installed")
from hypothesis import HealthCheck, given, settings, strategies as st# noqa: E402

from nanovllm import LLM, SamplingParams# noqa: E402
from nanovllm.utils.tiny_model import build_model# noqa: E402
from openapi_strategy import from_schema, request_schemas  # noqa: E402
from serving import module_server, wait_for  # noqa: E402

EXAMPLES = int(os.environ.get("NANOVLLM_FUZZ_EXAMPLES", "500"))
MAX_LEN = 64  # so that any accepted request is quick to run
NAME = "fuzzed"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
statuses: dict[int, int] = {}  # what the fuzz got, for the report


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(str(tmp_path_factory.mktemp("fuzz")), chat_template=True, max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    yield from module_server(model, tmp_path_factory, "--served-model-name", NAME, "--max-queued-requests", "64",
                             max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def request_bodies(path: str) -> st.SearchStrategy:
    """Bodies for `path`: valid ones from the server's own schema, those with one field replaced
    by arbitrary JSON, and arbitrary JSON."""
    schema = SCHEMAS[path]
    text = st.text(st.characters(exclude_categories=[]))  # (lone surrogates included)
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
                               lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                               max_leaves=8)
    valid = from_schema(schema)
    one_field_wrong = st.tuples(valid, st.sampled_from(sorted(schema["properties"])), json_values).map(
        lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(valid, one_field_wrong, json_values)


SCHEMAS: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def schemas(server):
    """The request bodies' schemas, from the server's OpenAPI document."""
    SCHEMAS.update(request_schemas(httpx.get(server.url + "/openapi.json").json()))
    assert set(ENDPOINTS) <= set(SCHEMAS)


def send(client, path: str, body) -> int:
    raw = json.dumps(body).encode()  # (an infinite float is written as Infinity: not JSON, a 400)
    headers = {"Content-Type": "application/json"}
    if isinstance(body, dict) and body.get("stream") is True:
        with client.stream("POST", path, content=raw, headers=headers) as response:
            data = response.read()
        if response.status_code == 200:
            assert data.endswith(b"data: [DONE]\n\n"), (body, data[-300:])
    else:
        response = client.post(path, content=raw, headers=headers)
    statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
    assert response.status_code < 500, (path, body, response.text[:500])
    return response.status_code


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="NANOVLLM_FUZZ_RANDOM" not in os.environ,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


@pytest.mark.parametrize("path", ENDPOINTS)
def test_fuzzed_requests_get_no_5xx(client, path):
    @FUZZ
    @given(body=st.deferred(lambda: request_bodies(path)))
    def one(body):
        send(client, path, body)
    one()
    print(f"{path}: statuses {dict(sorted(statuses.items()))}")


# ---- what a model may write ------------------------------------------------------------------
MODEL_PIECES = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool", "_call>", "</", "<", ">", "\n", " ",
                "{", "}", '"name"', '"arguments"', ": ", ", ", '"f"', '"{bad json"', "[1]", "null", '{"x": 1}',
                '"{\\"a\\": 2}"', "\\", '"', "é", "🚀", "\ufffd", "\u2028", "text"]
MODEL_CALLS = st.builds(lambda name, arguments: "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments})
                        + "\n</tool_call>", st.sampled_from(["f", "g", ""]),
                        st.one_of(st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
                                  st.sampled_from(["x", [1], "{bad", '{"a": 1}', None])))
MODEL_TEXT = st.lists(st.one_of(st.sampled_from(MODEL_PIECES), st.text(max_size=4), MODEL_CALLS), max_size=10).map(
    "".join)


def chat_choices(tools: bool, reasoning: bool, started: bool):
    from nanovllm.entrypoints.api_server import ChatChoices
    from nanovllm.entrypoints.protocol import ChatCompletionRequest
    from nanovllm.entrypoints.reasoning_parsers import Qwen3ReasoningParser
    from nanovllm.entrypoints.tool_parsers import HermesToolParser
    body = {"messages": [{"role": "user", "content": "x"}]}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "f"}}]
    request = ChatCompletionRequest.model_validate(body)
    request.use_parsers(HermesToolParser(), reasoning_started=started)
    return ChatChoices([], request, NAME, None, reasoning_parser=Qwen3ReasoningParser() if reasoning else None)


def streamed(pieces: list[str], tools: bool, reasoning: bool, started: bool) -> tuple:
    """(content, reasoning, calls, finish reason) as a client adds up a stream of these pieces."""
    choices, content, thought, calls, finish_reason = chat_choices(tools, reasoning, started), "", "", [], None
    for i, piece in enumerate(pieces):
        end = i == len(pieces) - 1
        text, extra, finish_reason = choices.stream_piece(0, piece, end, "stop" if end else None)
        content, thought = content + text, thought + (extra.get("reasoning_content") or "")
        calls += [(c["function"]["name"], c["function"]["arguments"]) for c in extra.get("tool_calls") or []]
    return content.strip() or None, thought or None, calls, finish_reason


@settings(max_examples=600, deadline=None, derandomize="NANOVLLM_FUZZ_RANDOM" not in os.environ, database=None,
          suppress_health_check=list(HealthCheck))
@given(text=MODEL_TEXT, tools=st.booleans(), reasoning=st.booleans(), started=st.booleans())
def test_any_text_a_model_writes_parses_alike_whole_and_streamed_however_cut(text, tools, reasoning, started):
    """Streamed content may keep the whitespace at its ends that the whole message strips; all
    else is equal: the reasoning, the calls (names and arguments, in order), the finish reason."""
    started = started and reasoning  # (a block the prompt opened)
    whole, finish_reason = chat_choices(tools, reasoning, started).final(text, "stop")
    message = whole["message"]
    expected = ((message["content"] or "").strip() or None, message.get("reasoning_content"),
                [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []],
                finish_reason)
    for pieces in [[text[:p], text[p:]] for p in range(len(text) + 1)] + [list(text) or [""]]:
        assert streamed(pieces, tools, reasoning, started) == expected, (text, pieces)


@pytest.fixture(scope="module")
def parsing_client(tmp_path_factory):
    """A server with both parsers, and room for a chat prompt with tools and the text after it."""
    model = build_model(str(tmp_path_factory.mktemp("parsing")), chat_template=True)
    for server in module_server(model, tmp_path_factory, "--reasoning-parser", "qwen3", max_model_len=512):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            yield c


@settings(max_examples=16, deadline=None, derandomize="NANOVLLM_FUZZ_RANDOM" not in os.environ, database=None,
          suppress_health_check=list(HealthCheck))
@given(text=MODEL_TEXT.filter(bool), tools=st.booleans())
def test_any_text_a_model_writes_is_served_whole_and_streamed(parsing_client, text, tools):
    body = {"messages": [{"role": "user", "content": "x"}], "temperature": 0, "max_tokens": 200,
            "structured_outputs": {"choice": [text]}}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert send(parsing_client, "/v1/chat/completions", body) == 200
    assert send(parsing_client, "/v1/chat/completions", {**body, "stream": True}) == 200


def test_the_server_is_healthy_after_the_fuzz(server, client, model):
    assert client.get("/health").status_code == 200
    assert wait_for(lambda: server.metrics()["nanovllm:num_requests_running"] == 0, timeout=30)
    assert wait_for(lambda: server.metrics()["nanovllm:kv_cache_usage_perc"] == 0)
    with LLM(model, max_model_len=MAX_LEN) as llm:
        expected = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                use_tqdm=False)[0]
    reply = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0,
                                                 "ignore_eos": True}).json()
    assert reply["choices"][0]["text"] == expected["text"]
