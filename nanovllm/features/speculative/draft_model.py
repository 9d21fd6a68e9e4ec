"""Speculative decoding's draft model: a smaller model with the target's tokenizer, run beside the
target on rank 0, proposing each drafting sequence's tokens on the device.

Its KV cache mirrors the target's: a cache of its own shape with the same blocks, addressed by the
model runner's block tables and fed from its token table. Every step it computes exactly the
positions the target computes, so a block's draft K/V is valid whenever the target's is: the prefix
cache's blocks serve both models, preemption recomputes both, and a rejected draft's slots are
written again later by both. A step, where sequence i drafts d_i tokens after its last token at
position c_i (D = max d_i):
  forward 1:     the step's tokens except the drafts (prefill chunks, plain decodes, each drafting
                 sequence's last token; CUDA graphs when they are all decodes): draft 1 from the
                 logits at c_i;
  forward j + 1: draft j at c_i + j of the sequences with d_i >= j (a decode step: CUDA graphs),
  (j = 1..D)     and draft j + 1 from its logits where d_i > j. A sequence's last forward only
                 writes its last draft's K/V (the target computes that position too).
Each draft is drawn as the target samples its position (target_probs), from a stream of its own
(DRAFT_SALT), or the argmax for a greedy row; its distribution q is kept for the rejection sampler.
With tensor parallelism the draft model runs on rank 0 alone, unsharded, and rank 0 broadcasts its
drafts (SpeculativeRunner._share_drafts).
"""
import numpy as np
import torch

from nanovllm.config import Config
from nanovllm.engine.batch_state import Need, SamplingInputs
from nanovllm.engine.cuda_graphs import DecodeGraphs
from nanovllm.engine.step_batch import StepBatch
from nanovllm.layers.attention import bind_backend, bind_kv_cache, kv_block_bytes
from nanovllm.layers.linear import quantization_scope
from nanovllm.layers.quantization import QuantizationConfig
from nanovllm.features.speculative.rejection_sampler import DRAFT_SALT, target_probs
from nanovllm.layers.inverse_transform import sample_from, uniform_per_row
from nanovllm.models import resolve_model_class
from nanovllm.utils.context import default_dtype_and_device
from nanovllm.utils.dummy_weights import load_dummy
from nanovllm.utils.loader import load_model
from nanovllm.utils.parallel import tensor_parallel


def select_rows(inputs: SamplingInputs, indices: np.ndarray) -> SamplingInputs:
    """The sampling inputs of these rows alone (the draft model draws with them), logprobs left out."""
    def pick(a):
        return a[indices] if a is not None else None
    return SamplingInputs(inputs.needs & ~Need.LOGPROBS, inputs.rows[indices], inputs.positions[indices],
                          pick(inputs.seeds), pick(inputs.temperatures), pick(inputs.top_ks), pick(inputs.top_ps),
                          pick(inputs.min_ps), processors=inputs.processors.select(indices)
                          if inputs.processors is not None else None)


class ClampedInputs(torch.nn.Module):
    """A draft model with a smaller embedding table than the target's (padded less), fed the
    target's token ids: an id past its table (a padding row of the target's, which a trained model
    does not emit) is read as its last one (it only makes a worse guess)."""

    def __init__(self, model: torch.nn.Module, vocab_size: int):
        super().__init__()
        self.model, self.max_id = model, vocab_size - 1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids.clamp(max=self.max_id), positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


