"""Scheduler unit tests with a fake runner: token budget, chunked prefill, decode-first and FCFS
admission, preemption order, finish reasons, and a randomized no-leak / no-loss stress test."""
import random
from types import SimpleNamespace

import pytest

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

BIG = 10**6  # a max_model_len / block count that never binds


def make_sched(num_blocks=BIG // 1000, block_size=4, budget=64, max_seqs=8, max_model_len=BIG,
               prefix_caching=True, eos=()):
    cfg = SimpleNamespace(preemption_mode="recompute", max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                          speculative=None)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, prefix_caching), eos_token_ids=set(eos))


def make_seq(token_ids, max_tokens=4, ignore_eos=True):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Sequence(token_ids, params, seed=0)


def det_token(token_ids) -> int:
    """The fake model: the next token is a deterministic function of all tokens so far, so equal
    prefixes continue equally (and prefix sharing keeps happening during decode)."""
    h = 0
    for t in token_ids:
        h = (h * 1000003 + t + 1) % (1 << 61)
    return h % 50


def step(sched, token_fn=lambda s: det_token(s.token_ids)):
    """One fake-runner step, synchronous: schedule, sample, complete. Returns
    ([(seq, its new tokens, whether it samples)], the sequences that finished)."""
    planned = sched.schedule()
    if planned is None:
        return [], []
    info = list(zip(planned.seqs, planned.num_new, planned.samples))
    sampled = [token_fn(s) for s in planned.sampling]
    updated = sched.complete(planned, sampled)
    return info, [s for s in updated if s.is_finished]


def run_to_end(sched, max_steps=10_000, token_fn=lambda s: det_token(s.token_ids)):
    history = []
    for _ in range(max_steps):
        if sched.is_finished():
            return history
        info, finished = step(sched, token_fn)
        assert info, "no progress: nothing scheduled while requests remain"
        history.append((info, finished))
    raise AssertionError("did not finish")


def check_blocks(sched):
    bm = sched.block_manager
    for block in bm.blocks:
        holders = sum(b == block.block_id for s in sched.running for b in s.block_table)
        assert block.ref_count == holders, (block.block_id, block.ref_count, holders)
        assert (block.block_id in bm.free) == (block.ref_count == 0)
    for s in sched.waiting:
        assert s.block_table == [] and s.status == SequenceStatus.WAITING


# ---------------------------------------------------------------- budget

def test_token_budget_and_max_num_seqs_respected():
    budget, max_seqs = 20, 3
    sched = make_sched(num_blocks=200, budget=budget, max_seqs=max_seqs)
    rng = random.Random(1)
    for _ in range(10):
        sched.add(make_seq([rng.randrange(100) for _ in range(rng.randrange(1, 30))], max_tokens=5))
    first = True
    for info, _ in run_to_end(sched):
        total = sum(n for _, n, _ in info)
        assert total <= budget
        assert len(info) <= max_seqs
        assert all(n >= 1 for _, n, _ in info)
        if first:  # plenty of work waiting: the first step fills the budget exactly
            assert total == budget
            first = False
    # Many short requests: the running set fills up to max_num_seqs and never beyond.
    sched = make_sched(num_blocks=200, budget=budget, max_seqs=max_seqs)
    for _ in range(10):
        sched.add(make_seq([1, 2, 3], max_tokens=5))
    seen_full = False
    while not sched.is_finished():
        step(sched)
        assert len(sched.running) <= max_seqs
        seen_full |= len(sched.running) == max_seqs
    assert seen_full


# ---------------------------------------------------------------- chunked prefill

def test_long_prompt_chunked_then_decodes_one_token_per_step():
    sched = make_sched(num_blocks=100, block_size=4, budget=16)
    seq = make_seq(list(range(1, 41)), max_tokens=3)   # 40 tokens > budget 16
    sched.add(seq)
    history = run_to_end(sched)
    chunks = [info[0][1] for info, _ in history]
    samples = [info[0][2] for info, _ in history]
    assert chunks == [16, 16, 8, 1, 1]
    assert samples == [False, False, True, True, True]
    assert seq.num_completion_tokens == 3 and seq.finish_reason == "length"
    assert [bool(f) for _, f in history] == [False, False, False, False, True]


