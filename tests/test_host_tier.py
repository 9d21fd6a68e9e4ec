"""The prefix cache's host tier end to end (CPU, float32): a prefix reloaded from host memory gives
exactly the logits of the same prefix served by the device tier, and the same greedy tokens as
recomputing it; over several evict/reload cycles, with chunked prefill, with tensor parallelism;
swap preemption gives the recompute mode's outputs; the stats count both tiers and the copies.

A device cache of a few blocks and filler requests between the turns push a prompt's blocks out
of the device; a large device cache keeps them there (the reference for "served from cache")."""
import os
import random
import sys

import pytest

from nanovllm import LLM, SamplingParams

BLOCK = 16
HOST_GIB = 0.002          # the tiny model's blocks are 16 KiB (fp32, 2 layers): ~120 of them
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
rng = random.Random(0)
PREFIX = [rng.randrange(1, 512) for _ in range(100)]
FILLERS = [[rng.randrange(1, 512) for _ in range(120)] for _ in range(3)]
TURNS = [PREFIX + [rng.randrange(1, 512) for _ in range(5 + i)] for i in range(3)]


def run_turns(model_dir, **options):
    """PREFIX's turns, each after the fillers (which evict it from a small device cache); the
    outputs of the turns and the engine's stats."""
    with LLM(model_dir, kvcache_block_size=BLOCK, max_model_len=256, **options) as llm:
        outputs = [llm.generate([PREFIX], PARAMS, use_tqdm=False)[0]]
        for turn in TURNS:
            llm.generate(FILLERS, PARAMS, use_tqdm=False)
            outputs.append(llm.generate([turn], PARAMS, use_tqdm=False)[0])
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]  # nothing leaked
    return outputs, stats


ALL_HITS = 3 * 96 + 2 * 3 * 112
SMALL_DEVICE = {"num_kvcache_blocks": 17}   # one request at a time: the fillers evict everything
LARGE_DEVICE = {"num_kvcache_blocks": 400}


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
def test_a_reloaded_prefix_gives_the_logits_of_a_cached_one(model_dir, chunked):
    options = {"max_num_batched_tokens": 32} if chunked else {}
    reloaded, stats = run_turns(model_dir, kv_offloading_size=HOST_GIB, **SMALL_DEVICE, **options)
    cached, cached_stats = run_turns(model_dir, **LARGE_DEVICE, **options)
    # every turn after the first found PREFIX's 6 full blocks on the host, none on the device (and
    # the fillers, 7 full blocks each, theirs from their second round on)
    assert [o["num_cached_tokens"] for o in reloaded] == [0, 96, 96, 96]
    assert stats["host_cache_hits"] == ALL_HITS and stats["prefix_cache_hits"] == 0
    assert cached_stats["prefix_cache_hits"] == ALL_HITS and cached_stats["host_cache_hits"] == 0
    assert [o["token_ids"] for o in reloaded] == [o["token_ids"] for o in cached]
    assert [o["logprobs"] for o in reloaded] == [o["logprobs"] for o in cached]  # bitwise: the same K/V
    assert stats["kv_reloaded_bytes"] > 0 and stats["kv_offloaded_bytes"] >= stats["kv_reloaded_bytes"] / 3


def test_a_reloaded_prefix_gives_the_tokens_of_a_recomputed_one(model_dir):
    reloaded, _ = run_turns(model_dir, kv_offloading_size=HOST_GIB, **SMALL_DEVICE)
    recomputed, stats = run_turns(model_dir, **SMALL_DEVICE)
    assert stats["prefix_cache_hits"] == 0 and stats["host_cache_hits"] == 0
    assert [o["token_ids"] for o in reloaded] == [o["token_ids"] for o in recomputed]
    for got, expected in zip(reloaded, recomputed):  # the same K/V computed in other chunks: float32 rounding
        for mine, theirs in zip(got["logprobs"], expected["logprobs"]):
            assert mine.keys() == theirs.keys() and all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)


def test_tensor_parallel_ranks_offload_and_reload_their_shards(model_dir):
    reloaded, stats = run_turns(model_dir, kv_offloading_size=HOST_GIB, tensor_parallel_size=2, **SMALL_DEVICE)
    single, _ = run_turns(model_dir, kv_offloading_size=HOST_GIB, **SMALL_DEVICE)
    assert stats["host_cache_hits"] == ALL_HITS
    assert [o["token_ids"] for o in reloaded] == [o["token_ids"] for o in single]
    for got, expected in zip(reloaded, single):
        for mine, theirs in zip(got["logprobs"], expected["logprobs"]):
            assert all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)


def test_pipeline_stages_offload_and_reload_their_layers(model_dir):
    """Each stage copies its own layers' K/V of a block (half the bytes: as many host blocks)."""
    reloaded, stats = run_turns(model_dir, kv_offloading_size=HOST_GIB, pipeline_parallel_size=2, **SMALL_DEVICE)
    single, single_stats = run_turns(model_dir, kv_offloading_size=HOST_GIB, **SMALL_DEVICE)
    assert stats["host_cache_hits"] == ALL_HITS and stats["num_host_blocks"] == single_stats["num_host_blocks"]
    assert [o["token_ids"] for o in reloaded] == [o["token_ids"] for o in single]
    for got, expected in zip(reloaded, single):
        for mine, theirs in zip(got["logprobs"], expected["logprobs"]):
            assert all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)


