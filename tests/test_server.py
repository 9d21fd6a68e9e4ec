"""The OpenAI-compatible server, run as a real subprocess (`python -m nanovllm serve`) on a free
loopback port and driven with the official openai client (sync and async) and httpx: outputs equal
LLM.generate's, streaming, n > 1, stop strings, logprobs, prefix-cache usage, every error with its
status code, concurrency, disconnects, metrics, SIGTERM; the serving benchmark; the chat CLI."""
import asyncio
import json
import os
import random
import signal
import subprocess
import sys

import pytest

fastapi = pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
pytest.importorskip("prometheus_client", reason="the serve extra (prometheus-client) is not installed")
openai = pytest.importorskip("openai", reason="the openai client is not installed")
httpx = pytest.importorskip("httpx", reason="httpx is not installed")

from nanovllm import LLM, SamplingParams# noqa: E402
from nanovllm.utils.tiny_model import build_model# noqa: E402
from serving import KEY, ROOT, Server, error_of, http, module_server, wait_for  # noqa: E402

NAME = "tiny-chat"
MAX_LEN = 2048  # a request this long runs for seconds: long enough to disconnect from, or queue behind
GREEDY = dict(temperature=0)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_model(str(tmp_path_factory.mktemp("chat")), chat_template=True, max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    yield from module_server(chat_model, tmp_path_factory, "--api-key", KEY, "--served-model-name", NAME,
                             max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def llm(chat_model):
    """The same engine in this process: the reference for the server's outputs."""
    with LLM(chat_model, max_model_len=MAX_LEN) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def chat_prompt(llm, messages) -> str:
    return llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ---- outputs ---------------------------------------------------------------------------------
def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.head(server.url + "/health").status_code == 200  # (what load balancers' probes may send)
    assert [m.id for m in client.models.list().data] == [NAME]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompts", [["The quick brown fox", "Paged"], [[5, 17, 99, 3, 250], [42]]],
                         ids=["strings", "token-ids"])
def test_completions_equal_generate(server, client, llm, stream, prompts):
    expected = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    if stream:
        texts, finish = ["", ""], [None, None]
        chunks = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY)
        usage = None
        for chunk in chunks:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                finish[choice.index] = choice.finish_reason or finish[choice.index]
    else:
        response = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, **GREEDY)
        texts = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
        finish = [c.finish_reason for c in sorted(response.choices, key=lambda c: c.index)]
        usage = response.usage
    assert texts == [e["text"] for e in expected]
    assert finish == [e["finish_reason"] for e in expected]
    assert usage.completion_tokens == sum(len(e["token_ids"]) for e in expected)
    assert usage.prompt_tokens == sum(len(llm.tokenizer.encode(p) if isinstance(p, str) else p) for p in prompts)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_equal_generate_on_the_rendered_prompt(server, client, llm, stream):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Paged attention?"}]
    expected = llm.generate(chat_prompt(llm, messages), SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)[0]
    if stream:
        roles, text, finish = [], "", None
        for chunk in client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=10,
                                                    stream=True, **GREEDY):
            delta = chunk.choices[0].delta
            if delta.role:
                roles.append(delta.role)
            text += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        assert roles == ["assistant"]  # the role first, once
    else:
        response = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=10, **GREEDY)
        message = response.choices[0].message
        assert message.role == "assistant"
        text, finish = message.content, response.choices[0].finish_reason
        assert response.usage.completion_tokens == len(expected["token_ids"])
    assert text == expected["text"] and finish == expected["finish_reason"]


def test_n_samples_equal_generate_with_the_same_seed(client, llm):
    prompt = "Prefix caching shares"
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=8, n=2, seed=1234)
    expected = llm.generate(prompt, params, use_tqdm=False)[0]["samples"]
    response = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, n=2, seed=1234, temperature=1.0,
                                         extra_body={"top_k": 50})
    got = sorted(response.choices, key=lambda c: c.index)
    assert [c.index for c in got] == [0, 1]
    assert [c.text for c in got] == [s["text"] for s in expected]


def test_stop_strings(client, llm):
    prompt = "Continuous batching lets"
    full = llm.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True, **GREEDY), use_tqdm=False)[0]["text"]
    stop = full[6:9]
    assert stop and full.index(stop) == 6, "pick a stop string whose first occurrence is known"
    expected = llm.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop], **GREEDY),
                            use_tqdm=False)[0]
    response = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, stop=[stop],
                                         extra_body={"ignore_eos": True}, **GREEDY)
    choice = response.choices[0]
    assert choice.text == expected["text"] == full[:6]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=prompt, max_tokens=20, stop=[stop], stream=True, extra_body={"ignore_eos": True}, **GREEDY))
    assert streamed == full[:6]


