"""Completions with echo: the prompt's tokens, token_logprobs (None first), top_logprobs and
text_offset before the completion's, with max_tokens 0 or more, as vLLM serves them; replayed
with lm-evaluation-harness's own loglikelihood payload and parser (lm_eval/models/
openai_completions.py: LocalCompletionsAPI._create_payload and parse_logprobs), whose sums must
equal a Hugging Face forward's."""
from operator import itemgetter

import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
httpx = pytest.importorskip("httpx")

from nanovllm.utils.tiny_model import build_model  # noqa: E402
from serving import error_of, module_server  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(str(tmp_path_factory.mktemp("echo")))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    yield from module_server(model, tmp_path_factory, max_model_len=256)


def lm_eval_payload(messages, seed=1234):
    """LocalCompletionsAPI._create_payload(messages, generate=False): a batch of token-id prompts."""
    return {"model": None, "prompt": messages, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": seed,
            "echo": True}


def lm_eval_parse_logprobs(outputs, ctxlens):
    """LocalCompletionsAPI.parse_logprobs: (sum of the continuation's logprobs, is it greedy)."""
    res = []
    for out in outputs if isinstance(outputs, list) else [outputs]:
        for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
            assert ctxlen > 0
            tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
            top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
            is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs))
            res.append((sum(tokens_logprobs), is_greedy))
    return res


def test_lm_evals_loglikelihood_requests(server, model):
    """Multiple-choice scoring: context + each continuation, scored in one batch."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    context = [5, 17, 33, 2, 9, 100, 200]
    continuations = [[300, 41], [42], [7, 8, 9]]
    with torch.no_grad():  # the continuations' greedy one, to score too
        greedy = [hf(torch.tensor([context])).logits[0, -1].argmax().item()]
    continuations.append(greedy)
    prompts = [context + c for c in continuations]
    response = httpx.post(server.url + "/v1/completions", json=lm_eval_payload(prompts), timeout=60)
    assert response.status_code == 200, response.text
    scores = lm_eval_parse_logprobs(response.json(), [len(context)] * len(prompts))
    for prompt, continuation, (score, is_greedy) in zip(prompts, continuations, scores):
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
        positions = range(len(context), len(prompt))
        expected = sum(logprobs[p - 1, prompt[p]].item() for p in positions)
        assert score == pytest.approx(expected, abs=1e-4)
        assert is_greedy == all(logprobs[p - 1].argmax().item() == prompt[p] for p in positions)
    assert scores[-1][1]  # (the greedy continuation is greedy)


def test_echo_with_max_tokens_0_and_with_a_completion(server):
    prompt = [5, 17, 33, 2, 9]
    only = httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}).json()
    choice = only["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
    assert choice["text"] == "".join(lp["tokens"]) and lp["text_offset"][0] == 0
    assert only["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    full = httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0}).json()
    flp = full["choices"][0]["logprobs"]
    assert len(flp["tokens"]) == len(prompt) + 3 and flp["token_logprobs"][:len(prompt)] == lp["token_logprobs"]
    assert full["choices"][0]["text"].startswith(choice["text"])
    plain = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 3, "temperature": 0}).json()
    assert full["choices"][0]["text"] == choice["text"] + plain["choices"][0]["text"]


def test_echo_with_stream_is_a_400(server):
    response = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"prompt": "hi", "echo": True, "stream": True})
    assert error_of(response, 400)["param"] == "echo"


def test_echo_logprobs_are_capped_per_call(server):
    """A small request may not ask for a huge response: echo's prompt logprobs come once per choice,
    so 200 prompt tokens x n 128 x 21 (logprobs 20) is a 400 naming n; the same with n 1 is served."""
    from nanovllm.entrypoints.protocol import MAX_ECHO_LOGPROBS
    body = {"prompt": list(range(1, 201)), "echo": True, "logprobs": 20, "max_tokens": 1}
    assert 200 * 128 * 21 > MAX_ECHO_LOGPROBS >= 200 * 21
    error = error_of(httpx.post(server.url + "/v1/completions", json={**body, "n": 128}, timeout=60), 400)
    assert error["param"] == "n" and f"{200 * 128 * 21:,} prompt logprobs" in error["message"], error
    served = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert served.status_code == 200 and len(served.json()["choices"][0]["logprobs"]["top_logprobs"]) == 201


def test_each_choice_echoes_its_own_prompt_with_several_prompts_and_n(server):
    """Several prompts, n samples each: choice c belongs to prompt c // n, and echoes that
    prompt's tokens and prompt logprobs (those a request of that prompt alone gets), whatever
    the other prompts hold."""
    prompts, n = [[5, 17, 33, 2, 9], [100, 200, 300, 41, 42, 7, 8], [11, 12]], 2
    body = {"max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 1.0, "seed": 3}
    alone = [httpx.post(server.url + "/v1/completions", timeout=60, json={**body, "prompt": p}).json()
             for p in prompts]
    response = httpx.post(server.url + "/v1/completions", timeout=60, json={**body, "prompt": prompts, "n": n})
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=itemgetter("index"))
    assert len(choices) == n * len(prompts)
    for c, choice in enumerate(choices):
        own = alone[c // n]["choices"][0]["logprobs"]
        lp, k = choice["logprobs"], len(prompts[c // n])
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == k + 1, c
        assert lp["tokens"][:k] == own["tokens"][:k] and lp["text_offset"][:k] == own["text_offset"][:k], c
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None, c
        assert lp["token_logprobs"][1:k] == pytest.approx(own["token_logprobs"][1:k], abs=1e-5), c
        assert [list(top) for top in lp["top_logprobs"][1:k]] == [list(top) for top in own["top_logprobs"][1:k]], c
        assert choice["text"].startswith("".join(own["tokens"][:k])), c
