"""The step path's contract between the scheduler and every rank's model runner.

A rank runs a step from its message (StepBatch) alone: each sequence's row, first position, token
count and whether it samples, plus the block-table entries and the tokens of rows new in this
step. Its input ids come from its own token table, where the sampler writes each token it draws.
So a rank never needs to know whether the host has read the last step's tokens, and the overlapped
loop (step N+1 planned and launched before step N is accounted for) is the synchronous loop with
one step in flight.
"""
import random
from types import SimpleNamespace

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence


def det_token(tokens) -> int:
    """A fake model: the next token is a function of all tokens so far."""
    h = 0
    for t in tokens:
        h = (h * 1000003 + t + 1) % (1 << 61)
    return h % 50


class FakeRank:
    """A rank as the model runner is one, with Python lists for its device tables: it writes the
    step's new rows and blocks, reads every input token from its token table, and writes the
    token it samples there."""

    def __init__(self):
        self.tokens: dict[int, list[int]] = {}
        self.blocks: dict[int, list[int]] = {}

    def run(self, batch) -> list[int]:
        for row, offset, blocks in batch.new_blocks:
            table = self.blocks.setdefault(row, [])
            del table[offset:]
            table.extend(blocks)
        for row, tokens in batch.new_tokens:
            self.tokens[row] = list(tokens)
        sampled = []
        for row, start, n, samples in zip(batch.rows.tolist(), batch.starts.tolist(), batch.num_new.tolist(),
                                          batch.samples.tolist()):
            context = self.tokens[row][:start + n]  # every input token is in the table
            assert len(context) == start + n, "an input token is missing from the token table"
            if samples:
                token = det_token(context)
                del self.tokens[row][start + n:]
                self.tokens[row].append(token)
                sampled.append(token)
        return sampled


