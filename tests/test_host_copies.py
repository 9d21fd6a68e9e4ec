"""The host tier's data movement (kv_offloading_size): ModelRunner copies whole KV blocks (every
layer, K and V) between device blocks and host slots as a step's StepBatch.offloads and .reloads
say, offloads first, on every tensor-parallel rank (each its own shard). The block manager's side
(which blocks, when) is tested with it; here the runner is driven directly."""
import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.features.host_tier import gather_blocks, slot_runs
from nanovllm.engine.step_batch import StepBatch

SIZE_GIB = 0.001  # 1,073,741 bytes: 131 host blocks of the tiny model's 8 KiB (4 KiB per rank with TP=2)
OPTIONS = dict(kv_offloading_size=SIZE_GIB, num_kvcache_blocks=16, max_model_len=128, device="cpu")


def copy_batch(offloads=None, reloads=None, rows=(), new_blocks=(), new_tokens=()) -> StepBatch:
    """A step of no sequences (or of one prefill into row 0 given as rows=(0,)) with these
    (device block, host slot) offloads and (host slot, device block) reloads."""
    pairs = lambda p: np.array(p, dtype=np.int32).reshape(-1, 2) if p is not None else None  # noqa: E731
    n = len(rows)
    num_new = np.array([len(t) for _, t in new_tokens], dtype=np.int32) if n else np.zeros(0, dtype=np.int32)
    return StepBatch(np.array(rows, dtype=np.int32), np.zeros(n, dtype=np.int32), num_new, np.zeros(n, dtype=bool),
                     list(new_blocks), list(new_tokens), offloads=pairs(offloads), reloads=pairs(reloads))


def copies(batch: StepBatch):
    """A step's host-tier copies, as the runner hands them to its HostCopies before the forward."""
    return batch.offloads, batch.reloads


def block(runner, block_id: int) -> torch.Tensor:
    """A device block of every layer, K and V, in the host tier's layout [2, L, bs, Hkv, D]."""
    return runner.kv_cache[:, :, block_id].clone()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, **OPTIONS) as llm:
        yield llm


@pytest.fixture
def runner(llm):
    """The runner with every device block and host slot holding distinct values (so a copy from
    the wrong block, layer, K/V or slot shows), and its copy counts at 0."""
    r = llm.model_runner
    r.kv_cache.copy_(torch.arange(r.kv_cache.numel(), dtype=torch.float32).view_as(r.kv_cache))
    r.host_copies.cache.copy_(-1 - torch.arange(r.host_copies.cache.numel(), dtype=torch.float32).view_as(r.host_copies.cache))
    r.host_copies.counts.update(dict.fromkeys(r.host_copies.counts, 0))
    return r


def test_host_tier_size(llm, model_dir):
    r = llm.model_runner
    block_bytes = r.kv_block_bytes()
    assert block_bytes == 2 * 2 * 16 * 2 * 16 * 4  # K/V, 2 layers, 16 tokens, 2 KV heads, head_dim 16, float32
    assert r.num_host_blocks == int(SIZE_GIB * 2**30) // block_bytes == 131
    layers, kv_heads, head_dim = 2, 2, 16
    assert r.host_copies.cache.shape == (131, 2, layers, 16, kv_heads, head_dim) and r.host_copies.cache.dtype == r.kv_cache.dtype
    assert r.host_copies.cache[0].is_contiguous() and r.host_copies.cache[0].nbytes == block_bytes  # one block: one run of bytes
    assert not r.host_copies.cache.is_pinned()  # (CPU)
    with LLM(model_dir, num_kvcache_blocks=16, max_model_len=128) as off:
        assert off.model_runner.num_host_blocks == 0 and off.model_runner.host_copies is None
    with pytest.raises(ValueError, match="kv_offloading_size=1e-06 GiB holds no KV block"):
        LLM(model_dir, **{**OPTIONS, "kv_offloading_size": 1e-6})


def test_slot_runs():
    assert slot_runs(np.array([5, 6, 7, 2, 9, 10, 4], dtype=np.int32)) == [(0, 5, 3), (3, 2, 1), (4, 9, 2), (6, 4, 1)]
    assert slot_runs(np.array([3], dtype=np.int32)) == [(0, 3, 1)]


