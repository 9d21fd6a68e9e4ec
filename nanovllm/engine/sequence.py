from enum import Enum, auto
from itertools import count
from time import perf_counter

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One sample of a request: its tokens, its KV blocks, where it stands, and its output so far.

    Where it stands, in tokens:
      token_ids            the tokens the host knows: the prompt, then the completion so far
      num_tokens           len(token_ids) plus the tokens sampled on the device whose ids have not
                           reached the host yet (overlap scheduling: one, while a step is in flight)
      num_computed_tokens  positions whose K/V are in the cache, or being written there by a
                           launched step (prefix-cache hits included)
      token_limit          num_tokens at which it ends by length (prompt + max_tokens, <= max_model_len)
    A step computes positions num_computed_tokens .. num_computed_tokens + n - 1 of it, and samples
    a token exactly when that brings num_computed_tokens up to num_tokens (the end of its prefill,
    or any decode step). These, its status and its finish reason change only in the methods below
    (admit, advance, rollback, append_each, truncate, evict, finish): grep finds every write.

    While running it holds a `row` of the batch (engine/batch_state.py): the row of its tokens in
    the device's token table, of its block table on every rank, and of its sampling parameters.
    `block_table` and `block_hashes` are the BlockManager's to write.
    """
    _ids = count()
    __slots__ = ("seq_id", "index", "sample_index", "status", "sampling_params", "seed", "token_ids",
                 "num_prompt_tokens", "num_tokens", "num_computed_tokens", "token_limit", "row", "block_table",
                 "block_hashes", "num_cached_tokens", "admitted", "stop_ids", "forks", "finish_reason",
                 "stop_reason", "logprobs", "detokenizer", "text", "num_emitted_tokens", "num_emitted_chars",
                 "inbox", "arrival_time", "first_token_time", "finish_time", "spec", "matcher", "prompt_logprobs")

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, seed: int, index: int = 0,
                 sample_index: int = 0):
        self.seq_id = next(Sequence._ids)
        self.index, self.sample_index = index, sample_index  # the request's place in its call; which of its n samples
        self.status = SequenceStatus.WAITING
        self.sampling_params = sampling_params
        self.seed = seed                       # sampling noise is a function of (seed, position)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.token_limit = len(token_ids) + sampling_params.max_tokens
        self.row = -1                          # its row of the batch while running, else -1
        self.block_table: list[int] = []       # physical block ids, one per block_size tokens
        self.block_hashes: list[int] = []      # chained hash of each full block published in the prefix cache
        self.num_cached_tokens = 0             # prompt tokens the prefix cache served at its first admission
        self.admitted = False                  # it has been admitted once (num_cached_tokens is final)
        self.stop_ids: set[int] = set()        # tokens that end it (EOS unless ignored, stop_token_ids)
        self.forks: list[Sequence] = []        # samples 2..n, queued once this one's prompt is computed
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.logprobs: list[dict] | None = [] if sampling_params.logprobs is not None else None
        self.detokenizer = None                # set when text is needed token by token (stream, stop strings)
        self.text = ""                         # completion text so far (with a detokenizer)
        self.num_emitted_tokens = self.num_emitted_chars = 0  # what its updates have reported
        self.inbox: list | None = None         # where the engine puts it when it has news (LLMEngine._run)
        self.arrival_time = perf_counter()     # perf_counter() seconds
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.spec = None                       # speculative decoding's state of it (features/speculative/scheduling.py)
        self.matcher = None                    # structured outputs: its grammar's state (the engine's, at creation)
        # per prompt token, its logprob dict (None for the first); the first sample's alone
        self.prompt_logprobs = [None] if sampling_params.prompt_logprobs is not None and sample_index == 0 else None

    @property
    def num_completion_tokens(self) -> int:
        """Completion tokens the host knows (those in flight not counted)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def metrics(self) -> dict:
        """Latency: TTFT (arrival to first token) and mean TPOT (per token after the first), in seconds."""
        ttft = tpot = None
        if self.first_token_time is not None:
            ttft = self.first_token_time - self.arrival_time
            if self.finish_time is not None and self.num_completion_tokens > 1:
                tpot = (self.finish_time - self.first_token_time) / (self.num_completion_tokens - 1)
        return {"arrival_time": self.arrival_time, "first_token_time": self.first_token_time,
                "finish_time": self.finish_time, "ttft_s": ttft, "tpot_s": tpot,
                "spec_num_draft_tokens": self.spec.draft_tokens if self.spec is not None else 0,
                "spec_num_accepted_tokens": self.spec.accepted_tokens if self.spec is not None else 0}

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]

    # ---- the writes ---------------------------------------------------------------------------
    def admit(self, num_cached: int):
        """It runs, its first num_cached tokens served by the prefix cache (its first admission's count is reported)."""
        self.status = SequenceStatus.RUNNING
        self.num_computed_tokens = num_cached
        if not self.admitted:
            self.num_cached_tokens, self.admitted = num_cached, True

    def advance(self, end: int, samples: bool):
        """A step computes its positions up to end; a token it samples is in flight till append_each()."""
        self.num_computed_tokens = end
        if samples:
            self.num_tokens = end + 1

    def rollback(self, num: int):
        """Take back its last num positions, computed and counted but not kept (drafts the target
        rejected; a token drawn again): their K/V slots are simply written again later."""
        self.num_computed_tokens -= num
        self.num_tokens -= num

    @staticmethod
    def append_each(seqs: list["Sequence"], tokens: list[int], now: float) -> list[tuple["Sequence", int]]:
        """The ids of tokens they sampled reached the host: one per sequence, in one loop (a method
        call per sequence costs ~10 µs in a 256-sequence decode step: scripts/bench_host.py).
        Returns (seq, token) for each whose token may end it: one of its stop_ids, or its last."""
        may_stop = []
        for seq, token in zip(seqs, tokens):
            token_ids = seq.token_ids
            token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if token in seq.stop_ids or len(token_ids) >= seq.token_limit:
                may_stop.append((seq, token))
        return may_stop

    def truncate(self, num: int):
        """Drop its last num tokens (made after the stop string that ended it)."""
        del self.token_ids[-num:]
        if self.logprobs is not None:
            del self.logprobs[-num:]

    def evict(self):
        """Preempted: its blocks are gone, and it waits to be computed again."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def finish(self, reason: str, stop_reason: int | str | None, now: float):
        """It ends, for reason ("stop", "length", "abort", "error"); a second call (a stop string in the
        text a speculative step finished with) changes the reasons alone. The scheduler frees its blocks."""
        self.status = SequenceStatus.FINISHED
        self.num_computed_tokens = 0
        self.finish_reason, self.stop_reason = reason, stop_reason
        if self.finish_time is None:
            self.finish_time = now
