import heapq
from dataclasses import dataclass, field

import numpy as np

from nanovllm.engine.sequence import Sequence


@dataclass
class StepBatch:
    """All that a rank needs to run one step, and no more; rank 0 sends it to the other ranks.

    Per scheduled sequence: its id, the position of its first new token, how many new tokens it
    has, and whether it samples this step; `token_ids` holds the new tokens of all sequences back
    to back (a decode step carries one token per sequence, not the prompt). A token the last step
    sampled and the host has not read yet (overlap scheduling) travels as a placeholder and an
    entry of `from_last_step`: the device fills it in from that step's sampled tokens. Block
    tables travel as changes to each rank's copy (`BlockTables`).
    """
    seq_ids: list[int]
    starts: list[int]
    num_new: list[int]
    token_ids: list[int]
    samples: list[bool]
    table_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (seq_id, offset, blocks)
    forget: list[int] = field(default_factory=list)  # sequences no longer scheduled
    # [indices in token_ids..., then the rows of the last step's sampled tokens they take, in order]
    from_last_step: list[int] = field(default_factory=list)


class BlockTables:
    """One rank's copy of the block tables of the sequences in recent steps: a persistent batch.

    tables [max_rows, max_blocks_per_seq] int32, one row per sequence, written only where a
    table changes: a sequence gets a row when it is first scheduled (the lowest free one, so
    every rank assigns the same), its new blocks are appended as it grows, and its row is freed
    when a step no longer schedules it. A step's block tables are then one gather of rows.

    Rank 0 encodes each step as changes against its copy; the other ranks apply them. A table
    only grows in place while its sequence holds its blocks (BlockManager.grow extends the list);
    after preemption the sequence gets a new list object, so `is` tells a grown table from a new one.
    """

    def __init__(self, max_rows: int, max_blocks_per_seq: int):
        self.tables = np.full((max_rows, max_blocks_per_seq), -1, dtype=np.int32)
        self.rows: dict[int, int] = {}                     # seq_id -> row
        self.lengths = np.zeros(max_rows, dtype=np.int64)  # blocks known per row
        self.free_rows = list(range(max_rows))             # a heap: the lowest free row first
        self._rows_of: tuple[list[int], np.ndarray] = ([], np.zeros(0, dtype=np.int64))
        self.known: dict[int, tuple[list[int], int]] = {}  # rank 0: seq_id -> (its table list, length) last sent
        self.sampled_rows: dict[int, int] = {}  # rank 0: seq_id -> its row of the last step's sampled tokens

    def __getitem__(self, seq_id: int) -> list[int]:
        row = self.rows[seq_id]
        return self.tables[row, :self.lengths[row]].tolist()

    def _row(self, seq_id: int) -> int:
        row = self.rows.get(seq_id)
        if row is None:
            row = self.rows[seq_id] = heapq.heappop(self.free_rows)
            self.lengths[row] = 0
        return row

    def _write(self, seq_id: int, offset: int, blocks: list[int]):
        row = self._row(seq_id)
        self.tables[row, offset:offset + len(blocks)] = blocks
        self.lengths[row] = offset + len(blocks)

    def _forget(self, seq_ids):
        for seq_id in seq_ids:
            heapq.heappush(self.free_rows, self.rows.pop(seq_id))
            self.known.pop(seq_id, None)

    def encode(self, seqs: list[Sequence]) -> StepBatch:
        """This step's message (rank 0), applying its table changes to this copy on the way."""
        seq_ids = [seq.seq_id for seq in seqs]
        if len(self.rows) != len(seq_ids) or not self.rows.keys() >= set(seq_ids):  # (most steps: the same set)
            scheduled = set(seq_ids)
            forget = [seq_id for seq_id in self.rows if seq_id not in scheduled]
            self._forget(forget)
        else:
            forget = []
        updates, token_ids, starts, num_new, samples, from_last, from_rows = [], [], [], [], [], [], []
        last_rows, sampling = self.sampled_rows, []
        known_tables = self.known
        for seq in seqs:
            table, known = seq.block_table, known_tables.get(seq.seq_id)
            if known is None or known[0] is not table or len(table) != known[1]:
                offset = known[1] if known is not None and known[0] is table else 0
                known_tables[seq.seq_id] = (table, len(table))
                updates.append((seq.seq_id, offset, table[offset:]))
                self._write(seq.seq_id, offset, table[offset:])
            start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
            if start == len(seq.token_ids):  # a decode of the token the last step sampled, unread
                from_last.append(len(token_ids))
                from_rows.append(last_rows[seq.seq_id])
                token_ids.append(0)
            else:
                token_ids += seq.token_ids[start:start + n]
            starts.append(start)
            num_new.append(n)
            sample = start + n == seq.num_tokens  # the step ends its prefill, or decodes
            samples.append(sample)
            if sample:
                sampling.append(seq.seq_id)
        self.sampled_rows = dict(zip(sampling, range(len(sampling))))
        return StepBatch(seq_ids=seq_ids, starts=starts, num_new=num_new, token_ids=token_ids,
                         samples=samples, table_updates=updates, forget=forget, from_last_step=from_last + from_rows)

    def apply(self, batch: StepBatch):
        """Another rank: the same changes, in the same order, so rows and tables match rank 0's."""
        self._forget(batch.forget)
        for seq_id, offset, blocks in batch.table_updates:
            self._write(seq_id, offset, blocks)

    def rows_of(self, seq_ids: list[int]) -> np.ndarray:
        """The rows of these sequences, [B] (the last answer is kept: most steps ask it again)."""
        if seq_ids != self._rows_of[0]:
            self._rows_of = (seq_ids, np.fromiter(map(self.rows.__getitem__, seq_ids), dtype=np.int64,
                                                  count=len(seq_ids)))
        return self._rows_of[1]
