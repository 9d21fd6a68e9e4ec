"""The exact shape of the server's responses where one-line slips in api_server.py would pass
test_server.py: the usage of n > 1 choices (a prompt's cached tokens counted once, not per
choice), the choice indexes of several prompts times n streamed (prompt * n + sample), top
logprobs cut to k when the sampled token is not among the k most likely, chat's `logprobs: true`
without `top_logprobs`, and the raw bytes of a server-sent event stream (`data: ...\\n\\n`, ending
with `data: [DONE]\\n\\n`). Outputs equal an in-process LLM's, with seeds where they sample."""
import asyncio
import json

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
pytest.importorskip("prometheus_client", reason="the serve extra (prometheus-client) is not installed")
openai = pytest.importorskip("openai", reason="the openai client is not installed")
httpx = pytest.importorskip("httpx", reason="httpx is not installed")

from nanovllm import LLM, SamplingParams# noqa: E402
from nanovllm.utils.tiny_model import build_model# noqa: E402
from serving import KEY, http, module_server  # noqa: E402

NAME = "tiny-chat"
MAX_LEN = 256  # short requests only: a small KV cache, a fast start
SAMPLED = dict(temperature=1.0, seed=1234)  # sampled, yet the same tokens in the server and here


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


def samples_of(output: dict) -> list[dict]:
    """LLM.generate's samples of one prompt (with n == 1 the output is the only sample)."""
    return output.get("samples", [output])


def by_index(choices) -> list:
    got = sorted(choices, key=lambda c: c.index)
    assert [c.index for c in got] == list(range(len(got)))
    return got


def own_bytes(llm, token_id: int) -> list[int]:
    """A byte-level BPE token's bytes: its characters mapped back through GPT-2's byte table (the
    tiny models' tokenizer is byte-level; a token may hold part of a UTF-8 character)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # (shifted to 256.. in GPT-2's table)
    byte_of = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    piece = llm.tokenizer.convert_ids_to_tokens(token_id)  # (None past the tokenizer's 400 tokens: no bytes)
    return [byte_of[c] for c in piece or ""]


def top_k(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) of one of the engine's logprobs entries."""
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


# ---- (1) usage with n > 1: a prompt's cached tokens once, not once per choice --------------------
@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_count_each_prompt_once_with_n_3(client, llm, stream):
    block = llm.config.block_size
    # token-id prompts no other test sends (so the server's prefix cache holds only what this sends)
    a = [300 + (i * 7 + 100 * stream) % 97 for i in range(2 * block + 8)]  # two full blocks and a part
    b = [200 + (i * 5 + 100 * stream) % 89 for i in range(3 * block + 1)]  # three full blocks and a token
    n, max_tokens = 3, 3

    def call(prompts):
        body = dict(model=NAME, prompt=prompts, max_tokens=max_tokens, n=n, extra_body={"ignore_eos": True},
                    **SAMPLED)
        if not stream:
            response = client.completions.create(**body)
            return {c.index: c.text for c in by_index(response.choices)}, response.usage
        texts, usage = {}, None
        for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **body):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
            usage = chunk.usage or usage
        return texts, usage

    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, **SAMPLED)
    # a's first time: its 2 forks find its blocks, but its prompt was cached for none of it: 0;
    # then a's 2 full blocks (b is new: 0); then both, b's 3 full blocks and a's 2. (n times that
    # would be 64, 96 and 240.)
    for prompts, cached in (([a], 0), ([a, b], 2 * block), ([b, a], 3 * block + 2 * block)):
        texts, usage = call(prompts)
        expected = llm.generate(prompts, params, use_tqdm=False)
        assert [texts[i] for i in range(len(prompts) * n)] == [s["text"] for e in expected for s in samples_of(e)]
        # the reference engine saw the same prompts in the same order: its first samples agree
        assert sum(e["num_cached_tokens"] for e in expected) == cached
        assert usage.prompt_tokens_details.cached_tokens == cached
        assert usage.prompt_tokens == sum(map(len, prompts))  # each prompt once, too
        assert usage.completion_tokens == len(prompts) * n * max_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


