"""Property-based tests (hypothesis) of BlockManager and Scheduler together, through their public
behaviour only: add / schedule / complete / finish on the Scheduler, the planned step's sequences
and token counts, and the Sequence fields block_table, num_computed_tokens, num_tokens, token_ids,
status.

A state machine interleaves arrivals (prompts built from a few shared prefixes plus random
suffixes, some with n > 1 samples), steps of a fake model, and aborts, under tiny KV budgets
(preemption), small token budgets (chunked prefill) and block sizes 1, 2 and 4. The fake model
keeps a fake KV cache: every slot records the prefix of tokens its K/V were computed from, so
the test checks what paging and prefix caching must guarantee, that every token a step reads
was computed from exactly that sequence's tokens, besides the accounting invariants (ref
counts, free list, published hashes, budgets, no sequence lost or duplicated). After the run,
steps alone must drain every request and free every block.
"""
from types import SimpleNamespace

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import nanovllm.engine.block_manager as block_manager_module
from nanovllm.features.speculative.config import SpeculativeConfig
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.features.speculative.scheduling import SpeculativeScheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

EOS = 0                       # the fake model's EOS id; prompts never contain it
PROMPT_VOCAB = (1, 2, 3)      # tiny, so that suffixes and sampled tokens also collide into shared prefixes
SAMPLE_VOCAB = (1, 2, 3, EOS)  # EOS last: hypothesis favours early elements
MAX_PREFIX_LEN, MAX_SUFFIX_LEN = 9, 5
MAX_PROMPT_LEN = MAX_PREFIX_LEN + MAX_SUFFIX_LEN
MAX_TOKENS = 8
# Largest max_model_len drawn; each run draws its own and clips requests to it, as the engine
# rejects a prompt + max_tokens over max_model_len.
MAX_MODEL_LEN = MAX_PROMPT_LEN + MAX_TOKENS
MAX_LIVE = 10                 # cap on unfinished sequences, which bounds the drain
MAX_DRAIN_STEPS = 3000        # far more than MAX_LIVE sequences of MAX_MODEL_LEN tokens need, even with preemption

# Deterministic for CI: derandomized, no example database. Sizes keep the file to ~20 s on 2 cores.
PROPERTY_SETTINGS = settings(max_examples=200, stateful_step_count=40, deadline=None, derandomize=True,
                             database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.filter_too_much,
                                                                   HealthCheck.data_too_large])

prefixes = st.lists(st.sampled_from(PROMPT_VOCAB), min_size=4, max_size=MAX_PREFIX_LEN)
suffixes = st.lists(st.sampled_from(PROMPT_VOCAB), min_size=0, max_size=MAX_SUFFIX_LEN)
# (which shared prefix, suffix, n, max_tokens, min_tokens, ignore_eos); hypothesis favours small
# integers and early elements, so the order of choices favours long completions that grow.
requests = st.tuples(st.integers(0, 2), suffixes, st.sampled_from([1, 1, 2, 3]),
                     st.integers(1, MAX_TOKENS).map(lambda k: MAX_TOKENS + 1 - k),  # long completions are simplest
                     st.integers(0, 2), st.sampled_from([True, False]))


