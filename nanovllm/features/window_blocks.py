"""Blocks per layer group, for models of sliding-window and full-attention layers (Gemma 3, gpt-oss):
the sliding-window layers keep only the blocks their window can still see.

Two groups of layers, each with a pool of blocks of its own (features/layer_groups.py picks this
layer for such a model):
  full attention   the BlockManager's pool, as for any model: every block of a sequence, held until
                   it finishes or is preempted, and cached by prefix after;
  sliding window   the window pool (`WindowBlockManager.window`, a BlockManager used block by
                   block): a sequence holds the blocks from its next query's window on, and hands
                   the others back as it grows. Query p sees keys p - W + 1 .. p, so between steps
                   a sequence holds at most ceil((W - 1) / bs) + 1 blocks (one more when its next
                   position starts a block), and during a step those of the chunk it computes.
The window pool is sized at start-up for all of that at once (num_window_blocks):

    max_num_seqs * 2 + ceil((max_num_seqs * (W - 1) + max_num_batched_tokens) / bs)

(W at most max_model_len) so it never runs out, and admission and preemption count the full pool alone, as before. A
sliding-window layer's memory per sequence is its window, not its length: Gemma 3's five local
layers of six keep 512 tokens of K/V each, the one global layer the whole context.

Each step (WindowScheduler.schedule), a scheduled sequence computing positions [s, s + n) frees
the blocks before s - W + 1 and takes blocks up to s + n; a running sequence the step leaves out
(the budget ran out) frees those before its next query's window. A freed block may still be read
by the step in flight (overlap scheduling): its next holder writes it in a later step, after, in
stream order. A table entry before the window is left as it was when its block is freed: every
kernel masks the keys before a query's window (the torch path does not read them), so what the
block's next holder writes there is never seen. The runner (WindowRunner) keeps the window
group's block tables on the device beside the full group's and hands the sliding-window layers a
Context of their own (layers/sliding_window.py's WindowStep: their block tables and slots).

Prefix caching across the groups: a block of either pool is published under the same chained key
(the full block's contents id, `uid`, recorded with it). A cached prefix of c tokens can be
resumed only where the window pool still holds the blocks of the window before c, those from
(c - W + 1) // bs: a lookup (WindowBlockManager._match_prefix) ends its hit at the longest such
prefix, and the admitted sequence holds those blocks again. A freed window block keeps its key
until the pool hands it out again (least recently freed first), so a repeated prompt finds its
last window's blocks until newer work has reused them.

CUDA graphs: a captured decode step gathers the window tables of its rows too (WindowRunner.
graph_group_context, DecodeGraphs' group_context hook), so a replay reads the tables as they are.

Not wired in (layer_groups.py then runs the model as before, each sliding-window layer keeping
every block in the full pool: correct, larger): speculative decoding, pipeline stages and the
host tier.
"""
import functools
import logging
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import ModelRunner, flatten_writes
from nanovllm.engine.scheduler import ScheduledStep, Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_batch import StepBatch
from nanovllm.engine.step_inputs import kv_slots
from nanovllm.layers.attention import bind_kv_cache
from nanovllm.layers.sliding_window import WindowStep

logger = logging.getLogger(__name__)


def window_of(config) -> int:
    return config.hf_config.sliding_window