class DraftModel:
    """The draft model, its KV cache and CUDA graphs; propose() runs its part of a step through
    the model runner it is given (the runner holds the draft model, not the other way round)."""

    def __init__(self, config: Config, device: torch.device, backend):
        self.config, self.device = config, device
        hf_config = config.draft_hf_config
        # (unsharded; quantized as its own config.json says, if it does)
        with default_dtype_and_device(config.dtype, device), tensor_parallel(None), \
                quantization_scope(QuantizationConfig.resolve(None, hf_config)):
            self.model = resolve_model_class(hf_config, config.max_model_len)(hf_config, config.max_model_len)
        if config.load_format == "dummy":
            load_dummy(self.model)
        else:
            load_model(self.model, config.speculative.model, show_progress=False)
        if hf_config.vocab_size < config.hf_config.vocab_size:
            self.model = ClampedInputs(self.model, hf_config.vocab_size)
        self.attention_layers = bind_backend(self.model, backend)  # (the target's, fused kernels too)
        self.vocab_size = config.hf_config.vocab_size  # the target's: q is over its token ids
        self.kv_cache = None
        self.graphs: DecodeGraphs | None = None

    def kv_block_bytes(self) -> int:
        return kv_block_bytes(self.attention_layers, self.config.block_size, self.config.kv_dtype)

    def bind_kv_cache(self, num_blocks: int | None):
        """Its cache of the runner's num_blocks blocks, in the target's KV dtype (None: unbind and free it)."""
        self.kv_cache = None
        self.kv_cache = bind_kv_cache(self.attention_layers, num_blocks, self.config.block_size, self.config.kv_dtype,
                                      self.device)

    def capture_graphs(self, runner, largest_only: bool = False, show_progress: bool = False) -> DecodeGraphs:
        """Its decode CUDA graphs over the runner's tables, kept unless largest_only (a memory probe)."""
        max_batch = runner.graph_sizes[-1]
        graphs = DecodeGraphs(self.model, runner.token_table, runner.block_tables, runner.block_size,
                              runner.scratch_row, max_batch, self.config.max_model_len,
                              self.config.draft_hf_config.hidden_size, self.config.dtype,
                              sizes=[max_batch] if largest_only else None, show_progress=show_progress)
        if not largest_only:
            self.graphs = graphs
        return graphs

    def propose(self, runner, batch: StepBatch, sampling: SamplingInputs) -> torch.Tensor | None:
        """Run the draft model's part of the step (every step: its cache must keep up): the step's
        tables first, then its drafts into the token table. q [R, V] over the step's sampling rows
        (row j of a drafting sequence: what its draft j + 1 was drawn from), or None: no drafts, or
        every row greedy."""
        run = runner.run
        num_drafts = batch.num_drafts
        if num_drafts is None:  # (a step without drafts: the draft model computes its tokens too)
            run(StepBatch(batch.rows, batch.starts, batch.num_new, np.zeros(batch.num_seqs, dtype=bool),
                          batch.new_blocks, batch.new_tokens, batch.fixed_tokens), self.model, self.graphs)
            return None
        mirror = StepBatch(batch.rows, batch.starts, batch.num_new - num_drafts, num_drafts > 0, batch.new_blocks,
                           batch.new_tokens, batch.fixed_tokens)
        logits, _ = run(mirror, self.model, self.graphs)
        # the drafting sequences, and each one's first row among the step's sampling rows
        per_sample = num_drafts[batch.samples].astype(np.int64)
        first_rows = (np.cumsum(per_sample + 1) - (per_sample + 1))[per_sample > 0]
        drafting = num_drafts > 0
        rows, last, counts = batch.rows[drafting], batch.starts[drafting].astype(np.int64), num_drafts[drafting]
        q = None
        if sampling.needs & Need.RANDOM:
            q = torch.zeros(int((per_sample + 1).sum()), self.vocab_size, device=self.device)
        for j in range(1, int(counts.max()) + 1):
            drawing = counts >= j  # (the same sequences as the logits' rows, in order)
            d = runner.upload({"rows": rows[drawing], "positions": last[drawing] + j,
                                    "target_rows": first_rows[drawing] + j - 1})
            tokens = self._draw(runner, logits, sampling, first_rows[drawing] + j - 1, d["target_rows"], q)
            runner.token_table[d["rows"], d["positions"]] = tokens.to(torch.int32)
            step = StepBatch(rows[drawing], (last[drawing] + j).astype(np.int32),
                             np.ones(int(drawing.sum()), dtype=np.int32), counts[drawing] > j)
            logits, _ = run(step, self.model, self.graphs)
        return q

    def _draw(self, runner, logits: torch.Tensor, sampling: SamplingInputs, target_rows: np.ndarray,
              target_rows_d: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        """One draft per logits row, drawn with the sampling inputs of the target rows that will
        verify it (target_rows; target_rows_d on the device), its distribution into q there."""
        vocab = self.vocab_size
        logits = logits[:, :vocab]
        if logits.shape[1] < vocab:  # (a draft whose embedding table is padded less: q is 0 past it)
            logits = torch.nn.functional.pad(logits, (0, vocab - logits.shape[1]), value=float("-inf"))
        inputs = select_rows(sampling, target_rows)
        sbatch = runner.sampling_batch(inputs, vocab)
        probs, argmax = target_probs(logits, sbatch)
        if probs is None:
            return argmax
        probs = probs / probs.sum(-1, keepdim=True)
        drawn = sample_from(probs, uniform_per_row(sbatch.seeds ^ DRAFT_SALT, sbatch.positions))
        q[target_rows_d] = probs
        return torch.where(sbatch.temperatures > 0, drawn, argmax)
