"""layers/fused_triton.py's kernels against the PyTorch modules they replace (under Triton's
interpreter without CUDA, compiled on a GPU), and their selection: a model whose attention runs on
Triton's backend has its RMSNorms, SiluAndMul and RotaryEmbedding run them; the torch backend's does not."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed")

from nanovllm.layers import fused_triton  # noqa: E402
from nanovllm.layers.activation import SiluAndMul  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402

INTERPRETED = type(fused_triton._rms_norm_kernel).__name__ == "InterpretedFunction"
DEVICE = "cpu" if INTERPRETED else "cuda"
# float32: only the order of the sum of squares differs (and the device's rsqrt, exp). bf16: so an
# output may round to the next bf16 value (its relative spacing is 2**-8..2**-7), at two roundings;
# and the interpreter rounds float32 to bf16 toward zero (compiled Triton, as torch, to nearest).
BF16_RTOL = 2 ** -5 if INTERPRETED else 2 ** -6
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=BF16_RTOL, atol=1e-5)}


def norm_pair(dim: int, dtype: torch.dtype, seed: int = 1) -> tuple[RMSNorm, RMSNorm]:
    """The PyTorch RMSNorm and the fused one, with the same (non-trivial) weight, drawn from seed."""
    reference, fused = RMSNorm(dim, eps=1e-6).to(DEVICE, dtype), RMSNorm(dim, eps=1e-6).to(DEVICE, dtype)
    fused.kernels = fused_triton
    weight = torch.randn(dim, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
    reference.weight.data.copy_(weight)
    fused.weight.data.copy_(weight)
    return reference, fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 100])  # (100: a block wider than the row, masked)
def test_add_rms_norm_equals_the_modules(dtype, dim):
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, dim, generator=gen).to(DEVICE, dtype) for _ in range(2))
    reference, fused = norm_pair(dim, dtype)
    assert fused.kernels is fused_triton and reference.kernels is None
    torch.testing.assert_close(fused(x), reference(x), **TOLERANCE[dtype])
    (y, s), (y_ref, s_ref) = fused(x, residual), reference(x, residual)
    if dtype == torch.float32 or not INTERPRETED:  # the residual stream: one rounding of the same sum
        assert torch.equal(s, s_ref)
    torch.testing.assert_close(s, s_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(y, y_ref, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_each_head_of_a_strided_view(dtype):
    """q/k norm: [T, H, D], a view into the qkv projection's output (rows qkv-wide apart)."""
    qkv = torch.randn(3, 4 * 16 + 2 * 2 * 16, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    q = qkv[:, :4 * 16].view(3, 4, 16)
    reference, fused = norm_pair(16, dtype)
    torch.testing.assert_close(fused(q), reference(q), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [96, 1500])  # (1500: two column blocks, the second masked)
def test_silu_and_mul_equals_the_module(dtype, d):
    x = (3 * torch.randn(4, 2 * d, generator=torch.Generator().manual_seed(3))).to(DEVICE, dtype)
    fused = SiluAndMul()
    fused.kernels = fused_triton
    torch.testing.assert_close(fused(x), SiluAndMul()(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False])  # (Qwen3's; Llama's has none)
@pytest.mark.parametrize("head_dim", [16, 40])  # (40: a half of 20, in a block of 32)
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (20, 10)])  # (20 and 10: 3 and 2 tiles of 8, the last masked)
def test_qk_norm_rope_equals_the_modules(dtype, qk_norm, head_dim, heads, kv_heads):
    """q and k as views into one qkv projection, at scattered positions: normalized (where the
    family has it), then rotated, as RMSNorm then RotaryEmbedding compute them."""
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    tokens = 5
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 7, 3, 99, 12], device=DEVICE)
    rope = RotaryEmbedding(head_dim, 128, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    # q_norm and k_norm with different weights, so k normalized by q_norm's weight (or q by k's) differs
    norms = [norm_pair(head_dim, dtype, seed) for seed in (1, 2)] if qk_norm else [(None, None)] * 2
    q_ref, k_ref = rope(positions, q, k, norms[0][0], norms[1][0])
    rope.kernels = fused_triton
    q_out, k_out = rope(positions, q, k, norms[0][1], norms[1][1])
    # (a rotated value is a difference of products: in bf16 its error is relative to the head's size)
    for out, ref in ((q_out, q_ref), (k_out, k_ref)):
        tolerance = dict(TOLERANCE[dtype])
        if dtype == torch.bfloat16:
            tolerance["atol"] = BF16_RTOL * ref.abs().max().item()
        torch.testing.assert_close(out, ref, **tolerance)


def test_empty_batches_and_bad_layouts():
    norm = norm_pair(8, torch.float32)[1]
    assert norm(torch.empty(0, 8, device=DEVICE)).shape == (0, 8)
    assert fused_triton.silu_and_mul(torch.empty(0, 6, device=DEVICE)).shape == (0, 3)
    with pytest.raises(ValueError, match="last axis contiguous"):
        norm(torch.randn(8, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match=r"\[T, 2d\]"):
        fused_triton.silu_and_mul(torch.randn(4, 5, device=DEVICE))


@pytest.mark.skipif(not INTERPRETED, reason="an engine on CPU")
def test_the_triton_backend_builds_the_model_with_the_fused_kernels(model_dir):
    """The target and its draft model alike. (Their outputs equal Hugging Face's: test_triton_backend.py's
    engine and speculative tests run this path.)"""
    from nanovllm import LLM
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    draft = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 1}
    for backend, kernels in (("triton", fused_triton), ("torch", None)):
        with LLM(model_dir, device="cpu", attention_backend=backend, max_model_len=64, speculative_config=draft) as llm:
            for model in (llm.model_runner.model, llm.model_runner.drafter.model):
                modules = list(model.modules())
                norms = [m for m in modules if isinstance(m, RMSNorm)]
                assert norms and all(m.kernels is kernels for m in norms)
                elementwise = [m for m in modules if isinstance(m, (SiluAndMul, RotaryEmbedding))]
                assert elementwise and all(m.kernels is kernels for m in elementwise)
