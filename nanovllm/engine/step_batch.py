import heapq
from dataclasses import dataclass, field

import numpy as np

from nanovllm.engine.scheduler import ScheduledStep
from nanovllm.engine.sequence import CAPACITY, SEQ_ID


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
    starts: np.ndarray     # [B] int32 (int32 throughout: the message to the other ranks stays small)
    num_new: np.ndarray    # [B] int32
    token_ids: np.ndarray  # [T] int32
    samples: np.ndarray    # [B] bool
    table_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (seq_id, offset, blocks)
    forget: list[int] = field(default_factory=list)  # sequences no longer scheduled
    # [2P] int32: P indices into token_ids, then the rows of the last step's sampled tokens they take
    from_last_step: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))


class BlockTables:
    """One rank's copy of the block tables of the sequences in recent steps: a persistent batch.

    tables [max_rows, max_blocks_per_seq] int32, one row per sequence, written only where a
    table changes: a sequence gets a row when it is first scheduled (the lowest free one, so
    every rank assigns the same), its new blocks are appended as it grows, and its row is freed
    when a step no longer schedules it. A step's block tables are then one gather of rows.

    Rank 0 encodes each step as changes against its copy (a row whose length in blocks differs
    from its sequence's block_capacity); the other ranks apply them.
    """

    def __init__(self, max_rows: int, max_blocks_per_seq: int, block_size: int):
        self.block_size = block_size
        self.tables = np.full((max_rows, max_blocks_per_seq), -1, dtype=np.int32)
        self.rows: dict[int, int] = {}                     # seq_id -> row
        self.lengths = np.zeros(max_rows, dtype=np.int64)  # blocks known per row
        self.free_rows = list(range(max_rows))             # a heap: the lowest free row first
        self._rows_of: tuple[list[int], np.ndarray] = ([], np.zeros(0, dtype=np.int64))
        self.sample_rows = np.zeros(max_rows, dtype=np.int64)  # rank 0: row -> its index in the last step's samples
        self._sampled_in_order: np.ndarray | None = None  # rank 0: the last step's rows, if all of them sampled
        self._zeros = np.zeros(max_rows, dtype=np.int32)  # (read-only)
        self._feedback: dict[int, np.ndarray] = {}  # (read-only) B -> [0..B) twice: from_last_step when row i takes sample i

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

    def encode(self, step: ScheduledStep) -> StepBatch:
        """This step's message (rank 0), applying its table changes to this copy on the way."""
        seqs, bs = step.seqs, self.block_size
        seq_ids = step.ints[SEQ_ID].tolist()
        if seq_ids != self._rows_of[0] and (len(self.rows) != len(seq_ids) or not self.rows.keys() >= set(seq_ids)):
            scheduled = set(seq_ids)
            forget = [seq_id for seq_id in self.rows if seq_id not in scheduled]
            self._forget(forget)
            for seq_id in seq_ids:
                self._row(seq_id)
        else:
            forget = []
        rows = self.rows_of(seq_ids)
        # A table changes only by growing while its sequence holds its blocks: after preemption the
        # sequence is not scheduled for a step, so its row is forgotten and a new one written whole.
        num_blocks = step.ints[CAPACITY] // bs
        changed = np.flatnonzero(self.lengths[rows] != num_blocks)
        offsets = self.lengths[rows[changed]]
        updates = [(seq_ids[i], offset, seqs[i].block_table[offset:])
                   for i, offset in zip(changed.tolist(), offsets.tolist())]
        if len(changed) and (num_blocks[changed] - offsets == 1).all():  # (most steps: one new block each)
            self.tables[rows[changed], offsets] = [blocks[0] for _, _, blocks in updates]
            self.lengths[rows[changed]] += 1
        else:
            for seq_id, offset, blocks in updates:
                self._write(seq_id, offset, blocks)
        # The new tokens: a decode of a token the last step sampled (not read yet) takes it from
        # that step's sampled tokens on the device; the others are known here.
        pending = step.starts == step.known
        num_seqs, all_pending = len(seqs), bool(pending.all())
        if rows is self._sampled_in_order and all_pending:
            # Overlap scheduling's steady state: the rows of the last step, which all sampled, in
            # the same order, each decoding the token it sampled: row i takes sample i.
            token_ids, from_last = self._zeros[:num_seqs], self.feedback(num_seqs)
        else:
            if all_pending:  # every row decodes the token it sampled in the last step
                token_ids, dst = self._zeros[:num_seqs], np.arange(num_seqs)
            else:
                parts, starts, num_new = [], step.starts.tolist(), step.num_new.tolist()
                for seq, start, n, p in zip(seqs, starts, num_new, pending.tolist()):
                    parts.append([0] if p else seq.token_ids[start:start + n])
                token_ids = np.array([t for part in parts for t in part], dtype=np.int32)
                dst = (np.cumsum(step.num_new) - 1)[pending]
            from_last = np.concatenate([dst, self.sample_rows[rows[pending]]]).astype(np.int32)
            self._sampled_in_order = None
        if not (step.all_sample and rows is self._sampled_in_order):  # (else: row i sampled i already)
            self.sample_rows[rows[step.samples]] = np.arange(int(step.samples.sum()))
            self._sampled_in_order = rows if step.all_sample else None
        return StepBatch(seq_ids=seq_ids, starts=step.starts.astype(np.int32), num_new=step.num_new.astype(np.int32),
                         token_ids=token_ids, samples=step.samples, table_updates=updates, forget=forget,
                         from_last_step=from_last)

    def apply(self, batch: StepBatch):
        """Another rank: the same changes, in the same order, so rows and tables match rank 0's."""
        self._forget(batch.forget)
        for seq_id, offset, blocks in batch.table_updates:
            self._write(seq_id, offset, blocks)

    def feedback(self, num_seqs: int) -> np.ndarray:
        """from_last_step when row i of a step takes sample i of the last: [0..B) twice (kept)."""
        array = self._feedback.get(num_seqs)
        if array is None:
            array = self._feedback[num_seqs] = np.tile(np.arange(num_seqs, dtype=np.int32), 2)
        return array

    def rows_of(self, seq_ids: list[int]) -> np.ndarray:
        """The rows of these sequences, [B] (the last answer is kept: most steps ask it again)."""
        if seq_ids != self._rows_of[0]:
            self._rows_of = (seq_ids, np.fromiter(map(self.rows.__getitem__, seq_ids), dtype=np.int64,
                                                  count=len(seq_ids)))
        return self._rows_of[1]
