from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepBatch:
    """All that a rank needs to run one step, and no more; rank 0 sends it to the other ranks.

    Per scheduled sequence, in the step's order: its row of the batch, the position of its first
    new token, how many new tokens it computes, and whether it samples. The input ids are not in
    it: every rank gathers them from its own token table [rows, max_model_len] by (row, position),
    where each step's sampler writes the tokens it samples (so a decode step's inputs are on the
    device before the host has read them) and `new_tokens` writes the tokens of a sequence new in
    its row (`fixed_tokens`, the rare token the sampler redrew after it was written; `draft_tokens`,
    a speculative step's drafts, which it computes and verifies). The block tables also live on
    the device, one row each; `new_blocks` holds the entries this step adds.

    The host tier of the prefix cache (kv_offloading_size): before the step's forward, every rank
    copies its shard of whole KV blocks (every layer, K and V) as the block manager queued them:
    first `offloads` (device -> host), then `reloads` (host -> device).
    """
    rows: np.ndarray       # [B] int32 (int32 throughout: the message to the other ranks stays small)
    starts: np.ndarray     # [B] int32
    num_new: np.ndarray    # [B] int32
    samples: np.ndarray    # [B] bool
    new_blocks: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (row, offset, block ids)
    new_tokens: list[tuple[int, list[int]]] = field(default_factory=list)       # (row, its tokens from position 0)
    fixed_tokens: list[tuple[int, int, int]] = field(default_factory=list)    # (row, position, token): redrawn (Redo)
    # speculative decoding: each sequence's draft tokens, computed after its last token (None: no
    # drafts in this step), and their ids, written into the token table before the step runs
    num_drafts: np.ndarray | None = None                                       # [B] int32
    draft_tokens: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (row, position, tokens)
    # prompt logprobs: (sequence index in the step, first new token whose hidden state predicts a
    # prompt token, how many do, top k): logprobs of the prompt tokens after them
    prompt_logprobs: list[tuple[int, int, int, int]] = field(default_factory=list)
    offloads: np.ndarray | None = None  # [n, 2] int32 (device block id, host slot): device -> host
    reloads: np.ndarray | None = None   # [m, 2] int32 (host slot, device block id): host -> device

    @property
    def num_seqs(self) -> int:
        return len(self.rows)