def test_logprobs_in_both_formats(client, llm):
    prompt = "The lazy dog"
    expected = llm.generate(prompt, SamplingParams(max_tokens=5, logprobs=3, **GREEDY), use_tqdm=False)[0]
    response = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, logprobs=3, **GREEDY)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token_id, entry, chosen, top in zip(expected["token_ids"], expected["logprobs"], lp.token_logprobs,
                                            lp.top_logprobs):
        assert chosen == pytest.approx(entry[token_id], abs=1e-5)
        # keyed by token text, as OpenAI's format is; a second token of the same text by its id
        assert len(top) == 3 and {round(v, 4) for v in top.values()} <= {round(v, 4) for v in entry.values()}
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == response.choices[0].text
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=NAME, prompt=prompt, max_tokens=5, logprobs=3, stream=True, **GREEDY) if c.choices[0].logprobs]
    assert [v for chunk in streamed for v in chunk.token_logprobs] == lp.token_logprobs
    assert [t for chunk in streamed for t in chunk.tokens] == lp.tokens

    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, logprobs=True, top_logprobs=2,
                                          **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
    # each token's own bytes (not those of its decoded text, U+FFFD for part of a character): they add up
    assert b"".join(bytes(item.bytes) for item in content).decode(errors="replace") == chat.choices[0].message.content


def test_top_logprobs_of_tokens_that_decode_alike_stay_apart(llm):
    """Two tokens holding parts of UTF-8 characters both decode to U+FFFD: the second is keyed by
    its id (vLLM's "token_id:N") instead of replacing the first; chat's list form gives each its bytes."""
    from nanovllm.entrypoints.api_server import ChatChoices, CompletionChoices
    from nanovllm.entrypoints.protocol import CompletionRequest
    ids = [llm.tokenizer.convert_tokens_to_ids(t) for t in ("Ã", "Â")]  # (bytes 0xC3 and 0xC2 alone)
    assert [llm.tokenizer.decode([i]) for i in ids] == ["\ufffd", "\ufffd"]
    choices = CompletionChoices([], CompletionRequest.model_validate({"prompt": "x"}), NAME, llm.tokenizer)
    assert choices._top([(ids[0], -1.0), (ids[1], -2.0)]) == {"\ufffd": -1.0, f"token_id:{ids[1]}": -2.0}
    chat = ChatChoices.__new__(ChatChoices)
    chat.tokenizer = llm.tokenizer
    assert [chat._bytes(i) for i in ids] == [[0xC3], [0xC2]]


def test_a_model_by_id(server):
    assert http(server, "GET", f"/v1/models/{NAME}").json()["id"] == NAME
    error = error_of(http(server, "GET", "/v1/models/other"), 404)
    assert error["code"] == "model_not_found"


def test_the_user_field_is_taken_and_changes_nothing(client):
    """OpenAI's `user` (an end-user id for a provider's abuse monitoring; litellm sends it)."""
    body = dict(model=NAME, max_tokens=6, **GREEDY)
    plain = client.completions.create(prompt="The quick", **body).choices[0].text
    assert client.completions.create(prompt="The quick", user="alice", **body).choices[0].text == plain
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(messages=messages, **body).choices[0].message.content
    assert client.chat.completions.create(messages=messages, user="alice", **body).choices[0].message.content == chat


def test_completions_default_to_16_tokens_and_chat_to_the_context(client):
    body = dict(model=NAME, extra_body={"ignore_eos": True}, **GREEDY)
    assert client.completions.create(prompt="hi", **body).usage.completion_tokens == 16
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **body)
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == MAX_LEN


def test_cached_tokens_on_a_repeated_long_prompt(client):
    prompt = list(range(10, 130))  # 120 tokens: seven full 16-token blocks
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, **GREEDY)
    second = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 112
    assert second.choices[0].text == first.choices[0].text


