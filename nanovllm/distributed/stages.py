"""What a pipeline stage is (pipeline_parallel_size > 1; distributed/pipeline.py's PipelineRunner
runs one, and its docstring tells the whole design): the ranks' groups (StageGroup, make_group),
the layers of each stage, the model built for them, a step cut into micro-batches, a stage's
share of the forward, and its clock. (Config's checks of the option: distributed/options.py.)"""
from contextlib import contextmanager
from time import perf_counter
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.engine.step_batch import StepBatch
from nanovllm.layers.transformer import head_dim_of, num_kv_heads_of
from nanovllm.utils import parallel
from nanovllm.utils.parallel import HeldElsewhere
from nanovllm.utils.tp_group import TPGroup

if TYPE_CHECKING:
    from nanovllm.config import Config


# Micro-batches per stage in a step: 2P of them keep each of P stages busy 2P / (3P - 1) of the
# step (80 % at P = 2, 75 % at P = 3, never under 2/3), against P / (2P - 1) for one each; more
# shrink the bubble further but cut the batch each kernel sees.
MICRO_BATCHES_PER_STAGE = 2
# ... but never fewer tokens than this in one: each micro-batch reads its stage's weights again,
# and a decode step is bound by those reads until its GEMMs have enough rows. On CPU (bench.py
# --dummy qwen3-0.6b, 2 stages of 1 core, 128 decoding sequences) runs of 64 tokens decode 73.6
# tok/s against 59.7 for one run and 65.5 for runs of 32; 32 sequences in runs of 8: 37.6 against
# 47.6 for one. On an H200 a bf16 GEMM is compute-bound from ~200 rows (989 TFLOP/s over 4.8 TB/s
# = 206 FLOP a byte; a weight's 2 bytes do 2 FLOP a row): 256 there, not yet measured.
MIN_MICRO_BATCH_TOKENS = {"cpu": 64, "cuda": 256}


def num_micro_batches(num_tokens: int, num_stages: int, device: str) -> int:
    """How many micro-batches a step of num_tokens is cut into (at least 1)."""
    return max(1, min(MICRO_BATCHES_PER_STAGE * num_stages, num_tokens // MIN_MICRO_BATCH_TOKENS[device]))


def layers_of_stage(num_layers: int, num_stages: int, stage: int, head_layers: float = 0.0) -> range:
    """The decoder layers of a stage. The first also runs the LM head, as much work as head_layers
    layers (head_cost_in_layers), so it takes that many fewer (at least one); the others share the
    rest alike, one more each for the last ones where it does not divide."""
    first = min(max(1, round((num_layers + head_layers) / num_stages - head_layers)), num_layers - num_stages + 1)
    if stage == 0:
        return range(first)
    base, extra = divmod(num_layers - first, num_stages - 1)
    later = stage - 1
    start = first + later * base + max(0, later - (num_stages - 1 - extra))
    return range(start, start + base + (later >= num_stages - 1 - extra))


def head_cost_in_layers(hf_config) -> float:
    """The LM head's multiply-adds a token (vocab x hidden) over a decoder layer's linear layers'
    (q, k, v, o and the MLP, or the experts a token goes to): the layers of work the LM head is in
    a decode step (attention's own, which grows with the context, left out)."""
    c = hf_config
    hidden, heads, kv_heads = c.hidden_size, c.num_attention_heads, num_kv_heads_of(c)
    attention = hidden * head_dim_of(c) * (2 * heads + 2 * kv_heads)
    top_k = getattr(c, "num_experts_per_tok", None)  # (MoE; Mixtral's experts are intermediate_size wide)
    expert = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    mlp = 3 * hidden * (expert * top_k if top_k else c.intermediate_size)
    return c.vocab_size * hidden / (attention + mlp)


@contextmanager
def pipeline_stage(layers: range):
    """A model built inside holds only these decoder layers (utils/parallel.py's stage_layers), and
    a HeldElsewhere in place of each other part (layers, embeddings, norm, LM head) it does not."""
    previous, parallel._STAGE_LAYERS = parallel._STAGE_LAYERS, layers
    try:
        yield
    finally:
        parallel._STAGE_LAYERS = previous


class StageGroup:
    """A rank's groups: its stage's TPGroup (`tp`, None with one rank a stage), and two groups of
    every rank: `world` for the hidden states from stage to stage (and the all-reduce of the KV
    block count), `back` for the final ones from the last stage to the first. NCCL runs a group's
    transfers between two ranks in order, on one stream: with 2 stages on one group, the second
    stage's first send back (queued before its second receive) would wait for the first stage's
    first receive, queued behind that stage's second send, which waits for the second receive: a
    deadlock. rank: in all (rank 0 runs the engine); local_rank: on its node (its GPU's index)."""

    def __init__(self, store: dist.Store, rank: int, config: "Config", local_rank: int | None = None):
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.rank, self.size, self.num_stages = rank, config.world_size, pp
        self.local_rank = rank if local_rank is None else local_rank
        self.stage, self.tp_rank = divmod(rank, tp)
        self.next = (self.stage + 1) % pp * tp + self.tp_rank       # (the ring: the last stage's is the first)
        self.previous = (self.stage - 1) % pp * tp + self.tp_rank
        self.first, self.last = self.stage == 0, self.stage == pp - 1
        self.world, self.back = (TPGroup(dist.PrefixStore(name, store), rank, self.size, config.device, self.local_rank)
                                 for name in ("pipeline", "pipeline-back"))
        self.tp = (TPGroup(dist.PrefixStore(f"stage{self.stage}", store), self.tp_rank, tp, config.device,
                           self.local_rank) if tp > 1 else None)

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """Over every rank of every stage."""
        return self.world.all_reduce(t, op)

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` on rank 0 (None elsewhere)."""
        return self.world.gather(t)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` into every rank of the first stage (ModelRunner._keep_sampled's tokens; the
        other stages never call it)."""
        return self.tp.broadcast(t) if self.tp is not None else t

    def send(self, t: torch.Tensor, tag: int, back: bool = False):
        """`t` to this rank's peer on the next stage (back: the last stage's to the first); the
        returned work is done once it has left."""
        return (self.back if back else self.world).pg.send([t], self.next, tag)

    def recv(self, t: torch.Tensor, tag: int, back: bool = False):
        """Into `t`, from this rank's peer on the previous stage (back: the first stage's, from the
        last); wait() on the returned work."""
        return (self.back if back else self.world).pg.recv([t], self.previous, tag)

    def shutdown(self):
        if self.tp is not None:
            self.tp.shutdown()
        self.world.shutdown()
        self.back.shutdown()


def split_batch(batch: StepBatch, parts: int) -> list[StepBatch]:
    """The step as up to `parts` runs of consecutive sequences with about equal new tokens. The
    table writes go with the first (prepared before any runs), each prompt-logprobs entry with
    its sequence (its index made the run's); the host tier's copies are the whole step's."""
    cu = np.cumsum(batch.num_new)
    ends = np.searchsorted(cu, cu[-1] * np.arange(1, parts) / parts) + 1      # (a run ends past these tokens)
    bounds = np.unique(np.concatenate([[0], ends.clip(1, batch.num_seqs), [batch.num_seqs]]))
    runs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        first = start == 0
        runs.append(StepBatch(
            batch.rows[start:end], batch.starts[start:end], batch.num_new[start:end], batch.samples[start:end],
            new_blocks=batch.new_blocks if first else [], new_tokens=batch.new_tokens if first else [],
            fixed_tokens=batch.fixed_tokens if first else [],
            prompt_logprobs=[(i - start, *rest) for i, *rest in batch.prompt_logprobs if start <= i < end]))
    return runs


def stage_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, received: torch.Tensor | None):
    """This stage's share of the decoder's forward (layers/transformer.py's DecoderModel): from the
    input ids on the first stage, else from received [2, T, hidden] (hidden, residual). Returns the
    same pair for the next stage, or on the last the final hidden states [T, hidden]."""
    decoder = model.model
    hidden, residual = (decoder.embed_tokens(input_ids), None) if received is None else received.unbind()
    for layer in decoder.layers:
        if not isinstance(layer, HeldElsewhere):
            hidden, residual = layer(positions, hidden, residual)
    if isinstance(decoder.norm, HeldElsewhere):
        return torch.stack([hidden, residual])
    return decoder.norm(hidden, residual)[0]


