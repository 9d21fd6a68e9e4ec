"""The Triton backend: our own kernels for the paged KV cache.

  _store_kv_kernel   copies each new token's K and V ([Hkv, D]) to cache slot slot_mapping[t], a few
                     tokens per program; a slot of -1 (CUDA-graph padding) is skipped.
  _prefill_kernel    flash-attention (online softmax, fp32) in tiles of BLOCK_M rows x BLOCK_N keys, for
                     multi-token queries, over the fresh K/V (no cached context) or the paged cache.
                     GQA-aware: a program's BLOCK_M rows are (query, head-in-group) pairs of ONE kv head,
                     so each K/V tile is loaded once for all H/Hkv query heads. Its grid follows each
                     sequence's own query count ("Work items" below), not the longest one's.
  _decode_kernel     split-KV decode: a program takes all H/Hkv query heads of one kv head (padded to
                     >= 16 rows for tl.dot) and one share of the context, writing a partial (max, sum, acc)
                     for each; with up to max_queries queries per sequence (a speculative verify step:
                     the last token and k drafts), its rows are (query, head-in-group) pairs, each query
                     masked to the keys up to its own position.
  _reduce_kernel     combines the splits' partials (skipped when num_splits == 1).

Mixed steps (prefill chunks beside decode rows) run both: split-KV decode for the sequences with one
new token, the prefill kernel for the others. One kernel for all would walk each decode row's whole
context in one program, and a grid of max_q's tiles per sequence is mostly idle (an 8K-token chunk
beside 255 decode rows, 4 query heads per kv head: 512 x 256 programs per kv head for ~800 tiles). The
decode rows' split count uses B, not the padded batch (a mixed step is never a graph replay), so a
row's bits may differ between the two kinds of step. A step in which every sequence has a few new
tokens (decode_max_queries: a verify step, eager or a graph replay) runs the decode kernel alone,
split-KV over every sequence: in the prefill kernel a batch-1 verify step would be Hkv programs
(8 of an H200's 132 SMs), each walking the whole context.

Work items of the prefill kernel. Sequence b has n_b = cu_q[b+1] - cu_q[b] new queries, i.e. r =
n_b * GROUP rows in cdiv(r, BLOCK_M) tiles, the first of them work item
    first(b) = (cu_q[b] * GROUP) // BLOCK_M + b,
which leaves room for all of them before first(b+1) (floor((c + r) / M) - floor(c / M) + 1 >= cdiv(r, M)),
and every tile of the step fits below (T * GROUP) // BLOCK_M + B: the grid per kv head, from shapes
only (CUDA-graph safe), at most B programs idle. A program finds its sequence by a binary search of
first() over cu_q (increasing in b).

The decode path reads no device value on the host (CUDA-graph safe): num_splits comes from shapes
(context_num_splits: the same for an eager step and its replay, hence the same bits), and each split
takes an equal share, in whole tiles, of its own sequence's length as read on the device (a row does
not depend on the others' lengths).

Softmax runs in base 2 (exp2 of scores pre-multiplied by scale * log2(e)). The running max starts
at a large negative *finite* number, so a row that has seen no valid key yet gets
exp2(-inf - NEG_BIG) = 0 and alpha = exp2(0) = 1 instead of NaN from (-inf) - (-inf).

An fp8 KV cache holds fp8(clamp(K / k_scale)) and likewise V (torch_ref.py). With the constexpr
KV_FP8 off the kernels compile as without fp8 (scale pointers unread). _store_kv_kernel quantizes on
the way in; the attention kernels convert fp8 tiles to the query's dtype (exact: every e4m3 value is a
bf16, fp16 and fp32 value) and fold the scales in: k_scale joins the softmax scale (q.(k_scale * k) =
k_scale * (q.k)), and v_scale multiplies the accumulator once at the end, before the split-KV partials
(the reduction is linear). The scales are the layer's 0-dim tensors, read on the device: a CUDA graph
stays valid. Fresh prefill over an fp8 cache reads the new K/V quantized as the cache holds them
(torch_ref.quantize_kv, bit for bit _store_kv_kernel's), as TorchBackend does, so a token's output does
not depend on how its prompt was chunked or cached.

Under TRITON_INTERPRET=1 (read at import: utils/triton_mode.py) the kernels run on CPU tensors in
Triton's interpreter, as the tests check them against TorchBackend.
"""
import functools

import torch
import triton
import triton.language as tl

from nanovllm.layers import fused_triton
from nanovllm.layers.backends.torch_ref import FP8_KV_DTYPE, quantize_kv
from nanovllm.utils.context import Context

