"""Split-K for the quantized decode GEMMs (fp8_triton.py, awq_triton.py): how many ways to split
K, and the deterministic sum of the splits' partial results.

At decode (T <= DECODE_MAX_TOKENS) a GEMM reads its whole weight once, does little arithmetic per
byte, and has one M tile, so it launches only ceil(N / BLOCK_N) programs, each streaming all of K:
N = 1024 in 32-column fp8 tiles is 32 programs on an H200's 132 SMs, most of the chip idle and
most of its memory bandwidth unused. Split-K adds a grid axis over K: program (m, n, s) sums K
tiles [s * k_tiles // S, (s + 1) * k_tiles // S) (whole K tiles, as balanced as they can be; a K
tile lies inside one scale block or group, since BLOCK_K divides it, so each tile still has one
scale per row and column) and writes its fp32 partial to a workspace [S, T, N]; _sum_splits_kernel
then adds the S partials in the order s = 0, 1, ... and rounds once to the output dtype.

No atomics: the engine replays captured CUDA graphs and tests them bit-equal to eager steps of the
same shape, so the result must not depend on which program finishes first. The split count is a
function of shapes and the device's SM count only (never of data), so a capture and an eager call
of the same shape split alike and give the same bits.
"""
import functools

import torch
import triton
import triton.language as tl

# The decode regime, shared by both kernels' tile choice: at T <= 16 one 16-row M tile (tl.dot's
# minimum) holds every token and the weight stream is the whole cost. Beyond it the prefill tiles
# reuse each weight tile over 64 tokens and the M axis supplies programs: no split.
DECODE_MAX_TOKENS = 16
# At least 2 programs per SM: a program streams its weight tiles (4 KB per K tile in both kernels)
# through a few pipeline stages, which is too few bytes in flight for one SM alone to cover DRAM
# latency (H200: ~4.8 TB/s x ~1 us ~ 5 MB in flight over 132 SMs, ~36 KB each), so each SM should
# hold a second program whose loads overlap the first's. More splits than that only add partials.
PROGRAMS_PER_SM = 2
# At least 4 K tiles per split: a split's weight stream (4 tiles x 4 KB) is then 4x (AWQ: 16 x 64
# fp32 partial at T = 16) to 8x (fp8: 16 x 32) the partial tile it writes, and the workspace round
# trip (written, then read by the sum; small enough to stay in L2) stays a minor cost beside it.
MIN_K_TILES_PER_SPLIT = 4
# The SM count on CPU, where the kernels run under the interpreter: an H200's (the deployment GPU),
# so that CPU runs split as the GPU would for the same shapes.
CPU_STAND_IN_SMS = 132
# The sum kernel: 1024 outputs per program (8 per thread of 4 warps), fp32 loads of every split.
SUM_BLOCK = 1024
SUM_NUM_WARPS = 4


def split_k_for(num_tokens: int, n: int, k: int, block_m: int, block_n: int, block_k: int, num_sms: int) -> int:
    """How many ways a [T, K] x [K, N] GEMM in (block_m, block_n, block_k) tiles splits K: enough
    that the grid has PROGRAMS_PER_SM programs per SM, as long as each split keeps at least
    MIN_K_TILES_PER_SPLIT K tiles; 1 beyond decode (prefill tiles) and whenever the output tiles
    alone fill the chip. Never more than the number of K tiles. Pure: shapes and SM count only."""
    if num_tokens > DECODE_MAX_TOKENS:
        return 1
    programs = triton.cdiv(num_tokens, block_m) * triton.cdiv(n, block_n)
    wanted = triton.cdiv(num_sms * PROGRAMS_PER_SM, max(programs, 1))
    return max(1, min(wanted, triton.cdiv(k, block_k) // MIN_K_TILES_PER_SPLIT))


@functools.cache
def _sm_count(device_type: str, index: int | None) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index).multi_processor_count
    return CPU_STAND_IN_SMS


def num_sms(device: torch.device) -> int:
    """The device's SM count (cached per device; CPU_STAND_IN_SMS on CPU). A host query: no sync."""
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _sm_count(device.type, index)


def check_split_k(split_k, k_tiles: int) -> None:
    """A forced split count (the wrappers' split_k=) must be an int in 1..k_tiles: every split owns
    at least one K tile."""
    if isinstance(split_k, bool) or not isinstance(split_k, int) or not 1 <= split_k <= max(k_tiles, 1):
        raise ValueError(f"split_k must be None (chosen by shape) or an int in 1..{max(k_tiles, 1)} "
                         f"(the number of K tiles, cdiv(K, BLOCK_K) = {k_tiles}), got {split_k!r}")


@triton.jit
def _sum_splits_kernel(ws_ptr, out_ptr, numel, SPLIT_K, BLOCK: tl.constexpr):
    """Grid (ceil(numel / BLOCK),): out[i] = sum over s = 0, 1, ... of ws[s, i] in fp32, rounded
    once to out's dtype. ws [SPLIT_K, T, N] and out [T, N], both contiguous (numel = T * N)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    ptrs = ws_ptr + offs
    acc = tl.zeros([BLOCK], tl.float32)
    for _ in range(SPLIT_K):                             # a fixed order: the same bits every call
        acc += tl.load(ptrs, mask=ok, other=0.0)
        ptrs += numel
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def workspace(split_k: int, out: torch.Tensor) -> torch.Tensor:
    """Where the GEMM writes: out itself for one split, else a fresh fp32 [split_k, T, N] (inside
    a CUDA graph capture it comes from the graph's memory pool)."""
    if split_k == 1:
        return out
    return torch.empty((split_k, *out.shape), dtype=torch.float32, device=out.device)


def sum_splits(ws: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = ws.sum(0) in out's dtype (nothing to do when the GEMM wrote out itself)."""
    if ws is out:
        return out
    assert ws.is_contiguous() and out.is_contiguous() and ws.shape[1:] == out.shape
    numel = out.numel()
    _sum_splits_kernel[(triton.cdiv(numel, SUM_BLOCK),)](ws, out, numel, ws.shape[0], BLOCK=SUM_BLOCK,
                                                          num_warps=SUM_NUM_WARPS)
    return out
