"""FP8 KV cache (kv_cache_dtype="fp8"): the kernels against the torch reference over an fp8 cache."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton (transformers does): see test_triton_backend.py
    os.environ.setdefault("TRITON_INTERPRET", "1")
from nanovllm.layers.backends.torch_ref import FP8_KV_DTYPE, TorchBackend, quantize_kv  # noqa: E402


# ---- kernels: Triton (interpreted on CPU) against the torch reference ----------------------------
@pytest.fixture(scope="module")
def kt():
    """tests/test_triton_backend.py's helpers, which set up the interpreter on CPU (or skip)."""
    return pytest.importorskip("test_triton_backend")


# (k_scale, v_scale): 1.0 (vLLM's default) and scales that put K/V anywhere in e4m3's range
SCALES = [(1.0, 1.0), (0.05, 3.0), (3.0, 0.05)]


def fp8_cache(kt, lens, block_size, num_kv_heads, head_dim, gen, k_scale, v_scale):
    """A PagedCache whose K/V ([num_blocks, block_size, Hkv, D], randn * scale) are stored in fp8."""
    cache = kt.PagedCache(lens, block_size, num_kv_heads, head_dim, gen)
    cache.k, cache.v = quantize_kv(cache.k * k_scale, k_scale), quantize_kv(cache.v * v_scale, v_scale)
    return cache.to(kt.DEVICE)


def scales(kt, k_scale, v_scale):
    return (torch.tensor(k_scale, device=kt.DEVICE), torch.tensor(v_scale, device=kt.DEVICE))


def reference(kt, q, k, v, cache, context, scale, k_scale, v_scale):
    """TorchBackend on the host over the same fp8 cache."""
    ctx = kt.make_context([b - a for a, b in zip(context.cu_seqlens_q_cpu, context.cu_seqlens_q_cpu[1:])],
                          context.seq_lens_k_cpu, None if context.block_tables is None else context.block_tables.cpu(),
                          device="cpu")
    return TorchBackend.forward(q.cpu().float(), k.cpu().float(), v.cpu().float(), cache.k.cpu(), cache.v.cpu(), ctx,
                                scale, torch.tensor(k_scale), torch.tensor(v_scale))


def assert_close(kt, out, ref, v_scale):
    """Both read the same e4m3 values, so only fp32 summation order differs: test_triton_backend's
    float32 tolerance, its absolute part scaled with V (the outputs' size)."""
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), ref.float(), atol=kt.ATOL * max(1.0, v_scale), rtol=kt.RTOL)


@pytest.mark.parametrize("k_scale, v_scale", SCALES)
@pytest.mark.parametrize("block_size, num_kv_heads, head_dim", [(16, 2, 64), (12, 4, 48)])
def test_kernel_store_kv_fp8_bytes_equal_the_reference(kt, block_size, num_kv_heads, head_dim, k_scale, v_scale):
    """Bit for bit the torch reference's bytes: values spanning e4m3's subnormals to past its
    range (clamped), exact ties and the tops of binades; slot -1 skipped."""
    gen = torch.Generator().manual_seed(block_size * 10 + num_kv_heads)
    num_blocks, num_tokens = 5, 23
    _, k, v = kt.qkv_views(num_tokens, 2, num_kv_heads, head_dim, gen)
    magnitude = torch.exp2(torch.randint(-12, 10, k.shape, generator=gen).float()).to(kt.DEVICE)
    k, v = k * magnitude * k_scale, v * magnitude * v_scale                  # 2^-12 .. 2^10 (past 448)
    # ties to even (1.0625 -> 1, 2^-8 + 2^-10 -> 2^-8 among the subnormals), carries into the next
    # binade (127.5 -> 128, 0.5 - 2^-6 -> 0.5), an exact value, one past 448, and -0
    ties = torch.tensor([1.0625, 2 ** -8 + 2 ** -10, 127.5, 0.5 - 2 ** -6, 120.0, 464.0, -0.0], device=kt.DEVICE)
    k[0, 0, :len(ties)], v[0, 0, :len(ties)] = ties * k_scale, ties * v_scale
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, 7, num_tokens - 1]] = -1                                        # CUDA-graph padding rows
    slots = slots.to(kt.DEVICE)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=FP8_KV_DTYPE, device=kt.DEVICE)
    v_cache = torch.zeros_like(k_cache)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    TorchBackend.store_kv(k[keep], v[keep], expect_k, expect_v, slots[keep], *scales(kt, k_scale, v_scale))
    kt.TritonBackend.store_kv(k, v, k_cache, v_cache, slots, *scales(kt, k_scale, v_scale))
    assert torch.equal(k_cache.view(torch.uint8), expect_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expect_v.view(torch.uint8))