def test_chunk_takes_the_budget_left_after_decodes():
    sched = make_sched(num_blocks=100, block_size=4, budget=10)
    a = make_seq([1, 2, 3], max_tokens=20)
    sched.add(a)
    step(sched)                                        # a prefilled, now decoding
    b = make_seq(list(range(100, 125)), max_tokens=2)  # 25 tokens
    sched.add(b)
    sizes = []
    while b.num_completion_tokens < 1:
        info, _ = step(sched)
        got = {s.seq_id: (n, smp) for s, n, smp in info}
        assert got[a.seq_id] == (1, True)              # a decodes every step, first
        assert info[0][0] is a
        sizes.append(got[b.seq_id])
    assert sizes == [(9, False), (9, False), (7, True)]


def test_chunk_progress_counters():
    sched = make_sched(num_blocks=100, block_size=4, budget=6)
    seq = make_seq(list(range(1, 15)), max_tokens=1)   # 14 tokens
    sched.add(seq)
    computed = []
    while not sched.is_finished():
        step(sched)
        computed.append(seq.num_computed_tokens)
    assert computed == [6, 12, 0]                      # finished: blocks freed, counter reset
    assert seq.num_completion_tokens == 1


# ---------------------------------------------------------------- ordering

def test_decodes_served_before_new_prompts_are_admitted():
    sched = make_sched(num_blocks=100, block_size=4, budget=4, max_seqs=8)
    a = make_seq([1, 2, 3, 4], max_tokens=6)
    sched.add(a)
    info, _ = step(sched)                              # a's prefill uses the whole budget
    assert [(s, n) for s, n, _ in info] == [(a, 4)]
    b = make_seq(list(range(10, 20)), max_tokens=2)
    c = make_seq(list(range(20, 30)), max_tokens=2)
    sched.add(b)
    sched.add(c)
    while not a.is_finished:
        info, _ = step(sched)
        assert info[0][0] is a and info[0][1] == 1     # a's decode first, never starved
        assert sum(n for _, n, _ in info) <= 4
    assert a.num_completion_tokens == 6


def test_running_prefill_chunks_served_before_admission():
    sched = make_sched(num_blocks=100, block_size=4, budget=8)
    a = make_seq(list(range(1, 21)), max_tokens=1)     # 20 tokens: chunks of 8, 8, 4
    sched.add(a)
    step(sched)
    b = make_seq([50, 51], max_tokens=1)
    sched.add(b)
    info, _ = step(sched)
    assert [(s, n) for s, n, _ in info] == [(a, 8)]    # a's chunk takes the budget, b waits
    info, _ = step(sched)
    assert [(s, n) for s, n, _ in info] == [(a, 4), (b, 2)]


def test_fcfs_admission():
    sched = make_sched(num_blocks=100, block_size=4, budget=100, max_seqs=2)
    seqs = [make_seq([i + 1] * (i + 2), max_tokens=3) for i in range(6)]
    for s in seqs:
        sched.add(s)
    admitted = []
    while not sched.is_finished():
        info, _ = step(sched)
        for s, _, _ in info:
            if s.seq_id not in admitted:
                admitted.append(s.seq_id)
    assert admitted == [s.seq_id for s in seqs]


def test_fcfs_head_of_line_not_bypassed_when_it_does_not_fit():
    sched = make_sched(num_blocks=6, block_size=4, budget=100, max_seqs=8, prefix_caching=False)
    a = make_seq(list(range(1, 13)), max_tokens=2)     # 3 blocks (4 with its decode)
    big = make_seq(list(range(100, 117)), max_tokens=1)  # 17 tokens: 5 blocks, cannot fit now
    small = make_seq([7], max_tokens=1)                # would fit, but arrived after big
    for s in (a, big, small):
        sched.add(s)
    info, _ = step(sched)
    assert [s for s, _, _ in info] == [a]
    assert list(sched.waiting) == [big, small]
    history = run_to_end(sched)
    order = [f.seq_id for _, fin in history for f in fin]
    assert order == [a.seq_id, big.seq_id, small.seq_id]


# ---------------------------------------------------------------- preemption

