"""FP8 KV cache (kv_cache_dtype="fp8"): the kernels against the torch reference over an fp8 cache,
and the engine on CPU against its own kv_cache_dtype="auto" runs.

The tiny random models (conftest.py) have large weights (initializer_range 0.2), so e4m3's three
mantissa bits move their logprobs by tenths of a nat: fp8 runs are compared with tolerances
against auto runs, and for equality against fp8 runs that differ only in scheduling (prefix
caching, preemption, tensor parallelism), which must not change what attention sees.
"""
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton (transformers does): see test_triton_backend.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.config import Config  # noqa: E402
from nanovllm.engine import model_runner  # noqa: E402
from nanovllm.entrypoints.args import llm_options  # noqa: E402
from nanovllm.layers.backends import resolve_backend  # noqa: E402
from nanovllm.layers.backends.torch_ref import FP8_KV_DTYPE, TorchBackend, quantize_kv  # noqa: E402
from nanovllm.utils.tiny_model import edit_model  # noqa: E402

MAX_MODEL_LEN = 400
# Largest |logprob(fp8) - logprob(auto)| of a token both runs list among their top 5, at any
# position up to the first where their greedy tokens differ. Measured on conftest's 8 prompts
# with 16 new tokens each: 0.50 nat (torch backend; most positions 0.05-0.2); the bound is 3x.
LOGPROB_TOL = 1.5
# The greedy runs agree until a near-tie: where they first differ, the auto run's logprob of its
# own token exceeds that of fp8's token by at most this much. Measured: 0.32 at most (first
# differences at positions 0 to 11 of 16; 2 of the 8 sequences agree throughout); 3x again.
NEAR_TIE = 1.0
# Triton against the torch reference over the same fp8 cache (their stores are bit-identical, so
# only fp32 summation order differs): measured 3.1e-6 nat. The same bound holds fp8 runs that
# differ only in scheduling (prefix-cache hits, preemption, chunking: 4.5e-6 measured, from the
# batch's fp32 matmuls); attending over unquantized fresh K/V, as vLLM does, moves them 0.08-0.15.
KERNEL_LOGPROB_TOL = 1e-4
# Runs whose fp32 sums run in another order (TP=2's all-reduces, speculative decoding's
# multi-token verification steps) move some K/V across an e4m3 rounding boundary now and then:
# measured 1.2e-4 for each (TP=2 with an auto cache: 3.1e-6); 4x.
REORDERED_LOGPROB_TOL = 5e-4
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)


def generate(path, prompts, params=GREEDY, **kwargs):
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    kwargs.setdefault("device", "cpu")  # (the tolerances were measured there, in float32)
    with LLM(path, **kwargs) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"], "blocks leaked"
    return outputs, stats


def tokens(outputs):
    return [o["token_ids"] for o in outputs]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def compare_logprobs(expected, actual) -> tuple[float, list[int], float]:
    """(largest logprob difference, per sequence the first position where the greedy tokens
    differ, largest near-tie margin there) between two runs of the same prompts."""
    worst, firsts, margin = 0.0, [], 0.0
    for e, a in zip(expected, actual):
        first = first_difference(e["token_ids"], a["token_ids"])
        firsts.append(first)
        for pos in range(min(first + 1, len(e["token_ids"]))):
            le, la = e["logprobs"][pos], a["logprobs"][pos]
            worst = max([worst] + [abs(le[t] - la[t]) for t in set(le) & set(la)])
        if first < len(e["token_ids"]):
            le, theirs = e["logprobs"][first], a["token_ids"][first]
            margin = max(margin, le[e["token_ids"][first]] - le.get(theirs, float("-inf")))
    return worst, firsts, margin


# ---- options ------------------------------------------------------------------------------------
def test_kv_cache_dtype_values(model_dir):
    assert Config(model_dir, device="cpu").kv_dtype == torch.float32        # auto: the model's dtype
    assert Config(model_dir, device="cpu", dtype="bfloat16").kv_dtype == torch.bfloat16
    for name in ("fp8", "fp8_e4m3"):
        assert Config(model_dir, device="cpu", kv_cache_dtype=name).kv_dtype == torch.float8_e4m3fn
    for bad in ("int8", "fp8_e5m2", None):
        with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'fp8_e4m3'\)"):
            Config(model_dir, device="cpu", kv_cache_dtype=bad)
    assert ("kv_cache_dtype", "auto", str) in llm_options()                # hence the --kv-cache-dtype flag


def test_fp8_kv_prefers_a_backend_that_reads_it(monkeypatch):
    """On CUDA with flash-attn installed, fp8 KV picks triton; flash_attn by name is refused
    (tests/test_flash_attn_backend.py, with the fake module, checks it through LLM)."""
    from nanovllm.layers import backends
    monkeypatch.setattr(backends, "available_backends", lambda device: ["flash_attn", "triton", "torch"])
    assert resolve_backend(None, "cuda") == "flash_attn"
    assert resolve_backend(None, "cuda", fp8_kv=True) == "triton"
    assert resolve_backend(None, "cpu", fp8_kv=True) == "torch"
    with pytest.raises(ValueError, match="attention_backend='triton' or 'torch', or kv_cache_dtype='auto'"):
        resolve_backend("flash_attn", "cuda", fp8_kv=True)


