"""Logits processors: what changes a row's logits before it is sampled, beyond temperature and
the filters: a grammar's mask (structured outputs), allowed_token_ids, logit_bias, the
repetition/presence/frequency penalties, and min_tokens (stop tokens banned until then), applied in
that order in one place of the sampler (sampler.processed_logits), which the rejection sampler's
target distribution shares. Loaded when a step's rows first ask for one (Need.PROCESSORS).

Each has three parts: what the host gathers for a step's sampling rows (processor_inputs), what
goes to the device (processor_tensors), and what it does to the logits (apply). A grammar's mask
must wait for the token in flight (its matcher follows the tokens its sequence takes): the engine
fills it (ProcessorInputs.bitmask) just before the step's sampling is queued.
"""
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.utils.context import to_device


@dataclass
class ProcessorInputs:
    """A step's logits processors on the host, per sampling row (None: no row has that one)."""
    penalties: dict[str, np.ndarray] | None = None   # presence, frequency, repetition [S] f32; num_prompt_tokens
    banned: tuple[list[int], list[int]] | None = None  # (sampling row index, token id): stop tokens before min_tokens
    biases: tuple[list[int], list[int], list[float]] | None = None  # (row index, token id, bias): logit_bias
    allowed: tuple[list[int], list[int]] | None = None  # (row index, token id): allowed_token_ids
    matchers: list[tuple[int, object]] | None = None  # (row index, grammar matcher): constrained rows
    bitmask: tuple[np.ndarray, object] | None = None  # their masks (the engine fills them from matchers)

    def select(self, indices: np.ndarray) -> "ProcessorInputs":
        """Those of these rows alone, renumbered (a draft model draws with them); no grammars."""
        new_index = {int(old): new for new, old in enumerate(indices)}

        def remap(entries):  # (row index, ...) lists: those of the rows kept, renumbered
            if entries is None:
                return None
            kept = [(new_index[i], *rest) for i, *rest in zip(*entries) if i in new_index]
            return tuple(map(list, zip(*kept))) if kept else None
        penalties = {k: v[indices] for k, v in self.penalties.items()} if self.penalties is not None else None
        return ProcessorInputs(penalties, remap(self.banned), remap(self.biases), remap(self.allowed))


def processor_inputs(state, rows: np.ndarray, positions: np.ndarray, seqs: list, penalties: bool, min_tokens: bool,
                     grammar: bool, bias: bool) -> ProcessorInputs:
    """The processors of these sampling rows (BatchState `state`'s rows, held by seqs, each
    sampling the token at positions[i]): those some row has (penalties, min_tokens, ...)."""
    inputs = ProcessorInputs()
    if penalties:
        inputs.penalties = {"presence": state.presence_penalty[rows], "frequency": state.frequency_penalty[rows],
                            "repetition": state.repetition_penalty[rows],
                            "num_prompt_tokens": state.num_prompt_tokens[rows]}
    if min_tokens:  # a stop token cannot be drawn before min_tokens
        early = [i for i, (seq, pos) in enumerate(zip(seqs, positions.tolist()))
                 if pos - seq.num_prompt_tokens < seq.sampling_params.min_tokens]
        pairs = [(i, t) for i in early for t in seqs[i].stop_ids]
        inputs.banned = ([i for i, _ in pairs], [t for _, t in pairs]) if pairs else None
    if grammar:
        inputs.matchers = [(i, seq.matcher) for i, seq in enumerate(seqs) if seq.matcher is not None]
    if bias:
        biased = [(i, t, b) for i, seq in enumerate(seqs) for t, b in (seq.sampling_params.logit_bias or {}).items()]
        allowed = [(i, t) for i, seq in enumerate(seqs) for t in seq.sampling_params.allowed_token_ids or ()]
        inputs.biases = tuple(map(list, zip(*biased))) if biased else None
        inputs.allowed = tuple(map(list, zip(*allowed))) if allowed else None
    return inputs


@dataclass
class ProcessorTensors:
    """A step's logits processors on the device (None: no row has that one)."""
    penalties: tuple | None = None  # apply_penalties' arguments after the logits
    banned: tuple | None = None     # (rows, token ids): logits set to -inf (min_tokens)
    bitmask: tuple | None = None    # (rows [n], bitmask [n, V / 32] int32): grammar-constrained rows
    biases: tuple | None = None     # (rows, token ids, biases) [N] each: logit_bias
    allowed: tuple | None = None    # (rows, token ids) [N] each: allowed_token_ids (others -inf)