# ---- (2) several prompts x n > 1, streamed: index = prompt * n + sample ---------------------------
def test_streamed_indexes_of_several_prompts_with_n_2(client, llm):
    prompts, n = ["The quick brown fox", "Paged attention", "Prefix caching shares"], 2
    body = dict(model=NAME, prompt=prompts, max_tokens=6, n=n, **SAMPLED)
    expected = [s for e in llm.generate(prompts, SamplingParams(max_tokens=6, n=n, **SAMPLED), use_tqdm=False)
                for s in samples_of(e)]
    assert len({s["text"] for s in expected}) == len(prompts) * n, "pick prompts whose choices all differ"

    whole = by_index(client.completions.create(**body).choices)
    assert [c.text for c in whole] == [s["text"] for s in expected]
    assert [c.finish_reason for c in whole] == [s["finish_reason"] for s in expected]

    texts, finishes, chunks = {}, {}, list(client.completions.create(
        stream=True, stream_options={"include_usage": True}, **body))
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1 and chunk.usage is None
        c = chunk.choices[0]
        assert c.index not in finishes, f"choice {c.index} goes on after its finish_reason"
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason is not None:
            finishes[c.index] = c.finish_reason
    assert sorted(texts) == sorted(finishes) == list(range(len(prompts) * n))
    assert [texts[i] for i in range(len(prompts) * n)] == [c.text for c in whole]
    assert [finishes[i] for i in range(len(prompts) * n)] == [c.finish_reason for c in whole]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(len(s["token_ids"]) for s in expected)


def test_streamed_chat_with_n_3_opens_every_choice_once(client, llm):
    messages, n = [{"role": "user", "content": "Prefix caching?"}], 3
    body = dict(model=NAME, messages=messages, max_completion_tokens=6, n=n, **SAMPLED)
    expected = samples_of(llm.generate([llm.render_chat(messages)], SamplingParams(max_tokens=6, n=n, **SAMPLED),
                                       use_tqdm=False)[0])
    whole = by_index(client.chat.completions.create(**body).choices)
    assert [c.message.content for c in whole] == [s["text"] for s in expected]
    chunks = list(client.chat.completions.create(stream=True, **body))
    opening, rest = chunks[0], chunks[1:]
    assert [(c.index, c.delta.role, c.delta.content) for c in opening.choices] == [(i, "assistant", "") for i in
                                                                                  range(n)]
    texts, finishes = {i: "" for i in range(n)}, {}
    for chunk in rest:
        (c,) = chunk.choices
        assert c.delta.role is None and c.index not in finishes
        texts[c.index] += c.delta.content or ""
        if c.finish_reason is not None:
            finishes[c.index] = c.finish_reason
    assert [texts[i] for i in range(n)] == [c.message.content for c in whole]
    assert [finishes.get(i) for i in range(n)] == [c.finish_reason for c in whole]


# ---- (3) top logprobs: the k most likely, even when the sampled token is not one of them --------
K = 2
HOT = dict(temperature=2.0, seed=99)  # hot enough that sampled tokens often lie outside the top K


def test_completion_top_logprobs_are_the_k_most_likely(client, llm):
    prompts, n = ["Continuous batching", "def forward"], 2
    expected = [s for e in llm.generate(prompts, SamplingParams(max_tokens=8, n=n, logprobs=K, **HOT),
                                        use_tqdm=False) for s in samples_of(e)]
    entries = [entry for s in expected for entry in s["logprobs"]]
    assert any(len(entry) == K + 1 for entry in entries), "no sampled token outside the top K: pick another seed"
    decode = lambda token_id: llm.tokenizer.decode([token_id])  # noqa: E731
    distinct_extra = 0  # entries whose K + 1 tokens decode distinctly (an uncut list would show K + 1 keys)
    for stream in (False, True):
        body = dict(model=NAME, prompt=prompts, max_tokens=8, n=n, logprobs=K, **HOT)
        if stream:
            got = {}
            for chunk in client.completions.create(stream=True, **body):
                for c in chunk.choices:
                    if c.logprobs is not None:
                        lp = got.setdefault(c.index, {"tokens": [], "token_logprobs": [], "top_logprobs": []})
                        for field in lp:
                            lp[field] += getattr(c.logprobs, field)
            got = [got[i] for i in range(len(prompts) * n)]
        else:
            got = [c.logprobs.model_dump() for c in by_index(client.completions.create(**body).choices)]
        for sample, lp in zip(expected, got, strict=True):
            assert lp["tokens"] == [decode(t) for t in sample["token_ids"]]
            assert lp["token_logprobs"] == pytest.approx([e[t] for t, e in zip(sample["token_ids"],
                                                                                 sample["logprobs"])], abs=1e-5)
            assert len(lp["top_logprobs"]) == len(sample["token_ids"])
            for entry, top in zip(sample["logprobs"], lp["top_logprobs"], strict=True):
                # keyed by token text; a token whose text an earlier (likelier) one holds, by its id
                best = top_k(entry, K)
                keys, seen = [], set()
                for t, _ in best:
                    keys.append(decode(t) if decode(t) not in seen else f"token_id:{t}")
                    seen.add(decode(t))
                assert len(top) == K and set(top) == set(keys)
                for key, (_, v) in zip(keys, best):
                    assert top[key] == pytest.approx(v, abs=1e-5)
                distinct_extra += len(entry) == K + 1 and len({decode(t) for t in entry}) == K + 1
    assert distinct_extra > 0, "no entry where an uncut top list would show: pick another seed"