def test_offload_copies_whole_blocks(runner):
    # consecutive slots (one copy each run) and scattered ones, the device blocks in any order
    offloads = [(3, 10), (5, 11), (0, 12), (9, 40), (16, 2), (7, 3)]  # 16: the spare block, also a block
    before = runner.host_copies.cache.clone()
    runner.host_copies.copy(*copies(copy_batch(offloads)))
    for block_id, slot in offloads:
        assert same_bytes(runner.host_copies.cache[slot], block(runner, block_id)), (block_id, slot)
    untouched = np.setdiff1d(np.arange(runner.num_host_blocks), [s for _, s in offloads])
    assert same_bytes(runner.host_copies.cache[untouched], before[untouched])
    stats = runner.host_copies.stats()
    assert stats.pop("copy_time_s") > 0
    assert stats == {"offloaded_blocks": 6, "reloaded_blocks": 0, "offloaded_bytes": 6 * 8192, "reloaded_bytes": 0}


def test_reload_into_other_blocks(runner):
    originals = {b: block(runner, b) for b in (2, 4, 6)}
    runner.host_copies.copy(*copies(copy_batch([(2, 7), (4, 8), (6, 0)])))
    runner.kv_cache.zero_()  # the device forgets them
    runner.host_copies.copy(*copies(copy_batch(reloads=[(8, 11), (7, 12), (0, 1)])))
    for block_id, original in ((11, 4), (12, 2), (1, 6)):
        assert same_bytes(block(runner, block_id), originals[original])
    others = [b for b in range(runner.num_kv_blocks + 1) if b not in (11, 12, 1)]
    assert not runner.kv_cache[:, :, others].any()  # nothing else written
    stats = runner.host_copies.stats()
    assert (stats["offloaded_blocks"], stats["reloaded_blocks"], stats["reloaded_bytes"]) == (3, 3, 3 * 8192)


def test_offloads_run_before_reloads(runner):
    """One step: block 5 is written back to slot 20 and block 9 to slot 21 while slots 3 and 20
    are reloaded into blocks 5 and 8. The offload reads block 5's old contents; the reload of
    slot 20 (just written) brings them into block 8."""
    old5, old9 = block(runner, 5), block(runner, 9)
    runner.host_copies.copy(*copies(copy_batch([(2, 3)])))
    kept = block(runner, 2)
    runner.host_copies.copy(*copies(copy_batch(offloads=[(5, 20), (9, 21)], reloads=[(3, 5), (20, 8)])))
    assert same_bytes(runner.host_copies.cache[20], old5) and same_bytes(runner.host_copies.cache[21], old9)
    assert same_bytes(block(runner, 5), kept) and same_bytes(block(runner, 8), old5)
    assert same_bytes(block(runner, 9), old9)  # an offload leaves its block as it was


def test_launch_copies_before_the_forward(runner):
    """Through the step path the engine uses: launch() of a copy-only step, and of a prefill whose
    K/V go into a block reloaded in the same step (the reload comes first, the forward overwrites)."""
    saved = block(runner, 4)
    runner.launch(copy_batch([(4, 50)]), None)
    assert same_bytes(runner.host_copies.cache[50], saved)
    tokens = list(range(1, 17))
    runner.launch(copy_batch(reloads=[(50, 6)], rows=(0,), new_blocks=[(0, 0, [6])], new_tokens=[(0, tokens)]), None)
    reference = block(runner, 6)
    assert not same_bytes(reference, saved)  # the prefill's K/V
    runner.kv_cache[:, :, 6] = 0
    runner.launch(copy_batch(rows=(0,), new_blocks=[(0, 0, [6])], new_tokens=[(0, tokens)]), None)
    assert same_bytes(block(runner, 6), reference)
    assert runner.host_copies.stats()["reloaded_blocks"] == 1


def test_fp8_cache(model_dir):
    with LLM(model_dir, kv_cache_dtype="fp8", **OPTIONS) as llm:
        r = llm.model_runner
        assert r.host_copies.cache.dtype == torch.float8_e4m3fn
        assert r.num_host_blocks == int(SIZE_GIB * 2**30) // 2048  # (a quarter of float32's block)
        r.kv_cache.view(torch.uint8).copy_(torch.randint(0, 256, r.kv_cache.shape, dtype=torch.uint8))
        old = block(r, 3)
        r.host_copies.copy(*copies(copy_batch([(3, 0)], reloads=[(0, 7)])))
        assert same_bytes(r.host_copies.cache[0], old) and same_bytes(block(r, 7), old)


