"""gpt-oss (models/gpt_oss.py, layers/attention_sinks.py, layers/scaled_rope.py, MXFP4 in
layers/quantization/mxfp4.py): tiny random models built with transformers equal Hugging Face
greedy token for token (float32, CPU) with prompts far longer than the window of 16, chunked
prefill, prefix caching, preemption and TP=2; an MXFP4 checkpoint equals HF on the weights
transformers' own dequantization gives; the pieces against their formulas; bad input refused."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # (the triton backend's refusal below builds it on CPU: interpreted)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_reference import assert_greedy_matches_hf, assert_logprobs_equal_hf, assert_prefix_cache_and_preemption
from nanovllm import LLM, SamplingParams
from nanovllm.layers.sliding_window import attend_with_sinks
from nanovllm.layers.quantization import mxfp4
from nanovllm.utils.tiny_model import GPT_OSS_SETTINGS, edit_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
WINDOW = GPT_OSS_SETTINGS["sliding_window"]
MODELS = {
    # sliding, full: gpt-oss's alternation; 4 experts, 2 a token, the SwiGLU clamped at 1.5
    "gpt_oss": ("gpt_oss", 0, {}),
    # four layers, one KV head (copied to both ranks under TP=2), a tied head
    "gpt_oss_mqa": ("gpt_oss", 1, dict(num_hidden_layers=4, num_key_value_heads=1, tie_word_embeddings=True)),
}


@pytest.fixture
def oss_dir(tiny_models):
    return lambda name: tiny_models(MODELS, name)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("options", [{}, dict(max_num_batched_tokens=64, kvcache_block_size=16)],
                         ids=["plain", "chunked-prefill"])
def test_gpt_oss_matches_hf(oss_dir, prompts, reference, name, options):
    path = oss_dir(name)
    assert max(map(len, prompts)) > 10 * WINDOW
    with LLM(path, max_model_len=400, **options) as llm:
        assert_greedy_matches_hf(llm, path, prompts, reference, GREEDY)


def test_gpt_oss_logprobs_equal_hf(oss_dir, prompts):
    assert_logprobs_equal_hf(oss_dir("gpt_oss"), prompts[2:6], max_model_len=400)


def test_gpt_oss_prefix_cache_and_preemption(oss_dir, prompts, reference):
    assert_prefix_cache_and_preemption(oss_dir("gpt_oss"), prompts, reference)


def test_gpt_oss_tp2_matches_hf(oss_dir, prompts, reference):
    """Heads, sinks and the experts' intermediate rows split across two ranks (gloo); the down
    projection's bias added once."""
    path = oss_dir("gpt_oss_mqa")
    with LLM(path, tensor_parallel_size=2, max_model_len=400, max_num_batched_tokens=64,
             kvcache_block_size=16) as llm:
        assert_greedy_matches_hf(llm, path, prompts, reference, GREEDY)


# ---- MXFP4 checkpoints ----------------------------------------------------------------------------

def mxfp4_checkpoint(src: str, dst) -> str:
    """src's experts as the published checkpoints hold them: {gate_up,down}_proj_blocks / _scales,
    [E, out, in / 32, 16] and [E, out, in / 32], from transformers' [E, in, out]."""
    def convert(tensors: dict):
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = mxfp4.quantize(tensors.pop(name).transpose(1, 2).contiguous())
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales

    quantization = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    return edit_model(src, str(dst), convert, lambda config: config.update(quantization_config=quantization))


