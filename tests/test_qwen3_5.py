"""Qwen3.5 (models/qwen3_5.py, layers/gated_delta_net.py, features/state_cache.py): tiny random
models of three Gated DeltaNet layers and one gated full-attention layer, built with transformers,
equal Hugging Face greedy token for token (float32, CPU) with chunked prefill, prefix caching
(resumed from state snapshots), preemption and TP=2; the delta rule's chunked form against its
recurrent form; the state pool's size; bad configs and options refused at start-up."""
import pytest
import torch

from hf_reference import (QWEN3_5_VISION, assert_greedy_matches_hf, assert_logprobs_equal_hf,
                          assert_text_equals_hf_model, save_multimodal_model)
from nanovllm import LLM, SamplingParams
from nanovllm.layers.gated_delta_net import (CHUNK_SIZE, causal_conv1d, chunk_gated_delta_rule, l2norm,
                                             recurrent_gated_delta_rule)

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
MODELS = {
    "qwen3_5": ("qwen3_5", 0, {}),
    # tied head, one KV head, half the head dims rotated, two value heads per key head on 4 key heads
    "qwen3_5_tied": ("qwen3_5", 1, dict(tie_word_embeddings=True, num_key_value_heads=1, linear_num_key_heads=4,
                                        linear_num_value_heads=8, rope_parameters={
                                            "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})),
}


@pytest.fixture
def qwen_dir(tiny_models):
    return lambda name: tiny_models(MODELS, name)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("options", [{}, dict(max_num_batched_tokens=64, kvcache_block_size=16)],
                         ids=["plain", "chunked-prefill"])
def test_qwen3_5_matches_hf(qwen_dir, prompts, reference, name, options):
    """Prompts of 1 to 300 tokens, together: prefill chunks of one and many delta-rule chunks, and decodes."""
    path = qwen_dir(name)
    with LLM(path, max_model_len=400, **options) as llm:
        assert_greedy_matches_hf(llm, path, prompts, reference, GREEDY)


def test_a_repeated_prompt_resumes_from_its_snapshot(qwen_dir, prompts, reference):
    """The state at the end of a prompt's full blocks is kept (taken inside a prefill chunk of 64
    here: position 144 of [128, 150)); the same prompt again, and another sharing those 144 tokens,
    resume there (144 cached tokens) and equal HF. A prompt sharing only 100 tokens has no snapshot
    to resume from: nothing cached, though its first 6 blocks are in the cache."""
    path = qwen_dir("qwen3_5")
    long = prompts[-1][:150]
    with LLM(path, max_model_len=400, max_num_batched_tokens=64, kvcache_block_size=16) as llm:
        first = llm.generate([long], GREEDY, use_tqdm=False)[0]
        assert first["token_ids"] == reference(path, long, 16)
        again = llm.generate([long], GREEDY, use_tqdm=False)[0]
        assert again["num_cached_tokens"] == 144 and again["token_ids"] == first["token_ids"]
        sibling = long[:144] + [7, 8, 9]
        out = llm.generate([sibling], GREEDY, use_tqdm=False)[0]
        assert out["num_cached_tokens"] == 144 and out["token_ids"] == reference(path, sibling, 16)
        cousin = long[:100] + [5] * 30
        out = llm.generate([cousin], GREEDY, use_tqdm=False)[0]
        assert out["num_cached_tokens"] == 0 and out["token_ids"] == reference(path, cousin, 16)
        assert len(llm.block_manager.snapshots) == 2  # at 144 (long's, which sibling's would be) and 128 (cousin's)


def test_snapshots_taken_at_a_delta_rule_chunk_boundary_and_off_it(qwen_dir, reference):
    """Prompts whose snapshot position falls on a 64-token chunk of the delta rule (64, 128) and
    inside one (48, 112), each taken and resumed; n > 1 samples resume from their prompt's snapshot."""
    path = qwen_dir("qwen3_5")
    base = list(range(3, 140))
    with LLM(path, max_model_len=400, kvcache_block_size=16) as llm:
        for n in (60, 65, 129, 113):
            prompt = base[:n]
            first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
            longer = prompt + [1, 2, 3, 4, 5, 6]
            out = llm.generate([longer], GREEDY, use_tqdm=False)[0]
            assert out["num_cached_tokens"] == (n - 1) // 16 * 16, n
            assert first["token_ids"] == reference(path, prompt, 16) and out["token_ids"] == reference(path, longer, 16)
        samples = llm.generate([base[:40]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=3),
                               use_tqdm=False)[0]
        assert all(s["token_ids"] == reference(path, base[:40], 16) for s in samples["samples"])
        assert [s["num_cached_tokens"] for s in samples["samples"]] == [0, 32, 32]


def test_preemption_recomputes_from_snapshots_and_leaks_nothing(qwen_dir, prompts, reference):
    """Under a KV budget of 14 blocks of 16 the engine preempts and recomputes (from the prompt's
    snapshot, or from zeros); output equals HF and every block is free after."""
    path = qwen_dir("qwen3_5")
    with LLM(path, max_model_len=192, kvcache_block_size=16, num_kvcache_blocks=14, max_num_seqs=8,
             max_num_batched_tokens=64) as llm:
        assert_greedy_matches_hf(llm, path, [p[:40] for p in prompts if len(p) >= 40] + prompts[:3], reference,
                                 SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        assert llm.stats()["num_preemptions"] > 0


def test_qwen3_5_tp2_matches_hf(qwen_dir, prompts, reference):
    """Linear-attention heads and the convolution's channels split over two ranks (gloo)."""
    path = qwen_dir("qwen3_5_tied")
    with LLM(path, tensor_parallel_size=2, max_model_len=400, max_num_batched_tokens=64, kvcache_block_size=16) as llm:
        assert_greedy_matches_hf(llm, path, prompts, reference, GREEDY)
        again = llm.generate([prompts[-1]], GREEDY, use_tqdm=False)[0]
        assert again["num_cached_tokens"] == 288 and again["token_ids"] == reference(path, prompts[-1], 16)


@pytest.mark.parametrize("name", MODELS)
def test_qwen3_5_logprobs_equal_hf(qwen_dir, prompts, name):
    """Each emitted token's logprob equals Hugging Face's log_softmax (the output gate, the partial
    RoPE and the gated norm change the logits where greedy tokens may not tell)."""
    assert_logprobs_equal_hf(qwen_dir(name), [prompts[1], prompts[4]], max_model_len=400, max_num_batched_tokens=32)


def test_the_hubs_conditional_generation_checkpoint_runs_its_text_model(tmp_path, prompts):
    """Qwen3_5ForConditionalGeneration (the Hub's checkpoints): text weights under
    model.language_model.*, a vision tower and MTP weights beside them, skipped; greedy text
    equals Hugging Face's for the whole model."""
    import transformers
    from safetensors.torch import load_file, save_file
    from nanovllm.utils.tiny_model import LINEAR_ATTENTION_SETTINGS
    path = str(tmp_path / "vl")
    hf = save_multimodal_model(path, transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration,
                               LINEAR_ATTENTION_SETTINGS, **QWEN3_5_VISION)
    weights = load_file(f"{path}/model.safetensors")
    assert any(k.startswith("model.visual.") for k in weights) and any(k.startswith("model.language_model.")
                                                                        for k in weights)
    weights["mtp.fc.weight"] = torch.zeros(64, 128)  # (the Hub's checkpoints carry MTP weights: skipped too)
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    assert_text_equals_hf_model(hf, path, prompts[2:6])


# ---- memory ---------------------------------------------------------------------------------------

def test_a_running_sequence_costs_its_fixed_state_not_tokens(qwen_dir):
    """KV blocks hold the one full-attention layer alone; the three linear layers' states are a pool
    of max_num_seqs rows + the scratch row + max_num_seqs snapshots, sized at start-up, whatever the
    sequences' lengths (and no snapshots without prefix caching)."""
    path = qwen_dir("qwen3_5")
    with LLM(path, max_model_len=400, max_num_seqs=4, kvcache_block_size=16) as llm:
        runner = llm.model_runner
        assert len(runner.attention_layers) == 1
        assert runner.kv_block_bytes() == 2 * 16 * 2 * 16 * 4  # K and V x 16 tokens x 2 KV heads x 16 dims x fp32
        assert runner.conv_states.shape == (3, 4 + 1 + 4, 2 * 32 + 64, 3)
        assert runner.ssm_states.shape == (3, 9, 4, 16, 16) and runner.ssm_states.dtype == torch.float32
        llm.generate([[5] * 300, [6] * 3], GREEDY, use_tqdm=False)
        assert runner.conv_states.shape[1] == 9
    with LLM(path, max_model_len=400, max_num_seqs=4, enable_prefix_caching=False) as llm:
        assert llm.model_runner.ssm_states.shape[1] == 5


# ---- the kernels ----------------------------------------------------------------------------------

def random_inputs(n: int, heads: int = 3, dk: int = 8, dv: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(heads, n, dk, generator=g)) * dk ** -0.5
    k = l2norm(torch.randn(heads, n, dk, generator=g))
    v = torch.randn(heads, n, dv, generator=g)
    decay = -torch.rand(heads, n, generator=g)
    beta = torch.rand(heads, n, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("n", [1, 5, CHUNK_SIZE, CHUNK_SIZE + 1, 3 * CHUNK_SIZE - 7])
def test_the_chunked_delta_rule_equals_the_token_by_token_recurrence(n):
    q, k, v, decay, beta, state = random_inputs(n, seed=n)
    out, final = chunk_gated_delta_rule(q, k, v, decay, beta, state)
    s, expected = state[None], []
    for t in range(n):
        o, s = recurrent_gated_delta_rule(q[None, :, t], k[None, :, t], v[None, :, t], decay[None, :, t],
                                          beta[None, :, t], s)
        expected.append(o[0])
    torch.testing.assert_close(out, torch.stack(expected, 1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final, s[0], rtol=1e-4, atol=1e-5)


def test_a_delta_rule_split_anywhere_carries_its_state():
    q, k, v, decay, beta, state = random_inputs(150, seed=7)
    whole, final = chunk_gated_delta_rule(q, k, v, decay, beta, state)
    for split in (1, 63, 64, 100):
        first, mid = chunk_gated_delta_rule(q[:, :split], k[:, :split], v[:, :split], decay[:, :split],
                                            beta[:, :split], state)
        rest, end = chunk_gated_delta_rule(q[:, split:], k[:, split:], v[:, split:], decay[:, split:],
                                           beta[:, split:], mid)
        torch.testing.assert_close(torch.cat([first, rest], 1), whole, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(end, final, rtol=1e-4, atol=1e-5)


def test_the_causal_conv_with_its_state_equals_the_whole_sequence():
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(20, 5, generator=g), torch.randn(5, 4, generator=g)
    whole, _ = causal_conv1d(x, torch.zeros(5, 3), weight)
    first, inputs = causal_conv1d(x[:9], torch.zeros(5, 3), weight)
    rest, _ = causal_conv1d(x[9:], inputs[:, -3:], weight)
    torch.testing.assert_close(torch.cat([first, rest]), whole)
    padded = torch.nn.functional.conv1d(x.t()[None], weight[:, None], padding=3, groups=5)[0, :, :20]
    torch.testing.assert_close(whole, torch.nn.functional.silu(padded).t())


# ---- refused at start-up --------------------------------------------------------------------------

def edited(src, dst, **changes) -> str:
    from nanovllm.utils.tiny_model import edit_model
    return edit_model(src, str(dst), edit_config=lambda config: config.update(changes))


@pytest.mark.parametrize("layer_types, match", [
    (["linear_attention", "mamba", "linear_attention", "full_attention"],
     r"layer type\(s\) \['mamba'\] in config.layer_types are not supported for Qwen3.5"),
    (["linear_attention", "full_attention"], "config.layer_types has 2 entries for num_hidden_layers=4"),
])
def test_unknown_layer_kinds_are_refused_by_name(qwen_dir, layer_types, match):
    """(transformers' own config class rewrites an unknown kind, so the check is fed a config directly.)"""
    from transformers import AutoConfig
    from nanovllm.models import resolve_model_class
    config = AutoConfig.from_pretrained(qwen_dir("qwen3_5"))
    config.layer_types = layer_types
    with pytest.raises(ValueError, match=match):
        resolve_model_class(config)


@pytest.mark.parametrize("changes, match", [
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported for Qwen3.5"),
    (dict(linear_num_value_heads=5), "linear_num_value_heads=5 is not a multiple of linear_num_key_heads=2"),
])
def test_bad_configs_are_refused(qwen_dir, tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        LLM(edited(qwen_dir("qwen3_5"), tmp_path / "bad", **changes))


@pytest.mark.parametrize("options, match", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative decoding is not supported for models with linear-attention layers"),
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size > 1 is not supported for models with linear-attention"),
])
def test_options_the_state_cache_does_not_support_are_refused(qwen_dir, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(qwen_dir("qwen3_5"), **options)


def test_a_token_redrawn_after_the_next_step_used_it_is_recomputed(tiny_models, monkeypatch):
    """Overlapped, the step after a flagged draw has already advanced the state by that token: the
    sequence is preempted and recomputed (no rollback can undo a recurrent update), and the outputs
    are those drawn without the flags (test_step_path.py's forced redraws, on Qwen3.5)."""
    from test_step_path import outputs_with_redraws
    path = tiny_models({"qwen3_5_vocab2048": ("qwen3_5", 0, dict(vocab_size=2048))}, "qwen3_5_vocab2048")
    plain, corrected, _ = outputs_with_redraws(path, False, monkeypatch, force=False)
    assert corrected == 0
    overlapped, corrected, undone = outputs_with_redraws(path, True, monkeypatch, force=True)
    assert overlapped == plain and corrected > 10 and undone > 5
