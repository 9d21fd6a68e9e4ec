"""Prefill/decode disaggregation (distributed/disaggregation.py): a prefill engine and a decode engine,
each a process, the decode engine pulling each prompt's K/V over torch.distributed (gloo here): the
output is a colocated engine's, token for token, with the prompt's full blocks served from the pull."""
import os
import subprocess
import sys

from types import SimpleNamespace

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.distributed.disaggregation import DisaggregatedLLM, publish_blocks
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from nanovllm.utils.tiny_model import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 512}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(str(tmp_path_factory.mktemp("disagg")))


def test_disaggregated_output_is_colocated_and_the_prefix_comes_from_the_prefill_engine(model):
    base = list(range(3, 103))
    prompts = [[7, 8, 9, 10, 11],  # (no full block: straight to the decode engine)
               list(range(40, 57)),  # 17 tokens: one full block, then the last token
               list(range(60, 93)),  # 33: two blocks
               base, base[:90] + [1, 2, 3],  # a prefix in common: the second's first blocks are cached already
               [5] * 300]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model, **OPTIONS) as llm:
        expected = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    with DisaggregatedLLM(model, OPTIONS) as llm:
        outputs = llm.generate(prompts, params)
        with pytest.raises(ValueError, match="exceeds max_model_len=512"):
            llm.submit([1] * 510, params)
        with pytest.raises(TypeError, match="list of token ids"):
            llm.submit("text", params)
        processes = llm.processes
    assert [o["token_ids"] for o in outputs] == expected
    # every full block before the last token was pulled (or, for the shared prefix, was there already)
    assert [o["num_cached_tokens"] for o in outputs] == [(len(p) - 1) // 16 * 16 for p in prompts]
    assert all(o["metrics"]["ttft_s"] > 0 for o in outputs)
    assert not [p for p in processes if p.is_alive()]


def test_the_demo_checks_the_outputs_and_prints_both_latencies():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "disagg_demo.py"), "--num-decodes", "3",
                          "--decode-tokens", "48", "--num-long", "2", "--long-len", "200"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tokens identical: True" in out.stdout
    for kind in ("decode", "long"):
        for where in ("colocated", "disaggregated"):
            assert f"{kind}  {where}:" in out.stdout and "TPOT p50" in out.stdout, out.stdout
    assert "took 384 prompt tokens' K/V from the prefill engine" in out.stdout, out.stdout  # (2 x 192)


# ---- publish_blocks: pulled K/V into the decode engine's prefix cache -------------------------------
BS = 4  # (a small block size: a few tokens span several blocks)


def decode_side(num_blocks: int) -> SimpleNamespace:
    """What publish_blocks reads of the decode engine: its block manager and its KV cache
    ([2, layers, blocks, block_size, kv_heads, head_dim], here 1 layer of 1 head of 1 value)."""
    return SimpleNamespace(block_manager=BlockManager(num_blocks, BS),
                           model_runner=SimpleNamespace(kv_cache=torch.zeros(2, 1, num_blocks, BS, 1, 1)))


def pulled(num_blocks: int) -> torch.Tensor:
    """K/V of num_blocks blocks as the prefill engine sends them, each block's values its own."""
    return torch.arange(1, num_blocks + 1, dtype=torch.float32).view(1, 1, num_blocks, 1, 1, 1).expand(
        2, 1, num_blocks, BS, 1, 1).contiguous()


def admitted(manager: BlockManager, token_ids: list[int]) -> Sequence:
    seq = Sequence(token_ids, SamplingParams(temperature=0, max_tokens=1), seed=0)
    num_cached = manager.allocate(seq)
    assert num_cached is not None
    seq.admit(num_cached)
    return seq


def test_published_blocks_are_freed_tail_first_so_the_prefix_stays_cached_longest():
    """As the block manager frees a sequence's blocks: a pulled prompt's last block goes out first,
    its first block last (every longer prefix needs the first)."""
    llm = decode_side(6)
    prompt = list(range(1, 14))                              # 3 full blocks, then the last token
    publish_blocks(llm, prompt, pulled(3))
    manager, cache = llm.block_manager, llm.model_runner.kv_cache
    other = admitted(manager, list(range(100, 116)))        # 4 blocks: the 3 untouched ones and 1 published
    manager.free_blocks(other)
    seq = admitted(manager, prompt)
    assert seq.num_computed_tokens == 2 * BS                 # the first two blocks are still served
    assert [cache[0, 0, b, 0, 0, 0].item() for b in seq.block_table[:2]] == [1, 2]   # (the pulled K/V)


def test_published_blocks_are_free_until_a_hit_takes_them():
    """A published block is free (ref_count 0: it can be handed out, or revived by a hit); a hit
    takes it off the free list, so no other sequence gets it while the hit holds it."""
    llm = decode_side(6)
    prompt = list(range(1, 14))
    publish_blocks(llm, prompt, pulled(3))
    manager = llm.block_manager
    assert manager.num_free_blocks == 6
    seq = admitted(manager, prompt)
    assert seq.num_computed_tokens == 3 * BS and manager.num_free_blocks == 6 - 4
    filler = admitted(manager, list(range(100, 100 + BS * manager.num_free_blocks)))   # every free block
    assert manager.num_free_blocks == 0 and not set(filler.block_table) & set(seq.block_table)
    manager.free_blocks(filler)
    manager.free_blocks(seq)
    assert manager.num_free_blocks == 6


def test_a_pulled_block_after_one_cached_here_chains_to_the_cached_one():
    """The first block is cached in the decode engine already (kept, not written again); the
    pulled blocks after it are published as its children, so a lookup follows the whole chain."""
    llm = decode_side(8)
    prompt = list(range(1, 14))
    publish_blocks(llm, prompt[:BS + 1], pulled(1))         # (an earlier request: the first block)
    manager = llm.block_manager
    [first] = manager.hash_to_block.values()
    publish_blocks(llm, prompt, pulled(3) * 10)
    seq = admitted(manager, prompt)
    assert seq.num_computed_tokens == 3 * BS and seq.block_table[0] == first
    assert llm.model_runner.kv_cache[0, 0, first, 0, 0, 0].item() == 1      # (kept, not overwritten)


@pytest.mark.parametrize("num_free", [3, 2])
def test_pulled_blocks_fill_the_free_blocks_exactly_the_rest_left_to_compute(num_free):
    """As many of the prompt's blocks as there are free blocks are published, from its first:
    all three with exactly three free, the first two with two."""
    llm = decode_side(num_free + 2)
    manager = llm.block_manager
    holder = admitted(manager, [500] * (BS + 1))             # (holds two blocks)
    prompt = list(range(1, 14))
    publish_blocks(llm, prompt, pulled(3))
    assert manager.num_free_blocks == num_free
    manager.free_blocks(holder)
    seq = admitted(manager, prompt)
    assert seq.num_computed_tokens == num_free * BS
