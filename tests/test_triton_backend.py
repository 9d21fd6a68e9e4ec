"""The Triton attention backend against the torch reference.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, which
@triton.jit reads when nanovllm.layers.backends.triton_attn is imported, so it is set before
that). On a CUDA machine the variable is left alone and the same tests run the compiled kernels
on the GPU; setting it there would make every later import of the backend in this pytest
process interpreted, GPU tests included. Sizes are small: the interpreter is slow.
"""
import inspect
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed: the Triton attention backend is untested here")

from nanovllm.layers.backends import triton_attn  # noqa: E402
from nanovllm.layers.backends.torch_ref import TorchBackend  # noqa: E402
from nanovllm.engine.step_inputs import graph_batch_sizes, padded_batch_size  # noqa: E402
from nanovllm.layers.backends.triton_attn import (TritonBackend, context_num_splits, decode,  # noqa: E402
                                                  decode_num_splits)
from nanovllm.utils.context import Context  # noqa: E402

# Ask the module, not the environment: it may have been imported before this file set the variable.
INTERPRETED = type(triton_attn._decode_kernel).__name__ == "InterpretedFunction"
DEVICE = "cpu" if INTERPRETED else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("the Triton backend was imported compiled (TRITON_INTERPRET off) and there is no CUDA device",
                allow_module_level=True)

if INTERPRETED:
    import triton  # noqa: E402
    import triton.language as tl  # noqa: E402

    @triton.jit
    def _count_to(x_ptr):
        n = tl.load(x_ptr)
        count = 0
        for _ in range(0, n, 1):                      # a loop bound read from memory, as the kernels have
            count += 1
        tl.store(x_ptr, count)

    def _interpreter_runs_loaded_loop_bounds() -> bool:
        """Older interpreters (triton 3.6) call int() on a 1-element array for such a bound, which
        numpy >= 2.4 refuses; triton 3.9 squeezes it first."""
        x = torch.tensor([3], dtype=torch.int32)
        try:
            _count_to[(1,)](x)
        except Exception:
            return False
        return x.item() == 3

    if not _interpreter_runs_loaded_loop_bounds():
        import numpy
        pytest.skip(f"triton {triton.__version__}'s interpreter cannot run loops with bounds loaded from memory "
                    f"under numpy {numpy.__version__} (fixed in newer triton)", allow_module_level=True)

ATOL, RTOL = 2e-5, 1e-4          # float32; the kernels accumulate in fp32 like the reference


@pytest.fixture(autouse=True)
def interpreter_tiles(request, monkeypatch):
    """fp32 prefill uses 32 x 16 tiles (what compiles without spills on the GPU's exact-fp32 path);
    the interpreter's cost is per tile, so most tests here run fp32 on the bf16 tiles (64 x 64).
    Tests decorated with @gpu_tiles keep the real ones. The masking logic is the same for both."""
    if INTERPRETED and not getattr(request.function, "gpu_tiles", False):
        monkeypatch.setattr(triton_attn, "PREFILL_BLOCK_M_FP32", triton_attn.PREFILL_BLOCK_M)
        monkeypatch.setattr(triton_attn, "PREFILL_BLOCK_N_FP32", triton_attn.PREFILL_BLOCK_N)


def gpu_tiles(test):
    test.gpu_tiles = True
    return test


def assert_close(out, ref, atol=ATOL, rtol=RTOL):
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol)