class StageClock:
    """When a rank worked on and waited in each step since time_stages(True): host time on CPU;
    on a GPU, CUDA events on the stream (a recv there holds the stream, not the host)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.steps: list[list] = []  # per step: [start, end, decode only?, micro-batches, [(wait start, end), ...]]

    def _mark(self):
        if not self.cuda:
            return perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step_started(self, decode_only: bool, micro_batches: int):
        self.steps.append([self._mark(), None, decode_only, micro_batches, []])

    def step_ended(self):
        self.steps[-1][1] = self._mark()

    def wait_started(self):
        self.steps[-1][4].append([self._mark(), None])

    def wait_ended(self):
        self.steps[-1][4][-1][1] = self._mark()

    def seconds(self) -> np.ndarray:
        """[steps, 5]: start and end (s from the first step's start), time waiting, decode only (1/0),
        micro-batches."""
        if not self.steps:
            return np.zeros((0, 5))
        if self.cuda:
            torch.cuda.synchronize()
        origin = self.steps[0][0]
        since = (lambda a, b: a.elapsed_time(b) / 1e3) if self.cuda else (lambda a, b: b - a)  # noqa: E731
        return np.array([[since(origin, start), since(origin, end), sum(since(a, b) for a, b in waits), decode, runs]
                         for start, end, decode, runs, waits in self.steps])


def stage_busy(times: np.ndarray, tp: int) -> tuple[np.ndarray, list[float]]:
    """stage_times' figures as each stage's busy share, [stages, steps] (the mean of its ranks), and
    over the decode steps. A rank is idle while it waits for the stage before, and on the stages
    after the first between steps too (for the next step's call); rank 0 spends that time on the
    engine's host work. A step's span runs to the next one's start (the last: its end)."""
    start, end, waited = times[..., 0], times[..., 1], times[..., 2]
    span = np.concatenate([start[:, 1:], end[:, -1:]], axis=1) - start          # [ranks, steps]
    work = np.where(np.arange(len(times))[:, None] == 0, span, end - start) - waited
    busy = (work / np.maximum(span, 1e-12)).reshape(-1, tp, times.shape[1]).mean(1)  # [stages, steps]
    decode = times[0, :, 3] == 1
    over_decode = (work[:, decode].sum(1) / np.maximum(span[:, decode].sum(1), 1e-12)).reshape(-1, tp).mean(1)
    return busy, over_decode.tolist()


def make_group(store: dist.Store, rank: int, config: "Config", local_rank: int | None = None):
    """The group a rank's runner is given: its TPGroup, or with pipeline stages a
    StageGroup (its stage's TPGroup and the point-to-point group of all ranks)."""
    if config.pipeline_parallel_size > 1:
        return StageGroup(store, rank, config, local_rank)
    return TPGroup(store, rank, config.tensor_parallel_size, config.device, local_rank)