LOG2E = 1.4426950408889634     # exp(x) == exp2(x * log2(e))
# The initial running max (see above); a constexpr, as @triton.jit code may read no other globals.
NEG_BIG = tl.constexpr(-1.0e30)
LOG2E_JIT = tl.constexpr(LOG2E)  # (the same, for @triton.jit code)
FP8_MAX = tl.constexpr(448.0)  # e4m3fn's largest finite value (torch_ref.FP8_MAX): stored values clamp there

# Tile sizes, each >= 16 (tl.dot's minimum on NVIDIA GPUs). Chosen by compiling for sm_90, untimed:
# ptxas reports no spills for bf16/fp16 at head_dim 64 and 128 (D=128: prefill ~190 registers and
# 80 KB shared memory, decode ~110 registers and 39 KB).
PREFILL_BLOCK_M = 64           # (query, head-in-group) rows per prefill program
PREFILL_BLOCK_N = 64           # keys per inner iteration
# fp32 (tests, not serving) takes the exact ("ieee") FMA path: 64x64 tiles spill kilobytes, 32x16 <= 0.5 KB
PREFILL_BLOCK_M_FP32 = 32
PREFILL_BLOCK_N_FP32 = 16
PREFILL_BLOCK_N_WIDE_HEADS = 32  # head_dim > 128: halves the K/V tiles (no spills at D=256, 96 KB shared)
DECODE_BLOCK_N = 64            # keys per decode iteration (K and V tiles of 64 x D)
STORE_KV_ELEMENTS = 4096       # elements of K (and of V) per store_kv program: 32 per thread of 4 warps
MIN_DOT_ROWS = 16              # the decode kernel pads its H/Hkv query heads to this many rows
MAX_HEAD_DIM = 256             # Q, K and V tiles of BLOCK_D columns must fit in registers/shared memory

# Split-KV (decode_num_splits): few sequences make too few (sequence, kv head) programs to fill the
# GPU; num_splits shares of each context multiply them, at the cost of a reduction pass.
DEFAULT_NUM_SMS = 132          # H100/H200 SXM; used where the device cannot be asked (CPU/interpreter)
TARGET_WAVES = 2               # aim for this many programs per SM, so stragglers balance out
MIN_KEYS_PER_SPLIT = 128       # a share shorter than two tiles is not worth its partial-result traffic
MAX_SPLITS = 64                # bounds the reduce kernel's tile and the partial-result buffers

# Specialization: Triton compiles a variant per key of its integer arguments (== 1: a constant;
# divisible by 16: an alignment hint), so arguments that change between steps are do_not_specialize:
# token counts, the block-table row stride (W grows with an eager step's longest context) and all
# derived from num_splits. The Q/K/V/out/cache strides stay specialized: fixed by the model's shapes,
# innermost 1 (head_dim contiguous: 16-byte vector loads/stores), outer multiples of 16 (rows aligned).
STORE_KV_DYNAMIC_ARGS = ["num_tokens"]
PREFILL_DYNAMIC_ARGS = ["s_bt", "num_seqs", "window"]
# (s_mb = H * num_splits, s_mh = num_splits; window: 0, or a sliding-window layer's)
DECODE_DYNAMIC_ARGS = ["s_bt", "s_mb", "s_mh", "num_splits", "max_queries", "window"]
REDUCE_DYNAMIC_ARGS = ["s_mb", "s_mh", "num_splits", "max_queries"]


