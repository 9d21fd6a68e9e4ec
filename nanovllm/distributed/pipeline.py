"""Pipeline parallelism (pipeline_parallel_size > 1): the decoder layers split into stages, each of
tensor_parallel_size ranks, the hidden states passed from stage to stage point to point.

Rank r is tensor-parallel rank r % tp of stage r // tp (the ranks are started as for tensor
parallelism: engine/workers.py, or distributed/nodes.py over several nodes, where each node holds
whole stages when tp divides the ranks a node runs; stages.py has the groups). Each stage builds
only its own layers (stages.pipeline_stage: a HeldElsewhere in place of the others, whose
checkpoint tensors the loader skips), and holds and sizes only their KV cache; the block manager
is rank 0's for all, so every stage holds the same number of blocks, the smallest any rank can.

The LM head is on the first stage, beside the embeddings (vLLM puts it on the last): the last
stage sends the final hidden states of the sampling rows back, so the sampler and everything
around it (grammars, logits processors, logprobs, the token table the next step reads) stay on
rank 0 as without stages, and a model with tied embeddings holds its one table once. So the
stages form a ring per tensor-parallel rank t: rank t of each stage sends to rank t of the next,
the last to the first. Between stages travel [2, T, hidden] (hidden and residual: the next
layer's add + norm takes both, so the split changes no arithmetic); back, [S, hidden] (all T
rows when prompt logprobs want them).

A step is cut into micro-batches (split_batch: runs of whole sequences with about equal tokens).
The first stage runs micro-batch 1 and sends it on, then runs 2 while the next stage runs 1, ...;
then it turns each one's final hidden states into logits as they come back. With M micro-batches
of equal work on P stages each stage works M / (M + P - 1) of the step; but each micro-batch
reads the stage's weights again, so a step is cut only into runs of MIN_MICRO_BATCH_TOKENS or
more (stages.num_micro_batches): a small decode step runs whole, its stages one after the other.

stage_times() reports how long each rank worked and waited, step by step, for bench.py's
--timeline: host time on CPU, CUDA events on a GPU (where a recv makes the stream wait, not the host).

The host tier of the prefix cache works as with tensor parallelism: each rank copies its own
layers' share of a block. Limits: no CUDA graphs (every stage runs eager); no speculative decoding
(Config says so at start-up).
"""
from dataclasses import replace

import numpy as np
import torch

from nanovllm.distributed.stages import (StageClock, StageGroup, head_cost_in_layers, layers_of_stage,
                                         num_micro_batches, pipeline_stage, split_batch, stage_forward)
from nanovllm.engine.model_runner import ModelRunner, StepInputs
from nanovllm.engine.step_batch import StepBatch
from nanovllm.utils.context import Context, forward_context


