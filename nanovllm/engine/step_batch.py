from dataclasses import dataclass, field

from nanovllm.engine.sequence import Sequence


@dataclass
class StepBatch:
    """All that a rank needs to run one step, and no more; rank 0 sends it to the other ranks.

    Per scheduled sequence: its id, the position of its first new token, how many new tokens it
    has, and whether it samples this step; `token_ids` holds the new tokens of all sequences back
    to back (a decode step carries one token per sequence, not the prompt). Block tables travel as
    changes to each rank's copy (`BlockTables`).
    """
    seq_ids: list[int]
    starts: list[int]
    num_new: list[int]
    token_ids: list[int]
    samples: list[bool]
    table_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (seq_id, offset, blocks)
    forget: list[int] = field(default_factory=list)  # sequences no longer scheduled


class BlockTables:
    """One rank's copy of the block tables of the sequences in recent steps.

    Rank 0 encodes each step as changes against its copy (a table only grows while its sequence
    runs; after preemption it is sent whole again); the other ranks apply those changes.
    """

    def __init__(self):
        self.tables: dict[int, list[int]] = {}

    def __getitem__(self, seq_id: int) -> list[int]:
        return self.tables[seq_id]

    def encode(self, seqs: list[Sequence]) -> StepBatch:
        updates = []
        for seq in seqs:
            known, table = self.tables.get(seq.seq_id), seq.block_table
            if known is not None and len(known) <= len(table) and table[:len(known)] == known:
                if len(table) > len(known):
                    updates.append((seq.seq_id, len(known), table[len(known):]))
            else:
                updates.append((seq.seq_id, 0, list(table)))
            self.tables[seq.seq_id] = list(table)
        scheduled = {seq.seq_id for seq in seqs}
        forget = [seq_id for seq_id in self.tables if seq_id not in scheduled]
        for seq_id in forget:
            del self.tables[seq_id]
        token_ids = []
        for seq in seqs:
            token_ids.extend(seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + seq.num_scheduled_tokens])
        return StepBatch(seq_ids=[seq.seq_id for seq in seqs], starts=[seq.num_computed_tokens for seq in seqs],
                         num_new=[seq.num_scheduled_tokens for seq in seqs], token_ids=token_ids,
                         samples=[seq.samples_this_step for seq in seqs], table_updates=updates, forget=forget)

    def apply(self, batch: StepBatch):
        for seq_id in batch.forget:
            del self.tables[seq_id]
        for seq_id, offset, blocks in batch.table_updates:
            table = self.tables.setdefault(seq_id, [])
            del table[offset:]
            table.extend(blocks)