def test_generation_unchanged(model_dir, prompts):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model_dir, max_model_len=400) as plain:
        expected = [o["token_ids"] for o in plain.generate(prompts, params, use_tqdm=False)]
    with LLM(model_dir, max_model_len=400, kv_offloading_size=SIZE_GIB) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_tp2_every_rank_copies_its_shard(model_dir):
    """With two ranks each runs the step's copies on its own shard (half the KV heads): a prefill
    fills blocks 3 and 4 on both ranks, offloads and reloads go through the workers' step path."""
    with LLM(model_dir, tensor_parallel_size=2, **OPTIONS) as llm:
        r = llm.model_runner
        assert r.num_host_blocks == int(SIZE_GIB * 2**30 / 2) // r.kv_block_bytes() == 131
        assert r.host_copies.cache.shape[4] == 1  # one of the two KV heads
        tokens = list(range(5, 37))
        r.launch(copy_batch(rows=(0,), new_blocks=[(0, 0, [3, 4])], new_tokens=[(0, tokens)]), None)
        r.launch(copy_batch([(3, 0), (4, 1)]), None)
        r.launch(copy_batch(offloads=[(7, 2)], reloads=[(1, 6), (0, 7)]), None)  # 7: offloaded, then reloaded
        parts = gather_blocks(r, [3, 4, 6, 7], [0, 1, 2, 2])
        assert len(parts) == 2
        for rank, both in enumerate(parts):
            device, host = both
            assert same_bytes(host[0], device[0]) and same_bytes(host[1], device[1]), rank  # offloaded
            assert same_bytes(device[2], device[1]) and same_bytes(device[3], device[0]), rank  # reloaded
            assert device[0].abs().sum() > 0 and not same_bytes(host[2], device[0]), rank  # slot 2: block 7's old
        assert not same_bytes(parts[0][0], parts[1][0])  # each rank its own heads
        assert r.host_copies.stats()["offloaded_blocks"] == 3 and r.host_copies.stats()["reloaded_blocks"] == 2


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(kv_offloading_size=True), TypeError, "kv_offloading_size must be a number"),
    (dict(kv_offloading_size="1"), TypeError, "kv_offloading_size must be a number"),
    (dict(kv_offloading_size=-1), ValueError, "kv_offloading_size must be a finite number of GiB >= 0"),
    (dict(kv_offloading_size=float("nan")), ValueError, "kv_offloading_size"),
    (dict(kv_offloading_size=float("inf")), ValueError, "kv_offloading_size"),
    (dict(preemption_mode="evict"), ValueError, r"preemption_mode must be one of \('recompute', 'swap'\)"),
    (dict(preemption_mode="swap"), ValueError, "needs kv_offloading_size > 0"),
    (dict(preemption_mode="swap", kv_offloading_size=1, enable_prefix_caching=False), ValueError,
     "enable_prefix_caching=True"),
    (dict(kv_offloading_size=1, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                                    "model": "MODEL"}), ValueError, "draft model"),
])
def test_bad_options(model_dir, kwargs, error, match):
    if "speculative_config" in kwargs:
        kwargs["speculative_config"]["model"] = model_dir
    with pytest.raises(error, match=match):
        Config(model_dir, **kwargs)


def test_good_options(model_dir):
    config = Config(model_dir, kv_offloading_size=2, preemption_mode="swap",
                    speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert (config.kv_offloading_size, config.preemption_mode) == (2, "swap")
    assert (Config(model_dir).kv_offloading_size, Config(model_dir).preemption_mode) == (0, "recompute")
    with pytest.raises(ValueError, match="kv_offloading_size"):  # LLM passes them on
        LLM(model_dir, kv_offloading_size=-0.5)


def test_copies_move_through_bounded_staging_chunks(runner, monkeypatch):
    """Many blocks at once move in chunks of host_tier.COPY_STAGING_BYTES, with the same bytes."""
    import nanovllm.features.host_tier as host_tier
    monkeypatch.setattr(host_tier, "COPY_STAGING_BYTES", 3 * runner.host_copies.cache[0].nbytes)  # 3 blocks a chunk
    ids, slots = [3, 9, 1, 12, 13, 14, 7, 11], [0, 1, 2, 3, 10, 11, 5, 6]
    before = [block(runner, b) for b in ids]
    runner.host_copies.copy(*copies(copy_batch(offloads=list(zip(ids, slots)))))
    assert all(same_bytes(runner.host_copies.cache[s], b) for s, b in zip(slots, before))
    targets = [15, 0, 2, 4, 5, 6, 8, 10]
    runner.host_copies.copy(*copies(copy_batch(reloads=list(zip(slots, targets)))))
    assert all(same_bytes(block(runner, t), b) for t, b in zip(targets, before))
