"""Quantized checkpoints and online FP8 (layers/quantization): each scheme computes exactly what
its dequantized weights compute (CPU, float32), stays near the unquantized model, shards under
tensor parallelism, and refuses what it cannot load with a ValueError naming it.

The checkpoints are made here in the published formats (utils/tiny_model.py): block FP8 as
Qwen3-*-FP8 (fp8 `weight` + `weight_scale_inv` per 128 x 128 block), AWQ as Qwen3-*-AWQ
(`qweight` / `qzeros` in AWQ's nibble order, fp16 `scales`). The tiny model is widened to 128
features and 128-wide heads so that every q/k/v and gate/up part, and each rank's share at
TP=2, is a whole number of 128-blocks and AWQ groups, as in the real models.
"""
import math

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers.linear import LinearBase
from nanovllm.utils.tiny_model import (build_model, dequantize_checkpoint, edit_model, fake_quantize_per_channel,
                                       quantize_checkpoint)

QUANT_SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=256)
MAX_LEN = 256
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
PROMPTS = [[1, 2, 3, 4, 5, 6], [7] * 40, list(range(100, 190))]
# How far a quantized model's next-token distributions are from the unquantized one's: the mean
# KL divergence (nats) over every prompt position, full vocabulary. Measured: fp8 block 0.026,
# fp8 per channel 0.023, AWQ int4 0.34 (round-to-nearest int4 of this tiny model's wide random
# weights, 0.2 std: its steps are coarse; real AWQ also rescales by activations). Bounds ~3x that.
NEAR_UNQUANTIZED_KL = {"fp8": 0.08, "fp8-online": 0.07, "awq": 1.0}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    base = build_model(str(root / "base"), **QUANT_SHAPE)
    fp8 = quantize_checkpoint(base, str(root / "fp8"), "fp8")
    awq = quantize_checkpoint(base, str(root / "awq"), "awq")
    return {"base": base, "fp8": fp8, "awq": awq,
            "fp8-dequantized": dequantize_checkpoint(fp8, str(root / "fp8-dq")),
            "awq-dequantized": dequantize_checkpoint(awq, str(root / "awq-dq")),
            "fp8-online-dequantized": fake_quantize_per_channel(base, str(root / "pc"))}


def generate(path, params=GREEDY, prompts=PROMPTS, **options):
    with LLM(path, max_model_len=MAX_LEN, **options) as llm:
        return llm.generate(prompts, params, use_tqdm=False)


def assert_same_output(got, expected, tol):
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
    for g, e in zip(got, expected):
        for mine, theirs in zip(g["logprobs"], e["logprobs"]):
            assert mine.keys() == theirs.keys() and all(abs(mine[t] - theirs[t]) < tol for t in mine)


# x @ W (AWQ) and F.linear(x, W^T) add in other orders: float32 rounding, measured 6e-6
SAME_ARITHMETIC_TOL = 1e-4


@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_a_quantized_checkpoint_computes_what_its_dequantized_weights_do(checkpoints, method):
    got = generate(checkpoints[method])
    assert_same_output(got, generate(checkpoints[f"{method}-dequantized"]), SAME_ARITHMETIC_TOL)
    assert [g["token_ids"] for g in got] != [e["token_ids"] for e in generate(checkpoints["base"])]  # (it is quantized)


def test_online_fp8_computes_the_per_channel_quantized_weights(checkpoints):
    got = generate(checkpoints["base"], quantization="fp8")
    assert_same_output(got, generate(checkpoints["fp8-online-dequantized"]), SAME_ARITHMETIC_TOL)


