"""Weights updated in place (features/weight_updates.py, issue 50): an engine serving model A, given
model B's tensors (Hugging Face's names and layout), equals HF greedy of B, including a prompt that
was prefix-cached under A (the cache is reset: nothing computed with A is reused); a dense model,
a mixture of experts (the experts' stacked layout) and Qwen3.5 (its state snapshots); bad tensors
refused by name before anything changes; an engine with requests in flight refused."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MODELS = {"qwen3_a": ("qwen3", 0, {}), "qwen3_b": ("qwen3", 1, {}),
          "moe_a": ("qwen3_moe", 0, {}), "moe_b": ("qwen3_moe", 1, {}),
          "qwen3_5_a": ("qwen3_5", 0, {}), "qwen3_5_b": ("qwen3_5", 1, {})}


def hf_tensors(path: str) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("family", ["qwen3", "moe", "qwen3_5"])
def test_an_update_to_model_b_equals_hf_b_and_reuses_nothing_of_a(family, tiny_models, prompts, reference):
    a, b = tiny_models(MODELS, f"{family}_a"), tiny_models(MODELS, f"{family}_b")
    cached = prompts[5]  # 150 tokens: 144 of them in the cache after its first run
    with LLM(a, max_model_len=400, kvcache_block_size=16) as llm:
        assert llm.generate([cached], GREEDY, use_tqdm=False)[0]["token_ids"] == reference(a, cached, 12)
        assert llm.generate([cached], GREEDY, use_tqdm=False)[0]["num_cached_tokens"] == 144
        tensors = hf_tensors(b)
        assert llm.update_weights(tensors.items()) >= len(tensors)
        again = llm.generate([cached], GREEDY, use_tqdm=False)[0]
        assert again["num_cached_tokens"] == 0 and again["token_ids"] == reference(b, cached, 12)
        outputs = llm.generate(prompts[:5], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [reference(b, p, 12) for p in prompts[:5]]


def test_a_subset_updates_those_weights_alone(tiny_models, prompts, reference):
    """B's tensors in two calls, a dict then pairs: the first (embeddings and layer 0) alone gives
    neither A's answer nor B's; both together equal B's."""
    a, b = tiny_models(MODELS, "qwen3_a"), tiny_models(MODELS, "qwen3_b")
    tensors = hf_tensors(b)
    first = {k: v for k, v in tensors.items() if ".layers.0." in k or "embed_tokens" in k}
    with LLM(a, max_model_len=400) as llm:
        llm.update_weights(first)
        half = llm.generate([prompts[4]], GREEDY, use_tqdm=False)[0]["token_ids"]
        assert half not in (reference(a, prompts[4], 12), reference(b, prompts[4], 12))
        llm.update_weights([(k, v) for k, v in tensors.items() if k not in first])
        assert llm.generate([prompts[4]], GREEDY, use_tqdm=False)[0]["token_ids"] == reference(b, prompts[4], 12)


def test_bad_tensors_are_refused_by_name_before_anything_changes(tiny_models, prompts, reference):
    a, b = tiny_models(MODELS, "qwen3_a"), tiny_models(MODELS, "qwen3_b")
    good = list(hf_tensors(b).items())
    name, tensor = good[3]
    bogus = "model.layers.0.mlp.bogus.weight"
    bad = [(good + [(bogus, tensor)], ValueError, f"{bogus!r} is not"),
           (good[:5] + [(name, tensor[:-1])], ValueError, f"{name!r}: expected shape"),
           (good[:2] + [("x",)], TypeError, "pairs"),
           (good[:2] + [(name, tensor.tolist())], TypeError, "torch.Tensor")]
    with LLM(a, max_model_len=400) as llm:
        for pairs, error, words in bad:
            with pytest.raises(error, match=words):
                llm.update_weights(pairs)
            assert llm.generate([prompts[4]], GREEDY, use_tqdm=False)[0]["token_ids"] == reference(a, prompts[4], 12)
        llm.add_request(prompts[3], GREEDY)
        with pytest.raises(ValueError, match="requests are in flight"):
            llm.update_weights(good)
        with pytest.raises(ValueError, match="requests are in flight"):
            llm.reset_prefix_cache()
        while not llm.is_finished():
            llm.step()
        llm.reset_prefix_cache()
        assert llm.generate([prompts[3]], GREEDY, use_tqdm=False)[0]["num_cached_tokens"] == 0