class SchedulerMachine(RuleBasedStateMachine):
    """Model of one engine's scheduling loop with a fake model and a fake KV cache."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), extra_blocks=st.integers(0, 3),
                budget=st.integers(1, 12), max_seqs=st.sampled_from([4, 3, 2, 1]), max_model_len=st.integers(6, MAX_MODEL_LEN),
                prefix_caching=st.sampled_from([True, True, True, False]), shared=st.lists(prefixes, min_size=1, max_size=3),
                initial=st.lists(requests, min_size=1, max_size=5))
    def setup(self, block_size, extra_blocks, budget, max_seqs, max_model_len, prefix_caching, shared, initial):
        self.setup_config(block_size, extra_blocks, budget, max_seqs, max_model_len, prefix_caching, shared, initial)

    speculative: SpeculativeConfig | None = None  # (SpeculativeMachine's)
    num_host_blocks, preemption_mode = 0, "recompute"  # (HostTierMachine's)

    def setup_config(self, block_size, extra_blocks, budget, max_seqs, max_model_len, prefix_caching, shared,
                     initial):
        # At least the blocks one sequence of max_model_len needs (the engine refuses less at
        # start-up); a few more at most, so that concurrent sequences preempt each other.
        num_blocks = -(-max_model_len // block_size) + extra_blocks
        self.bs = block_size
        self.budget, self.max_seqs, self.max_model_len = budget, max_seqs, max_model_len
        cfg = SimpleNamespace(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                              speculative=self.speculative, preemption_mode=self.preemption_mode)
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching,
                               num_host_blocks=self.num_host_blocks)
        scheduler_class = SpeculativeScheduler if self.speculative is not None else Scheduler
        self.sched = scheduler_class(cfg, self.bm, eos_token_ids={EOS})
        self.shared_prefixes = shared
        self.seqs: list[Sequence] = []   # every sequence ever created, forks included
        self.kv: dict[int, tuple] = {}   # fake KV cache: slot -> the token prefix its K/V were computed from
        self.host_kv: dict[int, list] = {}  # fake host tier: host slot -> its block's slots' entries of kv
        self.num_steps = 0
        for request in initial:  # every run starts with some work
            self.add(request)

    # ------------------------------------------------------------------ helpers
    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    def queued(self) -> list[Sequence]:
        return [*self.sched.waiting, *self.sched.running]

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def step(self, draw_token, draw_accepted=lambda num_drafts: num_drafts):
        """schedule() (which commits the step), check the batch, run the fake model (read and
        write the fake KV cache), sample a token for each sequence that completes its tokens (in
        a speculative step: accept the first draw_accepted(d) of its d drafts, then sample one),
        complete(), check."""
        sched, bm = self.sched, self.bm
        was_finished = {s.seq_id for s in self.seqs if s.is_finished}
        before = {s.seq_id: (s.num_tokens, s.num_computed_tokens) for s in sched.running}
        planned = sched.schedule()
        if planned is not None:
            self.copy_blocks(planned)
        self.num_steps += 1
        if self.live():
            assert planned is not None, "no progress: nothing scheduled while requests remain"
        if planned is None:
            self.check_structure()
            return
        batch = list(zip(planned.seqs, planned.starts, planned.num_new, planned.samples))
        draft_tokens = planned.draft_tokens if self.speculative is not None else []  # (a SpeculativeStep's)
        drafts_of_row = {row: drafts for row, _, drafts in draft_tokens}
        drafts = {s.seq_id: drafts_of_row.get(s.row, []) for s in planned.seqs}

        # Budgets.
        assert sum(planned.num_new) <= self.budget
        assert len(batch) <= self.max_seqs
        assert len(sched.running) <= self.max_seqs
        assert len({s.seq_id for s in planned.seqs}) == len(batch), "a sequence scheduled twice in one step"
        running_ids = {s.seq_id for s in sched.running}
        for s, start, n, samples in batch:
            d = len(drafts[s.seq_id])
            assert s.seq_id not in was_finished, f"finished sequence {s.seq_id} scheduled"
            assert s.seq_id in running_ids and s.status == SequenceStatus.RUNNING
            assert n >= 1 and s.num_computed_tokens == start + n
            if s.seq_id in before:  # running already: it goes on from where it was
                assert start == before[s.seq_id][1]
            assert start + n == len(s.token_ids) + d if samples else start + n < len(s.token_ids)
            assert s.num_tokens == len(s.token_ids) + samples + d
            assert s.num_tokens <= s.token_limit  # (drafts never run past max_tokens)
            assert len(s.block_table) * self.bs >= start + n
        scheduled = {s.seq_id for s in planned.seqs}
        for s in sched.running:
            if s.seq_id not in scheduled and s.seq_id in before:
                assert (s.num_tokens, s.num_computed_tokens) == before[s.seq_id]

        # The fake model: every position it attends to must hold K/V computed from exactly this
        # sequence's prefix; new positions go to blocks no other sequence holds. (A draft's K/V
        # is computed from the drafts before it: rejected ones must never be read afterwards.)
        for s, start, n, _ in batch:
            for p in range(start):
                assert self.kv.get(self.slot(s, p)) == tuple(s.token_ids[:p + 1]), \
                    f"seq {s.seq_id} reads wrong K/V at position {p} (slot {self.slot(s, p)})"
        for s, start, n, _ in batch:
            tokens = s.token_ids + drafts[s.seq_id]
            for p in range(start, start + n):
                block = bm.blocks[s.block_table[p // self.bs]]
                assert block.ref_count == 1, f"seq {s.seq_id} writes into shared block {block.block_id}"
                self.kv[self.slot(s, p)] = tuple(tokens[:p + 1])
        # (only now: the blocks a step publishes are those whose K/V it computes)
        self.check_structure()

        samplers = planned.sampling
        lengths = {s.seq_id: len(s.token_ids) for s in samplers}
        if draft_tokens:
            runs = [drafts[s.seq_id][:draw_accepted(len(drafts[s.seq_id]))] + [draw_token()] for s in samplers]
            updated = sched.complete(planned, runs)
            for s, run in zip(samplers, runs):
                appended = s.token_ids[lengths[s.seq_id]:]
                assert appended == run[:len(appended)] and appended
                if not s.is_finished:  # the whole run, and the rejected drafts taken back
                    assert appended == run and s.num_tokens == len(s.token_ids)
                    assert s.num_computed_tokens == len(s.token_ids) - 1
                else:
                    assert appended == run or s.finish_reason in ("stop", "length")
        else:
            runs = [[draw_token()] for _ in samplers]
            updated = sched.complete(planned, [run[0] for run in runs])
            for s, (token,) in zip(samplers, runs):
                assert s.token_ids[-1] == token and len(s.token_ids) == lengths[s.seq_id] + 1
                assert s.num_tokens == len(s.token_ids)
            for s, start, n, _ in batch:
                if not s.is_finished:
                    assert s.num_computed_tokens == start + n
        assert updated == samplers  # synchronous: none can have finished in between
        self.check_structure()

    def copy_blocks(self, planned):
        """The host tier's copies, as the model runner makes them before the step's forward: every
        offload (device block -> host slot), then every reload (host slot -> device block)."""
        bs = self.bs
        for block_id, slot in planned.offloads if planned.offloads is not None else []:
            self.host_kv[int(slot)] = [self.kv.get(int(block_id) * bs + j) for j in range(bs)]
        for slot, block_id in planned.reloads if planned.reloads is not None else []:
            assert int(slot) in self.host_kv, f"reload from host slot {slot}, which nothing was offloaded to"
            for j, entry in enumerate(self.host_kv[int(slot)]):
                self.kv[int(block_id) * bs + j] = entry

    # ------------------------------------------------------------------ rules
    def add(self, request):
        prefix_index, suffix, n, max_tokens, min_tokens, ignore_eos = request
        prompt = (self.shared_prefixes[prefix_index % len(self.shared_prefixes)] + suffix) or [PROMPT_VOCAB[0]]
        # What the engine accepts: prompt + max_tokens <= max_model_len.
        prompt = prompt[:self.max_model_len - 1]
        max_tokens = min(max_tokens, self.max_model_len - len(prompt))
        params = SamplingParams(temperature=0, n=n, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                min_tokens=min(min_tokens, max_tokens))
        # As LLMEngine._make_request does: samples 2..n ride on the first as forks.
        samples = [Sequence(prompt, params, seed=j, index=0, sample_index=j) for j in range(n)]
        samples[0].forks = samples[1:]
        self.sched.add(samples[0])
        self.seqs.extend(samples)

    @precondition(lambda self: len(self.live()) < MAX_LIVE)
    @rule(request=requests)
    def add_request(self, request):
        self.add(request)

    @rule(data=st.data(), num_steps=st.integers(1, 4))
    def steps(self, data, num_steps):
        for _ in range(num_steps):
            self.step(lambda: data.draw(st.sampled_from(SAMPLE_VOCAB), label="sampled"),
                      lambda d: data.draw(st.integers(0, d), label="accepted"))

    @precondition(lambda self: bool(self.sched.waiting or self.sched.running))
    @rule(data=st.data())
    def abort(self, data):
        if data.draw(st.integers(0, 3), label="abort now") != 3:  # aborts rarer than arrivals and steps
            return
        # Any queued or running sequence, as LLMEngine.abort does it. (Forks not yet queued are
        # aborted through their first sample, as the engine does; see the regression test below.)
        candidates = sorted(self.queued(), key=lambda s: s.seq_id)
        seq = data.draw(st.sampled_from(candidates), label="abort")
        pending_forks = list(seq.forks)
        self.sched.finish(seq, "abort")
        assert seq.is_finished and seq.block_table == []
        assert all(f.is_finished for f in pending_forks)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def structure(self):
        self.check_structure()

    def check_structure(self):
        sched, bm = self.sched, self.bm
        # Queues: disjoint, no duplicates, statuses agree, nothing lost.
        waiting_ids = [s.seq_id for s in sched.waiting]
        running_ids = [s.seq_id for s in sched.running]
        assert len(set(waiting_ids)) == len(waiting_ids), "duplicate in waiting"
        assert len(set(running_ids)) == len(running_ids), "duplicate in running"
        assert not set(waiting_ids) & set(running_ids), "a sequence both waiting and running"
        pending_fork_ids = [f.seq_id for s in self.queued() for f in s.forks]
        known = {s.seq_id for s in self.seqs}
        assert set(waiting_ids) | set(running_ids) <= known
        for s in sched.waiting:
            assert s.status == SequenceStatus.WAITING and s.block_table == []
        for s in sched.running:
            assert s.status == SequenceStatus.RUNNING
        for s in self.seqs:
            where = (s.seq_id in waiting_ids) + (s.seq_id in running_ids) + pending_fork_ids.count(s.seq_id)
            if s.is_finished:
                assert where == 0, f"finished sequence {s.seq_id} still queued"
                assert s.block_table == [] and s.finish_reason in ("stop", "length", "abort")
                assert s.num_completion_tokens <= s.sampling_params.max_tokens
                if s.finish_reason == "stop":
                    assert s.token_ids[-1] in s.stop_ids
                    assert s.num_completion_tokens >= s.sampling_params.min_tokens
                elif s.finish_reason == "length":
                    assert s.num_completion_tokens == s.sampling_params.max_tokens or s.num_tokens >= self.max_model_len
            else:
                assert where == 1, f"live sequence {s.seq_id} is in {where} places (lost or duplicated)"
                assert s.num_completion_tokens < s.sampling_params.max_tokens
                if s.seq_id in pending_fork_ids:
                    assert s.status == SequenceStatus.WAITING and s.block_table == []
            assert s.num_computed_tokens <= s.num_tokens

        # Blocks: ref count == holders among running block tables; free <=> ref 0.
        holders = [0] * bm.num_blocks
        for s in sched.running:
            assert len(set(s.block_table)) == len(s.block_table), f"seq {s.seq_id} holds a block twice"
            assert len(s.block_table) * self.bs >= s.num_computed_tokens
            for b in s.block_table:
                holders[b] += 1
        for block in bm.blocks:
            assert block.ref_count == holders[block.block_id], \
                f"block {block.block_id}: ref_count {block.ref_count}, held by {holders[block.block_id]}"
        free = {b.block_id for b in bm.blocks if b.ref_count == 0}
        assert set(bm.free) == free
        assert bm.num_free_blocks == len(free)

        # Published hashes: each maps to a block that still holds, in the fake KV cache, K/V
        # computed from the prefix the chained key stands for.
        for key, block_id in bm.hash_to_block.items():
            block = bm.blocks[block_id]
            assert block.hash == key, f"hash_to_block[{key}] -> block {block_id} whose hash is {block.hash}"
            assert block.token_ids is not None and len(block.token_ids) == self.bs
            last = self.kv.get(block_id * self.bs + self.bs - 1)
            assert last is not None and len(last) % self.bs == 0, f"published block {block_id} was never filled"
            prefix = list(last)
            assert block.token_ids == prefix[-self.bs:]
            for j in range(self.bs):
                assert self.kv.get(block_id * self.bs + j) == last[:len(last) - self.bs + j + 1]
            prev = None
            for i in range(len(prefix) // self.bs):
                prev_of_last, prev = prev, block_manager_module.chain_hash(prev, prefix[i * self.bs:(i + 1) * self.bs])
            assert prev == key, f"block {block_id}'s key is not the chained hash of its prefix"
            assert block_manager_module.chain_hash(prev_of_last, block.token_ids) == key
            if block.parent_uid is None:
                assert len(prefix) == self.bs
            else:
                for parent in bm.blocks:  # the parent's contents, if still on the device
                    if parent.uid == block.parent_uid and parent.hash is not None:
                        assert parent.hash == prev_of_last

        # The host tier: each entry's slot holds, in the fake host cache, the K/V of the prefix its
        # key stands for; slots are used once each; nothing stays pinned between steps.
        host = bm.host
        if host is not None:
            slots = [entry.slot for entry in host.entries.values()]
            assert len(set(slots)) == len(slots) and not set(slots) & set(host.free_slots)
            assert len(slots) + len(host.free_slots) == host.num_slots and not host.pinned
            for key, entry in host.entries.items():
                contents = self.host_kv.get(entry.slot)
                assert contents is not None and contents[-1] is not None, f"host slot {entry.slot} never written"
                prefix = list(contents[-1])
                assert len(prefix) % self.bs == 0 and prefix[-self.bs:] == entry.token_ids
                assert all(contents[j] == contents[-1][:len(prefix) - self.bs + j + 1] for j in range(self.bs))
                prev = None
                for i in range(len(prefix) // self.bs):
                    prev = block_manager_module.chain_hash(prev, prefix[i * self.bs:(i + 1) * self.bs])
                assert prev == key, f"host slot {entry.slot} holds another prefix"
                assert (entry.parent_uid is None) == (len(prefix) == self.bs)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # Drain with steps only: every request finishes and every block comes back.
        for _ in range(MAX_DRAIN_STEPS):
            if self.sched.is_finished():
                break
            self.step(lambda: SAMPLE_VOCAB[self.num_steps % len(SAMPLE_VOCAB)])
        else:
            raise AssertionError(f"not drained after {MAX_DRAIN_STEPS} steps")
        assert all(s.is_finished for s in self.seqs), "a request never finished"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        self.check_structure()


class PressureMachine(SchedulerMachine):
    """The same machine under KV pressure: room for about one max_model_len sequence, several
    sequences admitted at once with long completions, so decode growth preempts often."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), extra_blocks=st.integers(0, 1),
                budget=st.integers(4, 12), max_seqs=st.integers(3, 4), prefix_caching=st.booleans(),
                shared=st.lists(prefixes, min_size=1, max_size=3), initial=st.lists(requests, min_size=3, max_size=6))
    def setup(self, block_size, extra_blocks, budget, max_seqs, prefix_caching, shared, initial):
        SchedulerMachine.setup_config(self, block_size, extra_blocks, budget, max_seqs, MAX_MODEL_LEN,
                                      prefix_caching, shared, initial)