# ---- building steps -----------------------------------------------------------------------------
class PagedCache:
    """Random K/V caches [num_blocks, block_size, Hkv, D] and, per sequence, a block table drawn
    from a random permutation of the physical blocks (spare blocks hold garbage too)."""

    def __init__(self, lens, block_size, num_kv_heads, head_dim, gen, dtype=torch.float32, spare_blocks=3):
        self.block_size = block_size
        blocks_per_seq = [max(1, -(-n // block_size)) for n in lens]
        num_blocks = sum(blocks_per_seq) + spare_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.randn(shape, generator=gen).to(dtype)
        self.v = torch.randn(shape, generator=gen).to(dtype)
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        width = max(blocks_per_seq) + 1                      # always at least one -1 column
        self.tables = torch.full((len(lens), width), -1, dtype=torch.int32)
        for i, nb in enumerate(blocks_per_seq):
            self.tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)

    def slots(self, seq: int, positions) -> list[int]:
        bs = self.block_size
        return [int(self.tables[seq, p // bs]) * bs + p % bs for p in positions]

    def to(self, device):
        self.k, self.v, self.tables = self.k.to(device), self.v.to(device), self.tables.to(device)
        return self


def make_context(new_lens, ctx_lens, block_tables=None, slot_mapping=None, device=DEVICE) -> Context:
    """Every field the model runner fills: B sequences, new_lens[i] new tokens over ctx_lens[i] in all."""
    cu_q, cu_k = [0], [0]
    for n, length in zip(new_lens, ctx_lens):
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + length)
    i32 = dict(dtype=torch.int32, device=device)
    return Context(
        cu_seqlens_q=torch.tensor(cu_q, **i32), cu_seqlens_k=torch.tensor(cu_k, **i32),
        seq_lens_k=torch.tensor(ctx_lens, **i32), max_seqlen_q=max(new_lens), max_seqlen_k=max(ctx_lens),
        slot_mapping=None if slot_mapping is None else torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        block_tables=None if block_tables is None else block_tables.to(device),
        decode_only=all(n == 1 for n in new_lens), cu_seqlens_q_cpu=cu_q, seq_lens_k_cpu=list(ctx_lens))


def qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, gen, dtype=torch.float32, q_scale=1.0):
    """q [T, H, D], k, v [T, Hkv, D] as strided views of one packed [T, (H + 2 Hkv) * D] tensor,
    the way a fused qkv projection hands them over."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q * q_scale
    return (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))


def reference(q, k, v, cache, context, scale):
    """TorchBackend on CPU (it loops over sequences with the *_cpu fields)."""
    ctx = make_context([b - a for a, b in zip(context.cu_seqlens_q_cpu, context.cu_seqlens_q_cpu[1:])],
                       context.seq_lens_k_cpu, None if context.block_tables is None else context.block_tables.cpu(),
                       device="cpu")
    return TorchBackend.forward(q.cpu().float(), k.cpu().float(), v.cpu().float(),
                                None if cache is None else cache.k.cpu().float(),
                                None if cache is None else cache.v.cpu().float(), ctx, scale)


# ---- store_kv -----------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size, num_kv_heads, head_dim", [(1, 2, 16), (8, 2, 64), (16, 4, 128), (256, 1, 64)])
def test_store_kv_writes_slots_and_skips_minus_one(block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_tokens = 6, 20
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    _, k, v = qkv_views(num_tokens, 2, num_kv_heads, head_dim, gen)      # strided, like the model's
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    if len(slots) < num_tokens:                                          # block_size 1: fewer slots than tokens
        slots = torch.cat([slots, torch.full((num_tokens - len(slots),), -1)])
    slots[[0, 7, num_tokens - 1]] = -1                                   # CUDA-graph padding rows
    slots = slots.to(DEVICE)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    TorchBackend.store_kv(k[keep], v[keep], expect_k, expect_v, slots[keep])
    TritonBackend.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def test_store_kv_with_no_tokens_is_a_no_op():
    cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    empty = torch.zeros(0, 2, 64, device=DEVICE)
    TritonBackend.store_kv(empty, empty, cache, cache, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert not cache.any()


# ---- decode -------------------------------------------------------------------------------------
def decode_lens(block_size):
    """1 token, exactly one block, one block + 1, and a few blocks, in one batch."""
    if block_size >= 256:
        return [1, block_size, block_size + 1, 40, 2 * block_size + 37]
    return [1, block_size, block_size + 1, 3 * block_size + 5, 150]


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 256])
def test_decode_matches_reference(num_heads, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(num_heads * 1000 + num_kv_heads * 100 + head_dim + block_size)
    lens = decode_lens(block_size)
    cache = PagedCache(lens, block_size, num_kv_heads, head_dim, gen).to(DEVICE)
    q, k, v = qkv_views(len(lens), num_heads, num_kv_heads, head_dim, gen, q_scale=2.0)
    context = make_context([1] * len(lens), lens, cache.tables)
    assert context.decode_only
    scale = head_dim ** -0.5
    out = TritonBackend.forward(q, k, v, cache.k, cache.v, context, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, reference(q, k, v, cache, context, scale))


@pytest.mark.parametrize("block_size, head_dim", [(1, 16), (8, 16), (8, 32)])
def test_decode_small_blocks(block_size, head_dim):
    gen = torch.Generator().manual_seed(block_size + head_dim)
    lens = [1, block_size, block_size + 1, 37, 70]
    cache = PagedCache(lens, block_size, 2, head_dim, gen).to(DEVICE)
    q, k, v = qkv_views(len(lens), 4, 2, head_dim, gen)
    context = make_context([1] * len(lens), lens, cache.tables)
    out = TritonBackend.forward(q, k, v, cache.k, cache.v, context, 0.3)
    assert_close(out, reference(q, k, v, cache, context, 0.3))


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_decode_split_counts_agree(num_splits):
    """Any number of splits, including more splits than a context has tiles (empty splits)."""
    gen = torch.Generator().manual_seed(num_splits)
    lens = [1, 16, 17, 64, 65, 300]
    cache = PagedCache(lens, 16, 2, 64, gen).to(DEVICE)
    q, k, v = qkv_views(len(lens), 8, 2, 64, gen, q_scale=3.0)
    context = make_context([1] * len(lens), lens, cache.tables)
    out = decode(q, cache.k, cache.v, context.seq_lens_k, context.block_tables, 0.125, num_splits=num_splits)
    assert_close(out, reference(q, k, v, cache, context, 0.125))


def test_decode_cuda_graph_padding_rows():
    """Padded rows of a captured batch: context length 0, block-table row all -1, slot -1.
    The real rows are exact and the padded ones finite (zeros), whatever the split count."""
    gen = torch.Generator().manual_seed(7)
    lens = [5, 33, 100]
    cache = PagedCache(lens, 16, 2, 64, gen).to(DEVICE)
    q, k, v = qkv_views(len(lens) + 2, 4, 2, 64, gen)
    tables = torch.cat([cache.tables.cpu(), torch.full((2, cache.tables.shape[1]), -1, dtype=torch.int32)])
    seq_lens = torch.tensor(lens + [0, 0], dtype=torch.int32, device=DEVICE)
    ref = reference(q[:3], k[:3], v[:3], cache, make_context([1] * 3, lens, cache.tables), 0.125)
    for num_splits in (1, 4):
        out = decode(q, cache.k, cache.v, seq_lens, tables.to(DEVICE), 0.125, num_splits=num_splits)
        assert_close(out[:3], ref)
        assert torch.equal(out[3:].cpu(), torch.zeros_like(out[3:].cpu()))


def test_decode_num_splits_heuristic():
    # few sequences: split to fill ~2 programs per SM, within the bound's share limit
    assert decode_num_splits(1, 8, 4096, 132) == 32
    assert decode_num_splits(8, 8, 4096, 132) == 5
    # many sequences fill the GPU already: no split, no reduce pass
    assert decode_num_splits(256, 8, 4096, 132) == 1
    assert decode_num_splits(33, 8, 4096, 132) == 1
    # short bound: at most max_context // 128 shares; never below 1, never above MAX_SPLITS
    assert decode_num_splits(1, 1, 300, 132) == 2
    assert decode_num_splits(1, 1, 16, 132) == 1
    assert decode_num_splits(1, 1, 1 << 20, 132) == triton_attn.MAX_SPLITS


def runner_context(new_lens, ctx_lens, block_tables, max_model_len, slot_mapping=None) -> Context:
    """make_context plus the split-count fields the model runner fills (ladder of max_num_seqs 8)."""
    context = make_context(new_lens, ctx_lens, block_tables, slot_mapping)
    context.max_model_len = max_model_len
    if context.decode_only:
        context.padded_batch = padded_batch_size(len(new_lens), graph_batch_sizes(8))
    return context


def test_context_num_splits_contract():
    """From the padded batch and max_model_len alone: not the batch, the block-table width or the
    lengths, which differ between an eager step and its graph replay; B and W only as a fallback."""
    narrow, wide = torch.zeros(3, 2, dtype=torch.int32), torch.zeros(4, 256, dtype=torch.int32)
    expect = decode_num_splits(4, 2, 4096, 132)
    for tables, lens in ((narrow, [5, 6, 20]), (wide, [5, 6, 20, 4000])):
        context = Context(block_tables=tables, seq_lens_k=torch.tensor(lens), decode_only=True, padded_batch=4,
                          max_model_len=4096)
        assert context_num_splits(context, 2, 16, 132) == expect
    assert context_num_splits(Context(block_tables=narrow), 2, 16, 132) == decode_num_splits(3, 2, 32, 132)
    assert context_num_splits(Context(block_tables=narrow, padded_batch=1, max_model_len=4096), 8, 16, 132) == 32


def test_decode_row_is_bit_identical_whatever_the_other_rows():
    """Row 0 (300 tokens) decodes to the same bits: in a batch of short rows with a narrow block
    table, beside a 1900-token row (a wider table), and as a CUDA-graph replay sees it (a padding
    row, the max_model_len-wide table). All three pad to 4 rows, so they split alike."""
    gen = torch.Generator().manual_seed(21)
    block_size, max_model_len = 16, 2048
    lens = [300, 5, 40, 1900]
    cache = PagedCache(lens, block_size, 2, 32, gen).to(DEVICE)
    q, k, v = qkv_views(4, 4, 2, 32, gen, q_scale=2.0)
    tables = cache.tables.cpu()
    short = runner_context([1] * 3, lens[:3], tables[:3, :20].contiguous(), max_model_len)   # 300 tokens: 19 blocks
    longer = runner_context([1] * 4, lens, tables, max_model_len)
    graph_tables = torch.full((4, max_model_len // block_size), -1, dtype=torch.int32)
    graph_tables[:3, :tables.shape[1]] = tables[:3]
    graph = runner_context([1] * 4, lens[:3] + [0], graph_tables, max_model_len)         # row 3: padding
    outs = [TritonBackend.forward(q[:len(c.seq_lens_k)], None, None, cache.k, cache.v, c, 0.125)
            for c in (short, longer, graph)]
    for out in outs[1:]:
        assert torch.equal(out[:3].cpu(), outs[0].cpu())
    assert_close(outs[0], reference(q[:3], k[:3], v[:3], cache, make_context([1] * 3, lens[:3], tables[:3]), 0.125))


# ---- compiled variants --------------------------------------------------------------------------
def specialization_key(value):
    """What Triton's compile cache keys a runtime argument on (triton/runtime/jit.py, specialize_impl):
    ints by type and by being 1 or divisible by 16, pointers by dtype and 16-byte alignment,
    floats by type alone. (Constexprs and launch options: by value.)"""
    if isinstance(value, torch.Tensor):
        return str(value.dtype), value.data_ptr() % 16 == 0
    if isinstance(value, bool) or not isinstance(value, int):
        return value if isinstance(value, (bool, str)) else type(value).__name__
    return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64", value == 1, value % 16 == 0


def unspecialized(kernel) -> set[str]:
    """The kernel's do_not_specialize names (JITFunction keeps them; the interpreter's wrapper its kwargs)."""
    names = kernel.do_not_specialize if hasattr(kernel, "do_not_specialize") else kernel.kwargs["do_not_specialize"]
    params = list(inspect.signature(kernel.fn).parameters)
    return {params[n] if isinstance(n, int) else n for n in names or ()}


class VariantCounter:
    """Stands in for a kernel: keys each launch as Triton's compile cache would; launches it if asked."""

    def __init__(self, kernel, launch: bool):
        self.kernel, self.launch = kernel, launch
        params = inspect.signature(kernel.fn).parameters
        self.params = list(params)
        self.runtime = {name for name, p in params.items() if "constexpr" not in str(p.annotation)}
        self.dynamic = unspecialized(kernel)
        self.keys = set()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = {**dict(zip(self.params, args)), **kwargs}   # kwargs: constexprs and launch options
            self.keys.add(tuple((name, specialization_key(value) if name in self.runtime else value)
                                for name, value in sorted(named.items()) if name not in self.dynamic))
            if self.launch:
                self.kernel[grid](*args, **kwargs)
        return launch


def count_variants(monkeypatch, launch: bool) -> dict:
    counters = {name: VariantCounter(getattr(triton_attn, name), launch)
                for name in ("_store_kv_kernel", "_prefill_kernel", "_decode_kernel", "_reduce_kernel")}
    for name, counter in counters.items():
        monkeypatch.setattr(triton_attn, name, counter)
    return counters


def test_no_new_kernel_variants_after_warm_up(monkeypatch):
    """After one step of each kind (a fresh prefill, a mixed step over the cache, decode at each
    padded batch size), steps of other sizes compile nothing new: token counts, block-table widths
    and split counts are not specialized on."""
    counters = count_variants(monkeypatch, launch=False)
    gen = torch.Generator().manual_seed(0)
    lens = [2 * 16 * 16 + 3] * 8                               # up to 33 blocks: widths 1 .. 34
    cache = PagedCache(lens, 16, 2, 32, gen).to(DEVICE)
    tables = cache.tables.cpu()

    def step(new, cached, width):                              # the runner's tables are [B, width], contiguous
        ctx_lens = [c + n for c, n in zip(cached, new)]
        slots = [s for i, (c, n) in enumerate(zip(cached, new)) for s in cache.slots(i, range(c, c + n))]
        table = tables[:len(new), :width].contiguous() if any(cached) else None
        context = runner_context(new, ctx_lens, table, 512, slots)
        q, k, v = qkv_views(sum(new), 4, 2, 32, gen)
        TritonBackend.store_kv(k, v, cache.k, cache.v, context.slot_mapping)
        TritonBackend.forward(q, k, v, cache.k, cache.v, context, 0.125)

    def variants():
        return {name: len(counter.keys) for name, counter in counters.items()}

    step([5, 7], [0, 0], 1)                                    # fresh prefill
    step([20, 1], [3, 40], 4)                                  # mixed: a chunk over a cached prefix + a decode
    for batch in graph_batch_sizes(8):                         # decode at each padded size
        step([1] * batch, [17] * batch, 2)
    warm = variants()
    step([1], [0], 1)                                          # one token: num_tokens == 1
    step([16, 16], [0, 0], 1)                                  # num_tokens divisible by 16
    step([1, 15], [500, 16], 33)                               # another width
    step([1, 3, 12], [255, 16, 500], 32)                       # a width divisible by 16
    for batch, width in ((3, 16), (5, 33), (7, 17), (8, 32), (1, 1)):
        step([1] * batch, [min(16 * width - 1, 400)] * batch, width)
    assert variants() == warm


@pytest.mark.skipif(not INTERPRETED, reason="an engine run on CPU; on the GPU, gpu_check.sh times bench.py itself")
def test_bench_warm_up_compiles_every_variant_of_the_run(monkeypatch):
    """bench.py's warm-up launches every kernel variant its timed run launches: the run chunks
    prompts, mixes prefill chunks with decodes and decodes at many batch sizes and widths (in 2
    splits and a reduce, with max_model_len 320 in the context)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bench
    counters = count_variants(monkeypatch, launch=True)
    after_warm_up = {}
    warm_up = bench.warm_up

    def warm_up_then_count(llm, prompts):
        warm_up(llm, prompts)
        after_warm_up.update({name: set(counter.keys) for name, counter in counters.items()})
    monkeypatch.setattr(bench, "warm_up", warm_up_then_count)
    result = bench.main(["--dummy", "qwen3-tiny", "--num-seqs", "5", "--min-input-len", "8", "--max-input-len", "40",
                         "--min-output-len", "2", "--max-output-len", "9", "--device", "cpu", "--max-model-len", "320",
                         "--max-num-batched-tokens", "64", "--attention-backend", "triton"])
    assert result["attention_backend"] == "triton" and after_warm_up
    new = {name: counter.keys - after_warm_up[name] for name, counter in counters.items()}
    assert new == dict.fromkeys(counters, set())


def test_dynamic_args_are_real_kernel_args():
    """The do_not_specialize names are parameters of their kernels (a typo would silently do nothing)."""
    for kernel, names in ((triton_attn._store_kv_kernel, triton_attn.STORE_KV_DYNAMIC_ARGS),
                          (triton_attn._prefill_kernel, triton_attn.PREFILL_DYNAMIC_ARGS),
                          (triton_attn._decode_kernel, triton_attn.DECODE_DYNAMIC_ARGS),
                          (triton_attn._reduce_kernel, triton_attn.REDUCE_DYNAMIC_ARGS)):
        assert set(names) == unspecialized(kernel) and set(names) <= set(inspect.signature(kernel.fn).parameters)


# ---- prefill ------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_prefill_fresh_kv(num_heads, num_kv_heads, head_dim):
    """No cached context: block_tables is None and the new K/V are each sequence's whole context."""
    gen = torch.Generator().manual_seed(num_heads * 100 + num_kv_heads * 10 + head_dim)
    lens = [1, 7, 33, 64, 90]
    q, k, v = qkv_views(sum(lens), num_heads, num_kv_heads, head_dim, gen, q_scale=2.0)
    context = make_context(lens, lens)
    scale = head_dim ** -0.5
    out = TritonBackend.forward(q, k, v, None, None, context, scale)
    assert_close(out, reference(q, k, v, None, context, scale))


def test_decode_only_step_without_cached_context():
    """The first step of one-token prompts: decode_only, yet block_tables is None."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = qkv_views(4, 4, 2, 64, gen)
    context = make_context([1] * 4, [1] * 4)
    assert context.decode_only and context.block_tables is None
    out = TritonBackend.forward(q, k, v, None, None, context, 0.125)
    assert_close(out, reference(q, k, v, None, context, 0.125))


# Every pair of (GQA ratio, head_dim, block_size) values appears in one of these: the full product
# costs twice as long under the interpreter and finds nothing the pairs do not.
MIXED_CASES = [(4, 4, 64, 16), (4, 4, 128, 256), (4, 2, 64, 256), (4, 2, 128, 16), (8, 2, 64, 16), (8, 2, 128, 256)]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", MIXED_CASES)
def test_mixed_step_over_paged_cache(num_heads, num_kv_heads, head_dim, block_size):
    """Prefill chunks after cached prefixes, a prompt with no cache, and decode rows, in one step:
    store_kv first, then attention through the block tables (decode_only is False)."""
    gen = torch.Generator().manual_seed(num_heads * 7 + num_kv_heads * 5 + head_dim + block_size)
    cached = [0, block_size, 3, 0, block_size + 1, min(2 * block_size - 1, block_size + 60), 70]
    new = [30, 17, 1, 1, 1, 20, 37]            # rows 2-4 are decode rows; row 3 a 1-token prompt
    lens = [c + n for c, n in zip(cached, new)]
    cache = PagedCache(lens, block_size, num_kv_heads, head_dim, gen).to(DEVICE)
    q, k, v = qkv_views(sum(new), num_heads, num_kv_heads, head_dim, gen, q_scale=2.0)
    slots = [s for i, (c, n) in enumerate(zip(cached, new)) for s in cache.slots(i, range(c, c + n))]
    context = make_context(new, lens, cache.tables, slots)
    assert not context.decode_only
    TritonBackend.store_kv(k, v, cache.k, cache.v, context.slot_mapping)
    scale = head_dim ** -0.5
    out = TritonBackend.forward(q, k, v, cache.k, cache.v, context, scale)
    assert_close(out, reference(q, k, v, cache, context, scale))


def test_head_dim_and_block_size_not_powers_of_two():
    """head_dim 48 (masked to a 64-wide tile) and block_size 12: store, mixed step, decode."""
    test_mixed_step_over_paged_cache(6, 2, 48, 12)
    test_decode_small_blocks(12, 48)


def test_head_dim_256():
    """head_dim above 128 takes narrower prefill key tiles (PREFILL_BLOCK_N_WIDE_HEADS)."""
    gen = torch.Generator().manual_seed(256)
    lens = [3, 40]
    q, k, v = qkv_views(sum(lens), 4, 2, 256, gen)
    context = make_context(lens, lens)
    out = TritonBackend.forward(q, k, v, None, None, context, 256 ** -0.5)
    assert_close(out, reference(q, k, v, None, context, 256 ** -0.5))
    cache = PagedCache(lens, 16, 2, 256, gen).to(DEVICE)
    context = make_context([1, 1], lens, cache.tables)
    out = TritonBackend.forward(q[:2], None, None, cache.k, cache.v, context, 0.1)
    assert_close(out, reference(q[:2], k[:2], v[:2], cache, context, 0.1))


@gpu_tiles
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 4, 64), (8, 2, 128)])
def test_mixed_step_with_fp32_tiles(num_heads, num_kv_heads, head_dim):
    """The mixed step again, on the 32 x 16 tiles fp32 really uses (block_size 16 < BLOCK_M)."""
    test_mixed_step_over_paged_cache(num_heads, num_kv_heads, head_dim, 16)


class LaunchRecorder:
    """Stands in for a kernel: records each launch's grid and mode flags, then launches it."""
    FLAGS = ("PAGED", "MIXED", "SPLIT_KV")

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((tuple(grid), {k: v for k, v in kwargs.items() if k in self.FLAGS}))
            self.kernel[grid](*args, **kwargs)
        return launch


def record_launches(monkeypatch) -> dict:
    recorders = {name: LaunchRecorder(getattr(triton_attn, name))
                 for name in ("_prefill_kernel", "_decode_kernel", "_reduce_kernel")}
    for name, recorder in recorders.items():
        monkeypatch.setattr(triton_attn, name, recorder)
    return recorders


def build_mixed_step(cached, new, num_heads, num_kv_heads, head_dim, block_size, gen, dtype=torch.float32):
    """Sequence i has cached[i] tokens in the paged cache and new[i] new ones, already stored (as
    Attention does before calling the backend). Returns q, k, v, the cache and the context."""
    lens = [c + n for c, n in zip(cached, new)]
    cache = PagedCache(lens, block_size, num_kv_heads, head_dim, gen, dtype=dtype).to(DEVICE)
    q, k, v = qkv_views(sum(new), num_heads, num_kv_heads, head_dim, gen, dtype=dtype, q_scale=2.0)
    slots = [s for i, (c, n) in enumerate(zip(cached, new)) for s in cache.slots(i, range(c, c + n))]
    context = make_context(new, lens, cache.tables, slots)
    TritonBackend.store_kv(k, v, cache.k, cache.v, context.slot_mapping)
    return q, k, v, cache, context


def check_mixed_step_launches(recorders, context, new, group, num_kv_heads, block_size, block_m) -> int:
    """The decode rows went to one decode launch in mixed mode, split as context_num_splits says
    (then reduced); the prefill grid has one program per BLOCK_M-row tile of each sequence's own
    rows, plus at most one idle program per sequence (a max_q-sized grid per sequence has far
    more). Returns the split count."""
    batch = len(new)
    [(grid, flags)] = recorders["_prefill_kernel"].launches
    own_tiles = sum(triton.cdiv(n * group, block_m) for n in new)
    assert flags["PAGED"] and len(grid) == 2 and grid[1] == num_kv_heads
    assert own_tiles <= grid[0] <= own_tiles + batch
    splits = context_num_splits(context, num_kv_heads, block_size, triton_attn._num_sms(torch.device(DEVICE)))
    [(grid, flags)] = recorders["_decode_kernel"].launches
    assert flags["MIXED"] and grid == (batch, num_kv_heads, splits) and flags["SPLIT_KV"] == (splits > 1)
    assert [(g[0], f["MIXED"]) for g, f in recorders["_reduce_kernel"].launches] == [(batch, True)] * (splits > 1)
    return splits


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (8, 2)])
def test_mixed_step_of_long_chunks_and_many_decode_rows(monkeypatch, num_heads, num_kv_heads):
    """Two long prefill chunks (one fresh, one over a cached prefix) and a one-token prompt,
    between 40 decode rows: the decode rows are attended by the split-KV decode kernel, the
    chunks by the prefill kernel, over a grid sized by each sequence's own query count."""
    recorders = record_launches(monkeypatch)
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    decode_cached = torch.randint(1, 400, (40,), generator=gen).tolist()
    cached = decode_cached[:20] + [0] + decode_cached[20:30] + [170, 0] + decode_cached[30:]
    new = [1] * 20 + [200] + [1] * 10 + [150, 1] + [1] * 10
    q, k, v, cache, context = build_mixed_step(cached, new, num_heads, num_kv_heads, 32, 16, gen)
    assert not context.decode_only
    out = TritonBackend.forward(q, k, v, cache.k, cache.v, context, 0.2)
    assert_close(out, reference(q, k, v, cache, context, 0.2))
    splits = check_mixed_step_launches(recorders, context, new, num_heads // num_kv_heads, num_kv_heads, 16,
                                       triton_attn.PREFILL_BLOCK_M_FP32)
    assert splits > 1, "few sequences: the decode rows should be split"