# ---- kernels --------------------------------------------------------------------------------
@triton.jit
def _round_to_e4m3(x):
    """fp32 x, |x| <= FP8_MAX -> the nearest e4m3 value (ties to even), still fp32, so that the
    cast to fp8 after it is exact. The GPU's cast (cvt.rn.satfinite) rounds right by itself, but
    Triton's interpreter (3.9) rounds halves up and loses the carry at the top of a binade
    (127.3 became 64), and the kernels must give the reference's bits in both.
    Adding 2^(e + 20) to |x| in [2^e, 2^(e+1)) leaves 23 - 20 = 3 fraction bits, e4m3's, and
    the fp32 addition rounds to nearest even; subnormals (e < -6) share the quantum 2^-9 of e = -6."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = ((exponent + 20 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = (tl.abs(x) + magic) - magic
    return tl.where(bits < 0, -rounded, rounded)                                   # x's sign, -0 included


@triton.jit
def _quantize(x, scale_ptr):
    """A tile of new K or V -> its values in the fp8 cache's units (the cast is the caller's)."""
    x = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr))       # IEEE division, as torch's
    return _round_to_e4m3(tl.clamp(x, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL))  # (NaN stays NaN)


@triton.jit(do_not_specialize=STORE_KV_DYNAMIC_ARGS)
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, num_tokens,
                     s_kt, s_kh, s_kd, s_vt, s_vh, s_vd,
                     s_kcb, s_kcs, s_kch, s_kcd, s_vcb, s_vcs, s_vch, s_vcd,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr):
    """Grid (cdiv(T, BLOCK_T),): BLOCK_T tokens x all (kv head, dim) pairs, flattened to one axis.
    KV_FP8: the caches are fp8; K and V are divided by their scales first (scale_ptrs unread otherwise)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1)       # int64; -1 = padding row: skip
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    hd = tl.arange(0, BLOCK_H * BLOCK_D)
    h = hd // BLOCK_D
    d = hd % BLOCK_D
    mask = (slot >= 0)[:, None] & ((h < NUM_KV_HEADS) & (d < HEAD_DIM))[None, :]
    t = t.to(tl.int64)
    k = tl.load(k_ptr + t[:, None] * s_kt + (h * s_kh + d * s_kd)[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t[:, None] * s_vt + (h * s_vh + d * s_vd)[None, :], mask=mask, other=0.0)
    if KV_FP8:
        k, v = _quantize(k, k_scale_ptr), _quantize(v, v_scale_ptr)
    tl.store(k_cache_ptr + (blk * s_kcb + off * s_kcs)[:, None] + (h * s_kch + d * s_kcd)[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + (blk * s_vcb + off * s_vcs)[:, None] + (h * s_vch + d * s_vcd)[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=PREFILL_DYNAMIC_ARGS)
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, seq_lens_ptr, bt_ptr, k_scale_ptr, v_scale_ptr,
                    sinks_ptr, s_qt, s_qh, s_qd, s_ot, s_oh, s_od,
                    s_k0, s_k1, s_kh, s_kd, s_v0, s_v1, s_vh, s_vd, s_bt,
                    scale_log2, num_seqs, window,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    PAGED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
                    SINKS: tl.constexpr):
    """Grid ((T * GROUP) // BLOCK_M + B, Hkv): work items, see "Work items" at the top.

    PAGED: K/V are caches [num_blocks, block_size, Hkv, D] (s_k0 = block stride, s_k1 = slot
    stride) read through block table row b; the context length is seq_lens[b]. Sequences with
    one new query are the decode kernel's (mixed steps): their programs idle here.
    Not PAGED: K/V are the step's new rows [T, Hkv, D] (s_k1 = row stride, s_k0 unused); the
    context is the sequence's own new rows, cu_q[b] .. cu_q[b+1].
    KV_FP8: K/V (either kind) are fp8, dequantized with the scales (see the module's docstring).
    window > 0: a query at q_pos sees keys q_pos - window + 1 .. q_pos only (sliding-window layers);
    the loop starts at the tile of the first query's first key. SINKS: sinks_ptr [H] (see _sink_share).
    """
    work = tl.program_id(0)
    kvh = tl.program_id(1)
    # b = the last sequence whose first work item is <= work: binary search, first(0) = 0
    lo = work * 0                                        # (an int32 tensor, as the loop updates it)
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (tl.load(cu_q_ptr + mid) * GROUP) // BLOCK_M + mid <= work:
            lo = mid
        else:
            hi = mid
    b = lo
    q_start = tl.load(cu_q_ptr + b)
    n = tl.load(cu_q_ptr + b + 1) - q_start              # new queries of sequence b
    tile = work - (q_start * GROUP) // BLOCK_M - b       # this program's tile of sequence b
    if PAGED:
        length = tl.load(seq_lens_ptr + b)               # context length (cached + new)
        busy = (tile * BLOCK_M < n * GROUP) & (n > 1)
    else:
        length = n
        busy = tile * BLOCK_M < n * GROUP
    if busy:                                             # programs past this sequence's rows idle
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        qi = rows // GROUP                               # query index within the sequence
        head = kvh * GROUP + rows % GROUP                # query head
        row_ok = qi < n
        q_pos = length - n + qi                          # its position; it sees keys 0 .. q_pos
        lowest = tl.where(window > 0, q_pos - window, -1)  # ... and of those only keys past this one
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q_rows = (q_start + qi).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :] * s_qd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        qk_scale = scale_log2
        if KV_FP8:
            qk_scale = scale_log2 * tl.load(k_scale_ptr)
        m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        last_q = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, n - 1)
        kv_end = length - n + last_q + 1                 # keys past the tile's last query are masked anyway
        first_key = tl.where(window > 0, tl.maximum(length - n + (tile * BLOCK_M) // GROUP - window + 1, 0), 0)
        for start_n in range(first_key // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_end
            if PAGED:
                blk = tl.load(bt_ptr + b * s_bt + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
                k_rows = blk * s_k0 + (offs_n % BLOCK_SIZE) * s_k1
                v_rows = blk * s_v0 + (offs_n % BLOCK_SIZE) * s_v1
            else:
                k_rows = (q_start + offs_n).to(tl.int64) * s_k1
                v_rows = (q_start + offs_n).to(tl.int64) * s_v1
            kt = tl.load(k_ptr + k_rows[None, :] + kvh * s_kh + offs_d[:, None] * s_kd,
                         mask=n_ok[None, :] & d_ok[:, None], other=0.0)              # [BLOCK_D, BLOCK_N]
            if KV_FP8:
                kt = kt.to(q.dtype)
            qk = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale            # [BLOCK_M, BLOCK_N]
            visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > lowest[:, None]) & n_ok[None, :]
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))       # finite: m_i starts at NEG_BIG
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_ptr + v_rows[:, None] + kvh * s_vh + offs_d[None, :] * s_vd,
                         mask=n_ok[:, None] & d_ok[None, :], other=0.0)              # [BLOCK_N, BLOCK_D]
            if KV_FP8:
                vt = vt.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
            m_i = m_new
        if KV_FP8:
            acc = acc * tl.load(v_scale_ptr)
        if SINKS:
            l_i += _sink_share(sinks_ptr, head, m_i, row_ok)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :] * s_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _sink_share(sinks_ptr, head, m, ok):
    """Attention sinks (layers/attention_sinks.py): head's sink logit s joins the softmax's sum as
    one more term, exp(s) in the running sum's units 2^(score * log2(e) - m): 2^(s * log2(e) - m)."""
    sink = tl.load(sinks_ptr + head, mask=ok, other=0.0).to(tl.float32)
    return tl.exp2(sink * LOG2E_JIT - m)


