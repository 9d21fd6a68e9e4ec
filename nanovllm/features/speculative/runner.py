"""SpeculativeRunner, built in place of ModelRunner (LLMEngine.__init__): a step with drafts runs
the draft model's part first (its drafts into the token table), then the target's forward over each
sequence's last token and drafts (CUDA graphs of their own: verify_graphs), then the verify step."""
from dataclasses import dataclass, replace
from time import perf_counter

import numpy as np
import torch

from nanovllm.config import Config
from nanovllm.engine.batch_state import SamplingInputs
from nanovllm.engine.cuda_graphs import DecodeGraphs
from nanovllm.engine.step_inputs import padded_batch_size
from nanovllm.engine.model_runner import DeferredSampling, ModelRunner, StepLayout
from nanovllm.utils.context import to_device
from nanovllm.engine.step_batch import StepBatch
from nanovllm.features.speculative.draft_model import DraftModel
from nanovllm.features.speculative.rejection_sampler import target_probs, verify
from nanovllm.features.speculative.scheduling import draft_slots, expand_runs
from nanovllm.layers.backends import get_backend


class VerifiedTokens:
    """A speculative step's result on its way to the host: each sampling sequence's emitted
    tokens (its accepted drafts, then one more) and their logprobs. The host waits for them at
    once: its next drafts depend on them (speculative steps do not overlap)."""
    corrected: tuple = ()  # (as SampledTokens': nothing is ever redrawn here)
    prompt_logprobs: list | None = None
    wait_s = 0.0

    def __init__(self, tokens: torch.Tensor, emitted: torch.Tensor, logprobs: tuple | None,
                 num_logprobs: list[int | None] | None):
        self.tokens, self.emitted, self.logprobs, self.num_logprobs = tokens, emitted, logprobs, num_logprobs

    def result(self) -> tuple[list[list[int]], list[list[dict]] | None]:
        start = perf_counter()
        tokens, counts = self.tokens.tolist(), self.emitted.tolist()
        self.wait_s = perf_counter() - start
        emitted = [row[:n] for row, n in zip(tokens, counts)]
        if self.logprobs is None:
            return emitted, None
        chosen, top_values, top_ids = (t.tolist() if t is not None else None for t in self.logprobs)
        dicts = []
        for i, (run, k) in enumerate(zip(emitted, self.num_logprobs)):
            entries = []
            for j, token in enumerate(run):
                if k is None:
                    entries.append(None)
                    continue
                entry = dict(zip(top_ids[i][j][:k], top_values[i][j][:k])) if k else {}
                entry[token] = chosen[i][j]
                entries.append(entry)
            dicts.append(entries)
        return emitted, dicts


@dataclass
class DraftedStep(DeferredSampling):
    """A launched speculative step: its forward, and the draft model's distributions of its drafts
    (None: n-gram drafts, or every row greedy)."""
    draft_probs: torch.Tensor | None = None


