"""SamplingParams(prompt_logprobs=k): per prompt token its logprob and the top k, None for the
first, equal to a Hugging Face forward's log_softmax (float32, CPU) to 1e-4, with chunked
prefill, beside a prefix-cache hit (the request computes its whole prompt), after preemption
(positions collected once), with n > 1 and streaming."""
import pytest
import torch

from nanovllm import LLM, SamplingParams

PROMPT = [5, 17, 33, 2, 9, 100, 200, 300, 41, 42] * 5


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def get(prompt):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    return get


def check(prompt_logprobs, prompt, reference, k):
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        entry, expected = prompt_logprobs[j], reference[j - 1]
        assert abs(entry[prompt[j]] - expected[prompt[j]].item()) < 1e-4
        top = expected.topk(k)
        assert set(entry) == set(top.indices.tolist()) | {prompt[j]}
        for token, value in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[token] - value) < 1e-4


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16}, {"kvcache_block_size": 4}],
                         ids=["one-chunk", "chunked-prefill", "small-blocks"])
def test_prompt_logprobs_equal_hugging_face(model_dir, hf_logprobs, options):
    with LLM(model_dir, max_model_len=256, **options) as llm:
        cached = llm.generate([PROMPT[:40]], SamplingParams(max_tokens=2), use_tqdm=False)  # its blocks are cached
        out = llm.generate([PROMPT, PROMPT[:40] + [7]], [SamplingParams(max_tokens=3, prompt_logprobs=3),
                                                          SamplingParams(max_tokens=3)], use_tqdm=False)
    check(out[0]["prompt_logprobs"], PROMPT, hf_logprobs(PROMPT), 3)
    assert out[0]["num_cached_tokens"] == 0 and out[1]["num_cached_tokens"] > 0  # (the others still hit)
    assert "prompt_logprobs" not in out[1] and cached[0]["token_ids"]


def test_after_preemption_and_with_n_samples(model_dir, hf_logprobs):
    prompts = [[(i * 7 + j) % 400 + 1 for j in range(60)] for i in range(6)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, prompt_logprobs=0, n=2)
    with LLM(model_dir, max_model_len=128, num_kvcache_blocks=24, max_num_seqs=6) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["num_preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        check(out["prompt_logprobs"], prompt, hf_logprobs(prompt), 0)
        assert len(out["samples"]) == 2


def test_streamed_with_the_first_update(model_dir, hf_logprobs):
    with LLM(model_dir, max_model_len=256) as llm:
        updates = list(llm.stream([PROMPT], SamplingParams(max_tokens=4, prompt_logprobs=1)))
    assert "prompt_logprobs" in updates[0] and all("prompt_logprobs" not in u for u in updates[1:])
    check(updates[0]["prompt_logprobs"], PROMPT, hf_logprobs(PROMPT), 1)


def test_bad_values():
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(TypeError, match="prompt_logprobs must be an int"):
        SamplingParams(prompt_logprobs=1.5)


def test_beside_a_speculative_decode(model_dir, hf_logprobs):
    """A prompt whose logprobs are asked for, prefilled in the same step as a sequence verifying
    its drafts (n-gram speculation): the verify step keeps the step's prompt logprobs too."""
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with LLM(model_dir, max_model_len=256, speculative_config=speculative) as llm:
        mixed, schedule = [], llm.scheduler.schedule

        def recording():
            step = schedule()
            if step is not None and step.drafts and step.prompt_logprobs:
                mixed.append(step)
            return step
        llm.scheduler.schedule = recording
        looping = llm.add_request([7, 8, 9] * 10, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0]
        while not looping.spec or not looping.spec.draft_tokens:
            llm.step()  # until it drafts
        asking = llm.add_request(PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
        while not asking.is_finished:
            llm.step()
        assert mixed, "no step verified drafts beside a prompt chunk: the test tests nothing"
        check(asking.prompt_logprobs, PROMPT, hf_logprobs(PROMPT), 2)
