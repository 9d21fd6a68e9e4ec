from collections import deque
from time import perf_counter

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Continuous batching under a per-step token budget.

    Each step: running sequences first, in admission order (one token each when decoding, the next
    chunk of an unfinished prefill otherwise); then waiting sequences, first come first served,
    while the budget, max_num_seqs and free blocks allow. A prompt longer than the budget left is
    prefilled in chunks over several steps. When a running sequence needs a block and none is
    free, the most recently admitted running sequence is preempted: its blocks are freed and it
    returns to the front of the waiting queue, to be recomputed (its cached blocks may revive).
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

    def add(self, seq: Sequence):
        for s in [seq, *seq.forks]:
            s.stop_ids = set(s.sampling_params.stop_token_ids)
            if not s.sampling_params.ignore_eos:
                s.stop_ids |= self.eos_token_ids
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> list[Sequence]:
        """Pick this step's sequences and set each one's num_scheduled_tokens."""
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        block_size = self.block_manager.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            computed = seq.num_computed_tokens
            num_tokens = min(len(seq.token_ids) - computed, budget)
            # (most steps need no new block: skip the block manager then)
            while (computed + num_tokens > len(seq.block_table) * block_size
                   and not self.block_manager.grow(seq, computed + num_tokens)):
                victim = self.running.pop()  # the most recently admitted; never one already scheduled
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                seq.num_scheduled_tokens = num_tokens
                budget -= num_tokens
                scheduled.append(seq)
                i += 1
        # After a preemption no waiting sequence fits: the victim, now first in line, needs at least
        # the blocks it gave up, and fewer than that are left.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.allocate(seq):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_scheduled_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            budget -= seq.num_scheduled_tokens
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _preempt(self, seq: Sequence):
        self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.waiting.appendleft(seq)  # victims are popped newest first, so admission order survives
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], sampled: list[int], logprobs: list[dict] | None = None) -> list[Sequence]:
        """Account for a finished step. `sampled` holds one token per sequence that sampled, in
        order (and `logprobs` their logprob dicts). Returns the sequences that finished."""
        finished = []
        now = perf_counter()
        tokens = iter(sampled)
        token_logprobs = iter(logprobs) if logprobs is not None else None
        block_size = self.block_manager.block_size
        for seq in seqs:
            computed = seq.num_computed_tokens + seq.num_scheduled_tokens
            samples = computed == len(seq.token_ids)
            seq.num_computed_tokens, seq.num_scheduled_tokens = computed, 0
            if computed // block_size > len(seq.block_hashes):  # a block was filled: publish it
                self.block_manager.cache_full_blocks(seq)
            if not samples:
                continue
            token = next(tokens)
            seq.token_ids.append(token)
            if token_logprobs is not None:
                entry = next(token_logprobs)
                if seq.logprobs is not None:
                    seq.logprobs.append(entry)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.forks:  # the prompt is computed: the other samples now find its blocks cached
                self.waiting.extendleft(reversed([fork for fork in seq.forks if not fork.is_finished]))  # (aborted)
                seq.forks = []
            params, num_tokens = seq.sampling_params, len(seq.token_ids)
            num_completion = num_tokens - seq.num_prompt_tokens
            if token in seq.stop_ids and num_completion >= params.min_tokens:
                seq.finish_reason = "stop"
                seq.stop_reason = token if token in params.stop_token_ids else None
            elif num_completion >= params.max_tokens or num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                self.finish(seq)
                finished.append(seq)
        assert next(tokens, None) is None, "more sampled tokens than sampling sequences"
        return finished

    def finish(self, seq: Sequence):
        """Release a sequence from whichever queue holds it (also used to abort a request)."""
        for fork in seq.forks:  # samples not queued yet (the prompt never finished computing)
            fork.status, fork.finish_reason, fork.finish_time = SequenceStatus.FINISHED, seq.finish_reason, perf_counter()
        seq.forks = []
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free_blocks(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:  # (a fork may not be queued yet)
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_time = perf_counter()