class CollidingHashMachine(SchedulerMachine):
    """The same machine with a hash of 3 bits, so that different prefixes share keys all the time:
    a cache hit must be verified by its tokens and parent, never trusted on its key."""
    real_chain_hash = staticmethod(block_manager_module.chain_hash)

    def setup_config(self, *args):
        block_manager_module.chain_hash = lambda prev, tokens: CollidingHashMachine.real_chain_hash(prev, tokens) % 8
        super().setup_config(*args)

    def teardown(self):
        try:
            super().teardown()
        finally:
            block_manager_module.chain_hash = CollidingHashMachine.real_chain_hash


class SpeculativeMachine(SchedulerMachine):
    """The same machine with n-gram speculation (the tiny vocabulary makes drafts frequent) and a
    random number of drafts accepted per sequence and step: rejected drafts are taken back, their
    K/V never read, blocks holding them never published."""

    @initialize(k=st.sampled_from([1, 2, 4]), block_size=st.sampled_from([1, 2, 4]), extra_blocks=st.integers(0, 3),
                budget=st.integers(1, 12), max_seqs=st.sampled_from([4, 3, 2, 1]),
                max_model_len=st.integers(6, MAX_MODEL_LEN), prefix_caching=st.sampled_from([True, True, False]),
                shared=st.lists(prefixes, min_size=1, max_size=3), initial=st.lists(requests, min_size=1, max_size=5))
    def setup(self, k, block_size, extra_blocks, budget, max_seqs, max_model_len, prefix_caching, shared, initial):
        self.speculative = SpeculativeConfig("ngram", k, prompt_lookup_min=1, prompt_lookup_max=2)
        self.setup_config(block_size, extra_blocks, budget, max_seqs, max_model_len, prefix_caching, shared, initial)