@triton.jit
def _decode_queries(b, cu_q_ptr, max_queries, MIXED: tl.constexpr):
    """(first row, count) of sequence b's queries for the decode kernels: with MIXED, its n new
    queries from row cu_q[b] if n <= max_queries (else none: a longer sequence is the prefill
    kernel's); else one query, in row b."""
    if MIXED:
        row0 = tl.load(cu_q_ptr + b)
        n = tl.load(cu_q_ptr + b + 1) - row0
        n = tl.where(n <= max_queries, n, 0)
    else:
        row0 = b
        n = b * 0 + 1
    return row0.to(tl.int64), n


@triton.jit(do_not_specialize=DECODE_DYNAMIC_ARGS)
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_m_ptr, mid_l_ptr,
                   seq_lens_ptr, bt_ptr, cu_q_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr,
                   s_qt, s_qh, s_qd, s_ot, s_oh, s_od,
                   s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, s_bt,
                   s_mb, s_mh, s_ms,                     # mid_m / mid_l [B * max_queries, H, S]; mid_o [.., BLOCK_D]
                   scale_log2, num_splits, max_queries, window,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   SPLIT_KV: tl.constexpr, MIXED: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   KV_FP8: tl.constexpr, SINKS: tl.constexpr):
    """Grid (B, Hkv, num_splits). Sequence b's queries (_decode_queries: one in row b, or MIXED its
    n <= max_queries in rows cu_q[b] ..; a sequence with more idles, cu_q_ptr unused otherwise) at
    positions length - n .. length - 1; a program's rows are its (query, head-in-group) pairs of kv
    head kvh (BLOCK_G >= n * GROUP), each seeing keys up to its own position.

    num_splits and max_queries are runtime values, not constexprs (nor specialized): eager steps
    of different padded batch sizes use different counts, and each would otherwise compile a new
    variant. SPLIT_KV (num_splits > 1) selects writing partials for _reduce_kernel over writing
    `out`, at index b * max_queries + query. KV_FP8: the caches are fp8, dequantized with the
    scales (see the module's docstring). window > 0: each row sees only keys q_pos - window + 1 ..
    q_pos, and the splits share the span from the first query's window on, not the whole context.
    SINKS: sinks_ptr [H], added to the sum here (one split) or by _reduce_kernel (its partials')."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(seq_lens_ptr + b)                   # 0 for CUDA-graph padding rows
    row0, n = _decode_queries(b, cu_q_ptr, max_queries, MIXED)
    length = tl.where(n > 0, length, 0)                  # another kernel's sequence: no keys to read
    r = tl.arange(0, BLOCK_G)
    qi = r // GROUP                                      # the row's query, and its head in the group
    g_ok = qi < n                                        # (none when n = 0: nothing loaded or stored)
    q_pos = length - n + qi                              # the query's position: it sees keys 0 .. q_pos
    lowest = tl.where(window > 0, q_pos - window, -1)    # ... and of those only keys past this one
    # This split's keys: an equal share of the span (the context, or from the tile of the first
    # query's first key), in whole tiles, so no split is empty unless it has fewer tiles than splits.
    span = tl.where(window > 0, tl.maximum(length - n - window + 1, 0), 0) // BLOCK_N * BLOCK_N
    tiles_per_split = tl.cdiv(tl.cdiv(length - span, BLOCK_N), num_splits)
    start = span + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, length)

    head = kvh * GROUP + r % GROUP                       # the query heads sharing kv head kvh
    rows = row0 + qi
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + rows[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :] * s_qd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)                       # [BLOCK_G, BLOCK_D]

    qk_scale = scale_log2
    if KV_FP8:
        qk_scale = scale_log2 * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        blk = tl.load(bt_ptr + b * s_bt + offs_n // BLOCK_SIZE, mask=n_ok, other=-1)
        n_ok = n_ok & (blk >= 0)                         # never follow a -1 (unused) table entry
        blk = blk.to(tl.int64)
        slot = offs_n % BLOCK_SIZE
        kt = tl.load(k_cache_ptr + blk[None, :] * s_kb + slot[None, :] * s_ks + kvh * s_kh + offs_d[:, None] * s_kd,
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)                  # [BLOCK_D, BLOCK_N]
        if KV_FP8:
            kt = kt.to(q.dtype)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale                # [BLOCK_G, BLOCK_N]
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > lowest[:, None])
        qk = tl.where(n_ok[None, :] & visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_cache_ptr + blk[:, None] * s_vb + slot[:, None] * s_vs + kvh * s_vh + offs_d[None, :] * s_vd,
                     mask=n_ok[:, None] & d_ok[None, :], other=0.0)                  # [BLOCK_N, BLOCK_D]
        if KV_FP8:
            vt = vt.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
        m_i = m_new

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    if SPLIT_KV:
        mid = (b.to(tl.int64) * max_queries + qi) * s_mb + head * s_mh + split * s_ms   # [BLOCK_G]
        tl.store(mid_m_ptr + mid, m_i, mask=g_ok)
        tl.store(mid_l_ptr + mid, l_i, mask=g_ok)
        tl.store(mid_o_ptr + mid[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_ok[:, None])
    else:
        if SINKS:
            l_i += _sink_share(sinks_ptr, head, m_i, g_ok)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :] * s_od,
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=REDUCE_DYNAMIC_ARGS)
def _reduce_kernel(out_ptr, mid_o_ptr, mid_m_ptr, mid_l_ptr, cu_q_ptr, sinks_ptr,
                   s_ot, s_oh, s_od, s_mb, s_mh, s_ms, num_splits, max_queries,
                   HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_D: tl.constexpr, MIXED: tl.constexpr, SINKS: tl.constexpr):
    """Grid (B * max_queries, H): for query i of sequence b (program b * max_queries + i; as
    _decode_kernel, _decode_queries' rows), out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,
    M = max_s m_s. A query the sequence does not have reads and stores nothing."""
    p = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    b = p // max_queries
    i = p % max_queries
    row0, n = _decode_queries(b, cu_q_ptr, max_queries, MIXED)
    s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = s < tl.where(i < n, num_splits, 0)
    d_ok = offs_d < tl.where(i < n, HEAD_DIM, 0)
    mid = p * s_mb + h * s_mh + s * s_ms
    m = tl.load(mid_m_ptr + mid, mask=s_ok, other=NEG_BIG)
    l = tl.load(mid_l_ptr + mid, mask=s_ok, other=0.0)
    acc = tl.load(mid_o_ptr + mid[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))                        # empty splits: m = NEG_BIG, l = 0, acc = 0
    total = tl.sum(w * l, 0)
    if SINKS:
        total += _sink_share(sinks_ptr, h, tl.max(m, 0), i < n)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + (row0 + i) * s_ot + h * s_oh + offs_d * s_od, out.to(out_ptr.dtype.element_ty), mask=d_ok)


# ---- host side ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (host-side metadata, no sync)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def decode_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int = DEFAULT_NUM_SMS) -> int:
    """How many shares each decode context is split into, from shapes only (CUDA-graph safe).

    Enough that batch * num_kv_heads * splits reaches TARGET_WAVES programs per SM, with no share of
    max_context (the bound on every context) under MIN_KEYS_PER_SPLIT, at most MAX_SPLITS. E.g. 132
    SMs, 8 kv heads, 4096 tokens: batch 1 -> 32 splits; batch 8 -> 5; batch >= 33 -> 1 (no reduce).
    """
    want = triton.cdiv(TARGET_WAVES * num_sms, max(1, batch * num_kv_heads))
    cap = max(1, max_context // MIN_KEYS_PER_SPLIT)
    return max(1, min(want, cap, MAX_SPLITS))


def context_num_splits(context: Context, num_kv_heads: int, block_size: int, num_sms: int) -> int:
    """The split count of a decode step, from what its context says about the step's bounds.

    From context.padded_batch and max_model_len, not the batch or block-table width, which differ
    between an eager step (B rows, W = its longest context's blocks) and its graph replay (padded
    rows, W = max_blocks_per_seq): another count sums other tiles in another order, i.e. other bf16
    bits. Without those fields (direct calls, tests; padded_batch 0: a mixed step's decode rows, B
    counting its prefill chunks too) B and W stand in.
    """
    batch = context.padded_batch or context.block_tables.shape[0]
    bound = context.max_model_len or context.block_tables.shape[1] * block_size
    return decode_num_splits(batch, num_kv_heads, bound, num_sms)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands would otherwise go through TF32 on NVIDIA GPUs (10-bit mantissa)
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(head_dim: int) -> int:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"triton attention supports head_dim 1..{MAX_HEAD_DIM}, got {head_dim}")
    return max(MIN_DOT_ROWS, triton.next_power_of_2(head_dim))    # non-powers of two are masked


def _check(q: torch.Tensor, k: torch.Tensor | None, context: Context) -> tuple[int, int, int]:
    """(H, Hkv, D), after checking what the kernels rely on. k: [T, Hkv, D] or a cache [.., Hkv, D]."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if k.shape[-1] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != k head_dim {k.shape[-1]}")
    if context.cu_seqlens_q is None:
        raise ValueError("triton attention needs context.cu_seqlens_q")
    return num_heads, num_kv_heads, head_dim