def dequantized_by_transformers(src: str, dst) -> str:
    """The float32 checkpoint transformers' convert_moe_packed_tensors makes of an MXFP4 one."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    def convert(tensors: dict):
        for name in [n for n in tensors if n.endswith("_blocks")]:
            base = name[:-len("_blocks")]
            tensors[base] = convert_moe_packed_tensors(tensors.pop(name), tensors.pop(f"{base}_scales"),
                                                       dtype=torch.float32).contiguous()

    return edit_model(src, str(dst), convert, lambda config: config.pop("quantization_config"))


def test_an_mxfp4_checkpoint_equals_hf_on_transformers_dequantized_weights(oss_dir, prompts, reference, tmp_path):
    packed = mxfp4_checkpoint(oss_dir("gpt_oss"), tmp_path / "mxfp4")
    plain = dequantized_by_transformers(packed, tmp_path / "plain")
    with LLM(packed, max_model_len=400, max_num_batched_tokens=64, kvcache_block_size=16) as llm:
        assert_greedy_matches_hf(llm, plain, prompts, reference, GREEDY)
    # (so that it can fail:) the quantization changes the answers of the unquantized model
    with LLM(packed, max_model_len=400) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert any(o["token_ids"] != reference(oss_dir("gpt_oss"), p, 16) for o, p in zip(outputs, prompts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantize_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 48, 96, generator=g) * 0.3
    weight[0, 0, :32] = 0  # an all-zero group
    blocks, scales = mxfp4.quantize(weight)
    assert blocks.shape == (3, 48, 3, 16) and scales.shape == (3, 48, 3) and blocks.dtype == torch.uint8
    ours = mxfp4.dequantize(blocks, scales, dtype)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2))
    # a group's scale u = 2 ** (floor(log2 max|w|) - 2) puts its values within 8u; rounded to the
    # nearest element (4u and 6u are 2u apart) or clamped at 6u, each is within 2u of its weight
    unit = torch.ldexp(torch.ones_like(scales, dtype=torch.float32), scales.int() - 127).repeat_interleave(32, -1)
    assert ((ours.float() - weight).abs() <= 2 * unit).all()
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(ours.float()), dtype), ours)


def test_mxfp4_tensors_are_checked(oss_dir, tmp_path):
    packed = mxfp4_checkpoint(oss_dir("gpt_oss"), tmp_path / "mxfp4")
    no_scales = edit_model(packed, str(tmp_path / "no_scales"),
                           lambda t: t.pop("model.layers.1.mlp.experts.down_proj_scales"))
    with pytest.raises(ValueError, match=r"no weights for \['model.layers.1.mlp.experts.down_proj_scales'\]"):
        LLM(no_scales)
    unflagged = edit_model(packed, str(tmp_path / "unflagged"), edit_config=lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match=r"an MXFP4 (gate_up|down)_proj_blocks tensor, but config.json has no quantization"):
        LLM(unflagged)
    with pytest.raises(ValueError, match=r"quant_method 'mxfp4' is supported for \['gpt_oss'\] checkpoints"):
        LLM(edit_model(packed, str(tmp_path / "llama"), edit_config=lambda c: c.update(model_type="llama")))


# ---- the pieces ---------------------------------------------------------------------------------

def test_attend_with_sinks_equals_the_formula():
    """p_j = exp(l_j) / (exp(s_h) + sum_i exp(l_i)); a sink far above the scores sends out to 0."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 8, generator=g), torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    sinks = torch.tensor([0.0, 1.0, -2.0, 3.0])
    mask = torch.arange(5)[None, :] <= torch.arange(2, 5)[:, None]
    got = attend_with_sinks(q, k, v, 0.3, mask, sinks)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for i in range(3):
        for h in range(4):
            logits = (kk[:i + 3, h] @ q[i, h]) * 0.3
            weights = logits.exp() / (logits.exp().sum() + sinks[h].exp())
            torch.testing.assert_close(got[i, h], weights @ vv[:i + 3, h], rtol=1e-5, atol=1e-6)
    assert attend_with_sinks(q, k, v, 0.3, mask, torch.full((4,), 1e4)).abs().max() == 0


def test_yarn_tables_equal_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
    from nanovllm.layers.rotary_embedding import rope_parameters
    from nanovllm.layers.scaled_rope import scaled_rotary_embedding
    for truncate in (False, True):
        params = dict(GPT_OSS_SETTINGS["rope_parameters"], truncate=truncate)
        config = GptOssConfig(head_dim=16, num_attention_heads=4, hidden_size=64, rope_parameters=params,
                              max_position_embeddings=1024)
        hf = GptOssRotaryEmbedding(config)
        positions = torch.arange(1024)[None]
        cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions)
        ours = scaled_rotary_embedding(16, 1024, rope_parameters(config))
        assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0])
        assert hf.attention_scaling > 1