# ---- sizing -------------------------------------------------------------------------------------
# A small CPU budget instead of CPU_KV_CACHE_BYTES (2 GiB), so that no count is capped at what
# max_num_seqs sequences could use, and no test allocates gigabytes. The tiny model's blocks are
# 8 KiB in float32 (2 layers x K/V x 2 kv heads x 16 dims x 16 tokens x 4 bytes): 128 of them.
TEST_BUDGET = 1 << 20


@pytest.mark.parametrize("draft", [False, True])
def test_fp8_blocks_take_one_byte_per_element(monkeypatch, model_dir, draft):
    monkeypatch.setattr(model_runner, "CPU_KV_CACHE_BYTES", TEST_BUDGET)
    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 2}
    extra = {"speculative_config": spec} if draft else {}
    counts = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"), ("bfloat16", "fp8")):
        llm = LLM(model_dir, device="cpu", dtype=dtype, kv_cache_dtype=kv, max_model_len=MAX_MODEL_LEN, **extra)
        counts[dtype, kv] = llm.stats()["num_blocks"]
        caches = [llm.model_runner.kv_cache] + ([llm.model_runner.drafter.kv_cache] if draft else [])
        assert all(c.dtype == (torch.float8_e4m3fn if kv == "fp8" else getattr(torch, dtype)) for c in caches)
        llm.shutdown()
    assert counts["float32", "auto"] == TEST_BUDGET // ((2 if draft else 1) * 8192)
    assert counts["float32", "fp8"] == 4 * counts["float32", "auto"]
    assert counts["bfloat16", "fp8"] == 2 * counts["bfloat16", "auto"] == counts["float32", "fp8"]


# ---- end to end against auto --------------------------------------------------------------------
def test_fp8_logprobs_close_to_auto(model_dir, prompts):
    auto, _ = generate(model_dir, prompts)
    fp8, _ = generate(model_dir, prompts, kv_cache_dtype="fp8")
    worst, firsts, margin = compare_logprobs(auto, fp8)
    report = f"max logprob error {worst:.3f}, first differences {firsts}, near-tie margin {margin:.3f}"
    assert 0 < worst <= LOGPROB_TOL, report                 # (0: the cache was not fp8 at all)
    assert margin <= NEAR_TIE, report


def test_fp8_through_the_triton_kernels(model_dir, prompts):
    """The same engine run through the interpreted Triton kernels: a chunked prompt, a prefix-
    cache hit, mixed steps and decode (short: the interpreter is slow). Equal to the torch
    backend's fp8 run up to fp32 summation order, and close to auto."""
    if importlib.util.find_spec("triton") is None:  # (not importorskip: importing triton here would pick its mode)
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine Triton runs compiled: test_fp8_decode_graphs_equal_eager_on_gpu covers it")
    chosen = [prompts[1], prompts[3], prompts[3][:32] + [5, 6]]           # the last one hits the cache
    options = dict(max_model_len=128, max_num_batched_tokens=24, kvcache_block_size=16, kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    ours, stats = generate(model_dir, chosen, params, attention_backend="triton", **options)
    reference, _ = generate(model_dir, chosen, params, attention_backend="torch", **options)
    assert stats["num_cached_tokens"] > 0
    assert tokens(ours) == tokens(reference)
    worst, _, _ = compare_logprobs(reference, ours)
    assert worst <= KERNEL_LOGPROB_TOL
    auto, _ = generate(model_dir, chosen, params, attention_backend="torch", max_model_len=128)
    worst, _, margin = compare_logprobs(auto, ours)
    assert 0 < worst <= LOGPROB_TOL and margin <= NEAR_TIE


# ---- scheduling does not change what attention sees --------------------------------------------
def test_fp8_prefix_cache_hits_give_the_uncached_output(model_dir):
    """A fresh prompt attends over its quantized K/V, as a later request reading them from the
    prefix cache does: the same output with and without caching."""
    shared = list(range(3, 203))                                          # 12 full blocks of 16
    prompts = [shared + [7 + i] * (i + 1) for i in range(4)]
    with LLM(model_dir, device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_dtype="fp8") as llm:
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        later = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert all(o["num_cached_tokens"] == 192 for o in later)
    uncached, _ = generate(model_dir, prompts, kv_cache_dtype="fp8", enable_prefix_caching=False)
    assert tokens(first + later) == tokens(uncached)
    assert compare_logprobs(uncached, first + later)[0] <= KERNEL_LOGPROB_TOL


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_fp8_preemption_and_chunking_give_the_same_output(model_dir, prompts, async_scheduling):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    plain, _ = generate(model_dir, prompts, params, kv_cache_dtype="fp8")
    # 25 blocks of 16 tokens hold one max_model_len sequence: the 8 prompts take turns
    squeezed, stats = generate(model_dir, prompts, params, kv_cache_dtype="fp8", num_kvcache_blocks=25,
                               max_num_batched_tokens=64, async_scheduling=async_scheduling)
    assert stats["num_preemptions"] > 0
    assert tokens(squeezed) == tokens(plain)
    assert compare_logprobs(plain, squeezed)[0] <= KERNEL_LOGPROB_TOL


def test_fp8_tensor_parallel_equals_one_rank(model_dir, prompts):
    one, _ = generate(model_dir, prompts[:5], kv_cache_dtype="fp8")
    two, _ = generate(model_dir, prompts[:5], kv_cache_dtype="fp8", tensor_parallel_size=2)
    assert tokens(two) == tokens(one)
    assert compare_logprobs(one, two)[0] <= REORDERED_LOGPROB_TOL


def test_fp8_draft_model_speculation_equals_plain_decoding(model_dir, prompts):
    """The draft model keeps its own fp8 cache; with the target as its own draft every draft is
    accepted, and greedy output is plain decoding's."""
    plain, _ = generate(model_dir, prompts, kv_cache_dtype="fp8")
    config = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3}
    spec, stats = generate(model_dir, prompts, kv_cache_dtype="fp8", speculative_config=config)
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
    assert tokens(spec) == tokens(plain)
    assert compare_logprobs(plain, spec)[0] <= REORDERED_LOGPROB_TOL


