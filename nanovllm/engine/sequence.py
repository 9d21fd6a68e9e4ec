from enum import Enum, auto
from itertools import count
from time import perf_counter

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


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
    __slots__ = ("seq_id", "index", "sample_index", "status", "token_ids", "num_prompt_tokens", "num_tokens",
                 "sampling_params", "seed", "block_table", "block_hashes", "num_computed_tokens",
                 "num_scheduled_tokens", "num_cached_tokens", "num_pending", "token_limit", "admitted",
                 "finish_reason", "stop_reason", "stop_ids", "forks", "logprobs", "detokenizer", "text",
                 "num_emitted_tokens", "num_emitted_chars", "arrival_time", "first_token_time", "finish_time")

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, seed: int, index: int = 0,
                 sample_index: int = 0):
        self.seq_id = next(Sequence._ids)
        self.index, self.sample_index = index, sample_index  # request's place in its call; which of its n samples
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_tokens = len(token_ids)     # len(token_ids) + num_pending, kept by the scheduler
        self.sampling_params = sampling_params
        self.seed = seed                     # sampling noise is a function of (seed, position)
        self.block_table: list[int] = []     # physical block ids, one per block_size tokens
        self.block_hashes: list[int] = []    # chained hash of each full, computed block
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_cached_tokens = 0
        self.num_pending = 0
        self.token_limit = self.num_prompt_tokens + sampling_params.max_tokens  # (the scheduler caps it at max_model_len)
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