@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempts_most_recently_admitted_to_front_of_waiting(prefix_caching):
    sched = make_sched(num_blocks=6, block_size=4, budget=100, max_seqs=8, prefix_caching=prefix_caching)
    a, b, c = (make_seq([base + i for i in range(7)], max_tokens=6) for base in (10, 20, 30))
    late = make_seq([99], max_tokens=1)
    for s in (a, b, c):
        sched.add(s)
    step(sched)                                        # all prefilled: 3 x 2 blocks, 0 free
    assert sched.block_manager.num_free_blocks == 0
    sched.add(late)
    step(sched)                                        # position 7 still in block 1
    assert sched.num_preemptions == 0
    info, _ = step(sched)                              # position 8 needs a 3rd block each
    assert sched.num_preemptions == 1
    assert c.status == SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert list(sched.waiting) == [c, late]            # front, ahead of an older waiting request
    assert sched.running == [a, b]
    assert [s for s, _, _ in info] == [a, b]           # no admission in a step that preempted
    check_blocks(sched)
    run_to_end(sched)
    for s in (a, b, c):
        assert s.is_finished and s.num_completion_tokens == 6
        assert s.completion_token_ids == expected_completion(s.token_ids[:7], 6)
    assert late.is_finished
    assert sched.block_manager.num_free_blocks == 6


def test_preemption_order_preserved_among_several_victims():
    sched = make_sched(num_blocks=8, block_size=4, budget=100, max_seqs=8, prefix_caching=False)
    seqs = [make_seq([base + i for i in range(7)], max_tokens=8) for base in (10, 20, 30, 40)]
    a, b, c, d = seqs
    for s in seqs:
        sched.add(s)
    step(sched)
    newcomer = make_seq([5, 6], max_tokens=1)
    sched.add(newcomer)
    step(sched)
    # Position 8: a grows by preempting d (2 blocks freed); b takes the other; c has none and,
    # being the newest still running, is itself preempted.
    info, _ = step(sched)
    assert sched.num_preemptions == 2
    assert [s for s, _, _ in info] == [a, b]
    assert sched.running == [a, b]
    assert list(sched.waiting) == [c, d, newcomer]     # admission order kept, ahead of newcomer
    check_blocks(sched)
    # They are re-admitted in that order.
    readmitted = []
    while not sched.is_finished():
        info, _ = step(sched)
        for s, _, _ in info:
            if s in (c, d, newcomer) and s not in readmitted:
                readmitted.append(s)
        check_blocks(sched)
    assert readmitted == [c, d, newcomer]
    for s in seqs:
        assert s.num_completion_tokens == 8
        assert s.completion_token_ids == expected_completion(s.token_ids[:7], 8)


def test_preempted_sequence_revives_its_cached_prefix():
    sched = make_sched(num_blocks=7, block_size=4, budget=100, max_seqs=8, prefix_caching=True)
    a, b, c = (make_seq([base + i for i in range(7)], max_tokens=6) for base in (10, 20, 30))
    for s in (a, b, c):
        sched.add(s)
    step(sched)                                        # 3 x 2 blocks, 1 free
    step(sched)                                        # c has computed 8 tokens = 2 full blocks
    c_blocks = list(c.block_table)
    assert len(c.block_hashes) == 2
    step(sched)                                        # a takes the free block; b preempts c
    assert c.status == SequenceStatus.WAITING and sched.num_preemptions == 1
    # c's tail was freed first and b took it; c's first block is still cached and free.
    assert c_blocks[1] in b.block_table and c_blocks[0] in sched.block_manager.free
    stat = sched.block_manager.num_cached_tokens
    while c.status == SequenceStatus.WAITING:
        step(sched)
    assert sched.block_manager.num_cached_tokens - stat == 4
    assert c.block_table[0] == c_blocks[0]
    assert c.num_cached_tokens == 0                    # the per-request stat is the first admission's
    run_to_end(sched)
    assert c.completion_token_ids == expected_completion(c.token_ids[:7], 6)


# ---------------------------------------------------------------- finishing