def test_chat_top_logprobs_are_the_k_most_likely_in_order(server, llm):
    conversations = [[{"role": "user", "content": text}] for text in ("hello", "Paged attention?", "def forward")]
    params = SamplingParams(max_tokens=6, logprobs=K, **HOT)
    expected = llm.generate([llm.render_chat(m) for m in conversations], params, use_tqdm=False)
    assert any(len(entry) == K + 1 for e in expected for entry in e["logprobs"]), "pick another seed"

    async def all_of_them():  # several requests at once, batched together by the server
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
            return await asyncio.gather(*(client.chat.completions.create(
                model=NAME, messages=m, max_completion_tokens=6, logprobs=True, top_logprobs=K, **HOT)
                for m in conversations))

    for response, e in zip(asyncio.run(all_of_them()), expected, strict=True):
        content = response.choices[0].logprobs.content
        assert response.choices[0].message.content == e["text"]
        assert len(content) == len(e["token_ids"])
        for item, token_id, entry in zip(content, e["token_ids"], e["logprobs"], strict=True):
            assert item.token == llm.tokenizer.decode([token_id]) and item.bytes == own_bytes(llm, token_id)
            assert item.logprob == pytest.approx(entry[token_id], abs=1e-5)
            best = top_k(entry, K)
            assert [t.token for t in item.top_logprobs] == [llm.tokenizer.decode([t]) for t, _ in best]
            assert [t.logprob for t in item.top_logprobs] == pytest.approx([v for _, v in best], abs=1e-5)
            assert [t.bytes for t in item.top_logprobs] == [own_bytes(llm, t) for t, _ in best]


# ---- (4) chat logprobs without top_logprobs ------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_true_without_top_logprobs(client, llm, stream):
    messages, n = [{"role": "user", "content": "The lazy dog"}], 2
    expected = samples_of(llm.generate([llm.render_chat(messages)], SamplingParams(max_tokens=5, n=n, logprobs=0,
                                                                                   **SAMPLED), use_tqdm=False)[0])
    body = dict(model=NAME, messages=messages, max_completion_tokens=5, n=n, logprobs=True, **SAMPLED)
    if stream:
        contents = {i: [] for i in range(n)}
        for chunk in client.chat.completions.create(stream=True, **body):
            for c in chunk.choices:
                if c.logprobs is not None:
                    contents[c.index] += c.logprobs.content
        contents = [contents[i] for i in range(n)]
    else:
        contents = [c.logprobs.content for c in by_index(client.chat.completions.create(**body).choices)]
    for sample, content in zip(expected, contents, strict=True):
        assert len(content) == len(sample["token_ids"]) > 0
        for item, token_id, entry in zip(content, sample["token_ids"], sample["logprobs"], strict=True):
            assert set(entry) == {token_id}  # the engine computed the chosen token's logprob only
            assert item.token == llm.tokenizer.decode([token_id]) and item.bytes == own_bytes(llm, token_id)
            assert item.logprob == pytest.approx(entry[token_id], abs=1e-5)
            assert item.top_logprobs == []


# ---- (5) the raw event stream ---------------------------------------------------------------------
@pytest.mark.parametrize("path, body, num_choices", [
    ("/v1/completions", {"prompt": ["The quick brown fox", "日本語"], "max_tokens": 5, "n": 2}, 4),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi 🚀"}], "max_tokens": 5, "n": 2}, 2),
], ids=["completions", "chat"])
def test_the_raw_stream_is_data_events_ending_with_done(server, path, body, num_choices):
    response = http(server, "POST", path, json={"model": NAME, "stream": True, "ignore_eos": True,
                                                "stream_options": {"include_usage": True}, **SAMPLED, **body})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.content
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-40:]
    events = raw.decode("utf-8").split("\n\n")
    assert events[-1] == ""  # every event ends with a blank line, the last one too
    events = events[:-1]
    assert all(e.startswith("data: ") and "\n" not in e and "\r" not in e for e in events), events
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])  # (include_usage: null until the last chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5 * num_choices
    assert len({c["id"] for c in chunks}) == 1
    finished = [c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert sorted(finished) == list(range(num_choices))