class SpeculativeRunner(ModelRunner):
    """ModelRunner, with the draft model (on rank 0 alone) and the verify step."""

    def _load(self, config: Config):
        super()._load(config)
        # the target's backend itself (get_backend gives the same object again), not a layer's: a
        # sliding-window layer holds its windowed form, which the draft's other layers must not get
        backend = get_backend(config.attention_backend, config.device)
        self.drafter = (DraftModel(config, self.device, backend)
                        if config.draft_hf_config is not None and self.rank == 0 else None)

    def _capture(self, config: Config):
        super()._capture(config)
        self.verify_graphs = self._capture_graphs(query_len=1 + config.speculative.num_speculative_tokens) \
            if self.use_graphs else None
        if self.drafter is not None and self.use_graphs:
            self.drafter.capture_graphs(self, show_progress=True)  # (kept by the draft model)

    def probe_graphs(self) -> list[DecodeGraphs]:
        k = self.config.speculative.num_speculative_tokens
        graphs = super().probe_graphs() + [self._capture_graphs(largest_only=True, query_len=1 + k)]
        if self.drafter is not None:
            graphs.append(self.drafter.capture_graphs(self, largest_only=True))
        return graphs

    def kv_block_bytes(self) -> int:
        """A block's bytes, the draft model's part included (its cache has the same blocks)."""
        return super().kv_block_bytes() + (self.drafter.kv_block_bytes() if self.drafter is not None else 0)

    def bind_kv_cache(self, num_blocks: int | None):
        super().bind_kv_cache(num_blocks)
        if self.drafter is not None:
            self.drafter.bind_kv_cache(num_blocks)

    # ---- a step -------------------------------------------------------------------------------
    def _forward(self, batch: StepBatch, sampling: SamplingInputs) -> DraftedStep:
        """The draft model's part (the step's tables, its drafts), then the target's forward."""
        draft_probs = None
        if self.drafter is not None:
            draft_probs = self.drafter.propose(self, batch, sampling)
            batch = replace(batch, new_blocks=[], new_tokens=[], fixed_tokens=[])
            if batch.num_drafts is not None and self.group is not None:
                self._share_drafts(batch)
        logits, inputs = self.run(batch, self.model, self.graphs)
        return DraftedStep(batch, logits, inputs, draft_probs)

    def _draw(self, step: DraftedStep, sampling: SamplingInputs):
        """A step with drafts: the verify step in place of the sampler's draw."""
        if step.batch.num_drafts is None:
            return super()._draw(step, sampling)
        return self._verify(step.batch, step.logits, sampling, step.draft_probs)

    @torch.inference_mode()
    def execute(self, batch: StepBatch):
        """Ranks above 0: as ModelRunner's, with rank 0's drafts and verified tokens."""
        if batch.num_drafts is None:
            return super().execute(batch)
        self._copy_host_blocks(batch)
        if not batch.draft_tokens:  # rank 0's draft model drafted them
            self.prepare(replace(batch, rows=batch.rows[:0]), None)  # (this step's table writes first)
            batch = replace(batch, new_blocks=[], new_tokens=[], fixed_tokens=[])
            self._share_drafts(batch)
        self.run(batch, self.model, self.graphs)
        if batch.samples.any():  # rank 0's _verify(): each sequence's next token, where it goes
            rows = to_device(batch.rows[batch.samples].astype(np.int64), self.device)
            self._keep_verified(torch.empty(2, int(batch.samples.sum()), dtype=torch.int64, device=self.device), rows)

    def _layout(self, batch: StepBatch, graphs: DecodeGraphs | None) -> StepLayout:
        """A step with drafts: logits at each drafting sequence's last d + 1 tokens; replayed in a
        verify graph when every sequence decodes its last token and drafts."""
        layout = super()._layout(batch, graphs)
        if batch.num_drafts is None:
            return layout
        num_seqs, num_new, parts = batch.num_seqs, batch.num_new.astype(np.int64), layout.parts
        graphs = self.verify_graphs
        if (graphs is not None and num_seqs <= graphs.max_batch and batch.samples.all()
                and (num_new == batch.num_drafts + 1).all()):
            layout.graph_size, layout.graphs = padded_batch_size(num_seqs, graphs.sizes), graphs
            pad, q = layout.graph_size - num_seqs, graphs.query_len
            parts["rows"] = np.concatenate([batch.rows, np.full(pad, self.scratch_row)])
            parts["positions"] = np.concatenate([layout.lens_k - 1, np.full(pad, q - 1)])  # each one's last token
            parts["num_new"] = np.concatenate([num_new, np.zeros(pad, dtype=np.int64)])
            # its tokens are the last num_new of its q rows (padded at the front), all sampling
            parts["logits_indices"] = expand_runs(self.arange[:num_seqs] * q + q - num_new, num_new)
        else:
            counts = batch.num_drafts[batch.samples].astype(np.int64) + 1
            parts["logits_indices"] = expand_runs(parts["logits_indices"] - counts + 1, counts)
        return layout

    @staticmethod
    def _token_writes(batch: StepBatch) -> list[tuple[int, int, list[int]]]:
        return ModelRunner._token_writes(batch) + batch.draft_tokens  # (and the host's drafts: n-gram)

    def _share_drafts(self, batch: StepBatch):
        """Tensor parallelism with a draft model: rank 0's drafts broadcast into every token table."""
        rows, positions = (to_device(a, self.device) for a in draft_slots(batch))
        drafts = self.token_table[rows, positions].long()
        self.group.broadcast(drafts)
        self.token_table[rows, positions] = drafts.int()

    def _verify(self, batch: StepBatch, logits: torch.Tensor, sampling: SamplingInputs,
                draft_probs: torch.Tensor | None) -> VerifiedTokens:
        """A speculative step's sampling (rank 0): the rejection sampler over the logits of each
        sampling sequence's drafts and the position after them (one sampling entry per such row).
        The drafts are the host's (n-gram: batch.draft_tokens) or the draft model's, in the token
        table already, with their distributions draft_probs (None when every row is greedy)."""
        drafts = batch.num_drafts[batch.samples].astype(np.int64)                   # [S]
        counts = drafts + 1
        firsts = np.cumsum(counts) - counts                                          # [S] each one's first row
        parts = {}
        if batch.draft_tokens:
            draft_ids = np.zeros((len(drafts), max(1, int(drafts.max()))), dtype=np.int64)
            pending = iter(batch.draft_tokens)  # (in step order, as are the sequences that drafted)
            for i in np.flatnonzero(drafts):
                draft_ids[i, :drafts[i]] = next(pending)[2]
            parts["drafts"] = draft_ids.ravel()
        greedy_rows = (sampling.temperatures[firsts] == 0 if sampling.temperatures is not None
                       else np.ones(len(drafts), dtype=bool))
        seeds = sampling.seeds[firsts] if sampling.seeds is not None else np.zeros(len(drafts), dtype=np.int64)
        d = self.upload({**parts, "lengths": drafts, "greedy": greedy_rows.astype(np.int64), "seeds": seeds,
                         "positions": sampling.positions[firsts], "firsts": firsts,
                         "rows": batch.rows[batch.samples].astype(np.int64)})
        if batch.draft_tokens:
            draft_ids = d["drafts"].view(len(drafts), -1)
        else:  # the draft model's, from the token table (columns past a sequence's drafts are ignored)
            columns = d["positions"][:, None] + torch.arange(int(drafts.max()), device=self.device)
            draft_ids = self.token_table[d["rows"][:, None], columns.clamp_(max=self.config.max_model_len - 1)].long()
        sbatch = self.sampling_batch(sampling, logits.shape[-1])
        probs, argmax = target_probs(logits, sbatch)
        tokens, emitted = verify(probs, argmax, d["greedy"].bool(), draft_ids, d["lengths"],
                                 draft_probs if probs is not None else None, d["seeds"], d["positions"])
        ends = (batch.starts + batch.num_new)[batch.samples].astype(np.int64)       # [S] (all drafts accepted)
        accepted = emitted - 1
        where = torch.stack([tokens.gather(1, accepted[:, None])[:, 0], to_device(ends, self.device) - d["lengths"]
                             + accepted])
        self._keep_verified(where, d["rows"])
        logprobs = None
        if sbatch.num_logprobs is not None:  # of each emitted token, at the row that decided it
            raw = torch.log_softmax(logits.float(), -1)
            rows = (d["firsts"][:, None] + torch.arange(tokens.shape[1], device=self.device)).clamp_(max=len(raw) - 1)
            top = raw.topk(sbatch.num_logprobs, -1) if sbatch.num_logprobs > 0 else None
            logprobs = (raw[rows, tokens], top.values[rows] if top else None, top.indices[rows] if top else None)
        return VerifiedTokens(tokens, emitted, logprobs, [sampling.num_logprobs[f] for f in firsts]
                              if sampling.num_logprobs is not None else None)

    def _keep_verified(self, where: torch.Tensor, rows: torch.Tensor):
        """Write each sampling sequence's next token (where [2, S]: tokens, positions; rows [S]) into
        the token table, rank 0's broadcast first. Accepted drafts are there already; rejected ones
        are overwritten when their positions are computed again."""
        if self.group is not None:
            self.group.broadcast(where)
        self.token_table[rows, where[1]] = where[0].to(torch.int32)