def test_finish_on_eos_is_stop_and_max_tokens_is_length():
    sched = make_sched(eos=(7,))
    stopper = make_seq([1, 2, 3], max_tokens=10, ignore_eos=False)
    lengther = make_seq([4, 5, 6], max_tokens=4, ignore_eos=False)
    ignorer = make_seq([8, 9], max_tokens=5, ignore_eos=True)
    for s in (stopper, lengther, ignorer):
        sched.add(s)

    def token_fn(s):
        if s is lengther:
            return 3
        return 7 if s.num_completion_tokens == 2 else 1  # the 3rd completion token is EOS

    finished = {}
    for i in range(1, 20):
        _, fin = step(sched, token_fn)
        for s in fin:
            finished[s.seq_id] = i
        if sched.is_finished():
            break
    assert stopper.finish_reason == "stop" and stopper.completion_token_ids == [1, 1, 7]
    assert finished[stopper.seq_id] == 3
    assert lengther.finish_reason == "length" and lengther.completion_token_ids == [3, 3, 3, 3]
    assert ignorer.finish_reason == "length" and ignorer.completion_token_ids == [1, 1, 7, 1, 1]
    for s in (stopper, lengther, ignorer):
        assert s.status == SequenceStatus.FINISHED and s.block_table == []
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_max_model_len_finishes_with_length():
    sched = make_sched(max_model_len=10)
    seq = make_seq(list(range(1, 8)), max_tokens=100)
    sched.add(seq)
    run_to_end(sched)
    assert seq.finish_reason == "length" and seq.num_tokens == 10


def test_finish_aborts_waiting_and_running():
    sched = make_sched(num_blocks=10, block_size=4, budget=100, max_seqs=1)
    a = make_seq([1, 2, 3, 4, 5], max_tokens=50)
    b = make_seq([6, 7], max_tokens=50)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.running == [a] and list(sched.waiting) == [b]
    sched.finish(b, "abort")
    sched.finish(a, "abort")
    assert sched.is_finished()
    assert a.is_finished and b.is_finished
    assert sched.block_manager.num_free_blocks == 10


# ---------------------------------------------------------------- randomized stress

