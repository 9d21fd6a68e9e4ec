"""Prompt logprobs (SamplingParams.prompt_logprobs), an observer of the step: the scheduler notes
the prompt positions a step computes that a request wants (want), the model runner computes their
logprobs (prompt_logprobs), and the engine hands them to their sequences (collect). Loaded at a
request's first use."""
import torch

from nanovllm.utils.context import Context, forward_context

# Prompt logprobs are computed from this many rows' logits at a time (a [rows, vocab] float32
# matrix: 1024 x 151,936 is 620 MB), never the whole prompt's.
PROMPT_LOGPROBS_ROWS = 1024


def want(wanted: list, index: int, seq, start: int, end: int):
    """The chunk [start, end) of seq's prompt (the step's sequence `index`), whose logprobs are
    asked for: its tokens at p predict the prompt tokens at p + 1, those not collected yet (a
    recomputed prompt skips them). Appends (index, offset in the chunk, count, top k) to wanted."""
    first = max(start, len(seq.prompt_logprobs) - 1)  # (prompt_logprobs[j]: the token at j)
    last = min(end, seq.num_prompt_tokens - 1)
    if last > first:
        wanted.append((index, first - start, last - first, seq.sampling_params.prompt_logprobs))


def prompt_logprobs(model, token_table: torch.Tensor, hidden: torch.Tensor, batch, context: Context,
                    rank: int) -> list | None:
    """The logprobs of the prompt tokens batch.prompt_logprobs asks for, from the forward's hidden
    states: per entry (sequence index, first prompt position, chosen [n], top values [n, k], top ids
    [n, k]), on rank 0 (None on the others, which take part in the LM head's gather)."""
    cu_q = context.cu_seqlens_q_cpu
    results = []
    for i, offset, count, k in batch.prompt_logprobs:
        start = int(batch.starts[i]) + offset                    # the first token whose hidden state is used
        targets = token_table[int(batch.rows[i]), start + 1:start + 1 + count].long()
        parts = []
        for c in range(0, count, PROMPT_LOGPROBS_ROWS):
            rows = slice(cu_q[i] + offset + c, cu_q[i] + offset + min(count, c + PROMPT_LOGPROBS_ROWS))
            with forward_context(Context()):  # (no logits_indices: every row)
                logits = model.compute_logits(hidden[rows])
            if logits is None:  # ranks above 0
                continue
            logprobs = torch.log_softmax(logits.float(), -1)
            top = logprobs.topk(k, -1) if k else None
            parts.append((logprobs.gather(1, targets[c:c + len(logprobs), None])[:, 0],
                          top.values if top else None, top.indices if top else None))
        if parts:
            results.append((i, start + 1, *(torch.cat(p) if p[0] is not None else None for p in zip(*parts))))
    return results if rank == 0 else None


def collect(seqs: list, computed: list):
    """Append a step's prompt logprobs (prompt_logprobs' entries) to the step's seqs: per prompt
    token {its id: logprob, and the top k's}, skipping positions collected already (preemption)."""
    for i, first, chosen, values, ids in computed:
        seq = seqs[i]
        chosen = chosen.tolist()
        values, ids = (values.tolist(), ids.tolist()) if values is not None else ([[]] * len(chosen),) * 2
        for j, logprob in enumerate(chosen):
            if first + j == len(seq.prompt_logprobs):
                entry = dict(zip(ids[j], values[j]))
                entry[seq.token_ids[first + j]] = logprob
                seq.prompt_logprobs.append(entry)