def prefill_num_work_items(num_tokens: int, batch: int, group: int, block_m: int) -> int:
    """Programs per kv head of _prefill_kernel (see "Work items" at the top), from shapes only: T
    (q's rows, >= cu_seqlens_q[B]) and B."""
    return num_tokens * group // block_m + batch


def _may_have_decode_rows(context: Context) -> bool:
    """False only when the host copy of cu_seqlens_q shows no sequence with one new query (the decode
    launch would be all idle). O(1) in a mixed step (the scheduler puts decoding sequences first)."""
    cu = context.cu_seqlens_q_cpu
    return cu is None or any(b - a == 1 for a, b in zip(cu, cu[1:]))


def kv_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None):
    """The scale tensors the kernels are handed: the layer's when the cache is fp8 (None: 1.0,
    for callers without a layer: tests, the benchmark); else any tensor, never read."""
    if cache.dtype != FP8_KV_DTYPE:
        return cache, cache
    one = torch.ones((), dtype=torch.float32, device=cache.device) if k_scale is None or v_scale is None else None
    return (one if k_scale is None else k_scale), (one if v_scale is None else v_scale)


def _prefill(q, k, v, k_cache, v_cache, context: Context, scale: float, out: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, window: int = 0,
             sinks: torch.Tensor | None = None):
    num_heads, num_kv_heads, head_dim = _check(q, k if k is not None else k_cache, context)
    group = num_heads // num_kv_heads
    batch = context.cu_seqlens_q.shape[0] - 1
    paged = context.block_tables is not None
    if paged:                               # (forward checked that there is a cache)
        key, value, block_size, bt = k_cache, v_cache, k_cache.shape[1], context.block_tables
        ks, vs, s_bt = k_cache.stride(), v_cache.stride(), bt.stride(0)
        seq_lens = context.seq_lens_k
    else:                                   # the new rows are the whole context
        key, value, block_size, bt = k, v, 1, context.cu_seqlens_q                   # bt unused
        if k_cache is not None and k_cache.dtype == FP8_KV_DTYPE:                    # as the cache holds them
            key, value = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
        ks, vs, s_bt = (0,) + key.stride(), (0,) + value.stride(), 0
        seq_lens = context.cu_seqlens_q                                              # unused
    k_scale, v_scale = kv_scales(key, k_scale, v_scale)
    block_m, block_n = ((PREFILL_BLOCK_M_FP32, PREFILL_BLOCK_N_FP32) if q.dtype == torch.float32
                        else (PREFILL_BLOCK_M, PREFILL_BLOCK_N))
    block_d = _block_d(head_dim)
    if block_d > 128:                       # D=256: 64-key tiles need 160 KB of shared memory and spill
        block_n = min(block_n, PREFILL_BLOCK_N_WIDE_HEADS)
    if paged and _may_have_decode_rows(context):     # the decode rows of a mixed step: split-KV decode
        num_splits = context_num_splits(context, num_kv_heads, block_size, _num_sms(q.device))
        decode(q, k_cache, v_cache, seq_lens, bt, scale, out, num_splits, cu_seqlens_q=context.cu_seqlens_q,
               k_scale=k_scale, v_scale=v_scale, window=window, sinks=sinks)
    grid = (prefill_num_work_items(q.shape[0], batch, group, block_m), num_kv_heads)
    _prefill_kernel[grid](
        q, key, value, out, context.cu_seqlens_q, seq_lens, bt, k_scale, v_scale, q if sinks is None else sinks,
        *q.stride(), *out.stride(), *ks, *vs, s_bt,
        scale * LOG2E, batch, window,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, PAGED=paged,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(q.dtype), KV_FP8=key.dtype == FP8_KV_DTYPE, SINKS=sinks is not None,
        num_warps=4, num_stages=2)
    return out


