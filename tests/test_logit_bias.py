"""logit_bias (OpenAI's) and allowed_token_ids (vLLM's) in SamplingParams: added to, or restricting,
the logits before sampling (greedy and sampled), for the rows that ask only; logprobs stay the
model's raw ones; bad values are errors naming the field; the server takes both."""
import pytest

from nanovllm import LLM, SamplingParams

PROMPTS = [[5, 17, 33, 2, 9], [1, 2, 3], [100, 200, 300, 400]]


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, max_model_len=128) as llm:
        yield llm


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **kwargs)


def test_a_large_bias_forces_a_token_and_a_ban_takes_the_runner_up(llm):
    plain = llm.generate(PROMPTS, greedy(logprobs=5), use_tqdm=False)
    forced = llm.generate(PROMPTS, greedy(logit_bias={77: 100}), use_tqdm=False)
    assert all(o["token_ids"] == [77] * 8 for o in forced)
    for prompt, out in zip(PROMPTS, plain):
        first = out["token_ids"][0]
        ranked = sorted(out["logprobs"][0].items(), key=lambda kv: -kv[1])  # the raw top 5 (and the chosen)
        banned = llm.generate([prompt], greedy(logit_bias={first: -100}, logprobs=5), use_tqdm=False)[0]
        assert banned["token_ids"][0] == ranked[1][0]
        # the logprobs are the model's own: the banned token keeps its raw logprob
        assert abs(banned["logprobs"][0][ranked[1][0]] - ranked[1][1]) < 1e-5


def test_a_small_bias_shifts_a_near_tie(llm):
    """A bias just above the gap between the two most likely tokens swaps them; just below, not."""
    out = llm.generate(PROMPTS[:1], greedy(logprobs=2), use_tqdm=False)[0]
    (top, lp_top), (second, lp_second) = sorted(out["logprobs"][0].items(), key=lambda kv: -kv[1])[:2]
    gap = lp_top - lp_second
    assert llm.generate(PROMPTS[:1], greedy(logit_bias={second: gap + 1e-3}), use_tqdm=False)[0]["token_ids"][0] == second
    assert llm.generate(PROMPTS[:1], greedy(logit_bias={second: gap - 1e-3}), use_tqdm=False)[0]["token_ids"][0] == top


def test_allowed_token_ids_restrict_greedy_and_sampled_tokens(llm):
    allowed = [5, 6, 7, 300]
    full = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1, logprobs=512), use_tqdm=False)[0]
    best_allowed = max(allowed, key=lambda t: full["logprobs"][0][t])
    out = llm.generate(PROMPTS[:1], greedy(allowed_token_ids=allowed), use_tqdm=False)[0]
    assert out["token_ids"][0] == best_allowed and set(out["token_ids"]) <= set(allowed)
    sampled = llm.generate(PROMPTS * 10, [SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True, seed=i,
                                                         allowed_token_ids=allowed) for i in range(30)],
                           use_tqdm=False)
    tokens = [t for o in sampled for t in o["token_ids"]]
    assert set(tokens) <= set(allowed) and len(set(tokens)) >= 3


def test_rows_without_them_are_unchanged_in_the_same_batch(llm):
    plain = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    mixed = llm.generate(PROMPTS * 2, [greedy()] * 3 + [greedy(logit_bias={9: 100}), greedy(allowed_token_ids=[4]),
                                                         greedy(logit_bias={1: -100}, allowed_token_ids=[1, 2])],
                         use_tqdm=False)
    assert [o["token_ids"] for o in mixed[:3]] == [o["token_ids"] for o in plain]
    assert mixed[3]["token_ids"] == [9] * 8 and mixed[4]["token_ids"] == [4] * 8 and mixed[5]["token_ids"] == [2] * 8


@pytest.mark.parametrize("kwargs, error, words", [
    ({"logit_bias": {5: 101}}, ValueError, r"logit_bias\[5\] must be a number in \[-100, 100\]"),
    ({"logit_bias": {-1: 1}}, ValueError, "keys must be token ids"),
    ({"logit_bias": [5]}, TypeError, "must be a dict"),
    ({"allowed_token_ids": []}, ValueError, "non-empty list"),
    ({"allowed_token_ids": [1.5]}, ValueError, "non-empty list"),
])
def test_bad_values(kwargs, error, words):
    with pytest.raises(error, match=words):
        SamplingParams(**kwargs)


def test_ids_outside_the_vocabulary_are_refused(llm):
    for kwargs in ({"logit_bias": {512: 1}}, {"allowed_token_ids": [3, 512]}):
        with pytest.raises(ValueError, match=f"{next(iter(kwargs))} has 512, outside the vocabulary"):
            llm.generate(PROMPTS[:1], SamplingParams(**kwargs), use_tqdm=False)
