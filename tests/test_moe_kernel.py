"""The fused MoE Triton kernel (layers/moe_triton.py) against torch_experts.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, which
@triton.jit reads when nanovllm.layers.moe_triton is imported, so it is set before that). On a
CUDA machine the variable is left alone and the same tests run the compiled kernels on the GPU.
Sizes are small: the interpreter is slow.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed: the fused MoE kernel is untested here")

from nanovllm.layers import moe_triton  # noqa: E402
from nanovllm.layers.moe import route, torch_experts  # noqa: E402
from nanovllm.layers.moe_triton import align_by_expert, choose_block_m, triton_experts  # noqa: E402

# Ask the module, not the environment: it may have been imported before this file set the variable.
INTERPRETED = type(moe_triton._gate_up_kernel).__name__ == "InterpretedFunction"
DEVICE = "cpu" if INTERPRETED else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("moe_triton was imported compiled (TRITON_INTERPRET off) and there is no CUDA device",
                allow_module_level=True)

ATOL, RTOL = 1e-4, 1e-4          # float32; both accumulate in fp32


def make_experts(num_experts, hidden, inter, gen, dtype=torch.float32):
    """Random w13 [E, 2I, H] and w2 [E, H, I], scaled so activations stay O(1)."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
    return w13.to(dtype).to(DEVICE), w2.to(dtype).to(DEVICE)


def check(x, w13, w2, weights, ids):
    out = triton_experts(x, w13, w2, weights, ids)
    ref = torch_experts(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=ATOL, rtol=RTOL)


def random_ids(num_tokens, num_experts, top_k, gen):
    """Distinct experts per token, as top-k routing gives."""
    return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])


@pytest.mark.parametrize("num_experts,top_k", [(1, 1), (4, 1), (4, 2), (4, 4), (8, 2)])
@pytest.mark.parametrize("num_tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("hidden,inter", [(48, 40), (64, 32)])
def test_matches_reference(num_experts, top_k, num_tokens, hidden, inter):
    gen = torch.Generator().manual_seed(num_experts * 1000 + top_k * 100 + num_tokens + hidden)
    w13, w2 = make_experts(num_experts, hidden, inter, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    ids = random_ids(num_tokens, num_experts, top_k, gen).to(DEVICE)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(DEVICE)
    check(x, w13, w2, weights, ids)


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (5, 1), (17, 2)])
def test_idle_experts(num_tokens, top_k):
    """Every pair goes to experts 2 (and 5): the other experts get no token at all."""
    gen = torch.Generator().manual_seed(7)
    w13, w2 = make_experts(8, 48, 40, gen)
    x = torch.randn(num_tokens, 48, generator=gen).to(DEVICE)
    ids = torch.tensor([2, 5][:top_k]).repeat(num_tokens, 1).to(DEVICE)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(DEVICE)
    check(x, w13, w2, weights, ids)


def test_routed_and_large_tiles():
    """Router output through route(), with enough pairs per expert for the 64-row tiles."""
    gen = torch.Generator().manual_seed(3)
    num_experts, top_k, num_tokens, hidden, inter = 2, 2, 64, 40, 24
    assert choose_block_m(num_tokens * top_k, num_experts) == moe_triton.LARGE_BLOCK_M
    w13, w2 = make_experts(num_experts, hidden, inter, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    weights, ids = route(torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE), top_k, renormalize=True)
    check(x, w13, w2, weights, ids)


def test_strided_input():
    """x as a column slice of a wider tensor (row stride != H)."""
    gen = torch.Generator().manual_seed(5)
    w13, w2 = make_experts(4, 48, 40, gen)
    x = torch.randn(9, 80, generator=gen).to(DEVICE)[:, 16:64]
    weights, ids = route(torch.randn(9, 4, generator=gen).to(DEVICE), 2, renormalize=False)
    check(x, w13, w2, weights, ids)


def test_no_tokens():
    gen = torch.Generator().manual_seed(0)
    w13, w2 = make_experts(4, 48, 40, gen)
    x = torch.zeros(0, 48, device=DEVICE)
    out = triton_experts(x, w13, w2, torch.zeros(0, 2, device=DEVICE),
                         torch.zeros(0, 2, dtype=torch.int64, device=DEVICE))
    assert out.shape == (0, 48)


