"""FP8 experts: the fused kernel against torch_experts on the dequantized weights (per output
channel and 128 x 128 blocks), a Qwen3-MoE checkpoint in the published block format loaded into
FusedExperts (and greedy output token for token equal to the same model with the dequantized
weights saved in float32), quantization="fp8" of an unquantized checkpoint after loading, tensor
parallel slices of whole blocks, and the checkpoints and configurations that are refused.

Kernels run under Triton's interpreter on CPU (TRITON_INTERPRET=1, set before anything imports
triton, as in test_moe_kernel.py); on a CUDA machine the same tests run the compiled kernels.

Models are built as the engine builds them: in the scope of the engine's QuantizationConfig.
"""
import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.layers.moe import FusedExperts, route, torch_experts  # noqa: E402
from nanovllm.layers.linear import quantization_scope  # noqa: E402
from nanovllm.layers.quantization import QuantizationConfig, fp8  # noqa: E402
from nanovllm.models.mixtral import MixtralForCausalLM  # noqa: E402
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402
from nanovllm.models.sparse import num_experts_of  # noqa: E402
from nanovllm.utils.loader import load_model  # noqa: E402
from nanovllm.utils.parallel import tensor_parallel  # noqa: E402
from nanovllm.utils.tiny_model import edit_model  # noqa: E402

try:
    from nanovllm.layers import moe_triton
    INTERPRETED = type(moe_triton._gate_up_kernel).__name__ == "InterpretedFunction"
    KERNEL_DEVICE = "cpu" if INTERPRETED else "cuda"
    kernel_missing = KERNEL_DEVICE == "cuda" and not torch.cuda.is_available()
    kernel_reason = "moe_triton was imported compiled (TRITON_INTERPRET off) and there is no CUDA device"
except ImportError:
    moe_triton, KERNEL_DEVICE, kernel_missing = None, None, True
    kernel_reason = "triton is not installed: the fused MoE kernel is untested here"
needs_kernel = pytest.mark.skipif(kernel_missing, reason=kernel_reason)

BLOCK = (128, 128)
ONLINE = QuantizationConfig("fp8", serialized=False)
SERIALIZED = QuantizationConfig("fp8", serialized=True, weight_block_size=BLOCK)
# float32 activations: the kernel computes sum_k(x q) * s where the reference computes
# sum_k(x (q s)); the two differ by float32 rounding only.
FP32_ATOL, FP32_RTOL = 1e-4, 1e-4
# float16 activations against the float32 reference on the same (fp16-rounded) inputs: mid [P, I]
# is stored in fp16 between the two kernels. The spread block scales make outputs up to ~60 (mean
# ~4); measured: max error 0.02, relative (Frobenius) error 3e-4.
FP16_ATOL, FP16_RTOL, FP16_REL_ERROR = 5e-2, 1e-2, 2e-3
# quantization="fp8" against the unquantized experts: e4m3 keeps 3 mantissa bits (a weight's
# relative error up to 2^-4); the layer output's relative (Frobenius) error measures ~0.03-0.05.
ONLINE_REL_ERROR = 0.08

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# A tiny Qwen3-MoE whose expert sizes are whole 128 x 128 blocks (hidden 128, experts 256 wide, so
# that TP=2 still gets whole blocks); every layer sparse.
MODELS = {"qwen3_moe_fp8_sizes": ("qwen3_moe", 11, dict(hidden_size=128, moe_intermediate_size=256, head_dim=32,
                                                        decoder_sparse_step=1, norm_topk_prob=True))}
# What a block FP8 checkpoint's config.json says (as Qwen3's FP8 checkpoints); only the experts
# of the test checkpoints are quantized, so everything else is listed as not converted.
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": list(BLOCK),
                       "modules_to_not_convert": ["embed_tokens", "self_attn", "mlp.gate", "lm_head"]}


# ---- helpers ---------------------------------------------------------------------------------
def quantize_stack(w: torch.Tensor, block):
    """[E, N, K] -> (fp8 [E, N, K], scales per expert: [E, N] per channel, [E, N/bn, K/bk] per block)."""
    parts = [fp8.quantize_block(e, block) if block else fp8.quantize_per_channel(e) for e in w]
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


def dequantize_stack(q: torch.Tensor, scale: torch.Tensor, block, dtype=torch.float32) -> torch.Tensor:
    if block:
        return torch.stack([fp8.dequantize_block(qe, se, block, dtype) for qe, se in zip(q, scale)])
    return torch.stack([fp8.dequantize_per_channel(qe, se, dtype) for qe, se in zip(q, scale)])


