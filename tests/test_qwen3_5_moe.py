"""Qwen3.5-MoE (models/qwen3_5_moe.py): Qwen3.5's hybrid layers (three Gated DeltaNet, one full
attention) with a mixture of experts and a gated shared expert in every layer. Tiny random models
built with transformers equal Hugging Face greedy token for token (float32, CPU) with chunked
prefill, prefix caching, preemption and TP=2, the Hub's ConditionalGeneration checkpoint too."""
import pytest
import torch

from hf_reference import (QWEN3_5_VISION, assert_greedy_matches_hf, assert_logprobs_equal_hf,
                          assert_prefix_cache_and_preemption, assert_text_equals_hf_model, save_multimodal_model)
from nanovllm import LLM, SamplingParams
from nanovllm.utils.tiny_model import FAMILY_SETTINGS, edit_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
MODELS = {
    "qwen3_5_moe": ("qwen3_5_moe", 0, {}),
    # one KV head (copied to both ranks under TP=2), a tied head, 3 experts a token
    "qwen3_5_moe_mqa": ("qwen3_5_moe", 1, dict(num_key_value_heads=1, tie_word_embeddings=True, num_experts_per_tok=3)),
}


@pytest.fixture
def moe_dir(tiny_models):
    return lambda name: tiny_models(MODELS, name)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("options", [{}, dict(max_num_batched_tokens=64, kvcache_block_size=16)],
                         ids=["plain", "chunked-prefill"])
def test_qwen3_5_moe_matches_hf(moe_dir, prompts, reference, name, options):
    path = moe_dir(name)
    with LLM(path, max_model_len=400, **options) as llm:
        assert_greedy_matches_hf(llm, path, prompts, reference, GREEDY)


def test_qwen3_5_moe_logprobs_equal_hf(moe_dir, prompts):
    """(The shared expert's sigmoid gate scales its output: the logits tell where tokens may not.)"""
    assert_logprobs_equal_hf(moe_dir("qwen3_5_moe"), [prompts[1], prompts[4]], max_model_len=400)


def test_qwen3_5_moe_prefix_cache_and_preemption(moe_dir, prompts, reference):
    """(Resumed from the prompt's state snapshot, in a prefill chunk of 64.)"""
    assert_prefix_cache_and_preemption(moe_dir("qwen3_5_moe"), prompts, reference, max_num_batched_tokens=64)


def test_qwen3_5_moe_tp2_matches_hf(moe_dir, prompts, reference):
    """Experts' and the shared expert's intermediate rows split over two ranks (gloo)."""
    path = moe_dir("qwen3_5_moe_mqa")
    with LLM(path, tensor_parallel_size=2, max_model_len=400, max_num_batched_tokens=64, kvcache_block_size=16) as llm:
        assert_greedy_matches_hf(llm, path, prompts, reference, GREEDY)


def test_the_hubs_conditional_generation_checkpoint_runs_its_text_model(tmp_path, prompts):
    """Qwen3_5MoeForConditionalGeneration: the text model under model.language_model.* (experts and
    router included), a vision tower beside it, skipped; greedy text equals HF's whole model."""
    import transformers
    path = str(tmp_path / "vl")
    hf = save_multimodal_model(path, transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration,
                               FAMILY_SETTINGS["qwen3_5_moe"], **QWEN3_5_VISION)
    assert_text_equals_hf_model(hf, path, prompts[2:6])


def test_the_shared_expert_gate_changes_the_answer(moe_dir, prompts, reference, tmp_path):
    """(So that the tests above can fail:) the same weights with the shared expert's gate zeroed
    (sigmoid 1/2 for every token) answer differently from HF's."""
    path = moe_dir("qwen3_5_moe")

    def open_gates(tensors):
        for name in [n for n in tensors if n.endswith("shared_expert_gate.weight")]:
            tensors[name] = torch.zeros_like(tensors[name])
    opened = edit_model(path, str(tmp_path / "opened"), open_gates)
    with LLM(opened, max_model_len=400) as llm:
        outputs = llm.generate(prompts[-3:], GREEDY, use_tqdm=False)
    assert any(o["token_ids"] != reference(path, p, 16) for o, p in zip(outputs, prompts[-3:]))


def test_bad_configs_are_refused(moe_dir, tmp_path):
    bad = edit_model(moe_dir("qwen3_5_moe"), str(tmp_path / "bad"),
                     edit_config=lambda config: config.update(num_experts_per_tok=9))
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 must be in \[1, num_experts=4\]"):
        LLM(bad)