def num_window_blocks(config) -> int:
    """The window pool's blocks: every row's window and a step's tokens at once (see above); a
    window longer than max_model_len counts as max_model_len (no sequence gets further)."""
    rows, bs, window = config.max_num_seqs, config.block_size, min(window_of(config), config.max_model_len)
    return 2 * rows + -(-(rows * (window - 1) + config.max_num_batched_tokens) // bs)


def window_group_classes(config) -> tuple[type, type, object]:
    """The runner, scheduler and block manager (a factory taking BlockManager's arguments)."""
    manager = functools.partial(WindowBlockManager, window=window_of(config),
                                num_window_blocks=num_window_blocks(config))
    return WindowRunner, WindowScheduler, manager


@dataclass
class WindowStepBatch(StepBatch):
    """A step's message, with the window group's block-table writes: (row, offset, block ids)."""
    window_blocks: list[tuple[int, int, list[int]]] = field(default_factory=list)


@dataclass
class WindowScheduledStep(ScheduledStep):
    window_blocks: list[tuple[int, int, list[int]]] = field(default_factory=list)

    def batch(self) -> WindowStepBatch:
        batch = super().batch()
        return WindowStepBatch(**{f.name: getattr(batch, f.name) for f in fields(batch)},
                               window_blocks=self.window_blocks)


@dataclass
class WindowTable:
    """A sequence's blocks in the window pool: `blocks` by block index (entries before `first` are
    freed: stale); `sent`, the entries the device's table has; `published`, those looked at for the cache."""
    blocks: list[int]
    first: int = 0
    sent: int = 0
    published: int = 0


class WindowBlockManager(BlockManager):
    """The full group's BlockManager, and the window group's pool (`window`) with each running
    sequence's WindowTable (`tables`, by seq_id)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, *, window: int, num_window_blocks: int):
        super().__init__(num_blocks, block_size, enable_prefix_caching, num_host_blocks)
        self.window_size = window
        self.window = BlockManager(num_window_blocks, block_size, enable_prefix_caching)
        self.null_block = num_window_blocks  # (the pool's spare block: what a stale entry is first written as)
        self.tables: dict[int, WindowTable] = {}

    def first_needed(self, position: int) -> int:
        """The first block a query at `position` (or any after it) reads."""
        return max(0, position - self.window_size + 1) // self.block_size

    def _window_hit(self, key: int, uid: int) -> int | None:
        """The window pool's block published under key for the full block of contents uid."""
        block_id = self.window.hash_to_block.get(key)
        return block_id if block_id is not None and self.window.blocks[block_id].uid == uid else None

    def _match_prefix(self, seq: Sequence):
        """The full group's hits, ended where the window pool holds the window before the end."""
        hits = super()._match_prefix(seq)
        while hits and any(self._window_hit(hits[i][0], self.blocks[hits[i][1]].uid) is None
                           for i in range(self.first_needed(len(hits) * self.block_size), len(hits))):
            hits.pop()
        return hits

    def allocate(self, seq: Sequence, use_cache: bool = True) -> int | None:
        num_cached = super().allocate(seq, use_cache)
        if num_cached is None:
            return None
        first = self.first_needed(num_cached)
        table = WindowTable([self.null_block] * first, first)
        for i in range(first, num_cached // self.block_size):  # (the hit's window: held again)
            block_id = self._window_hit(seq.block_hashes[i], self.blocks[seq.block_table[i]].uid)
            block = self.window.blocks[block_id]
            if block.ref_count == 0:
                del self.window.free[block_id]
            block.ref_count += 1
            table.blocks.append(block_id)
        table.published = len(table.blocks)
        self.tables[seq.seq_id] = table
        return num_cached

    def slide(self, seq: Sequence, start: int, end: int, writes: list[tuple[int, int, list[int]]]):
        """seq computes positions [start, end) next: free its window blocks before start's window,
        take blocks up to end, publish those whose keys are known; the table's new entries go to
        writes. (Most decode steps change nothing: each test below is one comparison then.)"""
        table = self.tables[seq.seq_id]
        first = max(0, start - self.window_size + 1) // self.block_size
        if first > table.first:
            self._free_before(table, first)
        num_blocks = -(-end // self.block_size)
        if num_blocks > len(table.blocks):
            for _ in range(len(table.blocks), num_blocks):
                table.blocks.append(self.window._take_free_block())  # (never short: num_window_blocks)
            self.window._note_usage()
        if table.sent < len(table.blocks):
            writes.append((seq.row, table.sent, table.blocks[table.sent:]))
            table.sent = len(table.blocks)
        if len(seq.block_hashes) > table.published:
            self._publish_window(seq, table)

    def trim(self, seq: Sequence):
        """Free what a running sequence left out of a step holds before its next query's window."""
        self._free_before(self.tables[seq.seq_id], self.first_needed(seq.num_computed_tokens))

    def _free_before(self, table: WindowTable, first: int):
        for i in range(table.first, min(first, len(table.blocks))):
            self._release_window_block(table.blocks[i])
        table.first = max(table.first, first)

    def _release_window_block(self, block_id: int):
        block = self.window.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0
        if block.ref_count == 0:
            self.window.release(block_id)

    def _publish_window(self, seq: Sequence, table: WindowTable):
        """Publish the window blocks of seq's published full blocks (under their keys, with their uids)."""
        if not self.enable_prefix_caching:
            return
        for i in range(table.published, min(len(seq.block_hashes), len(table.blocks))):
            key, block_id = seq.block_hashes[i], table.blocks[i]
            if i >= table.first and key not in self.window.hash_to_block:
                full = self.blocks[seq.block_table[i]]
                self.window._publish(self.window.blocks[block_id], key, full.token_ids, full.uid, full.parent_uid)
        table.published = max(table.published, min(len(seq.block_hashes), len(table.blocks)))

    def free_blocks(self, seq: Sequence, swap: bool = False):
        table = self.tables.pop(seq.seq_id, None)
        if table is not None:
            for block_id in reversed(table.blocks[table.first:]):  # (the tail first: reused first)
                self._release_window_block(block_id)
        super().free_blocks(seq, swap)


class WindowScheduler(Scheduler):
    """The scheduler, sliding each scheduled sequence's window blocks after planning the step."""
    Step = WindowScheduledStep

    def schedule(self) -> WindowScheduledStep | None:
        step = super().schedule()
        if step is None:
            return None
        slide, writes, chunks = self.block_manager.slide, step.window_blocks, step.chunks
        for i, (seq, start) in enumerate(zip(step.seqs, step.starts)):
            slide(seq, start, start + (chunks[i][0] if i in chunks else 1), writes)
        if len(step.seqs) < len(self.running):  # (rare: some ran out of budget)
            scheduled = set(step.seqs)
            for seq in self.running:
                if seq not in scheduled:
                    self.block_manager.trim(seq)
        return step


class WindowRunner(ModelRunner):
    """The model runner, the sliding-window layers bound to the window pool's cache and tables
    (window_tables [rows + 1, max_blocks_per_seq], written by StepBatch.window_blocks)."""

    def _load(self, config):
        super()._load(config)
        windowed = [layer for layer in self.attention_layers if getattr(layer, "window", None)]
        self.attention_layers = [layer for layer in self.attention_layers if not getattr(layer, "window", None)]
        self.num_window_blocks = num_window_blocks(config)
        self.window_cache = bind_kv_cache(windowed, self.num_window_blocks, self.block_size, config.kv_dtype,
                                          self.device)
        self.window_layers = windowed
        self.window_tables = torch.zeros_like(self.block_tables)
        self.window_tables[self.scratch_row] = self.num_window_blocks  # (the spare block, as the full pool's)
        if self.rank == 0:
            logger.info("Sliding-window layers (%d of %d, window %d): a pool of their own, %d blocks x %d tokens, "
                        "%.2f MiB (max_num_seqs rows' windows and a step's tokens; fewer rows, a smaller pool)",
                        len(windowed), len(windowed) + len(self.attention_layers), window_of(config),
                        self.num_window_blocks, self.block_size, self.window_cache.numel() *
                        self.window_cache.element_size() / 2 ** 20)

    def window_block_bytes(self) -> int:
        """Bytes of one window-pool block (its layers' K and V; this rank's share)."""
        return self.window_cache[:, :, 0].numel() * self.window_cache.element_size()

    def prepare(self, batch: WindowStepBatch, graphs):
        if batch.window_blocks:
            rows, cols, ids = flatten_writes(batch.window_blocks)
            d = self.upload({"rows": rows, "cols": cols, "ids": ids})
            self.window_tables[d["rows"], d["cols"]] = d["ids"].int()
        inputs = super().prepare(batch, graphs)
        if inputs is None or inputs.graph_size:  # (a replay: its graph gathers them, graph_group_context)
            return inputs
        context = inputs.context
        step_rows = None
        if context.block_tables is not None:
            step_rows = inputs.rows if context.decode_only else self.upload({"r": batch.rows.astype(np.int64)})["r"]
        self.add_window_context(context, inputs.rows, inputs.positions, step_rows)
        return inputs

    def add_window_context(self, context, rows: torch.Tensor, positions: torch.Tensor,
                           step_rows: torch.Tensor | None):
        """context.layer_group: a WindowStep with the window tables' slots of the tokens (rows,
        positions [T]) and, where context has block tables, those of step_rows, as wide."""
        slots = kv_slots(self.window_tables, rows, positions, self.block_size)
        tables = None if step_rows is None else self.window_tables[step_rows, :context.block_tables.shape[1]]
        context.layer_group = WindowStep(replace(context, slot_mapping=slots, block_tables=tables))

    def graph_group_context(self, context, rows: torch.Tensor, positions: torch.Tensor):
        """(DecodeGraphs' hook) A captured decode step's WindowStep: its rows' window tables."""
        self.add_window_context(context, rows, positions, rows)