# ---- refused ------------------------------------------------------------------------------------

def edited(src, dst, **changes) -> str:
    return edit_model(src, str(dst), edit_config=lambda config: config.update(changes))


@pytest.mark.parametrize("changes, match", [
    (dict(layer_types=["sliding_attention", "chunked_attention"]),
     r"layer type\(s\) \['chunked_attention'\] in config.layer_types are not supported for gpt-oss"),
    (dict(num_experts_per_tok=5), r"num_experts_per_tok=5 must be in \[1, num_local_experts=4\]"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     r"rope_type 'dynamic' is not supported"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
     r"gpt-oss checkpoints quantized by 'fp8' are not supported"),
])
def test_bad_configs_are_refused(oss_dir, tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        LLM(edited(oss_dir("gpt_oss"), tmp_path / "bad", **changes))


def test_a_max_model_len_beyond_the_models_positions_is_refused(oss_dir):
    """Asked for, it is a ValueError naming both (a sliding window hides nothing past the positions
    RoPE was trained for); the default 4096 is capped at the model's 1024."""
    with pytest.raises(ValueError, match=r"max_model_len=2048 is beyond max_position_embeddings=1024"):
        LLM(oss_dir("gpt_oss"), max_model_len=2048)
    with LLM(oss_dir("gpt_oss")) as llm:
        assert llm.config.max_model_len == 1024


def test_gpt_oss_on_the_triton_backend_matches_hf(oss_dir, prompts, reference):
    """The Triton kernels' sink term (under the interpreter on CPU): prefill chunks over cached
    blocks, and decode rows, whose contexts split-KV splits (the sink added in the reduction)."""
    pytest.importorskip("triton", reason="triton is not installed")
    path = oss_dir("gpt_oss")
    with LLM(path, attention_backend="triton", device="cpu", max_model_len=400, max_num_batched_tokens=64,
             kvcache_block_size=16) as llm:
        assert_greedy_matches_hf(llm, path, prompts[3:6], reference, GREEDY)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [0, 5])
def test_triton_decode_with_sinks_equals_the_reference(num_splits, window):
    """One split (the sink added in the decode kernel) and three (in the reduction), full and windowed."""
    pytest.importorskip("triton", reason="triton is not installed")
    from nanovllm.layers.backends.triton_attn import decode
    g = torch.Generator().manual_seed(num_splits + window)
    lengths, heads, kv_heads, dim, block = [1, 40, 77], 4, 2, 16, 16
    k_cache, v_cache = (torch.randn(15, block, kv_heads, dim, generator=g) for _ in range(2))
    tables = torch.randperm(15, generator=g).view(3, 5).int()
    q = torch.randn(3, heads, dim, generator=g)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    got = decode(q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32), tables, 0.25,
                 num_splits=num_splits, window=window, sinks=sinks)
    for b, length in enumerate(lengths):
        k, v = (c[tables[b].long()].flatten(0, 1)[:length] for c in (k_cache, v_cache))
        visible = torch.arange(length)[None, :] > length - 1 - (window or length + 1)
        expected = attend_with_sinks(q[b:b + 1], k, v, 0.25, visible, sinks)
        torch.testing.assert_close(got[b:b + 1], expected, rtol=1e-4, atol=1e-5)


def test_sinks_are_refused_on_flash_attn(oss_dir, fake_flash_attn):
    with pytest.raises(ValueError, match=r"attention sinks \(gpt-oss\) run on attention_backend='torch' or "
                                         r"'triton', not on 'FlashAttnBackend'"):
        LLM(oss_dir("gpt_oss"), attention_backend="flash_attn", kvcache_block_size=256)
