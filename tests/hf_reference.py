"""The Hugging Face reference the end-to-end tests compare against."""
import torch

_HF_MODELS = {}


@torch.inference_mode()
def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference: Hugging Face `generate`, float32 on CPU, greedy, one prompt alone, EOS ignored."""
    from transformers import AutoModelForCausalLM

    if path not in _HF_MODELS:
        _HF_MODELS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    # an explicit mask: generate would otherwise mask every prompt token equal to the pad id
    out = _HF_MODELS[path].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = out[0, len(prompt_ids):].tolist()
    assert len(tokens) == max_new_tokens, "the reference stopped early"
    return tokens


@torch.inference_mode()
def save_with_random_norms(model, path: str):
    """Save a Hugging Face model built here, its norm weights that start at 0 ((1 + w) norms) drawn
    at random first, as tiny_model.build_model draws them, so that their code paths are tested."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") and not param.any():
            param.normal_(0.0, 0.2)
    model.save_pretrained(path)


@torch.inference_mode()
def assert_outputs_equal_hf_model(model, prompts: list, outputs: list[dict]):
    """Each output's tokens equal `model`'s (a Hugging Face model in memory) greedy, EOS ignored."""
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(out["token_ids"]),
                                  do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out["token_ids"] == expected, f"prompt of {len(prompt)} tokens"


def assert_greedy_matches_hf(llm, path: str, prompts: list, reference, params) -> list[dict]:
    """llm's greedy outputs of prompts (ignore_eos params) equal reference(path, prompt, n), token
    for token, and no KV block leaked; returns the outputs."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs) == len(prompts)
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == reference(path, prompt, params.max_tokens), f"prompt of {len(prompt)} tokens"
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], "blocks leaked"
    return outputs


def assert_matches_hf_with_caching_chunking_and_preemption(llm, path: str, prompts: list, reference):
    """The parallel engines' common check (llm: max_model_len=400, max_num_batched_tokens=96,
    num_kvcache_blocks=30): greedy output equal to HF under preemption, then prefix-cache hits."""
    from nanovllm import SamplingParams
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    shared = list(range(3, 203))
    assert_greedy_matches_hf(llm, path, prompts, reference, SamplingParams(temperature=0, max_tokens=32,
                                                                            ignore_eos=True))
    assert llm.stats()["num_preemptions"] > 0
    assert_greedy_matches_hf(llm, path, [shared + [1]], reference, greedy)
    later = assert_greedy_matches_hf(llm, path, [shared + [2], shared + [3]], reference, greedy)
    assert all(o["num_cached_tokens"] > 0 for o in later)