def expected_completion(prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(det_token(tokens))
    return tokens[len(prompt):]


def check_step(sched, planned, all_seqs, finished_ids, budget, max_seqs, kv):
    """Invariants right after schedule() (which commits the step), before the fake runner."""
    bm = sched.block_manager
    bs = bm.block_size
    seqs = planned.seqs
    assert sum(planned.num_new) <= budget
    assert len(seqs) <= max_seqs and len(sched.running) <= max_seqs
    assert len({s.seq_id for s in seqs}) == len(seqs)
    running_ids = [s.seq_id for s in sched.running]
    waiting_ids = [s.seq_id for s in sched.waiting]
    assert len(set(running_ids)) == len(running_ids) and len(set(waiting_ids)) == len(waiting_ids)
    # Every request in exactly one place.
    assert sorted(running_ids + waiting_ids + list(finished_ids)) == sorted(s.seq_id for s in all_seqs)
    for s, start, n, samples in zip(seqs, planned.starts, planned.num_new, planned.samples):
        assert s.status == SequenceStatus.RUNNING and n >= 1
        assert s.num_computed_tokens == start + n              # committed
        assert len(s.block_table) * bs >= start + n
        assert start + n == len(s.token_ids) if samples else start + n < len(s.token_ids)
        assert s.num_tokens == len(s.token_ids) + samples      # the token it samples is in flight
    assert planned.sampling == [s for s, samples in zip(seqs, planned.samples) if samples]
    for s in sched.running:
        assert s.status == SequenceStatus.RUNNING
        assert len(set(s.block_table)) == len(s.block_table)
    check_blocks(sched)
    # Simulated KV cache: slot -> the prefix it was computed for. Every token a scheduled sequence
    # attends to (already computed, incl. prefix-cache hits) must hold its own prefix.
    for s, start in zip(seqs, planned.starts):
        for p in range(start):
            slot = s.block_table[p // bs] * bs + p % bs
            assert kv.get(slot) == tuple(s.token_ids[:p + 1]), f"seq {s.seq_id} reads stale KV at pos {p}"


NUM_REQUESTS = 40  # per stress run: 8 up front, the rest arriving while others run

STRESS_CONFIGS = [
    # (block_size, num_blocks, budget, max_seqs, prefix_caching)
    (4, 12, 16, 4, True),
    (4, 12, 16, 4, False),
    (2, 20, 8, 3, True),
    (8, 8, 32, 8, True),
    (4, 40, 64, 16, True),
    (4, 40, 7, 16, False),
    (1, 40, 5, 6, True),
    (16, 4, 20, 2, True),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("block_size,num_blocks,budget,max_seqs,prefix_caching", STRESS_CONFIGS)
def test_randomized_stress(block_size, num_blocks, budget, max_seqs, prefix_caching, seed):
    rng = random.Random(seed * 1000 + block_size * 100 + num_blocks + budget)
    sched = make_sched(num_blocks=num_blocks, block_size=block_size, budget=budget, max_seqs=max_seqs,
                       prefix_caching=prefix_caching)
    bm = sched.block_manager
    capacity = num_blocks * block_size
    bases = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 3 * block_size + 2))] for _ in range(3)]

    def new_request():
        max_tokens = rng.randrange(1, 13)
        room = min(capacity - max_tokens, 40)          # every request must fit on its own
        base = rng.choice(bases + [[]])[:room - 1]
        suffix = [rng.randrange(1, 50) for _ in range(rng.randrange(0 if base else 1, max(2, room - len(base))))]
        prompt = (base + suffix)[:room]
        return make_seq(prompt, max_tokens=max_tokens)

    all_seqs = [new_request() for _ in range(8)]
    for s in all_seqs:
        sched.add(s)
    expected = {s.seq_id: expected_completion(s.token_ids, s.sampling_params.max_tokens) for s in all_seqs}
    finished_ids: list[int] = []
    kv: dict[int, tuple] = {}
    steps = 0
    while not sched.is_finished() or len(all_seqs) < NUM_REQUESTS:
        if len(all_seqs) < NUM_REQUESTS and rng.random() < 0.3:   # requests keep arriving
            s = new_request()
            all_seqs.append(s)
            expected[s.seq_id] = expected_completion(s.token_ids, s.sampling_params.max_tokens)
            sched.add(s)
        planned = sched.schedule()
        assert planned is not None or sched.is_finished(), "nothing scheduled while requests remain"
        if planned is None:
            continue
        check_step(sched, planned, all_seqs, finished_ids, budget, max_seqs, kv)
        # Fake runner: write this step's K/V (each token's slot records the prefix it belongs to).
        for s, start, n in zip(planned.seqs, planned.starts, planned.num_new):
            for p in range(start, start + n):
                kv[s.block_table[p // block_size] * block_size + p % block_size] = tuple(s.token_ids[:p + 1])
        sampled = [det_token(s.token_ids) for s in planned.sampling]
        finished = [s for s in sched.complete(planned, sampled) if s.is_finished]
        for s in finished:
            assert s.seq_id not in finished_ids, "finished twice"
            assert s.is_finished and s.block_table == []
            finished_ids.append(s.seq_id)
        check_blocks(sched)
        steps += 1
        assert steps < 5000, "did not finish"

    assert sorted(finished_ids) == sorted(s.seq_id for s in all_seqs)
    for s in all_seqs:
        assert s.finish_reason == "length"
        assert s.num_completion_tokens == s.sampling_params.max_tokens
        assert s.completion_token_ids == expected[s.seq_id]
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    if not prefix_caching:
        assert bm.num_cached_tokens == 0 and bm.hash_to_block == {}


def test_stress_configs_exercise_preemption_and_prefix_hits():
    """Guard that the stress scenario is not vacuous: tiny memory preempts, shared prefixes hit."""
    sched = make_sched(num_blocks=12, block_size=4, budget=16, max_seqs=4, prefix_caching=True)
    prefix = list(range(1, 13))
    seqs = [make_seq(prefix + [20 + i], max_tokens=12) for i in range(6)]
    for s in seqs:
        sched.add(s)
    run_to_end(sched)
    assert sched.num_preemptions > 0
    assert sched.block_manager.num_cached_tokens > 0
    for s in seqs:
        assert s.completion_token_ids == expected_completion(s.token_ids[:13], 12)
    assert sched.block_manager.num_free_blocks == 12