@pytest.mark.parametrize("k_scale, v_scale", SCALES)
@pytest.mark.parametrize("num_heads, num_kv_heads, block_size, num_splits", [(4, 4, 16, 1), (4, 2, 8, 3), (8, 2, 16, 4)])
def test_kernel_decode_over_fp8_cache(kt, num_heads, num_kv_heads, block_size, num_splits, k_scale, v_scale):
    gen = torch.Generator().manual_seed(num_heads * 100 + block_size + num_splits)
    lens = [1, block_size, block_size + 1, 37, 130]
    cache = fp8_cache(kt, lens, block_size, num_kv_heads, 32, gen, k_scale, v_scale)
    q, k, v = kt.qkv_views(len(lens), num_heads, num_kv_heads, 32, gen, q_scale=2.0)
    context = kt.make_context([1] * len(lens), lens, cache.tables)
    k_scales, v_scales = scales(kt, k_scale, v_scale)
    out = kt.decode(q, cache.k, cache.v, context.seq_lens_k, context.block_tables, 0.2, num_splits=num_splits,
                    k_scale=k_scales, v_scale=v_scales)
    assert_close(kt, out, reference(kt, q, k, v, cache, context, 0.2, k_scale, v_scale), v_scale)


@pytest.mark.parametrize("k_scale, v_scale", SCALES)
@pytest.mark.parametrize("num_heads, num_kv_heads, block_size", [(4, 2, 16), (6, 2, 12)])
def test_kernel_mixed_step_over_fp8_cache(kt, num_heads, num_kv_heads, block_size, k_scale, v_scale):
    """Prefill chunks over cached prefixes beside decode rows (the prefill kernel's paged path
    and the decode kernel's mixed mode), each backend storing the step's K/V first."""
    gen = torch.Generator().manual_seed(num_heads * 10 + block_size)
    cached, new = [0, block_size, 3, 0, 40], [21, 9, 1, 1, 17]
    lens = [c + n for c, n in zip(cached, new)]
    cache = fp8_cache(kt, lens, block_size, num_kv_heads, 32, gen, k_scale, v_scale)
    q, k, v = kt.qkv_views(sum(new), num_heads, num_kv_heads, 32, gen, q_scale=2.0)
    k, v = k * k_scale, v * v_scale
    slots = [s for i, (c, n) in enumerate(zip(cached, new)) for s in cache.slots(i, range(c, c + n))]
    context = kt.make_context(new, lens, cache.tables, slots)
    kv_scales = scales(kt, k_scale, v_scale)
    kt.TritonBackend.store_kv(k, v, cache.k, cache.v, context.slot_mapping, *kv_scales)
    out = kt.TritonBackend.forward(q, k, v, cache.k, cache.v, context, 0.25, *kv_scales)
    assert_close(kt, out, reference(kt, q, k, v, cache, context, 0.25, k_scale, v_scale), v_scale)


@pytest.mark.parametrize("k_scale, v_scale", SCALES)
def test_kernel_fresh_prefill_attends_over_the_quantized_kv(kt, k_scale, v_scale):
    """No cached context (block_tables None): both backends attend over the new K/V as the fp8
    cache holds them, i.e. as the paged path would read them back."""
    gen = torch.Generator().manual_seed(9)
    lens = [1, 7, 40]
    q, k, v = kt.qkv_views(sum(lens), 4, 2, 32, gen, q_scale=2.0)
    k, v = k * k_scale, v * v_scale
    k_cache = torch.zeros(8, 16, 2, 32, dtype=FP8_KV_DTYPE, device=kt.DEVICE)
    context = kt.make_context(lens, lens)
    kv_scales = scales(kt, k_scale, v_scale)
    out = kt.TritonBackend.forward(q, k, v, k_cache, k_cache, context, 0.25, *kv_scales)
    ref_context = kt.make_context(lens, lens, device="cpu")
    cpu_scales = torch.tensor(k_scale), torch.tensor(v_scale)
    ref = TorchBackend.forward(q.cpu(), k.cpu(), v.cpu(), k_cache.cpu(), k_cache.cpu(), ref_context, 0.25, *cpu_scales)
    assert_close(kt, out, ref, v_scale)
    unquantized = TorchBackend.forward(q.cpu(), k.cpu(), v.cpu(), None, None, ref_context, 0.25)
    assert not torch.allclose(ref, unquantized, atol=1e-3 * v_scale, rtol=1e-3)