def run_scheduler(overlap: bool, seed: int) -> dict[int, list[int]]:
    """A random workload through Scheduler + FakeRank, the loop synchronous or overlapped; the
    completions by request."""
    rng = random.Random(seed)
    cfg = SimpleNamespace(preemption_mode="recompute", max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=rng.randint(4, 40),
                          max_model_len=64, speculative=None)
    block_size = rng.choice([1, 2, 4, 8])
    sched = Scheduler(cfg, BlockManager(64 // block_size + rng.randint(0, 8), block_size), eos_token_ids={0})
    rank = FakeRank()
    shared = [rng.randrange(1, 50) for _ in range(12)]
    seqs = []
    for i in range(12):
        prompt = shared[:rng.randint(0, 12)] + [rng.randrange(1, 50) for _ in range(rng.randint(1, 10))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.5,
                                n=rng.choice([1, 1, 2]))
        samples = [Sequence(prompt, params, seed=0, index=i, sample_index=j) for j in range(params.n)]
        samples[0].forks = samples[1:]
        sched.add(samples[0])
        seqs += samples
    in_flight = None
    for _ in range(5000):
        planned = sched.schedule()
        launched = (planned, rank.run(planned.batch())) if planned is not None else None
        for seq in sched.running:  # the rank's copy of each block table is the block manager's
            assert rank.blocks[seq.row][:len(seq.block_table)] == seq.block_table
        done = in_flight if overlap else launched
        in_flight = launched if overlap else None
        if done is not None:
            sched.complete(*done)
        if sched.is_finished() and in_flight is None:
            break
    assert all(seq.is_finished for seq in seqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return {(seq.index, seq.sample_index): (seq.completion_token_ids, seq.finish_reason) for seq in seqs}


@pytest.mark.parametrize("seed", range(12))
def test_a_rank_runs_from_its_messages_alone_and_overlap_changes_nothing(seed):
    """Chunked prefills, preemption (a few spare blocks), prefix hits, forks and EOS stops: the
    overlapped loop gives the synchronous loop's completions, which are the fake model's."""
    synchronous = run_scheduler(overlap=False, seed=seed)
    assert run_scheduler(overlap=True, seed=seed) == synchronous


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_device_tables_hold_each_running_sequence_s_tokens_and_blocks(model_dir, async_scheduling):
    """The model runner's token table and block tables, written only by step messages and the
    sampler, agree with every running sequence after every step: under preemption, chunked
    prefill, prefix hits and n > 1."""
    llm = LLM(model_dir, max_model_len=64, num_kvcache_blocks=10, kvcache_block_size=8, max_num_batched_tokens=24,
              async_scheduling=async_scheduling)
    runner, sched = llm.model_runner, llm.scheduler
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, n=2, presence_penalty=0.3)
    shared = list(range(10, 30))
    for prompt in [shared + [1, 2], shared + [3], list(range(40, 60)), [7] * 9]:
        llm.add_request(prompt, params)
    checked = 0
    while not llm.is_finished():
        llm.step()
        for seq in sched.running:
            known = seq.token_ids
            assert runner.token_table[seq.row, :len(known)].tolist() == known
            assert runner.block_tables[seq.row, :len(seq.block_table)].tolist() == seq.block_table
            checked += 1
    assert checked > 50 and llm.stats()["num_preemptions"] > 0


def test_a_row_s_scratch_copy_is_the_spare_block(model_dir):
    """CUDA-graph padding rows read the scratch row: it must point at the spare KV block, which
    no sequence is ever given."""
    llm = LLM(model_dir, max_model_len=64, num_kvcache_blocks=10, kvcache_block_size=8)
    runner = llm.model_runner
    assert torch.all(runner.block_tables[runner.scratch_row] == llm.stats()["num_blocks"])
    assert runner.kv_cache.shape[2] == llm.stats()["num_blocks"] + 1


@pytest.fixture(scope="module")
def large_vocab_dir(tmp_path_factory):
    """A tiny model whose vocabulary is larger than the sampler's candidates (NUM_CANDIDATES)."""
    from nanovllm.utils.tiny_model import build_model
    return build_model(str(tmp_path_factory.mktemp("vocab2048")), tokenizer=False, vocab_size=2048)


def outputs_with_redraws(path, async_scheduling, monkeypatch, force: bool):
    """generate() with top-k/top-p/min-p over a large vocabulary; force: every candidate draw is
    flagged, and made wrong (the next token id), so the outputs are right only if each flagged
    token is redrawn the full way when the host reads it and corrected wherever it was used."""
    from nanovllm.layers import top_k_top_p as sampler_module
    real = sampler_module.draw_filtered
    if force:
        def wrong_and_flagged(probs, *args):
            tokens, _ = real(probs, *args)
            return (tokens + 1) % probs.shape[-1], torch.ones_like(tokens, dtype=torch.bool)
        monkeypatch.setattr(sampler_module, "draw_filtered", wrong_and_flagged)
    llm = LLM(path, max_model_len=64, async_scheduling=async_scheduling, max_num_batched_tokens=16)
    corrections, undone = [], []
    correct = llm.scheduler.correct

    def spy(step, indices, tokens, in_flight):
        correct(step, indices, tokens, in_flight)
        corrections.append(len(indices))
        undone.append(len(in_flight.undone) if in_flight is not None else 0)
    llm.scheduler.correct = spy
    params = [SamplingParams(temperature=1.0, top_p=0.8, seed=1, max_tokens=12),
              SamplingParams(temperature=0.7, top_k=40, min_p=0.02, seed=2, max_tokens=9, logprobs=2),
              SamplingParams(temperature=0, max_tokens=10)]
    outputs = llm.generate([list(range(1, 30)), [5, 6, 7], [9] * 20], params, use_tqdm=False)
    monkeypatch.setattr(sampler_module, "draw_filtered", real)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    return [(o["token_ids"], o["finish_reason"], [sorted(d) for d in o.get("logprobs", [])]) for o in outputs], \
        sum(corrections), sum(undone)


def test_tokens_redrawn_after_the_next_step_read_them_are_corrected_everywhere(large_vocab_dir, monkeypatch):
    """The sampler flags rows its candidates cannot vouch for and the host redraws them when it
    reads the tokens: synchronously that is before the next step, overlapped the next step has
    already decoded the first draw and is undone for those sequences. Either way the outputs are
    the ones drawn without the flags (every draw exact)."""
    plain, corrected, _ = outputs_with_redraws(large_vocab_dir, False, monkeypatch, force=False)
    assert corrected == 0
    synchronous, corrected, undone = outputs_with_redraws(large_vocab_dir, False, monkeypatch, force=True)
    assert synchronous == plain and corrected > 10 and undone == 0
    overlapped, corrected, undone = outputs_with_redraws(large_vocab_dir, True, monkeypatch, force=True)
    assert overlapped == plain and corrected > 10 and undone > 5


def test_a_sequence_preempted_with_its_last_token_in_flight_finishes_and_leaves_the_queue():
    """Overlapped: step 2 is planned before step 1 is accounted for, and preempts b, whose step-1
    token is still in flight; that token is a stop token of b's: accounting for step 1 must finish
    b and take it out of the waiting queue, not leave it there to be run again."""
    cfg = SimpleNamespace(preemption_mode="recompute", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, speculative=None)
    sched = Scheduler(cfg, BlockManager(3, 4, enable_prefix_caching=False), eos_token_ids=set())
    a = Sequence([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), seed=0)
    stop = det_token([5, 6, 7, 8])  # b's first token
    b = Sequence([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[stop]), seed=0)
    sched.add(a)
    sched.add(b)
    rank = FakeRank()
    step1 = sched.schedule()
    tokens1 = rank.run(step1.batch())
    step2 = sched.schedule()  # a needs a block for position 4 and takes the last; so would b: b is preempted
    assert sched.num_preemptions == 1 and list(sched.waiting) == [b] and step2.seqs == [a]
    tokens2 = rank.run(step2.batch())
    sched.complete(step1, tokens1)
    assert b.is_finished and (b.finish_reason, b.stop_reason) == ("stop", stop) and b.num_completion_tokens == 1
    assert not sched.waiting
    sched.complete(step2, tokens2)
    while not sched.is_finished():
        step = sched.schedule()
        sched.complete(step, rank.run(step.batch()))
    assert a.num_completion_tokens == 3 and b.num_completion_tokens == 1
    assert sched.block_manager.num_free_blocks == 3