class HostTierMachine(SchedulerMachine):
    """The same machine under KV pressure with a host tier of a few blocks: evicted cached blocks
    are written back to it and reloaded on a hit (their copies applied to a fake host cache), with
    swap preemption or recompute. The fake KV checks make every reloaded token's K/V the ones
    computed from exactly its prefix."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), extra_blocks=st.integers(0, 2), host_blocks=st.integers(1, 6),
                swap=st.booleans(), budget=st.integers(2, 12), max_seqs=st.integers(2, 4),
                shared=st.lists(prefixes, min_size=1, max_size=3), initial=st.lists(requests, min_size=2, max_size=6))
    def setup(self, block_size, extra_blocks, host_blocks, swap, budget, max_seqs, shared, initial):
        self.num_host_blocks, self.preemption_mode = host_blocks, "swap" if swap else "recompute"
        self.setup_config(block_size, extra_blocks, budget, max_seqs, MAX_MODEL_LEN, True, shared, initial)

    def teardown(self):
        super().teardown()
        # the tier was exercised: the runs as a whole reload (hypothesis checks each run's invariants)
        HostTierMachine.reloaded += self.bm.num_host_hit_tokens
    reloaded = 0


class HostTierCollidingHashMachine(CollidingHashMachine, HostTierMachine):
    """The host tier with 3-bit keys: a host hit too must be verified by its tokens and parent."""


SchedulerMachine.TestCase.settings = PROPERTY_SETTINGS
test_scheduler_state_machine = SchedulerMachine.TestCase
PressureMachine.TestCase.settings = settings(PROPERTY_SETTINGS, max_examples=100)
test_scheduler_under_kv_pressure = PressureMachine.TestCase
CollidingHashMachine.TestCase.settings = settings(PROPERTY_SETTINGS, max_examples=80)
test_scheduler_with_colliding_hashes = CollidingHashMachine.TestCase
SpeculativeMachine.TestCase.settings = settings(PROPERTY_SETTINGS, max_examples=150)
test_scheduler_with_speculative_steps = SpeculativeMachine.TestCase
HostTierMachine.TestCase.settings = settings(PROPERTY_SETTINGS, max_examples=150)
test_scheduler_with_a_host_tier = HostTierMachine.TestCase
HostTierCollidingHashMachine.TestCase.settings = settings(PROPERTY_SETTINGS, max_examples=80)
test_host_tier_with_colliding_hashes = HostTierCollidingHashMachine.TestCase


def test_the_host_tier_machine_reloads():
    """Its runs must actually serve prompts from the host tier (run after the machine above)."""
    if HostTierMachine.reloaded == 0:
        HostTierMachine.TestCase("runTest").runTest()
    assert HostTierMachine.reloaded > 0


def test_abort_of_unqueued_fork_stays_finished():
    """Found by the machine above: a fork aborted before its first sample's prompt was computed
    was still queued with the others, then scheduled and given a token after its abort."""
    cfg = SimpleNamespace(preemption_mode="recompute", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN, speculative=None)
    sched = Scheduler(cfg, BlockManager(20, 4), eos_token_ids={EOS})
    params = SamplingParams(temperature=0, n=2, max_tokens=3, ignore_eos=True)
    first, fork = (Sequence([1, 2, 3, 1, 2], params, seed=j, index=0, sample_index=j) for j in range(2))
    first.forks = [fork]
    sched.add(first)
    sched.finish(fork, "abort")   # as LLMEngine.abort(fork) does
    for _ in range(10):
        planned = sched.schedule()
        if planned is None:
            break
        assert fork not in planned.seqs, "an aborted fork was scheduled"
        sched.complete(planned, [1 for _ in planned.sampling])
    assert fork.is_finished and fork.num_completion_tokens == 0 and fork.block_table == []
