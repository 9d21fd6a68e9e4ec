"""Tiles and split-K for the quantized GEMMs (fp8_triton.py, awq_triton.py): which output tiles a
launch takes, how many ways it splits K, and the deterministic sum of the splits' partial results.

A [T, K] x [K, N] GEMM in BLOCK_M x BLOCK_N output tiles launches ceil(T / BLOCK_M) * ceil(N / BLOCK_N)
programs, each streaming its columns' weights over all of K. At a few tokens that is few programs:
N = 1024 in 128-column tiles is 8 on an H200's 132 SMs, most of the chip and its memory bandwidth
idle. So the tiles follow the program count the shape gives, not the token count: `plan` takes the
widest tile (the most reuse of each activation tile) that still gives PROGRAMS_PER_SM programs per
SM, and where the output grid alone leaves SMs without a program it also splits K. Split-K adds a
grid axis over K: program (m, n, s) sums K tiles [s * k_tiles // S, (s + 1) * k_tiles // S) (whole
tiles, balanced; BLOCK_K divides the scale block or group, so each tile still has one scale per row
and column) into an fp32 workspace [S, T, N]; _sum_splits_kernel adds the S partials in the order
s = 0, 1, ... and rounds once to the output dtype.

No atomics: captured CUDA graphs are tested bit-equal to eager steps of the same shape, so the result
must not depend on which program finishes first. The plan depends on shapes and the SM count only
(never data), so a capture and an eager call of the same shape tile and split alike.
"""
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Up to 16 tokens one 16-row M tile (tl.dot's minimum) holds every token: the weight stream is the
# whole cost. Beyond, 64-row M tiles reuse each weight tile over 64 tokens.
DECODE_MAX_TOKENS = 16
# 2 programs per SM: one program's few pipeline stages of weight tiles are too few bytes in flight to
# cover DRAM latency (H200: ~4.8 TB/s x ~1 us ~ 5 MB over 132 SMs, ~36 KB each), so a second
# program's loads overlap the first's. More than that only adds partials (split-K) or narrower tiles.
PROGRAMS_PER_SM = 2
# At least 2 K tiles per split. Its weight stream (2 x BLOCK_N x BLOCK_K: fp8 256 bytes a column,
# AWQ 64 at K tiles of 128) is then 1x (64 rows) to 4x (16) the fp32 partial it writes (4 bytes a
# row a column); the partials ([S, T, N] fp32: 1.3 MB for 5 splits of T = 64, N = 1024) stay in L2.
MIN_K_TILES_PER_SPLIT = 2
# The SM count on CPU (the interpreter): an H200's, so CPU runs tile and split as the GPU would.
CPU_STAND_IN_SMS = 132
# The sum kernel: 1024 outputs per program (8 per thread of 4 warps), fp32 loads of every split.
SUM_BLOCK = 1024
SUM_NUM_WARPS = 4


class Tiles(NamedTuple):
    """One GEMM launch's tiling: block_m x block_n output tiles over K tiles of block_k, and the
    kernel's warps and software-pipeline stages."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Cached: every eager GEMM call plans (Qwen3-0.6B: 112 a step), at 6-23 us a plan uncached on this
# CPU (1-2.6 ms a step; CUDA-graph replays plan nothing). The key holds the options themselves.
@functools.lru_cache(maxsize=4096)
def plan(num_tokens: int, n: int, k: int, tile_options: tuple[Tiles, ...], num_sms: int) -> tuple[Tiles, int]:
    """(tiles, split count) for a [T, K] x [K, N] GEMM: the first of tile_options (widest first)
    whose programs, with split_k_for's K splits, give PROGRAMS_PER_SM per SM; the last (narrowest)
    with its splits if none does. Pure: shapes and the SM count only."""
    for tiles in tile_options:
        grid = triton.cdiv(num_tokens, tiles.block_m) * triton.cdiv(n, tiles.block_n)
        split = split_k_for(grid, k, tiles.block_k, num_sms)
        if grid * split >= PROGRAMS_PER_SM * num_sms:
            break
    return tiles, split


def split_k_for(grid: int, k: int, block_k: int, num_sms: int) -> int:
    """How many ways an output grid of `grid` programs splits K: 1 when the grid gives every SM a
    program (a split's partials are extra traffic, worth it only for idle SMs); else enough for
    PROGRAMS_PER_SM programs per SM while each split keeps MIN_K_TILES_PER_SPLIT K tiles."""
    if grid >= num_sms:
        return 1
    wanted = triton.cdiv(num_sms * PROGRAMS_PER_SM, max(grid, 1))
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
    """A forced split count (the wrappers' split_k=) must be an int in 1..k_tiles (a K tile each)."""
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