def test_step_of_prefill_chunks_only_launches_no_decode_kernel(monkeypatch):
    """No sequence with one new query (the host copy of cu_seqlens_q says so): no decode launch.
    Without the host copy the decode kernel is launched and all its programs idle: same result."""
    recorders = record_launches(monkeypatch)
    gen = torch.Generator().manual_seed(17)
    q, k, v, cache, context = build_mixed_step([0, 40, 7], [30, 2, 50], 4, 2, 32, 16, gen)
    out = TritonBackend.forward(q, k, v, cache.k, cache.v, context, 0.2)
    assert_close(out, reference(q, k, v, cache, context, 0.2))
    assert not recorders["_decode_kernel"].launches and len(recorders["_prefill_kernel"].launches) == 1
    host_copy, context.cu_seqlens_q_cpu = context.cu_seqlens_q_cpu, None
    again = TritonBackend.forward(q, k, v, cache.k, cache.v, context, 0.2)
    assert len(recorders["_decode_kernel"].launches) == 1 and torch.equal(again, out)
    context.cu_seqlens_q_cpu = host_copy


@pytest.mark.parametrize("num_heads, num_kv_heads, dtype", [(4, 2, torch.float32), (8, 2, torch.float16),
                                                       (16, 2, torch.float16)])
def test_verify_step_runs_split_kv_decode_alone(monkeypatch, num_heads, num_kv_heads, dtype):
    """A speculative verify step (each sequence its last token and 0..4 drafts, 1..5 new tokens,
    over a paged cache) is the split-KV decode kernel's alone: one launch over every sequence, its
    rows (query, head) pairs, each query seeing the keys up to its own position, equal to the
    reference; batch 1 splits its context many ways. (The prefill kernel took these steps before:
    B x Hkv programs, each walking the whole context.) fp32 fits 16 rows, half precision 64."""
    group = num_heads // num_kv_heads
    tol = {} if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-2)
    for cached, new in (([700], [5]), ([30, 200, 64, 5, 129], [5, 1, 3, 5, 2])):
        recorders = record_launches(monkeypatch)
        gen = torch.Generator().manual_seed(sum(cached) + group)
        q, k, v, cache, context = build_mixed_step(cached, new, num_heads, num_kv_heads, 64, 16, gen, dtype=dtype)
        assert triton_attn.decode_max_queries(context, group, dtype, 64) == max(new)
        out = TritonBackend.forward(q, k, v, cache.k, cache.v, context, 0.125)
        assert_close(out, reference(q, k, v, cache, context, 0.125), **tol)
        splits = context_num_splits(context, num_kv_heads, 16, triton_attn._num_sms(torch.device(DEVICE)))
        assert recorders["_prefill_kernel"].launches == []
        [(grid, flags)] = recorders["_decode_kernel"].launches
        assert flags["MIXED"] and grid == (len(new), num_kv_heads, splits)
        assert [g for g, _ in recorders["_reduce_kernel"].launches] == [(len(new) * max(new), num_heads)] * (splits > 1)
        if len(new) == 1:
            assert splits >= 5, "a batch-1 verify step should split its 700-token context"