def processor_tensors(inputs: ProcessorInputs, rows: np.ndarray, positions: np.ndarray, token_table: torch.Tensor,
                      vocab_size: int) -> ProcessorTensors:
    """ProcessorInputs on the device; rows, positions [S]: the sampling rows' rows of the token
    table and the positions they sample (the penalties read the tokens before them there)."""
    device = token_table.device
    out = ProcessorTensors()
    if inputs.penalties is not None:
        p = inputs.penalties
        ints = to_device(np.stack([rows, positions, p["num_prompt_tokens"]]).astype(np.int64), device)
        floats = to_device(np.stack([p["presence"], p["frequency"], p["repetition"]]).astype(np.float32), device)
        seen, generated = penalty_tokens(token_table, ints[0], ints[1], ints[2], int(positions.max()), vocab_size)
        out.penalties = (seen, generated, floats[0], floats[1], floats[2])
    if inputs.banned is not None:
        banned = to_device(np.array(inputs.banned, dtype=np.int64), device)
        out.banned = (banned[0], banned[1])
    if inputs.bitmask is not None:
        bitmask_rows, bitmask = inputs.bitmask
        out.bitmask = (to_device(bitmask_rows, device), bitmask)
    if inputs.biases is not None:
        bias_rows, ids, biases = inputs.biases
        indices = to_device(np.array([bias_rows, ids], dtype=np.int64), device)
        out.biases = (indices[0], indices[1], to_device(np.array(biases, dtype=np.float32), device))
    if inputs.allowed is not None:
        indices = to_device(np.array(inputs.allowed, dtype=np.int64), device)
        out.allowed = (indices[0], indices[1])
    return out


def penalty_tokens(token_table: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
                   num_prompt_tokens: torch.Tensor, max_length: int,
                   vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_penalties' (seen, generated), [S, max_length] each, of each sampling row: the tokens
    before the one it samples, read from the token table."""
    pos = torch.arange(max_length, device=token_table.device)[None, :]
    seen = token_table[rows, :max_length].long().masked_fill_(pos >= lengths[:, None], vocab_size)
    return seen, seen.masked_fill(pos < num_prompt_tokens[:, None], vocab_size)


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, generated: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties, touching only the logits of tokens that occurred (O(B x L), not O(B x V)),
    with no host sync. seen, generated: [B, L] each row's prompt and completion tokens, and its
    completion tokens alone, padded with V (a column that exists only in here); penalties [B]. The
    repetition penalty divides the positive logits of seen tokens and multiplies the negative; then
    each completion token loses frequency per occurrence and presence once."""
    num_rows, vocab = logits.shape
    logits = torch.cat([logits, logits.new_zeros(num_rows, 1)], 1)  # [B, V + 1]: column V absorbs padding
    rows = torch.arange(num_rows, device=logits.device)[:, None]
    x = logits[rows, seen]  # (duplicates below write equal values: the repetition and presence penalties apply once)
    logits[rows, seen] = torch.where(x > 0, x / repetition[:, None], x * repetition[:, None])
    logits.index_put_((rows.expand_as(generated), generated), -frequency[:, None].expand_as(generated), accumulate=True)
    logits[rows, generated] = logits[rows, generated] - presence[:, None]
    return logits[:, :vocab]


def apply(logits: torch.Tensor, p: ProcessorTensors) -> torch.Tensor:
    """The float32 logits processed, in the module docstring's order (a copy: the given ones stay)."""
    if p.bitmask is not None:
        from nanovllm.features.structured_outputs import apply_bitmask  # (structured outputs' layer, loaded with them)
        logits = apply_bitmask(logits, *p.bitmask)
    if p.allowed is not None:
        rows, ids = p.allowed
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep.index_put_((rows, ids), torch.ones_like(rows, dtype=torch.bool))
        restricted = torch.zeros(len(logits), dtype=torch.bool, device=logits.device).index_fill_(0, rows, True)
        logits = logits.masked_fill(restricted[:, None] & ~keep, float("-inf"))
    if p.biases is not None:
        rows, ids, biases = p.biases
        logits = logits.index_put((rows, ids), biases, accumulate=True)
    if p.penalties is not None:
        logits = apply_penalties(logits, *p.penalties)
    if p.banned is not None:
        logits = logits.index_put(p.banned, logits.new_full((), float("-inf")))  # a device fill: no sync
    return logits
