"""The rows of the running batch, and what must be read per row at every step in one vectorized go.

A running sequence holds one row, from its admission until it finishes or is preempted: its
address on the device, the row of its tokens in the model runner's token table and of its block
table (each rank keeps its own copy of both, written by the step messages). On the host a row
holds its sequence's sampling parameters, written once when it takes the row, so that a step's
sampling inputs are one gather of its sampling rows rather than a Python loop over SamplingParams.
"""
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from nanovllm.engine.sequence import Sequence

if TYPE_CHECKING:
    from nanovllm.features.logits_processors import ProcessorInputs


class Need:
    """Which parts of the sampler a row uses, as bits; a step ORs the needs of its rows, and the
    sampler skips what no row uses. (Plain ints, not an enum.IntFlag: a step tests them about ten
    times, and a Flag's `&` costs about a microsecond each: scripts/bench_host.py.)"""
    RANDOM = 1       # temperature > 0 (else greedy: the argmax)
    FILTERS = 2      # top_k or top_p
    MIN_P = 4
    PENALTIES = 8    # presence, frequency or repetition penalty
    MIN_TOKENS = 16  # stop tokens are banned until min_tokens
    LOGPROBS = 32
    GRAMMAR = 64     # structured outputs: a mask of the tokens its grammar allows
    BIAS = 128       # logit_bias or allowed_token_ids
    PROCESSORS = PENALTIES | MIN_TOKENS | GRAMMAR | BIAS  # logits processors (features/logits_processors.py)


def needs_of(params) -> int:
    return ((Need.RANDOM if params.temperature > 0 else 0) | (Need.FILTERS if params.top_k > 0 or params.top_p < 1 else 0)
            | (Need.MIN_P if params.min_p > 0 else 0) | (Need.PENALTIES if params.has_penalties else 0)
            | (Need.MIN_TOKENS if params.min_tokens else 0) | (Need.LOGPROBS if params.logprobs is not None else 0)
            | (Need.GRAMMAR if params.structured_outputs is not None else 0)
            | (Need.BIAS if params.logit_bias or params.allowed_token_ids else 0))


@dataclass
class SamplingInputs:
    """A step's sampling parameters on the host, one entry per sampling row; parts no row needs are None."""
    needs: int                           # Need bits: what some row uses
    rows: np.ndarray                     # [S] int64 their rows (penalties read their tokens from the table)
    positions: np.ndarray                # [S] int64 position of the token each samples
    seeds: np.ndarray | None = None      # [S] int64, with temperatures, when some row is not greedy
    temperatures: np.ndarray | None = None  # [S] float32
    top_ks: np.ndarray | None = None     # [S] int64 (-1: off), with top_ps
    top_ps: np.ndarray | None = None     # [S] float32
    min_ps: np.ndarray | None = None     # [S] float32
    num_logprobs: list[int | None] | None = None  # per row: its SamplingParams.logprobs
    processors: "ProcessorInputs | None" = None  # penalties, min_tokens, logit_bias, grammars (Need.PROCESSORS)


class BatchState:
    """Row allocation, and the rows' sampling parameters: a [num_rows] array each, written by take_row()."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self.free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: the lowest first
        self.needs = np.zeros(num_rows, dtype=np.int64)
        self.seed = np.zeros(num_rows, dtype=np.int64)
        self.temperature = np.zeros(num_rows, dtype=np.float32)
        self.top_k = np.zeros(num_rows, dtype=np.int64)
        self.top_p = np.zeros(num_rows, dtype=np.float32)
        self.min_p = np.zeros(num_rows, dtype=np.float32)
        self.presence_penalty = np.zeros(num_rows, dtype=np.float32)
        self.frequency_penalty = np.zeros(num_rows, dtype=np.float32)
        self.repetition_penalty = np.zeros(num_rows, dtype=np.float32)
        self.num_prompt_tokens = np.zeros(num_rows, dtype=np.int64)
        self.num_constrained = 0  # rows held by sequences with a grammar (structured outputs)

    def take_row(self, seq: Sequence):
        """seq is admitted: give it a free row and write its sampling parameters there."""
        row = self.free_rows.pop()
        p = seq.sampling_params
        self.needs[row] = needs_of(p)
        self.seed[row] = seq.seed
        self.temperature[row] = p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.repetition_penalty[row] = p.repetition_penalty
        self.num_prompt_tokens[row] = seq.num_prompt_tokens
        self.num_constrained += seq.matcher is not None
        seq.row = row

    def free_row(self, seq: Sequence):
        """seq leaves the running batch (finished or preempted). A step in flight may still use the row
        on the device; the next holder's writes come after it there, in stream order."""
        self.free_rows.append(seq.row)
        self.num_constrained -= seq.matcher is not None
        seq.row = -1

    def sampling_inputs(self, rows: np.ndarray, positions: np.ndarray, seqs: list[Sequence]) -> SamplingInputs:
        """The sampling inputs of these rows, held by seqs, each sampling the token at positions[i]."""
        needs = int(np.bitwise_or.reduce(self.needs[rows]))
        inputs = SamplingInputs(needs, rows, positions)
        if needs & Need.RANDOM:
            inputs.seeds, inputs.temperatures = self.seed[rows], self.temperature[rows]
        if needs & Need.FILTERS:
            inputs.top_ks, inputs.top_ps = self.top_k[rows], self.top_p[rows]
        if needs & Need.MIN_P:
            inputs.min_ps = self.min_p[rows]
        if needs & Need.LOGPROBS:
            inputs.num_logprobs = [seq.sampling_params.logprobs for seq in seqs]
        if needs & Need.PROCESSORS:
            from nanovllm.features.logits_processors import processor_inputs  # (their layer: loaded when used)
            inputs.processors = processor_inputs(self, rows, positions, seqs, bool(needs & Need.PENALTIES),
                                                 bool(needs & Need.MIN_TOKENS), bool(needs & Need.GRAMMAR),
                                                 bool(needs & Need.BIAS))
        return inputs
