"""The state cache: what the engine adds for models with linear-attention layers (Qwen3.5's Gated
DeltaNet, layers/gated_delta_net.py): those whose config.layer_types lists "linear_attention".

A linear-attention layer keeps no K/V; it keeps a fixed-size state per sequence (a conv state and
a recurrent state). The engine holds those in a pool of slots, allocated at start-up beside the KV
cache (on a GPU before the KV cache is sized, so the blocks get what the states leave):

  slots 0 .. max_num_seqs - 1   one per row of the running batch: a running sequence's state lives
                                in its row's slot, so admission and preemption need no accounting
                                of their own (max_num_seqs bounds the rows, and so the states); a
                                sequence that starts at position 0 has its slot zeroed first
  slot max_num_seqs             the scratch row's (never read)
  the rest, max_num_seqs of them (with prefix caching)
                                snapshots: the state of a prompt at its last full block boundary,
                                keyed by that block's chained hash, least recently used reused first

Prefix caching across kinds: a cached prefix can be resumed only where every layer can resume. The
full-attention layers can from any of their cached blocks; the linear ones only where a snapshot
was taken. So a lookup (StateBlockManager._match_prefix) keeps the longest run of cached blocks
that ends at a snapshot, and the admitted sequence's slot is loaded from it before the step runs.
Snapshots are taken only at the end of each prompt's full blocks, where a prefix is most likely to
be shared (a repeated prompt, a system prompt plus its first turn, the n samples of a request):
each costs one slot's memory (a state of a few MiB for real models, the same for any prompt length)
and one copy in the step that computes that position. A preempted sequence comes back from its
prompt's snapshot and recomputes what it had generated.

CUDA graphs: a captured decode step's slots are its rows (StateRunner.graph_group_context); the
fresh rows are zeroed and the snapshots copied before a replay, outside the graph.

Not wired in: speculative decoding (a rejected draft would have to roll a state back, which needs a
state per draft position) and pipeline parallelism.
"""
import logging
from collections import OrderedDict
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import ScheduledStep, Scheduler
from nanovllm.engine.sequence import SequenceStatus
from nanovllm.engine.step_batch import StepBatch
from nanovllm.layers.gated_delta_net import GatedDeltaNet, StateStep
from nanovllm.utils.context import to_device

logger = logging.getLogger(__name__)


def state_cache_classes(config) -> tuple[type, type, type]:
    """The runner, scheduler and block manager of a model with linear-attention layers, or a
    ValueError for an option they do not support."""
    if config.speculative is not None:
        raise ValueError("speculative decoding is not supported for models with linear-attention layers (a rejected "
                         "draft would have to roll their recurrent state back); drop speculative_config")
    if config.pipeline_parallel_size > 1:
        raise ValueError("pipeline_parallel_size > 1 is not supported for models with linear-attention layers; use "
                         "tensor_parallel_size instead")
    return StateRunner, StateScheduler, StateBlockManager


def delta_rule_kernels(config, device: torch.device):
    """The Gated DeltaNet layers' kernels: fla-core's Triton kernels on CUDA where installed
    (layers/gated_delta_net_fla.py), else None: the layer's PyTorch reference (on CPU, with
    attention_backend='torch', or without fla-core, which start-up then names)."""
    if device.type != "cuda" or config.attention_backend == "torch":
        return None
    try:
        from nanovllm.layers.gated_delta_net_fla import FlaDeltaRule
    except ImportError as e:
        logger.warning("fla-core is not installed (%s): the Gated DeltaNet layers run their PyTorch reference, "
                       "one sequence at a time; pip install 'nanovllm[linear]' for its Triton kernels", e)
        return None
    return FlaDeltaRule()


def num_snapshot_slots(config) -> int:
    """Slots for prompt-end snapshots: as many as there are rows, none without prefix caching."""
    return config.max_num_seqs if config.enable_prefix_caching else 0


@dataclass
class StateStepBatch(StepBatch):
    """A step's message, with its state copies: `state_loads` (snapshot slot, row) copied before the
    forward; `state_saves` (sequence index, position, snapshot slot) taken during it (StateStep.saves)."""
    state_loads: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class StateScheduledStep(ScheduledStep):
    state_loads: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int, int]] = field(default_factory=list)

    def batch(self) -> StateStepBatch:
        batch = super().batch()
        return StateStepBatch(**{f.name: getattr(batch, f.name) for f in fields(batch)},
                              state_loads=self.state_loads, state_saves=self.state_saves)


class StateBlockManager(BlockManager):
    """The block manager, whose prefix hits end where a state snapshot was taken.

    snapshots  {key of the block a snapshot ends at: its slot}, least recently used first"""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.snapshots: OrderedDict[int, int] = OrderedDict()
        self.free_snapshot_slots: list[int] = []  # set by StateScheduler (it knows the rows)

    def _match_prefix(self, seq):
        hits = super()._match_prefix(seq)
        while hits and hits[-1][0] not in self.snapshots:  # the linear layers cannot resume there
            hits.pop()
        return hits

    def snapshot_of(self, key: int) -> int:
        """The slot of the snapshot ending at block `key` (a hit _match_prefix kept), marked used."""
        self.snapshots.move_to_end(key)
        return self.snapshots[key]

    def take_snapshot_slot(self, key: int) -> int | None:
        """A slot for a snapshot ending at block `key` (the least recently used one's if none is
        free), or None when one is kept already or there are no snapshot slots."""
        if key in self.snapshots:
            self.snapshots.move_to_end(key)
            return None
        if self.free_snapshot_slots:
            slot = self.free_snapshot_slots.pop()
        elif self.snapshots:
            slot = self.snapshots.popitem(last=False)[1]
        else:
            return None
        self.snapshots[key] = slot
        return slot