def test_decode_with_cu_seqlens_q_attends_only_sequences_of_up_to_max_queries():
    """decode(cu_seqlens_q=..., max_queries=Q) writes the rows of the sequences with 1..Q new
    queries, and leaves a longer sequence's rows (the prefill kernel's) as they were, whatever the
    split count; its argument checks name what is allowed."""
    gen = torch.Generator().manual_seed(31)
    q, k, v, cache, context = build_mixed_step([40, 3, 100], [2, 4, 1], 4, 2, 32, 16, gen)
    ref = reference(q, k, v, cache, context, 0.2)
    for num_splits in (1, 3, 16):
        out = torch.full_like(q, float("nan"))
        decode(q, cache.k, cache.v, context.seq_lens_k, context.block_tables, 0.2, out, num_splits,
               cu_seqlens_q=context.cu_seqlens_q, max_queries=2)
        mine = [0, 1, 6]                                 # sequence 0's two rows, sequence 2's one
        assert_close(out[mine], ref[mine])
        assert out[2:6].isnan().all()
    with pytest.raises(ValueError, match=r"max_queries must be 1, or with cu_seqlens_q an int >= 1, got 2"):
        decode(q[:3], cache.k, cache.v, context.seq_lens_k, context.block_tables, 0.2, max_queries=2)
    with pytest.raises(ValueError, match=r"max_queries \(9\) x 2 query heads per kv head must be at most 16 rows"):
        decode(q, cache.k, cache.v, context.seq_lens_k, context.block_tables, 0.2,
               cu_seqlens_q=context.cu_seqlens_q, max_queries=9)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the real shape is for the compiled kernels on a GPU")