class PipelineRunner(ModelRunner):
    """A ModelRunner that holds and runs one stage's layers (group: its StageGroup)."""
    group: StageGroup

    def _build_model(self, model_class: type):
        group = self.group
        hf_config = self.config.hf_config
        self.layers = layers_of_stage(hf_config.num_hidden_layers, group.num_stages, group.stage,
                                      head_cost_in_layers(hf_config))
        self.clock: StageClock | None = None  # time_stages(): off until asked for
        with pipeline_stage(self.layers):
            return super()._build_model(model_class)

    def _load(self, config):
        super()._load(config)
        self.use_graphs = False  # (no CUDA graphs: the module docstring's limits; gpu_memory.py reads it)

    def _keep_sampled(self, tokens: torch.Tensor, inputs: StepInputs):
        """The first stage's ranks keep the sampled tokens (StageGroup.broadcast: over the stage);
        the other stages never read the token table's tokens (the input ids prepare() gathers
        there go unused: they start from the hidden states they receive)."""
        if self.group.first:
            super()._keep_sampled(tokens, inputs)

    def warmup_logits(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """(gpu_memory.warmup) This stage alone on made-up inputs: its peak, and the logits on the first."""
        received = None
        if not self.group.first:
            received = torch.zeros(2, len(input_ids), self.config.hf_config.hidden_size, dtype=self.config.dtype,
                                   device=self.device)
        out = stage_forward(self.model, input_ids, positions, received)
        return self.model.compute_logits(out[0]) if self.group.first else None  # (out: [2, T, hidden] there)

    def run(self, batch: StepBatch, model, graphs) -> tuple[torch.Tensor | None, StepInputs | None]:
        """The step through the stages, in micro-batches; on the first stage their logits (as
        ModelRunner.run's: rank 0's, for its sampling rows in the step's order)."""
        if not batch.num_seqs:
            return super().run(batch, model, graphs)
        runs = split_batch(batch, num_micro_batches(int(batch.num_new.sum()), self.group.num_stages,
                                                    self.device.type))
        if self.clock is not None:
            self.clock.step_started(bool((batch.num_new == 1).all()), len(runs))
        inputs = [self.prepare(run, None) for run in runs]  # (every run's host work first)
        logits = self._first_stage(runs, inputs) if self.group.first else self._later_stage(runs, inputs)
        if self.clock is not None:
            self.clock.step_ended()
        rows, positions = zip(*(step.sampled_at for step in inputs))
        prompt = [entry for step in inputs for entry in step.prompt_logprobs or []]
        return logits, replace(inputs[0], sampled_at=(torch.cat(rows), torch.cat(positions)),
                               prompt_logprobs=prompt if batch.prompt_logprobs and self.rank == 0 else None)

    def _first_stage(self, runs: list[StepBatch], inputs: list[StepInputs]) -> torch.Tensor | None:
        """Embeddings and this stage's layers for each run, sent on as each is done; then each
        run's LM head, as its final hidden states come back: the step's logits (rank 0's)."""
        sent = []
        for tag, step in enumerate(inputs):
            with forward_context(step.context):
                out = stage_forward(self.model, step.input_ids, step.positions, None)
            sent.append((self.group.send(out, tag), out))  # (out kept alive until sent)
        logits, offset = [], 0
        for tag, (run, step) in enumerate(zip(runs, inputs)):
            offset, first_seq = offset + run.num_seqs, offset  # (the run's first sequence in the step)
            final = self._receive_final(run, step, tag)
            if final is None:
                continue
            all_rows = bool(run.prompt_logprobs)  # (else only the sampling rows came back)
            with forward_context(step.context if all_rows else Context()):
                logits.append(self.model.compute_logits(final))
            if all_rows:
                from nanovllm.features.prompt_logprobs import prompt_logprobs  # (its layer: loaded when used)
                step.prompt_logprobs = [(i + first_seq, *rest) for i, *rest in
                                        prompt_logprobs(self.model, self.token_table, final, run, step.context,
                                                        self.rank) or []]
        for work, _ in sent:
            work.wait()
        logits = [x for x in logits if x is not None]
        return torch.cat(logits) if logits else None

    def _later_stage(self, runs: list[StepBatch], inputs: list[StepInputs]) -> None:
        """Each run from the stage before through this stage's layers, and on: to the next stage,
        or from the last the final hidden states the first stage's LM head needs."""
        hidden_size = self.config.hf_config.hidden_size
        sent = []
        for tag, (run, step) in enumerate(zip(runs, inputs)):
            received = self._received(torch.empty(2, len(step.positions), hidden_size, dtype=self.config.dtype,
                                                  device=self.device), tag)
            with forward_context(step.context):
                out = stage_forward(self.model, None, step.positions, received)
            if self.group.last:
                out = out if run.prompt_logprobs else out[step.context.logits_indices] if run.samples.any() else None
            if out is not None:
                sent.append((self.group.send(out, tag, back=self.group.last), out))
        for work, _ in sent:
            work.wait()
        return None

    def _receive_final(self, run: StepBatch, step: StepInputs, tag: int) -> torch.Tensor | None:
        """A run's final hidden states from the last stage: its sampling rows' [S, hidden], every
        row's [T, hidden] when it has prompt logprobs, None when none samples (the last sends none)."""
        rows = len(step.positions) if run.prompt_logprobs else int(run.samples.sum())
        if not rows:
            return None
        return self._received(torch.empty(rows, self.config.hf_config.hidden_size, dtype=self.config.dtype,
                                          device=self.device), tag, back=True)

    def _received(self, t: torch.Tensor, tag: int, back: bool = False) -> torch.Tensor:
        """`t`, filled from the previous stage (the wait timed when time_stages() is on)."""
        work = self.group.recv(t, tag, back)
        if self.clock is not None:
            self.clock.wait_started()
        work.wait()
        if self.clock is not None:
            self.clock.wait_ended()
        return t


def time_stages(runner: PipelineRunner, on: bool):
    """Start (on: from zero) or stop timing the steps of every rank (called on rank 0)."""
    if runner.workers is not None:
        runner.workers.call(time_stages, on)
    runner.clock = StageClock(runner.device) if on else None


def stage_times(runner: PipelineRunner) -> np.ndarray | None:
    """Since time_stages(True), on rank 0: [ranks, steps, 5] (each rank's StageClock.seconds; None on the others)."""
    if runner.workers is not None:
        runner.workers.call(stage_times)
    times = torch.tensor(runner.clock.seconds(), dtype=torch.float64, device=runner.device)
    parts = runner.group.gather(times)
    return torch.stack(parts).cpu().numpy() if parts is not None else None


def stage_layout(runner: PipelineRunner) -> list[dict] | None:
    """On rank 0, per rank: its stage, its decoder layers [first, stop), its KV cache's bytes per
    block and its number of blocks (None on the others)."""
    if runner.workers is not None:
        runner.workers.call(stage_layout)
    group, layers = runner.group, runner.layers
    mine = torch.tensor([group.rank, group.stage, layers.start, layers.stop, runner.kv_block_bytes(),
                         runner.num_kv_blocks], dtype=torch.int64, device=runner.device)
    parts = group.gather(mine)
    keys = ("rank", "stage", "first_layer", "stop_layer", "kv_block_bytes", "num_kv_blocks")
    return [dict(zip(keys, part.tolist())) for part in parts] if parts is not None else None