# ---- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p", "top_p"),
    ({"prompt": "hi", "temperature": -1}, "temperature", "temperature"),
    ({"prompt": "hi", "max_tokens": MAX_LEN}, "max_tokens", "max_model_len"),
    ({"prompt": ""}, "prompt", "empty prompt"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [1, 2, 100000]}, "prompt", "outside the vocabulary"),
    ({"prompt": "hi", "echo": True, "stream": True}, "echo", "echo"),
    ({"prompt": "hi", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": "hi", "n": 10**9}, "n", "less than or equal to 128"),
    ({"prompt": "hi", "top_k": 10**20}, "top_k", "top_k"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs", "logprobs"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens", "integer"),
    ({"prompt": {"text": "hi"}}, "prompt", "prompt"),
    ({"max_tokens": 3}, "prompt", "Field required"),
])
def test_invalid_completions_are_400s_naming_the_problem(server, body, param, words):
    error = error_of(http(server, "POST", "/v1/completions", json={"model": NAME, **body}), 400)
    assert words.lower() in error["message"].lower() and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_malformed_json_unknown_model_and_keys(server):
    error = error_of(httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi",',
                                headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}), 400)
    assert "JSON" in error["message"]
    error = error_of(http(server, "POST", "/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404)
    assert "gpt-4" in error["message"] and error["code"] == "model_not_found"
    for key in (None, "wrong"):
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "hi"}),
                                   ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            error = error_of(http(server, method, path, key=key, json=body), 401)
            assert error["type"] == "authentication_error"
    assert http(server, "GET", "/health", key=None).status_code == 200
    assert http(server, "GET", "/metrics", key=None).status_code == 200


def test_invalid_chat_requests(server):
    for body, words in (({"messages": []}, "messages"),
                        ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
                        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "'url'"),
                        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "text or image_url"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
                            "url": "data:image/png;base64,AAAA"}}]}]}, "takes no images")):
        error = error_of(http(server, "POST", "/v1/chat/completions", json=body), 400)
        assert words in error["message"]


def test_the_server_is_healthy_after_errors(server, client, llm):
    for _ in range(3):
        http(server, "POST", "/v1/completions", json={"prompt": [1, 2, 10**9]})
    assert httpx.get(server.url + "/health").status_code == 200
    expected = llm.generate("fox", SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0]["text"]
    assert client.completions.create(model=NAME, prompt="fox", max_tokens=4, **GREEDY).choices[0].text == expected


# ---- many clients, disconnects, metrics --------------------------------------------------------
def test_64_concurrent_streaming_clients_each_get_exactly_their_tokens(server, llm):
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 400) for _ in range(rng.randint(1, 40))] for _ in range(64)]
    lengths = [rng.randint(1, 40) for _ in prompts]
    expected = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True, **GREEDY) for n in lengths],
                            use_tqdm=False)

    async def one(client, prompt, n):
        text, usage = "", None
        stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=n, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}, **GREEDY)
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    results = asyncio.run(all_of_them())
    assert [text for text, _ in results] == [e["text"] for e in expected]
    assert [count for _, count in results] == lengths


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_request(server, stream):
    body = {"model": NAME, "prompt": "The quick", "max_tokens": MAX_LEN - 10, "stream": stream, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    before = server.metrics()["nanovllm:generation_tokens_total"]
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30, headers=headers) as response:
            lines = response.iter_lines()  # (kept: dropping it would close the stream)
            assert next(line for line in lines if line.startswith("data:"))
            assert wait_for(lambda: server.metrics()["nanovllm:num_requests_running"] == 1)
            assert server.metrics()["nanovllm:kv_cache_usage_perc"] > 0
        # closed mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up, and closes the connection
            httpx.post(server.url + "/v1/completions", json=body, timeout=1.0, headers=headers)
    assert wait_for(lambda: server.metrics()["nanovllm:num_requests_running"] == 0)
    assert wait_for(lambda: server.metrics()["nanovllm:kv_cache_usage_perc"] == 0)
    assert server.metrics()["nanovllm:generation_tokens_total"] - before < body["max_tokens"] / 2  # cut short
    assert httpx.get(server.url + "/health").status_code == 200
    assert "Traceback" not in server.log()  # (a disconnect is no error of the server's)


def test_metrics_count_what_was_served(server, client):
    before = server.metrics()
    client.completions.create(model=NAME, prompt=[7] * 40, max_tokens=5, extra_body={"ignore_eos": True}, **GREEDY)
    client.completions.create(model=NAME, prompt=[7] * 40, max_tokens=5, extra_body={"ignore_eos": True}, **GREEDY)
    after = server.metrics()

    def grew(name):
        return after[name] - before.get(name, 0)
    assert grew("nanovllm:prompt_tokens_total") == 80
    assert grew("nanovllm:generation_tokens_total") == 10
    assert grew("nanovllm:prefix_cache_hit_tokens_total") == 32  # the second prompt's two full blocks
    assert grew("nanovllm:time_to_first_token_seconds_count") == 2
    assert grew("nanovllm:time_per_output_token_seconds_count") == 2
    assert grew("nanovllm:e2e_request_latency_seconds_count") == 2
    assert after["nanovllm:num_requests_running"] == after["nanovllm:num_requests_waiting"] == 0
    assert "nanovllm:num_preemptions_total" in after


