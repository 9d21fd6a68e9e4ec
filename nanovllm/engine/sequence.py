from enum import Enum, auto
from itertools import count
from time import perf_counter

import numpy as np

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    PREEMPTED = auto()  # waiting, preempted in the step being planned (readmitted from the next one)
    RUNNING = auto()
    FINISHED = auto()


# Rows of SeqState.ints: the per-sequence counters (the first NUM_COUNTERS, also kept in the
# Sequence while it has no row), then the integer sampling parameters.
COMPUTED, SCHEDULED, NUM_TOKENS, PENDING, LIMIT, CAPACITY, HASHED = range(7)
NUM_COUNTERS = 7
PROMPT, SEED, TOP_K, MIN_TOKENS, LOGPROBS, FLAGS, SEQ_ID = range(NUM_COUNTERS, NUM_COUNTERS + 7)
NUM_INTS = NUM_COUNTERS + 7
# Bits of ints[FLAGS]: which parts of the sampler a sequence needs (a batch ORs them).
RANDOM, FILTERS, USES_MIN_P, PENALIZED, HAS_MIN_TOKENS, WANTS_LOGPROBS, NEEDS_TEXT = (1 << i for i in range(7))
# Rows of SeqState.floats: the float sampling parameters.
TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(6)


class SeqState:
    """The counters and sampling parameters of a scheduler's live sequences, one column each, in
    preallocated arrays (a persistent batch): a step's bookkeeping is then a few vectorized
    operations over the columns it schedules, not a Python loop over sequences.

    ints [NUM_INTS, capacity] int64 and floats [6, capacity] float32. A sequence takes a column
    when the scheduler receives it and gives it back when it finishes; `gen` counts the reuses of
    each column, so a step still in flight can tell a column's new owner from the one it ran.
    """

    def __init__(self, capacity: int = 64):
        self.ints = np.zeros((NUM_INTS, capacity), dtype=np.int64)
        self.floats = np.zeros((6, capacity), dtype=np.float32)
        self.gen = np.zeros(capacity, dtype=np.int64)
        self.free = list(range(capacity - 1, -1, -1))  # popped from the end: lowest first
        self.num_detached = 0  # columns given back so far (unchanged: no column changed owner)

    def _grow(self):
        old = self.ints.shape[1]
        self.ints = np.concatenate([self.ints, np.zeros_like(self.ints)], axis=1)
        self.floats = np.concatenate([self.floats, np.zeros_like(self.floats)], axis=1)
        self.gen = np.concatenate([self.gen, np.zeros_like(self.gen)])
        self.free = list(range(2 * old - 1, old - 1, -1)) + self.free

    def attach(self, seq: "Sequence"):
        """Give seq a column: its counters move here, its sampling parameters are written once."""
        if not self.free:
            self._grow()
        col = self.free[-1]  # taken once every value is written (one that does not fit raises first)
        p = seq.sampling_params
        flags = ((RANDOM if p.temperature > 0 else 0) | (FILTERS if p.top_k > 0 or p.top_p < 1 else 0)
                 | (USES_MIN_P if p.min_p > 0 else 0) | (PENALIZED if p.has_penalties else 0)
                 | (HAS_MIN_TOKENS if p.min_tokens else 0) | (WANTS_LOGPROBS if p.logprobs is not None else 0)
                 | (NEEDS_TEXT if seq.detokenizer is not None else 0))
        self.ints[:NUM_COUNTERS, col] = seq._counters
        self.ints[NUM_COUNTERS:, col] = (seq.num_prompt_tokens, seq.seed, p.top_k, p.min_tokens,
                                         -1 if p.logprobs is None else p.logprobs, flags, seq.seq_id)
        self.floats[:, col] = (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                               p.repetition_penalty)
        self.free.pop()
        seq._state, seq._col = self, col

    def detach(self, seq: "Sequence"):
        """Take seq's counters back into it and free its column."""
        col = seq._col
        seq._counters = self.ints[:NUM_COUNTERS, col].tolist()
        seq._state = None
        self.gen[col] += 1
        self.num_detached += 1
        self.free.append(col)


def _counter(row: int, doc: str) -> property:
    """A counter of the sequence: in its SeqState column while it has one, else in the sequence."""
    def get(self) -> int:
        state = self._state
        return self._counters[row] if state is None else int(state.ints[row, self._col])

    def set(self, value: int):
        state = self._state
        if state is None:
            self._counters[row] = value
        else:
            state.ints[row, self._col] = value
    return property(get, set, doc=doc)


