"""The server's responses to a fixed set of requests, recorded byte for byte: a change to the
engine or to the entry points that changes any response (a token, a logprob beyond float32
rounding, a key's order, an error's wording, where a stream's chunks fall) fails here.

    NANOVLLM_RECORD_GOLDEN=1 python -m pytest -q tests/test_server_golden.py   # rewrite server_golden.json

(Re-record only on purpose, when a change of response is the point; the diff of the file is then
the change.) The requests go one at a time, in the order of REQUESTS, to two servers started as
the other server tests start theirs (`python -m nanovllm serve` on the tiny random-weight chat
model of nanovllm.utils.tiny_model, ChatML template with tools): one plain, one with
`--reasoning-parser qwen3`. One at a time, in order, each server fresh: the batches the engine
runs, and what its prefix cache holds when each request comes (the usage's cached_tokens), are
the same at every run. Every sampling request is greedy or seeded. The servers run torch on one
thread (OMP_NUM_THREADS=1), so that the float sums, and with them the logprobs, do not depend on
how many cores the machine has; its vector width still may, in the last bits (FLOAT_RTOL).

What is recorded of a response: its status, its Content-Type and its body as it came, bytes for
bytes (a stream's raw server-sent events included), except for these values, which vary by
nature and are replaced in the text, each where it stands, leaving every other byte as it was:
- a response's `"id"` ("cmpl-" or "chatcmpl-" and 32 hex digits, a fresh uuid4 per call) and a
  tool call's `"id"` ("call_" and 24 hex digits, uuid4 too) -> "cmpl-<1>", "call_<2>", ...:
  numbered by first appearance in the response, so that the chunks of one stream sharing one id
  (and two calls having two) is still checked;
- `"created"` (the Unix time of the call, or of the server's start for /v1/models): checked to lie
  between the servers' start and now, then written as <created>.
Nothing else in these responses varies: they carry no timing metrics (those are in /metrics,
which is not requested here, since its latency histograms are timings). An id or timestamp of
another form is left as it is, and so fails the comparison.

The golden file also holds the tiny model's weight fingerprint: where this environment draws
other weights (another torch or transformers release), that is what fails, not every response.
"""
import json
import os
import re
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
pytest.importorskip("prometheus_client", reason="the serve extra (prometheus-client) is not installed")
pytest.importorskip("xgrammar", reason="structured outputs and tool_choice need xgrammar (the 'structured' extra)")
pytest.importorskip("httpx", reason="httpx is not installed")

from safetensors.torch import load_file  # noqa: E402

from nanovllm.utils.tiny_model import build_model  # noqa: E402
from serving import KEY, Server, http  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server_golden.json")
RECORD = os.environ.get("NANOVLLM_RECORD_GOLDEN") == "1"
NAME = "tiny-golden"
MAX_LEN = 1024  # (the tools fill 600 tokens of a prompt)

HELLO = [{"role": "user", "content": "hello"}]
# (the golden file's own tools, not another test's: a change there must not change these requests)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
        "type": "object", "required": ["city", "unit"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "required": ["a", "b"], "additionalProperties": False,
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer"}}}}}]
WEATHER_IN_PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
DIGIT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "word": {"type": "string", "maxLength": 6}},
         "required": ["n", "word"], "additionalProperties": False}