def test_swap_preemption_gives_the_outputs_of_recompute(model_dir, prompts):
    # swap: a victim's cached blocks are written to the host tier as it is preempted, and its
    # prefix comes back from there (or from the device, if still intact) on readmission
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs, stats = {}, {}
    for mode, host_gib in (("recompute", 0), ("swap", HOST_GIB)):
        with LLM(model_dir, num_kvcache_blocks=24, max_num_seqs=8, max_model_len=330, kv_offloading_size=host_gib,
                 preemption_mode=mode) as llm:
            outputs[mode] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
            stats[mode] = llm.stats()
        assert stats[mode]["num_preemptions"] > 0 and stats[mode]["num_free_blocks"] == stats[mode]["num_blocks"]
        assert stats[mode]["num_host_blocks_used"] <= stats[mode]["num_host_blocks"]
    assert outputs["swap"] == outputs["recompute"]
    assert stats["swap"]["host_cache_hits"] > 0 and stats["swap"]["kv_offloaded_bytes"] > 0
    assert stats["swap"]["num_cached_tokens"] > stats["recompute"]["num_cached_tokens"]


def test_the_host_tier_needs_prefix_caching_to_serve_anything(model_dir):
    outputs, stats = run_turns(model_dir, kv_offloading_size=HOST_GIB, enable_prefix_caching=False, **SMALL_DEVICE)
    assert stats["host_cache_hits"] == 0 and stats["kv_offloaded_bytes"] == 0
    assert [o["num_cached_tokens"] for o in outputs] == [0, 0, 0, 0]


def test_bench_multiturn_computes_fewer_prefill_tokens_with_the_host_tier(capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_multiturn
    result = bench_multiturn.main(["--conversations", "4", "--turns", "4", "--system-len", "64",
                                   "--question-len", "32", "--answer-len", "8"])
    off, on = result["off"], result["on"]
    assert off["host_cache_hits"] == 0 and on["host_cache_hits"] > 0 and on["kv_reloaded_bytes"] > 0
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert len(on["ttft_ms_per_turn"]) == 4 and "off / on" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_swap_preemption_offloads_the_victims_cached_blocks_in_that_step(mode):
    """With a fake runner (the scheduler alone): the step that preempts a sequence under
    preemption_mode="swap" copies every cached block of the victim to the host tier (its offloads);
    "recompute" copies only the one that step hands to another sequence (write-back on eviction),
    and leaves the other on the device. (Outputs cannot tell the two apart: the test above.)"""
    from types import SimpleNamespace

    from nanovllm.engine.block_manager import BlockManager
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.engine.sequence import Sequence, SequenceStatus
    config = SimpleNamespace(preemption_mode=mode, max_num_seqs=8, max_num_batched_tokens=100, max_model_len=1000,
                             speculative=None)
    sched = Scheduler(config, BlockManager(7, 4, True, num_host_blocks=16), eos_token_ids=set())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a, b, c = (Sequence([base + i for i in range(7)], params, seed=0) for base in (10, 20, 30))
    for seq in (a, b, c):
        sched.add(seq)

    def step():
        planned = sched.schedule()
        sched.complete(planned, [1] * len(planned.sampling))
        return planned
    step()                    # three prefills of 2 blocks each: 1 block free
    step()                    # each computes its 8th token: 2 full, cached blocks each
    victim_blocks, victim_keys = list(c.block_table), list(c.block_hashes)
    assert len(victim_keys) == 2 and sched.num_preemptions == 0
    planned = step()          # position 8: a takes the free block, b preempts c and takes its tail
    assert c.status == SequenceStatus.WAITING and sched.num_preemptions == 1
    assert victim_blocks[1] in b.block_table and victim_blocks[0] in sched.block_manager.free
    offloaded = set() if planned.offloads is None else {int(block) for block, _ in planned.offloads}
    on_host = [key in sched.block_manager.host.entries for key in victim_keys]
    if mode == "swap":
        assert set(victim_blocks) <= offloaded and on_host == [True, True]
    else:
        assert victim_blocks[1] in offloaded and victim_blocks[0] not in offloaded and on_host == [False, True]


LAYER_KINDS = {  # the families of several kinds of layers (issue 48), at the test sizes of their own files
    "gemma3": dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   sliding_window=16, query_pre_attn_scalar=24, tie_word_embeddings=True),
    "gpt_oss": {},
    "qwen3_5": {},
}


@pytest.mark.parametrize("arch", LAYER_KINDS)
def test_swap_preemption_and_reloads_for_each_kind_of_layer(arch, tmp_path, prompts, reference):
    """Sliding-window (sharing the one pool of blocks while the host tier is on), sink and linear-
    attention layers: swap preemption and prefix reloads from the host tier give Hugging Face's
    greedy tokens, and nothing leaks."""
    from nanovllm.utils.tiny_model import build_model
    path = build_model(str(tmp_path / arch), arch=arch, **LAYER_KINDS[arch])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(path, num_kvcache_blocks=24, max_num_seqs=8, max_model_len=330, kv_offloading_size=HOST_GIB,
             preemption_mode="swap", kvcache_block_size=BLOCK) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts[-3:], params, use_tqdm=False)
        stats = llm.stats()
    assert [o["token_ids"] for o in outputs + again] == [reference(path, p, 24) for p in prompts + prompts[-3:]]
    assert stats["num_preemptions"] > 0 and stats["host_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