def test_mixed_step_at_serving_shape_on_gpu(monkeypatch):
    """The step of issue 18: one 8K-token chunk over a cached prefix beside 255 decode rows, bf16,
    32 query heads over 4 kv heads of 128 (Qwen3-30B-A3B's attention), against the torch reference
    on the GPU in fp32; int32 offsets, grid limits and the binary search at that size."""
    recorders = record_launches(monkeypatch)
    gen = torch.Generator().manual_seed(18)
    decode_cached = torch.randint(16, 1500, (255,), generator=gen).tolist()
    cached, new = decode_cached[:128] + [512] + decode_cached[128:], [1] * 128 + [8192] + [1] * 127
    q, k, v, cache, context = build_mixed_step(cached, new, 32, 4, 128, 16, gen, dtype=torch.bfloat16)
    out = TritonBackend.forward(q, k, v, cache.k, cache.v, context, 128 ** -0.5)
    torch.cuda.synchronize()
    ref_context = make_context(new, context.seq_lens_k_cpu, cache.tables)
    ref = TorchBackend.forward(q.float(), k.float(), v.float(), cache.k.float(), cache.v.float(), ref_context,
                               128 ** -0.5)
    assert_close(out, ref, atol=1e-2, rtol=2e-2)
    check_mixed_step_launches(recorders, context, new, 8, 4, 16, triton_attn.PREFILL_BLOCK_M)