def decode_max_queries(context: Context, group: int, dtype: torch.dtype, head_dim: int) -> int:
    """The queries per sequence a paged step's split-KV decode launch takes: 1 for a decode step; a
    verify step's (or any step whose sequences each have a few new tokens) max_seqlen_q when its
    rows, max_seqlen_q * group, fit a decode program (decode_max_rows); else 0 (the prefill kernel)."""
    if context.decode_only:
        return 1
    fits = 1 < context.max_seqlen_q and context.max_seqlen_q * group <= decode_max_rows(dtype, head_dim)
    return context.max_seqlen_q if fits else 0


def decode_max_rows(dtype: torch.dtype, head_dim: int) -> int:
    """(query, head) rows one decode program may take: the prefill kernel's 64 (32 past head_dim
    128), 16 in fp32. Compiled for sm_90 under triton 3.6 (ptxas via cuobjdump, no GPU), 64 rows
    at D=128 take ~210 registers and 82 KB shared, no spills; at D=256 they spill (104 bytes, 164 KB
    shared) and 32 rows do not; exact fp32 spills 6 KB at 32 rows, none at 16."""
    if dtype == torch.float32:
        return MIN_DOT_ROWS
    return PREFILL_BLOCK_M if _block_d(head_dim) <= 128 else PREFILL_BLOCK_M // 2