def spread_blocks(w: torch.Tensor, gen, block=BLOCK) -> torch.Tensor:
    """w [E, N, K] with each 128 x 128 block scaled by its own factor in [1/8, 8], so that a scale
    read from the wrong block gives a visibly wrong result."""
    num_experts, n, k = w.shape
    factors = 2.0 ** (torch.rand(num_experts, -(-n // block[0]), -(-k // block[1]), generator=gen) * 6 - 3)
    return w * torch.stack([fp8.expand_block_scales(f, (n, k), block) for f in factors])


def random_ids(num_tokens, num_experts, top_k, gen):
    return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])


def make_problem(num_experts, top_k, num_tokens, hidden, inter, block, seed, device):
    """Random routed tokens and fp8 experts: (x, q13, s13, q2, s2, weights, ids), on device."""
    gen = torch.Generator().manual_seed(seed)
    w13 = spread_blocks(torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5, gen)
    w2 = spread_blocks(torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5, gen)
    q13, s13 = quantize_stack(w13, block)
    q2, s2 = quantize_stack(w2, block)
    x = torch.randn(num_tokens, hidden, generator=gen)
    ids = random_ids(num_tokens, num_experts, top_k, gen)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return tuple(t.to(device) for t in (x, q13, s13, q2, s2, weights, ids))


def quantized_model(config, quantization):
    """Qwen3-MoE built as the engine builds it, in the scope of `quantization`."""
    with quantization_scope(quantization):
        return Qwen3MoeForCausalLM(config, 64)


def expert_names(prefix, expert):
    return [f"{prefix}.experts.{expert}.{p}_proj.weight" for p in ("gate", "up", "down")]


def quantize_experts_to_blocks(tensors: dict):
    """Every expert weight -> its fp8 weight and float32 weight_scale_inv (the published format)."""
    for name in [n for n in tensors if ".experts." in n]:
        tensors[name], tensors[name + "_scale_inv"] = fp8.quantize_block(tensors[name], BLOCK)


def dequantize_experts_from_blocks(tensors: dict):
    """Every fp8 expert weight and its scale -> the float32 weight they stand for."""
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        weight = name.removesuffix("_scale_inv")
        tensors[weight] = fp8.dequantize_block(tensors[weight], tensors.pop(name), BLOCK, torch.float32)


def packed_from_checkpoint(tensors: dict, prefix: str, num_experts: int):
    """A layer's experts as torch_experts takes them (w13 [E, 2I, H], w2 [E, H, I]), dequantized
    from the checkpoint's own tensors: independent of FusedExperts' loader."""
    def deq(name):
        return fp8.dequantize_block(tensors[name], tensors[name + "_scale_inv"], BLOCK, torch.float32)
    names = [expert_names(prefix, e) for e in range(num_experts)]
    w13 = torch.stack([torch.cat([deq(gate), deq(up)]) for gate, up, _ in names])
    w2 = torch.stack([deq(down) for _, _, down in names])
    return w13, w2


@pytest.fixture(scope="module")
def fp8_models(tiny_models, tmp_path_factory):
    """(unquantized folder, block FP8 folder, the FP8 one dequantized to float32)."""
    path = tiny_models(MODELS, "qwen3_moe_fp8_sizes")
    root = tmp_path_factory.mktemp("fp8_models")
    block = edit_model(path, root / "block_fp8", quantize_experts_to_blocks,
                       lambda config: config.update(quantization_config=QUANTIZATION_CONFIG))
    dequantized = edit_model(block, root / "dequantized", dequantize_experts_from_blocks,
                             lambda config: config.pop("quantization_config"))
    return path, block, dequantized


def load_fused_experts(tensors: dict, prefix: str, config, quantization, group=None) -> FusedExperts:
    """One layer's FusedExperts (on the TP rank of `group`), its checkpoint tensors routed by the
    model's checkpoint_target into weight_loader, as load_model does."""
    router = Qwen3MoeForCausalLM(config, 64)
    with tensor_parallel(group):
        experts = FusedExperts(num_experts_of(config), config.hidden_size, config.moe_intermediate_size, quantization)
    for name, tensor in tensors.items():
        if name.startswith(f"{prefix}.experts."):
            target, shard_id = router.checkpoint_target(name)
            experts.weight_loader(getattr(experts, target.rpartition(".")[2]), tensor, shard_id)
    return experts


# ---- the kernel against the reference --------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("num_experts,top_k,num_tokens", [(1, 1, 5), (4, 2, 1), (4, 2, 33), (8, 3, 17)])
@pytest.mark.parametrize("block", [None, BLOCK], ids=["per_channel", "block"])
def test_kernel_matches_reference_on_dequantized_weights(block, num_experts, top_k, num_tokens):
    """Ragged tokens per expert; hidden 160 leaves a partial last block (of w13's input and w2's
    output), intermediate 256 gives two block columns of w2; per channel, odd sizes (48, 40)."""
    hidden, inter = (160, 256) if block else (48, 40)
    x, q13, s13, q2, s2, weights, ids = make_problem(num_experts, top_k, num_tokens, hidden, inter, block,
                                                     seed=num_experts * 100 + num_tokens, device=KERNEL_DEVICE)
    out = moe_triton.triton_experts(x, q13, q2, weights, ids, s13, s2, block)
    ref = torch_experts(x, dequantize_stack(q13, s13, block), dequantize_stack(q2, s2, block), weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=FP32_ATOL, rtol=FP32_RTOL)


@needs_kernel
@pytest.mark.parametrize("block", [None, BLOCK], ids=["per_channel", "block"])
def test_kernel_with_16_bit_activations(block):
    """The fp8 tile converted to the activations' 16-bit dtype (float16: the interpreter has no
    bfloat16 dot; the GPU test below covers bfloat16)."""
    x, q13, s13, q2, s2, weights, ids = make_problem(4, 2, 20, 160, 256, block, seed=5, device=KERNEL_DEVICE)
    x = x.half()
    out = moe_triton.triton_experts(x, q13, q2, weights, ids, s13, s2, block).float().cpu()
    ref = torch_experts(x.float(), dequantize_stack(q13, s13, block), dequantize_stack(q2, s2, block),
                        weights, ids).cpu()
    torch.testing.assert_close(out, ref, atol=FP16_ATOL, rtol=FP16_RTOL)
    assert ((out - ref).norm() / ref.norm()).item() < FP16_REL_ERROR


@needs_kernel
def test_kernel_refuses_what_it_cannot_compute():
    x, q13, s13, q2, s2, weights, ids = make_problem(2, 1, 3, 160, 256, BLOCK, seed=0, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="come with both w13_scale and w2_scale"):
        moe_triton.triton_experts(x, q13, q2, weights, ids)
    with pytest.raises(ValueError, match=r"scales of shape \(2, 3, 2\) for weights \(2, 512, 160\) in"):
        moe_triton.triton_experts(x, q13, q2, weights, ids, s13[:, :3], s2, BLOCK)
    with pytest.raises(ValueError, match=r"block's 48 columns a multiple of BLOCK_K=32; block \(128, 48\)"):
        moe_triton.triton_experts(x, q13, q2, weights, ids, s13, s2, (128, 48))


@pytest.mark.parametrize("block", [None, BLOCK], ids=["per_channel", "block"])
def test_reference_is_torch_experts_on_the_dequantized_weights(block):
    """Exactly: what the CPU computes for FP8 experts is today's arithmetic on the weights they
    stand for."""
    x, q13, s13, q2, s2, weights, ids = make_problem(4, 2, 9, 160, 256, block, seed=1, device="cpu")
    ref = torch_experts(x, dequantize_stack(q13, s13, block), dequantize_stack(q2, s2, block), weights, ids)
    assert torch.equal(torch_experts(x, q13, q2, weights, ids, s13, s2, block), ref)


# ---- block FP8 checkpoints -------------------------------------------------------------------
def test_block_checkpoint_loads_into_fused_experts(fp8_models):
    _, block_dir, _ = fp8_models
    config = AutoConfig.from_pretrained(block_dir)
    quantization = QuantizationConfig.resolve(None, config)
    assert quantization.serialized and quantization.weight_block_size == BLOCK
    model = quantized_model(config, quantization)
    load_model(model, block_dir, show_progress=False)
    tensors = load_file(os.path.join(block_dir, "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        assert experts.w13.dtype == experts.w2.dtype == fp8.FP8
        assert experts.w13_scale_inv.shape == (4, 2 * 256 // 128, 1) and experts.w2_scale_inv.shape == (4, 1, 2)
        assert layer.mlp.gate.weight.dtype == torch.float32                 # the router is not quantized
        x = torch.randn(13, 128, generator=gen)
        weights, ids = route(layer.mlp.gate(x), config.num_experts_per_tok, True)
        w13, w2 = packed_from_checkpoint(tensors, f"model.layers.{i}.mlp", 4)
        assert torch.equal(layer.mlp(x), torch_experts(x, w13, w2, weights, ids))


def test_block_checkpoint_greedy_equals_the_dequantized_float32_model(fp8_models, prompts):
    """The engine end to end: the FP8 checkpoint and the float32 one holding its dequantized
    weights give the same tokens (on CPU, where the FP8 experts compute exactly the dequantized
    ones; the kernel's float32 rounding differs slightly)."""
    _, block_dir, dequantized_dir = fp8_models
    batch = [p[:40] for p in prompts[:5]]
    with LLM(dequantized_dir, device="cpu", max_model_len=128) as llm:
        expected = [o["token_ids"] for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    with LLM(block_dir, device="cpu", max_model_len=128) as llm:
        assert all(layer.mlp.experts.w13.dtype == fp8.FP8 for layer in llm.model_runner.model.model.layers)
        assert [o["token_ids"] for o in llm.generate(batch, GREEDY, use_tqdm=False)] == expected


def test_missing_scale_is_reported(fp8_models, tmp_path):
    _, block_dir, _ = fp8_models
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    missing = edit_model(block_dir, tmp_path / "missing", lambda t: t.pop(name))
    config = AutoConfig.from_pretrained(missing)
    with pytest.raises(ValueError, match=r"no weights for \['model\.layers\.1\.mlp\.experts\.experts\.2\.up\."
                                         r"weight_scale_inv'\]"):
        load_model(quantized_model(config, QuantizationConfig.resolve(None, config)), missing, show_progress=False)
    tensors = load_file(os.path.join(missing, "model.safetensors"))
    experts = load_fused_experts(tensors, "model.layers.1.mlp", config, SERIALIZED)
    assert experts.missing_shards() == ["experts.2.up.weight_scale_inv"]


def test_tensor_parallel_ranks_hold_whole_blocks(fp8_models):
    """TP=2 over experts 256 wide: each rank one 128-wide block of gate, of up and of down's input;
    the ranks' partial outputs add up to the whole layer's."""
    _, block_dir, _ = fp8_models
    config = AutoConfig.from_pretrained(block_dir)
    tensors = load_file(os.path.join(block_dir, "model.safetensors"))
    prefix = "model.layers.0.mlp"
    whole = load_fused_experts(tensors, prefix, config, SERIALIZED)
    ranks = [load_fused_experts(tensors, prefix, config, SERIALIZED, SimpleNamespace(rank=r, size=2)) for r in (0, 1)]
    up_scale = tensors[f"{prefix}.experts.3.up_proj.weight_scale_inv"]                # [2, 1]
    down_scale = tensors[f"{prefix}.experts.3.down_proj.weight_scale_inv"]            # [1, 2]
    for r, experts in enumerate(ranks):
        assert experts.w13.shape == (4, 256, 128) and experts.w13_scale_inv.shape == (4, 2, 1)
        assert not experts.missing_shards()
        assert torch.equal(experts.w13_scale_inv[3, 1], up_scale[r])                  # its block of up
        assert torch.equal(experts.w2_scale_inv[3], down_scale[:, r:r + 1])           # of down's input
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(11, 128, generator=gen)
    weights, ids = route(torch.randn(11, 4, generator=gen), 2, True)
    torch.testing.assert_close(sum(experts(x, weights, ids) for experts in ranks), whole(x, weights, ids),
                               atol=FP32_ATOL, rtol=FP32_RTOL)


# ---- quantization="fp8" of an unquantized checkpoint -----------------------------------------
def test_online_fp8_quantizes_per_channel_after_loading(fp8_models):
    path, _, _ = fp8_models
    config = AutoConfig.from_pretrained(path)
    model = quantized_model(config, ONLINE)
    load_model(model, path, show_progress=False)  # (which quantizes once every tensor is in)
    reference = Qwen3MoeForCausalLM(config, 64)
    load_model(reference, path, show_progress=False)
    gen = torch.Generator().manual_seed(3)
    for layer, ref_layer in zip(model.model.layers, reference.model.layers):
        experts = layer.mlp.experts
        assert experts.w13.dtype == experts.w2.dtype == fp8.FP8
        assert experts.w13_scale.shape == (4, 512) and experts.w2_scale.shape == (4, 128)
        assert {n: p.dtype for n, p in experts.named_parameters()} == {
            "w13": fp8.FP8, "w2": fp8.FP8, "w13_scale": torch.float32, "w2_scale": torch.float32}
        w13, w2, s13, s2 = experts.w13, experts.w2, experts.w13_scale, experts.w2_scale
        experts.process_weights_after_loading()                                  # a second call: no-op
        assert experts.w13 is w13 and experts.w13_scale is s13

        x = torch.randn(17, 128, generator=gen)
        out, ref = layer.mlp(x), ref_layer.mlp(x)
        weights, ids = route(layer.mlp.gate(x), config.num_experts_per_tok, True)
        assert torch.equal(out, torch_experts(x, dequantize_stack(w13, s13, None), dequantize_stack(w2, s2, None),
                                              weights, ids))
        assert ((out - ref).norm() / ref.norm()).item() < ONLINE_REL_ERROR
        assert not torch.equal(out, ref)


# ---- what is refused -------------------------------------------------------------------------
def test_refused_configurations():
    with pytest.raises(ValueError, match="AWQ MoE checkpoints are not supported"):
        FusedExperts(4, 128, 256, QuantizationConfig("awq", serialized=True))
    with pytest.raises(ValueError, match=r"whole 128x128 blocks: intermediate size 256 / tensor_parallel_size 4 = "
                                         r"64 is not a multiple of 128"):
        with tensor_parallel(SimpleNamespace(rank=0, size=4)):
            FusedExperts(4, 128, 256, SERIALIZED)
    experts = FusedExperts(4, 128, 256, SERIALIZED)
    with pytest.raises(ValueError, match="expert 1's up weight is torch.float32"):
        experts.weight_loader(experts.w13, torch.zeros(256, 128), (1, "up"))


def test_scale_names_are_routed(fp8_models):
    path, _, _ = fp8_models
    qwen = Qwen3MoeForCausalLM(AutoConfig.from_pretrained(path), 64)
    assert qwen.checkpoint_target("model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv") == (
        "model.layers.0.mlp.experts.w13_scale_inv", (3, "gate"))
    assert qwen.checkpoint_target("model.layers.1.mlp.experts.0.down_proj.weight") == (
        "model.layers.1.mlp.experts.w2", (0, "down"))
    mixtral_config = AutoConfig.for_model("mixtral", vocab_size=64, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                          num_local_experts=2, num_experts_per_tok=1)
    mixtral = MixtralForCausalLM(mixtral_config, 64)
    assert mixtral.checkpoint_target("model.layers.0.block_sparse_moe.experts.1.w2.weight_scale_inv") == (
        "model.layers.0.mlp.experts.w2_scale_inv", (1, "down"))


def test_unquantized_model_refuses_fp8_tensors(fp8_models):
    """An FP8 checkpoint read as an unquantized model: its scales have nowhere to go."""
    _, block_dir, _ = fp8_models
    with pytest.raises(ValueError, match=r"does not use: \['model\.layers\.0\.mlp\.experts\.0\.down_proj\."
                                         r"weight_scale_inv'"):
        load_model(Qwen3MoeForCausalLM(AutoConfig.from_pretrained(block_dir), 64), block_dir, show_progress=False)


# ---- GPU: bfloat16 activations and CUDA graphs -----------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernel_missing, reason="needs a CUDA device")
@pytest.mark.parametrize("block", [None, BLOCK], ids=["per_channel", "block"])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_bf16_activations_on_gpu(block, num_tokens):
    x, q13, s13, q2, s2, weights, ids = make_problem(8, 2, num_tokens, 256, 384, block, seed=num_tokens, device="cuda")
    ref = torch_experts(x, dequantize_stack(q13, s13, block), dequantize_stack(q2, s2, block), weights, ids)
    out = moe_triton.triton_experts(x.bfloat16(), q13, q2, weights, ids, s13, s2, block)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernel_missing, reason="needs a CUDA device")
@pytest.mark.parametrize("block", [None, BLOCK], ids=["per_channel", "block"])
def test_fp8_cuda_graph_capture(block):
    """No host read: the FP8 call captures into a CUDA graph and replays with new routing."""
    x, q13, s13, q2, s2, weights, ids = make_problem(8, 2, 16, 256, 256, block, seed=0, device="cuda")
    x = x.bfloat16()
    moe_triton.triton_experts(x, q13, q2, weights, ids, s13, s2, block)     # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_triton.triton_experts(x, q13, q2, weights, ids, s13, s2, block)
    ids.copy_(random_ids(16, 8, 2, torch.Generator().manual_seed(1)).cuda())
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, moe_triton.triton_experts(x, q13, q2, weights, ids, s13, s2, block), atol=0, rtol=0)


# ---- the H200's code -------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("triton") is None or
                    importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="triton (with its CUDA backend) is not installed")
def test_kernels_compile_for_sm90():
    """Every kernel variant compiles to sm_90 code (no GPU needed: scripts/compile_moe_kernels.py,
    in a process of its own since this one may run Triton interpreted). The interpreter accepts
    what the compiler may not (a dot of fp8 with bf16, say)."""
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "compile_moe_kernels.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, script, "--arch", "90"], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 of 18 variants failed" in result.stdout