def test_store_then_decode_through_both_backends():
    """One decode step end to end: each backend stores the new token and attends; same result."""
    gen = torch.Generator().manual_seed(11)
    lens = [16, 17, 200]
    cache = PagedCache(lens, 16, 2, 64, gen).to(DEVICE)
    q, k, v = qkv_views(len(lens), 4, 2, 64, gen)
    slots = [cache.slots(i, [n - 1])[0] for i, n in enumerate(lens)]
    context = make_context([1] * 3, lens, cache.tables, slots)
    ref_k, ref_v = cache.k.cpu().clone(), cache.v.cpu().clone()
    TorchBackend.store_kv(k.cpu(), v.cpu(), ref_k, ref_v, context.slot_mapping.cpu())
    TritonBackend.store_kv(k, v, cache.k, cache.v, context.slot_mapping)
    assert torch.equal(cache.k.cpu(), ref_k) and torch.equal(cache.v.cpu(), ref_v)
    out = TritonBackend.forward(q, k, v, cache.k, cache.v, context, 0.125)
    assert_close(out, reference(q, k, v, cache, context, 0.125))


def test_half_precision_inputs():
    """fp16 in, fp16 out, fp32 accumulation: within fp16 rounding of the fp32 reference."""
    gen = torch.Generator().manual_seed(5)
    cached, new = [0, 20, 40], [12, 1, 9]
    lens = [c + n for c, n in zip(cached, new)]
    cache = PagedCache(lens, 16, 2, 64, gen, dtype=torch.float16).to(DEVICE)
    q, k, v = qkv_views(sum(new), 4, 2, 64, gen, dtype=torch.float16)
    slots = [s for i, (c, n) in enumerate(zip(cached, new)) for s in cache.slots(i, range(c, c + n))]
    context = make_context(new, lens, cache.tables, slots)
    TritonBackend.store_kv(k, v, cache.k, cache.v, context.slot_mapping)
    out = TritonBackend.forward(q, k, v, cache.k, cache.v, context, 0.125)
    assert out.dtype == torch.float16
    assert_close(out, reference(q, k, v, cache, context, 0.125), atol=2e-3, rtol=1e-2)
    dec = decode(q[[11, 12, 21]], cache.k, cache.v, context.seq_lens_k, context.block_tables, 0.125, num_splits=2)
    assert_close(dec, out[[11, 12, 21]], atol=2e-3, rtol=1e-2)