def _decode_block_g(group: int, max_queries: int, dtype: torch.dtype, head_dim: int) -> int:
    """A decode program's rows: its kv head's query heads (padded to tl.dot's 16); with more queries
    per sequence, always decode_max_rows, whatever max_queries: one compiled variant for every
    verify step (1 + k varies with the drafts) and mixed step of short chunks."""
    if max_queries == 1:
        return max(MIN_DOT_ROWS, triton.next_power_of_2(group))
    rows = decode_max_rows(dtype, head_dim)
    if max_queries * group > rows:
        raise ValueError(f"max_queries ({max_queries}) x {group} query heads per kv head must be at most "
                         f"{rows} rows (decode_max_rows for {dtype}, head_dim {head_dim})")
    return rows


def decode(q, k_cache, v_cache, seq_lens_k, block_tables, scale: float, out: torch.Tensor | None = None,
           num_splits: int | None = None, cu_seqlens_q: torch.Tensor | None = None,
           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
           max_queries: int = 1, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Split-KV paged decode: q [B, H, D], one query per sequence at its last position.

    cu_seqlens_q [B+1]: q and out are all T rows of the step, [T, H, D], and only the sequences with
    at most max_queries new rows are attended (their rows of out written): a mixed step's one-token
    rows (max_queries 1), or a verify step's 1 + k (each row sees keys up to its own position).
    No host sync: CUDA-graph safe. num_splits=None: decode_num_splits of these shapes. k_scale,
    v_scale: see kv_scales. window > 0: sliding-window attention (each row its last `window` keys).
    sinks [H] (float32): attention sinks' logits (layers/attention_sinks.py).
    """
    num_rows, num_heads, head_dim = q.shape
    batch = block_tables.shape[0]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if cu_seqlens_q is None and num_rows != batch:
        raise ValueError(f"decode needs one query row per sequence: q has {num_rows} rows, "
                         f"block_tables {batch}")
    if cu_seqlens_q is not None and cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries for {batch} sequences (needs B+1)")
    group = num_heads // num_kv_heads
    if (isinstance(max_queries, bool) or not isinstance(max_queries, int) or max_queries < 1
            or (cu_seqlens_q is None and max_queries != 1)):
        raise ValueError(f"max_queries must be 1, or with cu_seqlens_q an int >= 1, got {max_queries!r}")
    block_d = _block_d(head_dim)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size, _num_sms(q.device))
    if num_splits > 1:
        mid_m = torch.empty((batch * max_queries, num_heads, num_splits), dtype=torch.float32, device=q.device)
        mid_l = torch.empty_like(mid_m)
        mid_o = torch.empty((batch * max_queries, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
    else:                                   # the kernel writes `out` directly; these are not touched
        mid_m = mid_l = mid_o = out
    mixed = cu_seqlens_q is not None
    cu_q = cu_seqlens_q if mixed else seq_lens_k   # (not read unless mixed: any int32 tensor will do)
    k_scale, v_scale = kv_scales(k_cache, k_scale, v_scale)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, mid_o, mid_m, mid_l, seq_lens_k, block_tables, cu_q, k_scale, v_scale,
        q if sinks is None else sinks, *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        num_heads * num_splits, num_splits, 1,
        scale * LOG2E, num_splits, max_queries, window,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, SPLIT_KV=num_splits > 1, MIXED=mixed,
        BLOCK_G=_decode_block_g(group, max_queries, q.dtype, head_dim), BLOCK_N=DECODE_BLOCK_N,
        BLOCK_D=block_d, DOT_PRECISION=_dot_precision(q.dtype), KV_FP8=k_cache.dtype == FP8_KV_DTYPE,
        SINKS=sinks is not None, num_warps=4, num_stages=2)
    if num_splits > 1:
        _reduce_kernel[(batch * max_queries, num_heads)](
            out, mid_o, mid_m, mid_l, cu_q, q if sinks is None else sinks, *out.stride(), num_heads * num_splits,
            num_splits, 1, num_splits, max_queries, HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d, MIXED=mixed, SINKS=sinks is not None, num_warps=4)
    return out


class TritonBackend:
    elementwise = fused_triton  # (imported as this module is: in the same Triton mode)

    @staticmethod
    def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        """k, v [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at slot_mapping [T] (int64, -1 = skip);
        an fp8 cache gets them quantized (k_scale, v_scale: see kv_scales)."""
        num_tokens, num_kv_heads, head_dim = k.shape
        if num_tokens == 0:
            return
        block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
        block_t = max(1, STORE_KV_ELEMENTS // (block_h * block_d))
        k_scale, v_scale = kv_scales(k_cache, k_scale, v_scale)
        _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
            k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, num_tokens,
            *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
            BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, KV_FP8=k_cache.dtype == FP8_KV_DTYPE,
            num_warps=4)

    @staticmethod
    def forward(q, k, v, k_cache, v_cache, context: Context, scale: float, k_scale=None, v_scale=None,
                window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]; the same semantics as TorchBackend.forward
        (window > 0, sinks [H]: layers/sliding_window.py's WindowedTorchBackend's)."""
        _check(q, k if k is not None else k_cache, context)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] == 0:
            return out
        if context.block_tables is not None and k_cache is None:
            raise ValueError("context.block_tables is set but the attention layer has no KV cache")
        num_kv_heads = k_cache.shape[2] if k_cache is not None else 0
        max_queries = (decode_max_queries(context, q.shape[1] // num_kv_heads, q.dtype, q.shape[2])
                       if context.block_tables is not None else 0)
        if max_queries:                 # decode, or a verify step: split-KV decode for every sequence
            num_splits = context_num_splits(context, num_kv_heads, k_cache.shape[1], _num_sms(q.device))
            return decode(q, k_cache, v_cache, context.seq_lens_k, context.block_tables, scale, out, num_splits,
                          cu_seqlens_q=None if context.decode_only else context.cu_seqlens_q,
                          k_scale=k_scale, v_scale=v_scale, max_queries=max_queries, window=window, sinks=sinks)
        return _prefill(q, k, v, k_cache, v_cache, context, scale, out, k_scale, v_scale, window, sinks)
