from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from time import perf_counter

import numpy as np

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import (CAPACITY, COMPUTED, FLAGS, HASHED, LIMIT, NEEDS_TEXT, NUM_TOKENS, PENDING,
                                      PROMPT, SCHEDULED, SeqState, Sequence, SequenceStatus)


TOKEN_IDS_OF = attrgetter("token_ids")


@dataclass
class ScheduledStep:
    """A planned step, as arrays over its sequences (in order), read from their SeqState columns
    when it was planned: what the runner needs to build the step's inputs, and what launched() and
    complete() need to account for it, even after the sequences have moved on."""
    seqs: list[Sequence]
    cols: np.ndarray     # [B] their SeqState columns
    index: np.ndarray | slice  # cols, or the same columns as a slice when they are consecutive
    gens: np.ndarray     # [B] those columns' generations (a finished sequence's column is reused)
    ints: np.ndarray     # [NUM_INTS, B] their columns of SeqState.ints when planned
    state: SeqState
    num_detached: int    # state.num_detached when planned
    with_text: list[Sequence] = field(default_factory=list)  # complete(): those updated that need their text

    def __post_init__(self):
        ints = self.ints
        self.starts = ints[COMPUTED]                 # [B] position of the first token computed
        self.num_new = ints[SCHEDULED]               # [B] tokens computed
        self.ends = self.starts + self.num_new       # [B] num_computed_tokens once it is done
        self.known = ints[NUM_TOKENS] - ints[PENDING]  # [B] tokens the host knew: the others are pending
        self.samples = self.ends == ints[NUM_TOKENS]   # [B] it ends its prefill or decodes: it samples
        self.all_sample = bool(self.samples.all())


def column_index(cols: np.ndarray) -> np.ndarray | slice:
    """cols as a slice when they are consecutive (the usual case: sequences admitted together
    take neighbouring columns and keep them), else cols itself. Reading or writing a row of
    SeqState through a slice is a view, several times cheaper than a gather or scatter."""
    n = len(cols)
    if n and cols[-1] - cols[0] == n - 1 and (n == 1 or bool((np.diff(cols) == 1).all())):
        return slice(int(cols[0]), int(cols[0]) + n)
    return cols


def plan_step(seqs: list[Sequence], state: SeqState, cols: np.ndarray | None = None,
              index: np.ndarray | slice | None = None) -> ScheduledStep:
    """A step of these sequences (attached to state, num_scheduled_tokens set), as arrays.
    index: column_index(cols), when the caller has it."""
    if cols is None:
        cols = np.array([seq._col for seq in seqs], dtype=np.int64)
    if index is None:
        index = column_index(cols)
    if isinstance(index, slice):  # (copies: the step keeps what its columns held when planned)
        gens, ints = state.gen[index].copy(), state.ints[:, index].copy()
    else:
        gens, ints = state.gen[cols], state.ints[:, cols]
    return ScheduledStep(seqs, cols, index, gens, ints, state, state.num_detached)