class Sequence:
    """One request: its tokens (prompt + completion so far), its KV blocks and its progress counters.

    Counters, all in tokens:
      num_computed_tokens   tokens whose K/V are in the cache (prefix-cache hits included)
      num_scheduled_tokens  tokens this step computes: a prefill chunk, or 1 when decoding
      num_cached_tokens     prompt tokens served by the prefix cache when first admitted
      num_pending           tokens sampled on the device whose ids the host has not read yet
                            (overlap scheduling: at most two, one per step in flight)
    `token_ids` holds only tokens the host knows; num_tokens counts the pending ones too, since
    the scheduler plans with them. A sequence samples a token in a step exactly when that step
    brings num_computed_tokens up to num_tokens (the end of its prefill, or any decode step).
    """
    _ids = count()
    __slots__ = ("seq_id", "index", "sample_index", "status", "token_ids", "num_prompt_tokens", "_counters",
                 "_state", "_col", "sampling_params", "seed", "block_table", "block_hashes",
                 "num_cached_tokens", "admitted", "finish_reason", "stop_reason", "stop_ids", "forks", "logprobs", "detokenizer", "text",
                 "num_emitted_tokens", "num_emitted_chars", "arrival_time", "first_token_time", "finish_time")

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, seed: int, index: int = 0,
                 sample_index: int = 0):
        self.seq_id = next(Sequence._ids)
        self.index, self.sample_index = index, sample_index  # request's place in its call; which of its n samples
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        # the counters below, while the sequence has no SeqState column (see _counter)
        self._counters = [0, 0, len(token_ids), 0, len(token_ids) + sampling_params.max_tokens, 0, 0]
        self._state: SeqState | None = None
        self._col = -1
        self.sampling_params = sampling_params
        self.seed = seed                     # sampling noise is a function of (seed, position)
        self.block_table: list[int] = []     # physical block ids, one per block_size tokens
        self.block_hashes: list[int] = []    # chained hash of each full, computed block
        self.num_cached_tokens = 0
        self.admitted = False                # set at first admission; num_cached_tokens is final then
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.stop_ids: set[int] = set()      # tokens that end it (EOS unless ignored, stop_token_ids)
        self.forks: list[Sequence] = []      # samples 2..n, queued once this one's prompt is computed
        self.logprobs: list[dict] | None = [] if sampling_params.logprobs is not None else None
        self.detokenizer = None              # set when text is needed token by token (stream, stop strings)
        self.text = ""                       # completion text so far (with a detokenizer)
        self.num_emitted_tokens = self.num_emitted_chars = 0  # what stream() has yielded
        self.arrival_time = perf_counter()       # perf_counter() seconds
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    num_computed_tokens = _counter(COMPUTED, "tokens whose K/V are in the cache (or on their way there)")
    num_scheduled_tokens = _counter(SCHEDULED, "tokens the step being planned computes")
    num_tokens = _counter(NUM_TOKENS, "len(token_ids) + num_pending")
    num_pending = _counter(PENDING, "tokens sampled on the device whose ids the host has not read yet")
    token_limit = _counter(LIMIT, "num_tokens at which it ends by length (the scheduler caps it at max_model_len)")
    block_capacity = _counter(CAPACITY, "tokens its block table holds: len(block_table) * block_size")
    num_hashed_blocks = _counter(HASHED, "len(block_hashes): its blocks published in the prefix cache")

    @property
    def num_completion_tokens(self) -> int:
        """Completion tokens the host knows (pending ones not counted)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def samples_this_step(self) -> bool:
        return self.num_computed_tokens + self.num_scheduled_tokens == self.num_tokens

    def metrics(self) -> dict:
        """Latency of this request: TTFT (arrival to first token) and mean TPOT (time per output
        token after the first), in seconds; times are perf_counter() values."""
        ttft = tpot = None
        if self.first_token_time is not None:
            ttft = self.first_token_time - self.arrival_time
            if self.finish_time is not None and self.num_completion_tokens > 1:
                tpot = (self.finish_time - self.first_token_time) / (self.num_completion_tokens - 1)
        return {"arrival_time": self.arrival_time, "first_token_time": self.first_token_time,
                "finish_time": self.finish_time, "ttft_s": ttft, "tpot_s": tpot}

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]
