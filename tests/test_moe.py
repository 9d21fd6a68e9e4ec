"""Mixture-of-experts models (Qwen3-MoE, Mixtral): greedy output equal to Hugging Face token for
token in float32 (alone, batched, with chunked prefill and prefix caching, at TP=2), the router,
checkpoints with missing or extra expert tensors, and the options that are refused."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from hf_reference import assert_greedy_matches_hf
from nanovllm.layers.moe import route, torch_experts
from nanovllm.utils.tiny_model import edit_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
MAX_MODEL_LEN = 400

# name -> (arch, seed, overrides of tiny_model's defaults: 2 layers, 4 experts, 2 per token)
MODELS = {
    "qwen3_moe": ("qwen3_moe", 0, dict(mlp_only_layers=[0])),  # layer 0 dense, layer 1 sparse; renormalized
    "qwen3_moe_raw_weights": ("qwen3_moe", 1, dict(norm_topk_prob=False, decoder_sparse_step=1)),  # all sparse
    "qwen3_moe_step2": ("qwen3_moe", 2, dict(decoder_sparse_step=2, num_experts=8)),  # layer 1 sparse only
    "mixtral": ("mixtral", 3, {}),
}


@pytest.fixture
def moe_dir(tiny_models):
    return lambda name: tiny_models(MODELS, name)


@pytest.mark.parametrize("name", MODELS)
def test_moe_matches_hf_alone_and_batched(name, moe_dir, prompts, reference):
    path = moe_dir(name)
    llm = LLM(path, max_model_len=MAX_MODEL_LEN)
    sparse = [type(layer.mlp).__name__ == "SparseMoE" for layer in llm.model_runner.model.model.layers]
    assert sparse == {"qwen3_moe": [False, True], "qwen3_moe_step2": [False, True]}.get(name, [True, True])
    assert_greedy_matches_hf(llm, path, prompts[2:3], reference, GREEDY)  # alone
    assert_greedy_matches_hf(llm, path, prompts, reference, GREEDY)       # batched


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_with_chunked_prefill_and_prefix_caching(name, moe_dir, prompts, reference):
    path = moe_dir(name)
    llm = LLM(path, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64, kvcache_block_size=16)
    shared = prompts[-1][:200]
    family = [shared + p[:20] for p in prompts[:4]]  # a long common prefix: chunked, then served from cache
    assert_greedy_matches_hf(llm, path, family, reference, GREEDY)
    assert_greedy_matches_hf(llm, path, family, reference, GREEDY)
    assert llm.stats()["num_cached_tokens"] >= 4 * 192


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_tp2_matches_hf(name, moe_dir, prompts, reference):
    path = moe_dir(name)
    with LLM(path, tensor_parallel_size=2, max_model_len=MAX_MODEL_LEN) as llm:
        assert_greedy_matches_hf(llm, path, prompts, reference, GREEDY)


# ---- the router and the reference expert computation ------------------------------------------
@pytest.mark.parametrize("renormalize", [True, False])
def test_route(renormalize):
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    weights, ids = route(logits, 3, renormalize)
    probs = logits.softmax(-1)
    assert ids.tolist() == probs.topk(3).indices.tolist()
    expected = probs.topk(3).values
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
    assert torch.allclose(weights, expected, atol=1e-6) and weights.dtype == torch.float32


def test_torch_experts_is_the_per_token_sum():
    g = torch.Generator().manual_seed(0)
    x, w13, w2 = torch.randn(6, 8, generator=g), torch.randn(4, 10, 8, generator=g), torch.randn(4, 8, 5, generator=g)
    weights, ids = route(torch.randn(6, 4, generator=g), 2, True)
    ids[0] = torch.tensor([3, 3])  # (an expert may be picked twice only by a test; it must still add up)
    expected = torch.zeros_like(x)
    for t in range(6):
        for j in range(2):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            expected[t] += weights[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    assert torch.allclose(torch_experts(x, w13, w2, weights, ids), expected, atol=1e-5)


# ---- checkpoints and configs that do not fit ----------------------------------------------------
@pytest.mark.parametrize("name, prefix", [("qwen3_moe", "model.layers.1.mlp.experts"),
                                          ("mixtral", "model.layers.0.block_sparse_moe.experts")])
def test_missing_or_extra_expert_tensors_are_clear_errors(name, prefix, moe_dir, tmp_path):
    path = moe_dir(name)
    up = "up_proj" if name == "qwen3_moe" else "w3"
    missing = edit_model(path, tmp_path / "missing", lambda t: t.pop(f"{prefix}.3.{up}.weight"))
    with pytest.raises(ValueError, match=r"no weights for .*experts\.3\.up"):
        LLM(missing, max_model_len=64)
    extra = edit_model(path, tmp_path / "extra",
                            lambda t: t.update({f"{prefix}.4.{up}.weight": t[f"{prefix}.0.{up}.weight"].clone()}))
    with pytest.raises(ValueError, match=rf"does not use: \['{prefix}\.4\.{up}\.weight'\]"):
        LLM(extra, max_model_len=64)
    wrong = edit_model(path, tmp_path / "wrong", lambda t: t.update({f"{prefix}.1.{up}.weight": torch.zeros(3, 64)}))
    with pytest.raises(ValueError, match=r"has shape \(3, 64\)"):
        LLM(wrong, max_model_len=64)


@pytest.mark.parametrize("option, value, words", [
    ("shared_expert_intermediate_size", 64, "shared experts are not supported"),
    ("scoring_func", "sigmoid", "scoring_func='sigmoid' is not supported"),
    ("topk_method", "noaux_tc", "topk_method='noaux_tc' is not supported"),
    ("num_experts_per_tok", 5, r"num_experts_per_tok=5 must be in \[1, 4\]"),
])
def test_unsupported_moe_options_are_refused(option, value, words, moe_dir, tmp_path):
    path = edit_model(moe_dir("qwen3_moe"), tmp_path / option, edit_config=lambda config: config.update({option: value}))
    with pytest.raises(ValueError, match=words):
        LLM(path, max_model_len=64)