DIGIT_FORMAT = {"type": "json_schema", "json_schema": {"name": "digit", "schema": DIGIT}}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# (name, server, method, path, body: JSON, or raw bytes; options: key=None sends no API key)
REQUESTS = [
    # ---- /v1/completions ----
    ("completion greedy", "plain", "POST", COMPLETIONS,
     {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}, {}),
    ("completion seeded top_p top_k", "plain", "POST", COMPLETIONS,
     {"prompt": "Paged attention", "max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7}, {}),
    ("completion n=2 of two prompts", "plain", "POST", COMPLETIONS,
     {"prompt": ["Continuous batching", "def forward"], "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 3}, {}),
    ("completion logprobs", "plain", "POST", COMPLETIONS,
     {"prompt": "Prefix caching", "max_tokens": 6, "temperature": 0, "logprobs": 3}, {}),
    ("completion echo with logprobs", "plain", "POST", COMPLETIONS,
     {"prompt": "The lazy dog", "echo": True, "logprobs": 2, "max_tokens": 4, "temperature": 0}, {}),
    ("completion echo only (max_tokens 0)", "plain", "POST", COMPLETIONS,
     {"prompt": "The lazy dog jumps", "echo": True, "max_tokens": 0, "logprobs": 1}, {}),
    ("completion stop strings", "plain", "POST", COMPLETIONS,
     {"prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0, "stop": ["zz", "ing"]}, {}),
    ("completion stop string included", "plain", "POST", COMPLETIONS,
     {"prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0, "stop": "ption",
      "include_stop_str_in_output": True}, {}),
    ("completion max_tokens null (to max_model_len)", "plain", "POST", COMPLETIONS,
     {"prompt": "日本語", "max_tokens": None, "temperature": 0}, {}),
    ("completion prompt token ids", "plain", "POST", COMPLETIONS,
     {"prompt": [10, 20, 30, 40, 50], "max_tokens": 5, "temperature": 0}, {}),
    ("completion prompts of token ids, seeded", "plain", "POST", COMPLETIONS,
     {"prompt": [[1, 2, 3], [300, 301]], "max_tokens": 4, "temperature": 1.0, "seed": 9}, {}),
    ("completion sampling extras", "plain", "POST", COMPLETIONS,
     {"prompt": "Prefix caching shares", "max_tokens": 10, "temperature": 0.7, "seed": 11, "min_p": 0.05,
      "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.2, "min_tokens": 4,
      "ignore_eos": True, "logit_bias": {"5": 3.5, "17": -100}, "stop_token_ids": [42], "user": "u1"}, {}),
    ("completion allowed_token_ids", "plain", "POST", COMPLETIONS,
     {"prompt": "Paged", "max_tokens": 6, "temperature": 1.0, "seed": 2, "allowed_token_ids": [5, 17, 42, 100, 200]},
     {}),
    ("completion structured choice", "plain", "POST", COMPLETIONS,
     {"prompt": "Is it?", "max_tokens": 10, "temperature": 1.0, "seed": 1,
      "structured_outputs": {"choice": ["yes", "no", "maybe"]}}, {}),
    ("completion structured regex", "plain", "POST", COMPLETIONS,
     {"prompt": "Code:", "max_tokens": 12, "temperature": 0, "structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}, {}),
    ("completion response_format json_object", "plain", "POST", COMPLETIONS,
     {"prompt": "JSON:", "max_tokens": 24, "temperature": 0, "response_format": {"type": "json_object"}}, {}),
    ("completion stream n=2", "plain", "POST", COMPLETIONS,
     {"prompt": ["The quick brown fox", "日本語"], "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 5, **STREAM},
     {}),
    ("completion stream logprobs", "plain", "POST", COMPLETIONS,
     {"prompt": "Prefix caching", "max_tokens": 5, "temperature": 0, "logprobs": 2, "stream": True}, {}),
    # ---- /v1/chat/completions ----
    ("chat greedy", "plain", "POST", CHAT, {"model": NAME, "messages": HELLO, "max_tokens": 10, "temperature": 0}, {}),
    ("chat seeded n=2", "plain", "POST", CHAT,
     {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paged attention?"}],
      "max_completion_tokens": 8, "temperature": 0.9, "top_p": 0.95, "seed": 21, "n": 2}, {}),
    ("chat top_logprobs", "plain", "POST", CHAT,
     {"messages": HELLO, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3}, {}),
    ("chat logprobs without top_logprobs", "plain", "POST", CHAT,
     {"messages": HELLO, "max_tokens": 4, "temperature": 1.0, "seed": 4, "logprobs": True}, {}),
    ("chat stream n=2", "plain", "POST", CHAT,
     {"messages": [{"role": "user", "content": "hi 🚀"}], "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 8,
      **STREAM}, {}),
    ("chat response_format json_object", "plain", "POST", CHAT,
     {"messages": HELLO, "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"}}, {}),
    ("chat response_format json_schema", "plain", "POST", CHAT,
     {"messages": HELLO, "max_tokens": 60, "temperature": 0, "response_format": DIGIT_FORMAT}, {}),
    ("chat tools auto", "plain", "POST", CHAT,
     {"messages": WEATHER_IN_PARIS, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 12, "temperature": 0}, {}),
    ("chat tools required", "plain", "POST", CHAT,
     {"messages": WEATHER_IN_PARIS, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
      "temperature": 1.0, "seed": 1}, {}),
    ("chat tools named function", "plain", "POST", CHAT,
     {"messages": WEATHER_IN_PARIS, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}},
      "max_tokens": 100, "temperature": 0}, {}),
    ("chat tools required stream", "plain", "POST", CHAT,
     {"messages": WEATHER_IN_PARIS, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
      "max_tokens": 200, "temperature": 1.0, "seed": 2, **STREAM}, {}),
    ("chat tool turns and content parts", "plain", "POST", CHAT,
     {"messages": [*WEATHER_IN_PARIS,
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
                   {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "now?"}]}],
      "tools": TOOLS, "tool_choice": "none", "max_tokens": 8, "temperature": 0}, {}),
    # ---- reasoning (--reasoning-parser qwen3) ----
    ("reasoning chat greedy", "reasoning", "POST", CHAT, {"messages": HELLO, "max_tokens": 8, "temperature": 0}, {}),
    ("reasoning chat json_schema", "reasoning", "POST", CHAT,
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "temperature": 0,
      "response_format": DIGIT_FORMAT}, {}),
    ("reasoning chat json_schema stream", "reasoning", "POST", CHAT,
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "temperature": 0,
      "response_format": DIGIT_FORMAT, **STREAM}, {}),
    # ---- the model ----
    ("models", "plain", "GET", "/v1/models", None, {}),
    ("model by name", "plain", "GET", f"/v1/models/{NAME}", None, {}),
    # ---- errors ----
    ("error unknown model", "plain", "POST", COMPLETIONS, {"model": "nope", "prompt": "x"}, {}),
    ("error no API key", "plain", "POST", COMPLETIONS, {"prompt": "x"}, {"key": None}),
    ("error not JSON", "plain", "POST", COMPLETIONS, b'{"prompt": "x",', {}),
    ("error a field of the wrong type", "plain", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, {}),
    ("error an unknown field", "plain", "POST", COMPLETIONS, {"prompt": "x", "suffix": "y"}, {}),
    ("error a prompt too long", "plain", "POST", COMPLETIONS, {"prompt": "The quick brown fox " * 150}, {}),
    ("error prompt token ids too long", "plain", "POST", COMPLETIONS, {"prompt": [5] * (MAX_LEN + 10)}, {}),
    ("error a token id outside the vocabulary", "plain", "POST", COMPLETIONS, {"prompt": [1, 600]}, {}),
    ("error max_tokens past max_model_len", "plain", "POST", CHAT, {"messages": HELLO, "max_tokens": 1000}, {}),
    ("error bad values (the first one checked)", "plain", "POST", COMPLETIONS,
     {"prompt": "x", "temperature": -1, "logit_bias": {"x1": 2}}, {}),
    ("error a sampling value out of range", "plain", "POST", COMPLETIONS, {"prompt": "x", "temperature": -1}, {}),
    ("error max_completion_tokens 0", "plain", "POST", CHAT, {"messages": HELLO, "max_completion_tokens": 0}, {}),
    ("error too many stop strings", "plain", "POST", COMPLETIONS, {"prompt": "x", "stop": ["s"] * 17}, {}),
    ("error top_logprobs without logprobs", "plain", "POST", CHAT, {"messages": HELLO, "top_logprobs": 2}, {}),
    ("error a schema keyword xgrammar ignores", "plain", "POST", CHAT,
     {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}, {}),
    ("error a tool_choice naming no tool", "plain", "POST", CHAT,
     {"messages": HELLO, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, {}),
]


def fingerprint(model: str) -> float:
    weights = load_file(os.path.join(model, "model.safetensors"))
    return round(sum(float(w.double().abs().sum()) for w in weights.values()), 6)


ID = re.compile(r'("id": ?")(cmpl-|chatcmpl-|call_)([0-9a-f]+)(")')
ID_DIGITS = {"cmpl-": 32, "chatcmpl-": 32, "call_": 24}
CREATED = re.compile(r'("created": ?)(\d+)')


def normalized(text: str, since: float) -> str:
    """text with its ids numbered and its timestamps checked and replaced (see the docstring)."""
    numbers: dict[str, int] = {}

    def number(match: re.Match) -> str:
        head, prefix, digits, tail = match.groups()
        if len(digits) != ID_DIGITS[prefix]:
            return match.group(0)
        numbers.setdefault(prefix + digits, len(numbers) + 1)
        return f"{head}{prefix}<{numbers[prefix + digits]}>{tail}"

    def timestamp(match: re.Match) -> str:
        if not int(since) <= int(match.group(2)) <= time.time():
            return match.group(0)
        return match.group(1) + "<created>"
    return CREATED.sub(timestamp, ID.sub(number, text))


def send(server: Server, since: float, method: str, path: str, body, options: dict) -> dict:
    """The response to one request as recorded; since: when its server was started."""
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    response = http(server, method, path, key=options.get("key", KEY), **kwargs)
    return {"status": response.status_code, "content_type": response.headers.get("content-type"),
            "body": normalized(response.content.decode("utf-8"), since)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(str(tmp_path_factory.mktemp("golden")), chat_template=True)


@pytest.fixture(scope="module")
def responses(model, tmp_path_factory) -> dict[str, dict]:
    """Every request of REQUESTS sent in order, each one's response as recorded (see the docstring)."""
    flags = {"plain": (), "reasoning": ("--reasoning-parser", "qwen3")}
    servers, started = {}, time.time()
    try:
        for name, extra in flags.items():
            servers[name] = Server(model, tmp_path_factory.mktemp("log") / f"{name}.log", "--api-key", KEY,
                                   "--served-model-name", NAME, *extra, max_model_len=MAX_LEN,
                                   env={"OMP_NUM_THREADS": "1"})
        got = {name: send(servers[where], started, method, path, body, options)
               for name, where, method, path, body, options in REQUESTS}
    finally:
        for server in servers.values():
            assert server.stop() == 0, server.log()
    if RECORD:
        record(model, got)
    return got


def request_of(name: str, where: str, method: str, path: str, body, options: dict) -> dict:
    """A request as the golden file describes it (to tell a changed request from a changed answer)."""
    return {"server": where, "method": method, "path": path,
            "body": body.decode() if isinstance(body, bytes) else body, **options}


def record(model: str, got: dict[str, dict]):
    entries = [{"name": entry[0], "request": request_of(*entry), **got[entry[0]]} for entry in REQUESTS]
    with open(GOLDEN, "w", encoding="utf-8") as f:
        json.dump({"fingerprint": fingerprint(model), "responses": entries}, f, indent=1, ensure_ascii=False)
        f.write("\n")


@pytest.fixture(scope="module")
def golden(responses) -> dict:
    with open(GOLDEN, encoding="utf-8") as f:
        return json.load(f)


def test_the_model_and_the_requests_are_the_ones_recorded(model, golden):
    assert fingerprint(model) == golden["fingerprint"], \
        "the tiny model's weights differ from the recorded ones: this environment draws other numbers"
    assert [e["name"] for e in golden["responses"]] == [entry[0] for entry in REQUESTS], \
        "REQUESTS changed: re-record (NANOVLLM_RECORD_GOLDEN=1)"
    assert [e["request"] for e in golden["responses"]] == [request_of(*entry) for entry in REQUESTS]


# A body's decimal fractions (the logprobs) are compared to within these, every other byte exactly:
# float32 log_softmax sums in an order that depends on the CPU's vector width (AVX2 or AVX-512
# kernels), so two machines may differ in the last bits (seen: 5e-7 at logprobs near -3).
FLOAT_RTOL, FLOAT_ATOL = 1e-5, 1e-6
FLOAT = re.compile(r"-?\d+\.\d+(?:[eE][-+]?\d+)?")


def split_floats(body: str) -> tuple[str, list[float]]:
    """The body with each decimal fraction replaced by "<f>", and the fractions in order."""
    return FLOAT.sub("<f>", body), [float(x) for x in FLOAT.findall(body)]


def first_difference(got: str, want: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    around = slice(max(0, at - 80), at + 80)
    return f"they differ from character {at}:\n got: ...{got[around]!r}\nwant: ...{want[around]!r}"


@pytest.mark.parametrize("name", [entry[0] for entry in REQUESTS])
def test_the_response_is_the_one_recorded(responses, golden, name):
    want = next((e for e in golden["responses"] if e["name"] == name), None)
    assert want is not None, f"no recorded response for {name!r}: re-record (NANOVLLM_RECORD_GOLDEN=1)"
    got = responses[name]
    assert (got["status"], got["content_type"]) == (want["status"], want["content_type"])
    got_text, got_floats = split_floats(got["body"])
    want_text, want_floats = split_floats(want["body"])
    assert got_text == want_text, first_difference(got["body"], want["body"])
    assert got_floats == pytest.approx(want_floats, rel=FLOAT_RTOL, abs=FLOAT_ATOL), \
        first_difference(got["body"], want["body"])