# ---- checkpoint scales --------------------------------------------------------------------------
def with_scales(model_dir, folder, k_scale, v_scale, num_layers=2):
    """A copy of the model whose checkpoint has vLLM's per-layer k_scale (a scalar) and v_scale
    (shape [1]; a list: that many values) tensors."""
    def add_scales(weights: dict):
        for i in range(num_layers):
            weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale, dtype=torch.float32)
            values = v_scale if isinstance(v_scale, list) else [v_scale]
            weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(values, dtype=torch.float32)
    return edit_model(model_dir, folder, add_scales)


def test_checkpoint_scales_reach_the_layers(model_dir, prompts, tmp_path):
    # not powers of two: those would scale every K/V exactly, giving the bits of scale 1
    path = with_scales(model_dir, tmp_path / "scaled", 0.3, 0.7)
    scaled, _ = generate(path, prompts, kv_cache_dtype="fp8")
    with LLM(path, device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_dtype="fp8") as llm:
        layers = llm.model_runner.attention_layers
        assert [(a.k_scale.item(), a.v_scale.item()) for a in layers] == [(pytest.approx(0.3), pytest.approx(0.7))] * 2
    unit, _ = generate(model_dir, prompts, kv_cache_dtype="fp8")
    worst, _, _ = compare_logprobs(unit, scaled)
    assert worst > 0, "the checkpoint's scales changed nothing"
    auto, _ = generate(model_dir, prompts)
    worst, _, margin = compare_logprobs(auto, scaled)  # still the model's attention: scaled back on reading
    assert worst <= LOGPROB_TOL and margin <= NEAR_TIE


def test_auto_ignores_checkpoint_scales(model_dir, prompts, tmp_path):
    path = with_scales(model_dir, tmp_path / "scaled", 0.3, 0.7)
    assert tokens(generate(path, prompts[:4])[0]) == tokens(generate(model_dir, prompts[:4])[0])


def test_dummy_weights_keep_unit_scales(model_dir):
    """load_format="dummy" draws every weight at random, but not the optional scales (random ones
    near 0, or negative, would make the cache useless)."""
    with LLM(model_dir, device="cpu", load_format="dummy", kv_cache_dtype="fp8", max_model_len=64) as llm:
        assert all(a.k_scale.item() == a.v_scale.item() == 1.0 for a in llm.model_runner.attention_layers)
        [out] = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out["token_ids"]) == 3


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), [0.5, 0.5]])
def test_bad_checkpoint_scale_is_a_value_error(model_dir, tmp_path, bad):
    path = with_scales(model_dir, tmp_path / "bad", 0.5, bad)
    what = "one number" if isinstance(bad, list) else "positive finite"
    with pytest.raises(ValueError, match=rf"'model\.layers\.\d\.self_attn\.v_scale'.*{what}"):
        LLM(path, device="cpu", kv_cache_dtype="fp8")


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
@pytest.mark.parametrize("num_heads, num_kv_heads, block_size, num_splits",
                         [(4, 4, 16, 1), (4, 2, 8, 3), (8, 2, 16, 4)])
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_fp8_decode_graphs_equal_eager_on_gpu(model_dir, prompts):
    """Replayed CUDA graphs read the layers' scales from device memory: the same tokens as eager
    decode, with checkpoint-free scales and the triton backend, in bf16."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    options = dict(device="cuda", dtype="bfloat16", attention_backend="triton", kv_cache_dtype="fp8",
                   max_model_len=MAX_MODEL_LEN, max_num_seqs=16)
    graphs, _ = generate(model_dir, prompts, params, **options)
    eager, _ = generate(model_dir, prompts, params, enforce_eager=True, **options)
    assert tokens(graphs) == tokens(eager)