def test_bad_shapes_are_value_errors():
    q = torch.zeros(2, 6, 64, device=DEVICE)
    k = torch.zeros(2, 4, 64, device=DEVICE)
    context = make_context([2], [2])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TritonBackend.forward(q, k, k, None, None, context, 1.0)
    q, k = torch.zeros(2, 2, 512, device=DEVICE), torch.zeros(2, 2, 512, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        TritonBackend.forward(q, k, k, None, None, context, 1.0)


# ---- the benchmark script -----------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype, itemsize", [("auto", 4), ("fp8", 1)])
def test_bench_decode_attention_cpu_smoke(capsys, kv_cache_dtype, itemsize):
    """The kernel over a float32 cache, and over a float8_e4m3fn one whose bytes count 1 per element."""
    if DEVICE != "cpu":
        pytest.skip("the CPU smoke run is for interpreter machines")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_decode_attention
    result = bench_decode_attention.main(["--device", "cpu", "--batch", "3", "--context", "40", "--num-heads", "4",
                                          "--num-kv-heads", "2", "--head-dim", "32", "--block-size", "16",
                                          "--dtype", "float32", "--iters", "1", "--kv-cache-dtype", kv_cache_dtype])
    out = capsys.readouterr().out
    assert result["check_ok"] and result["kv_cache_dtype"] == kv_cache_dtype
    assert result["kv_bytes"] == 2 * 3 * 40 * 2 * 32 * itemsize
    assert result["time_per_call_s"] > 0 and result["copy_bandwidth_gbs"] > 0
    assert "GB/s" in out and "max abs error" in out
    assert ("float8_e4m3fn" in out) == (kv_cache_dtype == "fp8")


def test_bench_decode_attention_verify_step_cpu_smoke(capsys):
    """--queries 1 + k: a verify step's attention, checked against TorchBackend, beside the prefill
    kernel on the same step (--vs-prefill-kernel), whose output is checked too."""
    if DEVICE != "cpu":
        pytest.skip("the CPU smoke run is for interpreter machines")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_decode_attention
    result = bench_decode_attention.main(["--device", "cpu", "--batch", "2", "--context", "40", "--num-heads", "4",
                                          "--num-kv-heads", "2", "--head-dim", "32", "--dtype", "float32",
                                          "--iters", "1", "--queries", "5", "--vs-prefill-kernel"])
    out = capsys.readouterr().out
    assert result["check_ok"] and result["prefill_kernel_check_ok"]
    assert result["prefill_kernel_time_per_call_s"] > 0 and result["speedup_vs_prefill_kernel"] > 0
    assert "verify (5 queries each)" in out and "prefill kernel" in out
    with pytest.raises(SystemExit):
        bench_decode_attention.main(["--device", "cpu", "--vs-prefill-kernel"])


@pytest.mark.skipif(not INTERPRETED, reason="the engine-level CPU run needs the interpreter; test_gpu.py covers CUDA")
@pytest.mark.parametrize("block_size", [16, 8])
def test_engine_on_cpu_with_triton_matches_hf(model_dir, prompts, reference, block_size):
    """LLM(device="cpu", attention_backend="triton"): chunked prefill, mixed steps, prefix-cache
    hits and decode, all through the interpreted kernels; greedy tokens equal Hugging Face's."""
    from nanovllm import LLM, SamplingParams
    llm = LLM(model_dir, device="cpu", attention_backend="triton", kvcache_block_size=block_size, max_model_len=400,
              max_num_batched_tokens=64)
    chosen = [prompts[0], prompts[3], prompts[5], prompts[5][:40] + [7, 7]]  # the last one hits the cache
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(chosen, params, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [reference(model_dir, p, 8) for p in chosen]
    assert llm.stats()["num_cached_tokens"] > 0


def test_a_decode_graph_computes_what_the_eager_step_does(monkeypatch, model_dir):
    """What a graph captures (DecodeGraphs.forward: gather the inputs from the token and block
    tables, then the model), run eagerly over padded static inputs, gives the eager step's hidden
    states for the real rows. (Capture itself is faked on the CPU: warm-up and capture run eagerly.)"""
    import contextlib

    from nanovllm import LLM, SamplingParams
    from nanovllm.engine.cuda_graphs import DecodeGraphs
    from nanovllm.utils.context import forward_context

    class NoGraph:
        def pool(self):
            return None
    if DEVICE == "cpu":
        monkeypatch.setattr(torch.cuda, "CUDAGraph", NoGraph)
        monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    llm = LLM(model_dir, max_model_len=64, max_num_seqs=8, attention_backend="triton", kvcache_block_size=16,
              device=DEVICE, dtype="float32", enforce_eager=True, num_kvcache_blocks=32)
    runner = llm.model_runner
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8], list(range(10, 30))):
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for _ in range(3):
        llm.step()
    step = llm.scheduler.schedule()
    batch = step.batch()
    assert (batch.num_new == 1).all()  # a decode step
    with torch.inference_mode():
        inputs = runner.prepare(batch, None)
        with forward_context(inputs.context):
            eager = runner.model(inputs.input_ids, inputs.positions)
        graphs = DecodeGraphs(runner.model, runner.token_table, runner.block_tables, runner.block_size,
                              runner.scratch_row, max_batch=8, max_model_len=64,
                              hidden_size=llm.config.hf_config.hidden_size, dtype=torch.float32)
        size = padded_batch_size(len(batch.rows), graphs.sizes)
        pad = size - len(batch.rows)
        graphs.inputs[0, :size] = torch.tensor(batch.rows.tolist() + [runner.scratch_row] * pad)
        graphs.inputs[1, :size] = torch.tensor(batch.starts.tolist() + [0] * pad)
        graphs.forward(size)
    torch.testing.assert_close(graphs.output[:len(batch.rows)], eager)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decode_graphs_compute_what_the_eager_steps_do(monkeypatch, model_dir, reference, method):
    """Speculative decode steps through their CUDA graphs (DecodeGraphs with query_len 1 + k: each
    sequence's last token and drafts padded at the front to 1 + k query tokens, the padding's K/V
    into the spare block, attention on the multi-query paged path of the Triton kernels) give
    Hugging Face's greedy tokens, as decode steps through theirs do; drafts of any length 0..k
    share a replay. On the CPU capture is faked (a replay runs the captured forward eagerly, in
    the interpreter); test_gpu.py replays real graphs."""
    import contextlib

    from nanovllm import LLM, SamplingParams
    from nanovllm.engine.cuda_graphs import DecodeGraphs

    if DEVICE == "cpu":
        class NoGraph:
            def pool(self):
                return None
        monkeypatch.setattr(torch.cuda, "CUDAGraph", NoGraph)
        monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    replays = []

    def replay(self, rows, positions, size, num_new=None):
        replays.append((self.query_len, size, num_new[:size].tolist() if num_new is not None else None))
        self.inputs[0, :size], self.inputs[1, :size] = rows, positions
        if num_new is not None:
            self.inputs[2, :size] = num_new
        if DEVICE == "cpu":
            self.forward(size)
        else:
            self.graphs[size].replay()
        return self.output[:size * self.query_len]
    monkeypatch.setattr(DecodeGraphs, "replay", replay)
    k = 3
    config = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        config["model"] = model_dir
    llm = LLM(model_dir, device=DEVICE, dtype="float32", attention_backend="triton", kvcache_block_size=8,
              max_model_len=128, max_num_seqs=4, num_kvcache_blocks=64, speculative_config=config,
              enforce_eager=DEVICE == "cpu")
    runner = llm.model_runner
    if DEVICE == "cpu":  # (on a GPU the engine captured them)
        runner.graphs, runner.verify_graphs = runner._capture_graphs(), runner._capture_graphs(query_len=1 + k)
        if runner.drafter is not None:
            runner.drafter.capture_graphs(runner)  # (kept by the draft model)
    chosen = [[11, 22, 33, 44, 55, 66, 77, 88] * 3, [5, 6, 7] * 4, list(range(100, 120))]
    outputs = llm.generate(chosen, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [reference(model_dir, p, 24) for p in chosen]
    verified = [r for r in replays if r[0] == 1 + k and r[1] >= 2]
    assert verified, "no speculative decode step replayed a graph"
    assert any(len(set(num_new)) > 1 for _, _, num_new in verified)  # (mixed draft lengths in one replay)
    assert llm.stats()["spec_num_accepted_tokens"] > 0


# ---- sliding windows (layers/sliding_window.py) -----------------------------------------------------
@pytest.mark.parametrize("window", [1, 5, 16, 70])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_windowed_steps_match_the_windowed_reference(window, num_splits, monkeypatch):
    """window=: decode rows, verify-like rows (2 and 4 queries), prefill chunks over cached prefixes
    and fresh prompts (no cache) against WindowedTorchBackend; the decode kernel with its span split
    num_splits ways. Windows shorter than a key tile, longer than a context, and between."""
    from nanovllm.layers.sliding_window import WindowedTorchBackend
    monkeypatch.setattr(triton_attn, "context_num_splits", lambda *args: num_splits)
    gen = torch.Generator().manual_seed(window * 10 + num_splits)
    block_size, heads, kv_heads, head_dim = 8, 4, 2, 16
    scale = head_dim ** -0.5
    # (and a first query whose window starts at the last key of a tile: DECODE_BLOCK_N = PREFILL_BLOCK_N = 64 here)
    edge = [([1, 1], [63 + window, 127 + window]), ([10], [63 + window + 9])]
    for new, lens in [([1, 1, 1], [1, 30, 100]), ([2, 4, 1], [33, 41, 9]), ([1, 20, 3, 40], [50, 20, 90, 140])] + edge:
        cache = PagedCache(lens, block_size, kv_heads, head_dim, gen).to(DEVICE)
        q, k, v = qkv_views(sum(new), heads, kv_heads, head_dim, gen)
        context = make_context(new, lens, cache.tables)
        ref_context = make_context(new, lens, cache.tables.cpu(), device="cpu")
        ref = WindowedTorchBackend(window).forward(q.cpu(), None, None, cache.k.cpu(), cache.v.cpu(), ref_context, scale)
        assert_close(TritonBackend.forward(q, k, v, cache.k, cache.v, context, scale, window=window), ref)
    new = [3, 50, 17]                                            # fresh prompts: the new rows are the context
    q, k, v = qkv_views(sum(new), heads, kv_heads, head_dim, gen)
    ref = WindowedTorchBackend(window).forward(q.cpu(), k.cpu(), v.cpu(), None, None,
                                               make_context(new, new, device="cpu"), scale)
    assert_close(TritonBackend.forward(q, k, v, None, None, make_context(new, new), scale, window=window), ref)


def test_window_zero_is_full_attention():
    gen = torch.Generator().manual_seed(11)
    new, lens = [1, 20], [60, 20]
    cache = PagedCache(lens, 8, 2, 16, gen).to(DEVICE)
    q, k, v = qkv_views(sum(new), 4, 2, 16, gen)
    context = make_context(new, lens, cache.tables)
    assert_close(TritonBackend.forward(q, k, v, cache.k, cache.v, context, 0.25, window=0),
                 reference(q, k, v, cache, context, 0.25))