@pytest.mark.parametrize("num_experts,top_k,num_tokens,block_m",
                         [(4, 2, 17, 16), (8, 1, 3, 16), (3, 3, 40, 16), (4, 2, 50, 64), (1, 1, 1, 16)])
def test_align_by_expert(num_experts, top_k, num_tokens, block_m):
    gen = torch.Generator().manual_seed(num_tokens)
    ids = random_ids(num_tokens, num_experts, top_k, gen)
    ids[ids == num_experts - 1] = 0                      # the last expert gets no pair
    num_pairs = num_tokens * top_k
    sorted_pairs, block_expert, num_padded = align_by_expert(ids.to(DEVICE), num_experts, block_m)
    sorted_pairs, block_expert, num_padded = sorted_pairs.cpu(), block_expert.cpu(), num_padded.cpu()

    max_padded = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    assert sorted_pairs.shape == (max_padded,) and block_expert.shape == (max_padded // block_m,)
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    assert num_padded.shape == (1,)
    assert num_padded.item() == sum(-(-c // block_m) * block_m for c in counts.tolist())

    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))           # each pair exactly once
    assert (sorted_pairs[num_padded.item():] == num_pairs).all()     # the tail is all sentinel
    flat = ids.flatten()
    for b, tile in enumerate(sorted_pairs[:num_padded.item()].view(-1, block_m)):
        pairs = tile[tile < num_pairs]
        assert len(pairs), "a tile before num_padded holds at least one pair"
        assert (flat[pairs] == block_expert[b]).all()                # one expert per tile
        assert (tile[:len(pairs)] == pairs).all()                    # pairs first, then padding
        assert pairs.tolist() == sorted(pairs.tolist())              # in order within the expert
    assert (block_expert >= 0).all() and (block_expert < num_experts).all()


def test_tiles_past_num_padded_exit():
    """A kernel program whose tile starts at or past num_padded returns before touching anything."""
    gen = torch.Generator().manual_seed(1)
    w13, w2 = make_experts(2, 32, 32, gen)
    x = torch.randn(4, 32, generator=gen).to(DEVICE)
    ids = torch.tensor([[0], [1], [0], [1]], device=DEVICE)
    sorted_pairs, block_expert, _ = align_by_expert(ids, 2, 16)
    mid = torch.full((4, 32), float("nan"), device=DEVICE)
    moe_triton._gate_up_kernel[(block_expert.shape[0], 1)](
        x, w13, mid, sorted_pairs, block_expert, torch.zeros(1, dtype=torch.int64, device=DEVICE), w13, 4, 32, 32,
        *x.stride(), *w13.stride(), *mid.stride(), 0, 0, 0,
        TOP_K=1, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, DOT_PRECISION="ieee",
        SCALES=moe_triton.NO_SCALES.value, GROUP_N=1, GROUP_K=1)
    assert mid.isnan().all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_bf16_against_fp32(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    num_experts, top_k, hidden, inter = 8, 2, 256, 192
    w13, w2 = make_experts(num_experts, hidden, inter, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    weights, ids = route(torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE), top_k, renormalize=True)
    ref = torch_experts(x, w13, w2, weights, ids)
    out = triton_experts(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture():
    """No host sync anywhere: the whole call captures into a CUDA graph and replays with new routing."""
    gen = torch.Generator().manual_seed(0)
    num_experts, top_k, num_tokens, hidden, inter = 8, 2, 16, 128, 96
    w13, w2 = make_experts(num_experts, hidden, inter, gen, torch.bfloat16)
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16().to(DEVICE)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE)
    weights, ids = route(logits, top_k, renormalize=True)
    triton_experts(x, w13, w2, weights, ids)             # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_experts(x, w13, w2, weights, ids)
    new_weights, new_ids = route(torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE), top_k, True)
    new_ids[:4] = torch.tensor([0, 1], device=DEVICE)   # some experts busier, others idle
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, triton_experts(x, w13, w2, weights, ids), atol=0, rtol=0)