# ---- a second server: no chat template, a tiny queue -------------------------------------------
LONG = 4096  # the plain model's context: a request that long runs for seconds
SIGTERM_EXIT_LIMIT = 60  # seconds from SIGTERM to exit that mean a hang, not a loaded machine


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    return build_model(str(tmp_path_factory.mktemp("plain")), max_position_embeddings=LONG)


def test_queue_limit_no_template_and_sigterm(plain_model, tmp_path):
    server = Server(plain_model, tmp_path / "server.log", "--max-queued-requests", "1", "--max-num-seqs", "1",
                    max_model_len=LONG)
    try:
        error = error_of(http(server, "POST", "/v1/chat/completions", key=None,
                              json={"messages": [{"role": "user", "content": "hi"}]}), 400)
        assert "chat template" in error["message"]

        long = {"prompt": "a", "max_tokens": LONG - 10, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=long, timeout=30) as running:
            lines = running.iter_lines()  # (kept: dropping it would close the stream)
            next(line for line in lines if line.startswith("data:"))  # it runs, in the one sequence slot
            with httpx.stream("POST", server.url + "/v1/completions", json=long, timeout=30) as waiting:
                assert wait_for(lambda: server.metrics()["nanovllm:num_requests_waiting"] == 1)
                full = httpx.post(server.url + "/v1/completions", json={"prompt": "b"}, timeout=30)
                assert "max-queued-requests" in error_of(full, 503)["message"] and full.headers["retry-after"] == "1"
                assert waiting.status_code == 200
                # SIGTERM with both in flight: each stream ends with an error event, then [DONE]
                server.proc.send_signal(signal.SIGTERM)
                for stream in (lines, waiting.iter_lines()):
                    tail = [line for line in stream if line.startswith("data:")]
                    assert tail[-1] == "data: [DONE]"
                    assert json.loads(tail[-2][5:])["error"]["code"] == 503, tail[-2]
        # (how promptly it exits, ~1.2 s, is scripts/bench_server_faults.py's figure: this bound is
        # for a hang, and holds on a loaded machine)
        assert server.proc.wait(SIGTERM_EXIT_LIMIT) == 0, server.log()
    finally:
        server.stop()


def test_tensor_parallel_server_with_the_key_from_the_environment(plain_model, tmp_path):
    """--tensor-parallel-size 2 (worker processes behind the engine thread), NANOVLLM_API_KEY as
    the key; SIGTERM ends the workers too."""
    server = Server(plain_model, tmp_path / "server.log", "--tensor-parallel-size", "2", max_model_len=128,
                    env={"NANOVLLM_API_KEY": "from-env"})
    try:
        workers = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True,
                                                      text=True).stdout.split()]
        assert http(server, "GET", "/v1/models", key=KEY).status_code == 401
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        response = http(server, "POST", "/v1/completions", key="from-env", json=body)
        assert response.status_code == 200, response.text
        with LLM(plain_model, max_model_len=128) as reference:
            expected = reference.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY),
                                          use_tqdm=False)[0]
        assert response.json()["choices"][0]["text"] == expected["text"]
    finally:
        assert server.stop() == 0, server.log()
    assert wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in workers), timeout=15)


