"""The Hugging Face reference the end-to-end tests compare against."""
import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.utils.tiny_model import EOS_TOKEN, TINY_SIZES, build_tokenizer, draw_zero_initialized

_HF_MODELS = {}


@torch.inference_mode()
def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference: Hugging Face `generate`, float32 on CPU, greedy, one prompt alone, EOS ignored."""
    if path not in _HF_MODELS:
        _HF_MODELS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = greedy_of(_HF_MODELS[path], prompt_ids, max_new_tokens)
    assert len(tokens) == max_new_tokens, "the reference stopped early"
    return tokens


@torch.inference_mode()
def greedy_of(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """A Hugging Face model's greedy completion of one prompt, EOS ignored."""
    ids = torch.tensor([prompt_ids])
    # an explicit mask: generate would otherwise mask every prompt token equal to the pad id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def save_with_random_norms(model, path: str):
    """Save a Hugging Face model built here, the parameters transformers zeroes at init drawn at
    random first, as tiny_model.build_model draws them, so that their code paths are tested."""
    draw_zero_initialized(model, 0.2)
    model.save_pretrained(path)


def save_multimodal_model(path: str, config_class, model_class, text: dict, **options):
    """A tiny multimodal Hugging Face model, its tokenizer beside it: the text model of TINY_SIZES
    updated by `text`, the rest of config_class's **options (vision_config, token ids, ...); drawn
    with seed 0 (save_with_random_norms) and saved at path. Returns the model."""
    eos = build_tokenizer(path).convert_tokens_to_ids(EOS_TOKEN)
    config = config_class(text_config=dict(TINY_SIZES, eos_token_id=eos, **text), **options)
    config.architectures = [model_class.__name__]
    torch.manual_seed(0)
    model = model_class(config).to(torch.float32).eval()
    save_with_random_norms(model, path)
    return model


def assert_text_equals_hf_model(model, path: str, prompts: list) -> str:
    """LLM(path)'s greedy text (chunked prefill: 64-token steps, 16-token blocks) equals `model`'s,
    a Hugging Face model in memory; returns the class the engine ran."""
    with LLM(path, max_model_len=400, max_num_batched_tokens=64, kvcache_block_size=16) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        ran = type(llm.model_runner.model).__name__
    assert_outputs_equal_hf_model(model, prompts, outputs)
    return ran


# Qwen3.5's (and Qwen3.5-MoE's) vision tower at toy size, and its special tokens
QWEN3_5_VISION = dict(vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                         patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                                         num_position_embeddings=64),
                      image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)


def assert_outputs_equal_hf_model(model, prompts: list, outputs: list[dict]):
    """Each output's tokens equal `model`'s (a Hugging Face model in memory) greedy, EOS ignored."""
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == greedy_of(model, prompt, len(out["token_ids"])), f"prompt of {len(prompt)} tokens"


@torch.inference_mode()
def assert_logprobs_equal_hf(path: str, prompts: list, **options):
    """LLM(path, **options)'s logprob of each greedy token equals Hugging Face's log_softmax of its
    logits within 1e-4 (what greedy tokens alone do not check: a soft-cap, a gate, an approximation).
    HF's logits are its generate's: a prefill, then a token at a time, as the engine computes them.
    (One forward over prompt and output is another computation: for the Qwen3.5-MoE model of
    test_qwen3_5_moe it differs from HF's own generate by 2e-4, its chunked delta rule rounding
    otherwise than the recurrent one; the engine's logprobs are within 1e-5 of generate's.)"""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(path, **options) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1),
                               use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        steps = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(out["token_ids"]),
                            do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                            return_dict_in_generate=True)
        assert steps.sequences[0, len(prompt):].tolist() == out["token_ids"]
        for token, entry, logits in zip(out["token_ids"], out["logprobs"], steps.logits):
            assert abs(entry[token] - logits[0].log_softmax(-1)[token].item()) < 1e-4


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


def assert_prefix_cache_and_preemption(path: str, prompts: list, reference, **options):
    """A repeated 150-token prompt resumes from its cached blocks (144 tokens) and gives the same
    answer, HF's; under a KV budget of 14 blocks of 16, prompts of 32 tokens make the engine preempt
    and recompute, and still equal HF, no block leaked."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    long = prompts[-1][:150]
    with LLM(path, max_model_len=192, kvcache_block_size=16, num_kvcache_blocks=14, max_num_seqs=8, **options) as llm:
        first = llm.generate([long], greedy, use_tqdm=False)[0]
        again = llm.generate([long], greedy, use_tqdm=False)[0]
        assert again["num_cached_tokens"] == 144 and again["token_ids"] == first["token_ids"]
        assert first["token_ids"] == reference(path, long, 16)
        # five prompts of two blocks each, all admitted; each needs a third block as it decodes
        assert_greedy_matches_hf(llm, path, [p[:32] for p in prompts if len(p) >= 32], reference, greedy)
        assert llm.stats()["num_preemptions"] > 0


def random_vision_language_model(config_class, model_class, vision: dict, text: dict):
    """A tiny Hugging Face vision-language model in float32, every parameter (norms too) drawn from
    N(0, 0.2) under seed 0, so that none is at its initial value (the vision towers' tests)."""
    torch.manual_seed(0)
    model = model_class(config_class(vision_config=vision, text_config=text)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def vision_tower_of(hf, tower_class):
    """Our tower_class loaded from hf's model.visual.* weights by name, strictly (none missing or extra)."""
    tower = tower_class(hf.config.vision_config).eval()
    tower.load_state_dict({k.removeprefix("model.visual."): v for k, v in hf.state_dict().items()
                           if k.startswith("model.visual.")})
    return tower