class StateScheduler(Scheduler):
    """The scheduler, planning each step's state copies: a snapshot loaded into the row of a sequence
    admitted from a cached prefix, and one taken where a step computes the end of a prompt's full blocks.
    (The device runs them in planning order, so a slot reused for a new snapshot is read first by any
    step planned before.)"""
    Step = StateScheduledStep

    def __init__(self, config, block_manager: StateBlockManager, eos_token_ids: set[int]):
        super().__init__(config, block_manager, eos_token_ids)
        first = config.max_num_seqs + 1  # (after the rows and the scratch row)
        block_manager.free_snapshot_slots = list(range(first + num_snapshot_slots(config) - 1, first - 1, -1))

    def schedule(self) -> StateScheduledStep | None:
        step = super().schedule()
        if step is not None and self.block_manager.enable_prefix_caching:
            self._plan_snapshots(step)
        return step

    def _admit_waiting(self, step: StateScheduledStep, budget: int):
        admitted = super()._admit_waiting(step, budget)
        for seq in admitted:
            if seq.num_computed_tokens:  # (from a cached prefix, which ends at a snapshot)
                key = seq.block_hashes[seq.num_computed_tokens // self.block_size - 1]
                step.state_loads.append((self.block_manager.snapshot_of(key), seq.row))
        return admitted

    def _plan_snapshots(self, step: StateScheduledStep):
        """A snapshot for each sequence whose chunk computes the end of its prompt's full blocks (the
        longest prefix a lookup of the same prompt can hit: never its last token). A plain decode
        never does (it computes a position past its prompt), so only the step's chunks are read. Their
        blocks are published by now (schedule()), so the snapshot's key is known."""
        for i, (n, _) in step.chunks.items():
            seq, start = step.seqs[i], step.starts[i]
            boundary = (seq.num_prompt_tokens - 1) // self.block_size * self.block_size
            if start < boundary <= start + n:
                slot = self.block_manager.take_snapshot_slot(seq.block_hashes[boundary // self.block_size - 1])
                if slot is not None:
                    step.state_saves.append((i, boundary, slot))

    def correct(self, step, indices, tokens, in_flight):
        """As Scheduler.correct; a sequence whose in-flight step it undoes has had its state advanced
        by the dropped token, which no rollback can take back: it is preempted and recomputed."""
        undone = set(in_flight.undone) if in_flight is not None else set()
        super().correct(step, indices, tokens, in_flight)
        for seq in (in_flight.undone - undone) if in_flight is not None else ():
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
                self._preempt(seq)


class StateRunner(ModelRunner):
    """The model runner, with the state pool (and the kernels, delta_rule_kernels) bound to the
    linear-attention layers and each step's StateStep on the forward context (a captured decode
    step's too: graph_group_context)."""

    def _load(self, config):
        super()._load(config)
        layers = [m for m in self.model.modules() if isinstance(m, GatedDeltaNet)]
        conv_shape, ssm_shape = layers[0].state_shapes()
        num_slots = config.max_num_seqs + 1 + num_snapshot_slots(config)
        # [layer, slot, ...]: conv states in the model's dtype (they hold its inputs), recurrent
        # states in float32 (transformers' kernels accumulate them so; bf16 would drift over a long prompt)
        self.conv_states = torch.zeros(len(layers), num_slots, *conv_shape, dtype=config.dtype, device=self.device)
        self.ssm_states = torch.zeros(len(layers), num_slots, *ssm_shape, dtype=torch.float32, device=self.device)
        kernels = delta_rule_kernels(config, self.device)
        for i, layer in enumerate(layers):
            layer.conv_state, layer.ssm_state = self.conv_states[i], self.ssm_states[i]
            layer.kernels = kernels

    def state_slot_bytes(self) -> int:
        """Bytes of one slot's states, every linear-attention layer's (this rank's share)."""
        return (self.conv_states[:, 0].numel() * self.conv_states.element_size()
                + self.ssm_states[:, 0].numel() * self.ssm_states.element_size())

    def prepare(self, batch: StateStepBatch, graphs):
        inputs = super().prepare(batch, graphs)
        if inputs is None:
            return None
        fresh = batch.rows[batch.starts == 0]  # (sequences that start at position 0: from zeros)
        if len(fresh):
            index = to_device(fresh.astype(np.int64), self.device)
            self.conv_states[:, index] = 0
            self.ssm_states[:, index] = 0
        for snapshot, row in batch.state_loads:
            self.conv_states[:, row] = self.conv_states[:, snapshot]
            self.ssm_states[:, row] = self.ssm_states[:, snapshot]
        if inputs.graph_size:  # (a replay: its graph has its StateStep, graph_group_context)
            return inputs
        rows = inputs.rows if inputs.context.decode_only else to_device(batch.rows.astype(np.int64), self.device)
        inputs.context.layer_group = StateStep(rows, batch.rows.tolist(),
                                               {i: (position, slot) for i, position, slot in batch.state_saves})
        return inputs

    def graph_group_context(self, context, rows: torch.Tensor, positions: torch.Tensor):
        """(DecodeGraphs' hook) A captured decode step's StateStep: each row its slot (padding rows
        the scratch slot), no snapshot (a decode step never computes a prompt's end)."""
        context.layer_group = StateStep(rows, [], {})