def test_speculative_server_and_its_metrics(plain_model, tmp_path):
    """--speculative-config (JSON): the same greedy completion, and vLLM's spec_decode counters."""
    server = Server(plain_model, tmp_path / "server.log", "--speculative-config",
                    '{"method": "ngram", "num_speculative_tokens": 3}', max_model_len=256)
    try:
        prompt = [11, 22, 33, 44, 55, 66, 77, 88] * 5
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        response = http(server, "POST", "/v1/completions", key=None, json=body)
        assert response.status_code == 200, response.text
        with LLM(plain_model, max_model_len=256) as reference:
            expected = reference.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY),
                                          use_tqdm=False)[0]
        assert response.json()["choices"][0]["text"] == expected["text"]
        metrics = server.metrics()
        assert 0 < metrics["nanovllm:spec_decode_num_accepted_tokens_total"] \
            <= metrics["nanovllm:spec_decode_num_draft_tokens_total"]
        assert metrics['nanovllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    finally:
        assert server.stop() == 0, server.log()


def test_host_tier_server_and_its_metrics(plain_model, tmp_path):
    """--kv-offloading-size: the host tier's blocks and their usage are gauges on /metrics (a host
    leak shows from outside), beside its copy counters."""
    server = Server(plain_model, tmp_path / "server.log", "--kv-offloading-size", "0.01", "--num-kvcache-blocks",
                    "12", "--kvcache-block-size", "16", max_model_len=128)
    try:
        assert server.metrics()["nanovllm:host_cache_usage_perc"] == 0
        for first in range(4):  # (distinct prompts of 6 blocks each: the device's 12 blocks evict to the host)
            body = {"prompt": [first + 1, *range(10, 105)], "max_tokens": 2, "temperature": 0}
            assert http(server, "POST", "/v1/completions", key=None, json=body).status_code == 200
        metrics = server.metrics()
        assert metrics["nanovllm:host_cache_blocks"] > 0 and 0 < metrics["nanovllm:host_cache_usage_perc"] <= 1
        assert metrics["nanovllm:kv_offload_bytes_total"] > 0
    finally:
        assert server.stop() == 0, server.log()


def test_sigint_exits_cleanly_too_and_the_access_log_is_optional(server, plain_model, tmp_path):
    assert '"POST /v1/completions HTTP/1.1" 200' in server.log()  # (the module's server logs each request)
    quiet = Server(plain_model, tmp_path / "server.log", "--disable-log-requests")
    assert httpx.post(quiet.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}).status_code == 200
    assert "POST /v1/completions" not in quiet.log()
    quiet.proc.send_signal(signal.SIGINT)
    assert quiet.proc.wait(10) == 0, quiet.log()
    assert "Traceback" not in quiet.log()


# ---- the serving benchmark and the chat CLI ----------------------------------------------------
def test_bench_serving_reports_every_figure(server):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_serving.py"), "--base-url", server.url,
                          "--api-key", KEY, "--num-requests", "12", "--request-rate", "50", "--input-len", "20",
                          "--output-len", "8", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["output_tokens"] == 12 * 8
    for name in ("request_throughput", "output_throughput"):
        assert report[name] > 0
    for metric in ("ttft", "tpot"):
        assert 0 < report[f"{metric}_p50_ms"] <= report[f"{metric}_p90_ms"] <= report[f"{metric}_p99_ms"]
    assert report["prompt_tokens"] == 12 * 20 and report["cached_prompt_tokens"] == 0  # (random prompts)


def test_bench_serving_shared_prefix_workload_counts_the_prefix_cache_hits(server):
    """8 prompts over 2 shared prefixes of 48 tokens (3 blocks of 16): every request after the first
    of its group that arrives once that one's blocks are in the cache finds its prefix (--seed 1: none
    of the other tests' prompts, drawn with seed 0, starts alike)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_serving.py"), "--base-url", server.url,
                          "--api-key", KEY, "--num-requests", "8", "--request-rate", "20", "--input-len", "5",
                          "--output-len", "4", "--shared-prefix-groups", "2", "--shared-prefix-len", "48", "--seed", "1",
                          "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["completed"] == 8 and report["prompt_tokens"] == 8 * 53
    assert 48 <= report["cached_prompt_tokens"] <= 6 * 48 and report["cached_prompt_tokens"] % 16 == 0
    assert report["prefix_cache_hit_rate"] == report["cached_prompt_tokens"] / report["prompt_tokens"]


def test_chat_cli_two_turns_the_second_from_the_cache(chat_model):
    first = "Tell me about paged attention and block tables, please."
    turns = f"{first}\nAnd prefix caching?\n/reset\n{first}\n/exit\n"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "nanovllm", "chat", chat_model, "--temperature", "0",
                          "--max-tokens", "6", "--max-model-len", str(MAX_LEN), "--system",
                          "You are a helpful assistant who answers briefly."],
                         input=turns, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    summaries = [line for line in out.stdout.splitlines() if line.startswith("[") and "cached" in line]
    assert len(summaries) == 3 and "(conversation cleared)" in out.stdout, out.stdout
    prompt_tokens = [int(s[1:].split()[0]) for s in summaries]
    cached = [int(s.split(", ")[1].split()[0]) for s in summaries]
    assert cached[0] == 0 and cached[1] >= 16, summaries  # the first turn's prompt blocks
    assert prompt_tokens[2] == prompt_tokens[0] and cached[2] >= 16, summaries  # after /reset: turn one again


def test_chat_cli_refuses_a_model_without_a_template(plain_model):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "nanovllm", "chat", plain_model, "--max-model-len", "64"],
                         input="hi\n", capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "no chat template" in out.stderr