class Scheduler:
    """Continuous batching under a per-step token budget.

    Each step: running sequences first, in admission order (one token each when decoding, the next
    chunk of an unfinished prefill otherwise); then waiting sequences, first come first served,
    while the budget, max_num_seqs and free blocks allow. A prompt longer than the budget left is
    prefilled in chunks over several steps. When a running sequence needs a block and none is
    free, the most recently admitted running sequence is preempted: its blocks are freed and it
    returns to the front of the waiting queue, to be recomputed (its cached blocks may revive).

    The counters of every sequence it holds live in `state` (a SeqState, one column each), so the
    running sequences are scheduled, launched and completed by vectorized operations; Python
    loops only over the few that need more (a new block, a published block, a stop token).
    """

    def __init__(self, config: Config, block_manager: BlockManager, eos_token_ids: set[int]):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self.num_finished = 0  # sequences finished so far (aborted ones included)
        self.state = SeqState()
        self.forking: dict[int, Sequence] = {}  # seq_id -> a sequence whose forks are not queued yet
        self.stop_mask = np.zeros(1, dtype=bool)  # [max id + 1]: the stop ids of any sequence received (a filter)
        self._running_cols: tuple[np.ndarray, np.ndarray | slice] | None = None  # running's columns, index
        self._planned: tuple[list[Sequence], np.ndarray, np.ndarray | slice | None] | None = None  # schedule()'s

    def add(self, seq: Sequence):
        for s in [seq, *seq.forks]:
            s.stop_ids = set(s.sampling_params.stop_token_ids)
            if not s.sampling_params.ignore_eos:
                s.stop_ids |= self.eos_token_ids
            s.token_limit = min(s.token_limit, self.max_model_len)
            self.state.attach(s)
            if s.stop_ids and max(s.stop_ids) >= len(self.stop_mask):
                self.stop_mask = np.concatenate([self.stop_mask, np.zeros(max(s.stop_ids) + 1 - len(self.stop_mask), bool)])
            self.stop_mask[list(s.stop_ids)] = True
        if seq.forks:
            self.forking[seq.seq_id] = seq
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def _cols_of_running(self) -> tuple[np.ndarray, np.ndarray | slice]:
        """The running sequences' columns, [len(running)], and their column_index() (kept while
        `running` is unchanged)."""
        if self._running_cols is None:
            cols = np.fromiter((seq._col for seq in self.running), dtype=np.int64, count=len(self.running))
            self._running_cols = cols, column_index(cols)
        return self._running_cols

    def schedule(self) -> list[Sequence]:
        """Pick this step's sequences and set each one's num_scheduled_tokens."""
        scheduled, cols, index, budget = self._schedule_running_vectorized()
        victims = []
        if scheduled is None:
            scheduled, budget, victims = self._schedule_running()
            cols = index = None
        # A victim preempted in this step is first in line: it waits for the next step (by then a
        # token it had in flight has arrived, and the runner has dropped its old block table), and
        # so does everyone behind it.
        admitted = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending or seq.status is SequenceStatus.PREEMPTED or not self.block_manager.allocate(seq):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_scheduled_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            budget -= seq.num_scheduled_tokens
            self.running.append(seq)
            self._running_cols = None
            admitted.append(seq)
        if cols is not None:
            if admitted:
                cols = np.concatenate([cols, np.array([seq._col for seq in admitted], dtype=np.int64)])
                index = None
        else:
            cols = np.array([seq._col for seq in scheduled + admitted], dtype=np.int64)
        scheduled += admitted
        self._planned = (scheduled, cols, index)
        for seq in victims:
            seq.status = SequenceStatus.WAITING
        return scheduled

    def _schedule_running_vectorized(self):
        """The running sequences' share of the step, computed over their columns at once; returns
        (scheduled, their columns, column_index of those or None, budget left), or
        (None, None, None, None) when a sequence needs a block and none is free (the general loop
        then preempts)."""
        running, budget = self.running, self.max_num_batched_tokens
        if not running:
            return [], np.zeros(0, dtype=np.int64), None, budget
        cols, index = self._cols_of_running()
        ints = self.state.ints
        running_ints = ints[:, index]  # [NUM_INTS, R]: a view, or one gather
        num_tokens, computed = running_ints[NUM_TOKENS], running_ints[COMPUTED]
        n = num_tokens - computed
        n[num_tokens >= running_ints[LIMIT]] = 0  # their last token is still in flight (overlap scheduling)
        used = np.cumsum(n)
        if used[-1] > budget:  # the budget runs out at sequence k: it gets what is left, later ones nothing
            k = int(np.searchsorted(used, budget, side="right"))
            n[k] = budget - (used[k - 1] if k else 0)
            n[k + 1:] = 0
        ends = computed + n
        grow = np.flatnonzero(ends > running_ints[CAPACITY])  # they need a block
        if len(grow):
            if not self.block_manager.grow_all([running[i] for i in grow.tolist()], ends[grow].tolist()):
                return None, None, None, None
            bs = self.block_manager.block_size
            ints[CAPACITY, cols[grow]] = -(-ends[grow] // bs) * bs
        ints[SCHEDULED, index] = n
        chosen = np.flatnonzero(n)
        if len(chosen) == len(running):
            return list(running), cols, index, budget - int(n.sum())
        return [running[i] for i in chosen.tolist()], cols[chosen], None, budget - int(n.sum())

    def _schedule_running(self) -> tuple[list[Sequence], int, list[Sequence]]:
        """The running sequences' share of the step, one at a time, preempting when out of blocks.
        Returns them, the budget left and the sequences preempted."""
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        victims: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_tokens >= seq.token_limit:  # its last token is still in flight (overlap scheduling)
                seq.num_scheduled_tokens = 0
                i += 1
                continue
            computed = seq.num_computed_tokens
            num_tokens = min(seq.num_tokens - computed, budget)
            while (computed + num_tokens > seq.block_capacity
                   and not self.block_manager.grow(seq, computed + num_tokens)):
                victim = self.running.pop()  # the most recently admitted; never one already scheduled
                self._running_cols = None
                self._preempt(victim)
                victims.append(victim)
                if victim is seq:
                    break
            else:
                seq.num_scheduled_tokens = num_tokens
                budget -= num_tokens
                scheduled.append(seq)
                i += 1
        for seq in self.running[i:]:
            seq.num_scheduled_tokens = 0
        return scheduled, budget, victims

    def _preempt(self, seq: Sequence):
        self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.PREEMPTED  # WAITING once this step is planned
        seq.num_scheduled_tokens = 0
        self.waiting.appendleft(seq)  # victims are popped newest first, so admission order survives
        self.num_preemptions += 1

    def plan(self, seqs: list[Sequence]) -> ScheduledStep:
        """The step schedule() just returned, as arrays (see ScheduledStep)."""
        cols, index = self._planned[1:] if self._planned is not None and self._planned[0] is seqs else (None, None)
        return plan_step(seqs, self.state, cols, index)

    def launched(self, step: ScheduledStep) -> ScheduledStep:
        """The planned step is on its way to the device: advance its sequences past it. Its
        scheduled tokens count as computed (the next step may build on them), and a sequence that
        samples gets a pending token, whose id complete() fills in."""
        ints, cols, ends = self.state.ints, step.index, step.ends
        ints[COMPUTED, cols] = ends
        ints[SCHEDULED, cols] = 0
        sampling = cols if step.all_sample else step.cols[step.samples]
        ints[PENDING, sampling] += 1
        ints[NUM_TOKENS, sampling] += 1
        if self.block_manager.enable_prefix_caching:
            # Publish the blocks the step fills whose tokens the host knows (a decode of a pending
            # token publishes its block in complete()): the next step, scheduled before this one
            # is accounted for, can then find them. Whoever reads them runs after this step.
            known = np.minimum(ends, step.known)
            for i in np.flatnonzero(known // self.block_manager.block_size > step.ints[HASHED]).tolist():
                self.block_manager.cache_full_blocks(step.seqs[i], int(known[i]))
        if self.forking:  # a prompt is computed: the other samples now find its blocks cached
            for seq in [seq for seq in self.forking.values() if seq.num_tokens > seq.num_prompt_tokens]:
                del self.forking[seq.seq_id]
                self.waiting.extendleft(reversed([fork for fork in seq.forks if not fork.is_finished]))
                seq.forks = []
        return step

    def complete(self, step: ScheduledStep, sampled: list[int], logprobs: list[dict] | None = None,
                 token_array: np.ndarray | None = None) -> list[Sequence]:
        """Account for a launched step whose results are in: `sampled` holds one token per
        sequence that sampled, in order (`token_array` the same as an array, when the caller has
        one; `logprobs` their logprob dicts). Appends the tokens, publishes the blocks they
        filled, checks the stop conditions. Returns the sequences that got a token. With overlap
        scheduling the next step may already be running: a sequence that finished meanwhile (a
        stop, an abort) may have sampled once more there, and that token is dropped here, never
        returned."""
        state, seqs, cols = self.state, step.seqs, step.index
        if len(sampled) == len(seqs) and (state.num_detached == step.num_detached  # (most steps: all sample,
                                          or (state.gen[cols] == step.gens).all()):  # none ended since)
            updated, tokens, entries = seqs, sampled, logprobs
        else:  # drop the rows that did not sample, and those that finished since (their column was given back)
            cols = step.cols
            rows = np.flatnonzero(step.samples)    # [S] the sampling rows, in the order of `sampled`
            assert len(rows) == len(sampled), "one sampled token per sampling sequence"
            keep = (state.gen[cols[rows]] == step.gens[rows]).tolist()
            rows = rows[keep]
            cols = cols[rows]
            updated = [seqs[i] for i in rows.tolist()]
            tokens = [t for t, k in zip(sampled, keep) if k]
            entries = [e for e, k in zip(logprobs, keep) if k] if logprobs is not None else None
        # seq.token_ids.append(token) for each, in C: the one per-sequence pass of a step
        deque(map(list.append, map(TOKEN_IDS_OF, updated), tokens), maxlen=0)
        state.ints[PENDING, cols] -= 1
        if entries is not None:
            for seq, entry in zip(updated, entries):
                if seq.logprobs is not None:
                    seq.logprobs.append(entry)
        every_row = len(updated) == len(seqs)
        ints = step.ints if every_row else step.ints[:, rows]  # PROMPT, FLAGS, LIMIT: as planned
        starts = step.starts if every_row else step.starts[rows]
        ends = step.ends if every_row else step.ends[rows]  # = the position of the token just appended
        token_array = np.array(tokens, dtype=np.int64) if token_array is None or len(tokens) != len(token_array) \
            else token_array
        first = starts < ints[PROMPT]  # its prefill ended: its first token
        # its pending token filled a block (launched() could not publish it): publish it now
        bs = self.block_manager.block_size
        publish = (ends % bs == 0) & self.block_manager.enable_prefix_caching
        text = (ints[FLAGS] & NEEDS_TEXT) > 0
        mask = self.stop_mask  # [max stop id + 1] bool
        may_stop = (mask[np.minimum(token_array, len(mask) - 1)] & (token_array < len(mask))
                    | (ends + 1 >= ints[LIMIT]))
        now = perf_counter()
        num_left_running = 0  # finished here while running: still in `running`
        for i in np.flatnonzero(first | publish | text | may_stop).tolist():  # (most steps: none, or a few)
            seq = updated[i]
            if first[i] and seq.first_token_time is None:
                seq.first_token_time = now
            if publish[i] and seq.status is SequenceStatus.RUNNING and ends[i] // bs > len(seq.block_hashes):
                self.block_manager.cache_full_blocks(seq, int(ends[i]))
            if text[i]:
                step.with_text.append(seq)
            if not may_stop[i]:
                continue
            token, params = tokens[i], seq.sampling_params
            if token in seq.stop_ids and len(seq.token_ids) - seq.num_prompt_tokens >= params.min_tokens:
                seq.finish_reason = "stop"
                seq.stop_reason = token if token in params.stop_token_ids else None
            elif len(seq.token_ids) >= seq.token_limit:
                seq.finish_reason = "length"
            else:
                continue
            if seq.status is SequenceStatus.RUNNING:
                num_left_running += 1
            self.finish(seq, keep_in_running=True)
        if num_left_running:  # drop them from running in one pass
            self.running = [seq for seq in self.running if seq.status is SequenceStatus.RUNNING]
        return updated

    def postprocess(self, seqs: list[Sequence], sampled: list[int], logprobs: list[dict] | None = None
                    ) -> list[Sequence]:
        """plan(), launched() and complete() at once: the synchronous loop's bookkeeping after a
        step. Returns the sequences that finished."""
        updated = self.complete(self.launched(self.plan(seqs)), sampled, logprobs)
        return [seq for seq in updated if seq.is_finished]

    def finish(self, seq: Sequence, keep_in_running: bool = False):
        """Release a sequence from whichever queue holds it (also used to abort a request).
        keep_in_running: the caller drops it from `running` itself, together with others (one
        pass over `running` for many finishes, not one each)."""
        for fork in seq.forks:  # samples not queued yet (the prompt never finished computing)
            fork.status, fork.finish_reason, fork.finish_time = SequenceStatus.FINISHED, seq.finish_reason, perf_counter()
            if fork._state is not None:
                self.state.detach(fork)
        seq.forks = []
        self.forking.pop(seq.seq_id, None)
        if seq.status == SequenceStatus.RUNNING:
            if not keep_in_running:
                self.running.remove(seq)
            self._running_cols = None
            self.block_manager.free_blocks(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:  # (a fork may not be queued yet)
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_time = perf_counter()
        self.num_finished += 1
        if seq._state is not None:
            self.state.detach(seq)