def next_token_distributions(path, **options) -> list[dict[int, float]]:
    """Every prompt position's log-probabilities over the whole vocabulary (512 tokens)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=512)
    return [position for o in generate(path, params, **options) for position in o["prompt_logprobs"][1:]]


@pytest.mark.parametrize("scheme", ["fp8", "fp8-online", "awq"])
def test_quantized_distributions_stay_near_the_unquantized_models(checkpoints, scheme):
    expected = next_token_distributions(checkpoints["base"])
    got = (next_token_distributions(checkpoints["base"], quantization="fp8") if scheme == "fp8-online"
           else next_token_distributions(checkpoints[scheme]))
    kl = [sum(math.exp(e[t]) * (e[t] - g[t]) for t in e) for g, e in zip(got, expected)]
    assert len(kl) == sum(len(p) - 1 for p in PROMPTS)
    assert 0 < sum(kl) / len(kl) < NEAR_UNQUANTIZED_KL[scheme], sum(kl) / len(kl)


@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_tensor_parallel_shards_quantized_layers(checkpoints, method):
    expected = generate(checkpoints[method])
    assert_same_output(generate(checkpoints[method], tensor_parallel_size=2), expected, SAME_ARITHMETIC_TOL)


def linear_weight_bytes(llm) -> int:
    return sum(p.numel() * p.element_size() for m in llm.model_runner.model.modules() if isinstance(m, LinearBase)
               for p in m.parameters(recurse=False))


def test_weight_memory_of_the_linear_layers(checkpoints):
    sizes = {}
    for name, path, options in [("bf16", checkpoints["base"], {"dtype": "bfloat16"}),
                                ("fp8", checkpoints["fp8"], {"dtype": "bfloat16"}),
                                ("fp8-online", checkpoints["base"], {"dtype": "bfloat16", "quantization": "fp8"}),
                                ("awq", checkpoints["awq"], {"dtype": "bfloat16"})]:
        with LLM(path, max_model_len=MAX_LEN, **options) as llm:
            sizes[name] = linear_weight_bytes(llm)
    # fp8: 1 byte a weight, plus a float32 scale per row (online) or per 128 x 128 block;
    # AWQ: half a byte, plus an fp16 scale and a 4-bit zero per 128 weights (0.26x)
    assert 0.5 <= sizes["fp8"] / sizes["bf16"] < 0.51
    assert 0.5 <= sizes["fp8-online"] / sizes["bf16"] < 0.52
    assert 0.25 <= sizes["awq"] / sizes["bf16"] < 0.27


def test_modules_to_not_convert_stay_unquantized(checkpoints, tmp_path):
    skip = ["model.layers.1.mlp.down_proj", "layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj",
            "layers.0.self_attn.v_proj"]
    path = quantize_checkpoint(checkpoints["base"], str(tmp_path / "partial"), "fp8", modules_to_not_convert=skip)
    with LLM(path, max_model_len=MAX_LEN) as llm:
        layers = llm.model_runner.model.model.layers
        assert layers[1].mlp.down_proj.quant_method is None and layers[0].self_attn.qkv_proj.quant_method is None
        assert layers[0].mlp.down_proj.quant_method is not None and layers[1].self_attn.qkv_proj.quant_method is not None
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_output(got, generate(dequantize_checkpoint(path, str(tmp_path / "partial-dq"))), SAME_ARITHMETIC_TOL)


def test_dummy_weights_of_every_scheme_generate(checkpoints):
    for path, options in [(checkpoints["base"], {"quantization": "fp8"}), (checkpoints["fp8"], {}),
                          (checkpoints["awq"], {})]:
        out = generate(path, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1),
                       load_format="dummy", **options)
        assert all(len(o["token_ids"]) == 4 and all(torch.isfinite(torch.tensor(list(lp.values()))).all()
                                                    for lp in o["logprobs"]) for o in out)


def test_dummy_quantized_checkpoints_hold_the_unquantized_draws_quantized(checkpoints):
    """load_format="dummy" on an FP8 block or AWQ checkpoint gives each layer the unquantized
    model's random weight, quantized (bench.py --probe-check relies on it): dequantized, every
    layer is within the scheme's rounding of the unquantized layer's weight."""
    from nanovllm.layers.quantization import awq, fp8

    def layers(path):
        llm = LLM(path, load_format="dummy", max_model_len=MAX_LEN)
        found = {n: m for n, m in llm.model_runner.model.named_modules() if isinstance(m, LinearBase)}
        llm.shutdown()
        return found
    base = layers(checkpoints["base"])
    # (relative to the largest |w|: half an fp8 step; an int4 step of a group whose range is twice that)
    for scheme, tol in (("fp8", 2 ** -4), ("awq", 2 / 15)):
        quantized = layers(checkpoints[scheme])
        assert quantized.keys() == base.keys()
        for name, layer in quantized.items():
            if layer.quant_method is None:
                continue
            if scheme == "fp8":
                w = fp8.dequantize_block(layer.weight, layer.weight_scale_inv, layer.quant_method.block, torch.float32)
            else:
                w = awq.dequantize(layer.qweight, layer.qzeros, layer.scales, layer.quant_method.group, torch.float32).T
            expected = base[name].weight.float()
            assert (w - expected).abs().max() <= tol * expected.abs().max(), (scheme, name)


# ---- what cannot be loaded ------------------------------------------------------------------------
def edit_quantization_config(edit):
    """edit_model's edit_config for an edit of config.json's quantization_config."""
    return lambda config: edit(config["quantization_config"])


def test_a_missing_scale_tensor_is_named(checkpoints, tmp_path):
    path = edit_model(checkpoints["fp8"], tmp_path / "m",
                           lambda t: t.pop("model.layers.1.self_attn.o_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match=r"no weights for .*layers\.1\.self_attn\.o_proj\.weight_scale_inv"):
        LLM(path, max_model_len=MAX_LEN)


def test_a_tensor_of_the_wrong_shape_is_named(checkpoints, tmp_path):
    def shrink(t):
        t["model.layers.0.mlp.up_proj.qzeros"] = t["model.layers.0.mlp.up_proj.qzeros"][:, :-1].contiguous()
    path = edit_model(checkpoints["awq"], tmp_path / "w", shrink)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.qzeros.* has shape \(1, 31\).*\(1, 32\)"):
        LLM(path, max_model_len=MAX_LEN)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(quant_method="gptq"), r"quant_method 'gptq'; supported: \['fp8', 'awq'\]"),
    (lambda c: c.update(bits=8), r"bits=8 .*supported"),
    (lambda c: c.update(group_size=64), r"group_size=64 .*supported"),
    (lambda c: c.update(zero_point=False), r"zero_point=False .*supported"),
], ids=["unknown-method", "awq-bits", "awq-group", "awq-symmetric"])
def test_an_unsupported_quantization_config_is_named(checkpoints, tmp_path, edit, message):
    path = edit_model(checkpoints["awq"], tmp_path / "c", edit_config=edit_quantization_config(edit))
    with pytest.raises(ValueError, match=message):
        LLM(path, max_model_len=MAX_LEN)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("weight_block_size"), r"weight_block_size \[128, 128\]"),
    (lambda c: c.update(activation_scheme="static"), r"activation_scheme 'static'"),
], ids=["per-tensor-fp8", "static-activations"])
def test_an_unsupported_fp8_checkpoint_is_named(checkpoints, tmp_path, edit, message):
    path = edit_model(checkpoints["fp8"], tmp_path / "c", edit_config=edit_quantization_config(edit))
    with pytest.raises(ValueError, match=message):
        LLM(path, max_model_len=MAX_LEN)


def test_the_quantization_argument_is_checked(checkpoints, model_dir):
    with pytest.raises(ValueError, match=r"quantization must be None or one of \['fp8', 'awq'\], got 'int8'"):
        LLM(model_dir, quantization="int8")
    with pytest.raises(ValueError, match=r"quantization='fp8' contradicts the checkpoint.*'awq'"):
        LLM(checkpoints["awq"], quantization="fp8")
    with pytest.raises(ValueError, match=r"quantization='awq' needs an AWQ checkpoint"):
        LLM(model_dir, quantization="awq")
    generate(checkpoints["awq"], SamplingParams(max_tokens=1), quantization="awq")  # naming the same method is fine


def test_a_shape_that_blocks_cannot_split_is_refused(model_dir, tmp_path):
    # the default tiny model's k and v projections are 32 rows: no whole 128-row block
    path = quantize_checkpoint(model_dir, str(tmp_path / "small"), "fp8")
    with pytest.raises(ValueError, match=r"multiple of 128, got \[64, 32, 32\]"):
        LLM(path)


# ---- the formats, pinned by their published definitions ------------------------------------------
def test_awq_words_hold_their_columns_in_autoawqs_order():
    # AutoAWQ's packer: for i in range(8): word |= column[8 c + ORDER[i]] << 4 i, ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    from nanovllm.layers.quantization import awq
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    values = torch.tensor([[3, 14, 1, 5, 9, 2, 6, 15]])
    word = sum(int(values[0, order[i]]) << (4 * i) for i in range(8))
    assert awq.pack(values).item() == word - (1 << 32)           # (the top nibble 15 makes the int32 negative)
    assert awq.unpack(awq.pack(values)).tolist() == values.tolist()


def test_block_fp8_scales_multiply_their_128_by_128_block():
    # Qwen3-*-FP8: w[o, i] = weight[o, i] * weight_scale_inv[o // 128, i // 128] (it multiplies, despite its name)
    from nanovllm.layers.quantization import fp8
    w = torch.randn(200, 300) * torch.logspace(-2, 1, 300)
    q, scale_inv = fp8.quantize_block(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 3)
    rows, cols = torch.arange(200)[:, None] // 128, torch.arange(300)[None, :] // 128
    back = q.float() * scale_inv[rows, cols]
    # e4m3 has 3 mantissa bits (half a step: 1/16 of the value) and subnormal steps of 2^-9
    assert ((back - w).abs() <= w.abs() / 16 + scale_inv[rows, cols] * 2 ** -10).all()
    assert torch.equal(fp8.dequantize_block(q, scale_inv, (128, 128), torch.float32), back)


def test_online_fp8_of_a_mixture_of_experts(tmp_path):
    # experts quantized per output channel too (through the fused experts), the router not
    moe = build_model(str(tmp_path / "moe"), arch="qwen3_moe")
    with LLM(moe, max_model_len=MAX_LEN, quantization="fp8") as llm:
        layer = llm.model_runner.model.model.layers[0]
        assert layer.mlp.experts.w13.dtype == torch.float8_e4m3fn and layer.mlp.gate.weight.dtype == torch.float32
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_output(got, generate(fake_quantize_per_channel(moe, str(tmp_path / "moe-pc"))), SAME_ARITHMETIC_TOL)


def test_an_all_zero_row_gets_a_finite_scale_and_dequantizes_to_zeros():
    """Per-channel FP8 of a weight with an all-zero row: its scale is floored (MIN_SCALE), not
    0 (whose 0 / 0 would be NaN in every entry), and the row comes back as zeros; the other rows
    as before (their largest |w| maps to 448 exactly)."""
    from nanovllm.layers.quantization.fp8 import FP8_MAX, dequantize_per_channel, quantize_per_channel
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    w[2] = 0.0
    q, scale = quantize_per_channel(w)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.isfinite(q.float()).all()
    back = dequantize_per_channel(q, scale, torch.float32)
    assert torch.equal(back[2], torch.zeros(64))
    others = [0, 1, 3]
    assert torch.equal(scale[others], w[others].abs().amax(1) / FP8_MAX)
    assert (back[others] - w[others]).abs().max() <= 0.07 * w[others].abs().max()  # (e4m3: 3 mantissa bits)


def test_online_fp8_of_a_model_with_an_all_zero_row_stays_finite(checkpoints, tmp_path):
    """End to end: a checkpoint whose o_proj and down_proj have an all-zero output row (a pruned
    channel), quantized online: finite logprobs, and the output of its per-channel-quantized
    weights computed unquantized."""
    def zero_rows(tensors):
        tensors["model.layers.0.self_attn.o_proj.weight"][5] = 0.0
        tensors["model.layers.1.mlp.down_proj.weight"][0] = 0.0
    path = edit_model(checkpoints["base"], str(tmp_path / "zero-rows"), zero_rows)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    got = generate(path, params, quantization="fp8")
    assert all(math.isfinite(v) for o in got for lp in o["logprobs"] for v in lp.values())
    reference = fake_quantize_per_channel(path, str(tmp_path / "zero-rows-pc"))
    assert_same_output(got, generate(reference, params), SAME_ARITHMETIC_TOL)
