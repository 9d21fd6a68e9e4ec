import os
import random
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The folder's tokenizer, or None when it ships none (prompts must then be token ids)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


class LLMEngine:
    """Requests in, completions out: owns the tokenizer, scheduler, block manager and model runner."""

    def __init__(self, config: Config):
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        eos = config.eos_token_ids
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = {self.tokenizer.eos_token_id}
        self.eos_token_ids = eos
        self.model_runner = ModelRunner(config)
        self.block_manager = BlockManager(self.model_runner.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, eos)
        self._seed_rng = random.Random()  # seeds for requests that bring none
        # Throughput counters since start: a step with any prefill tokens counts as prefill time.
        self.counters = {"prefill_tokens": 0, "prefill_time_s": 0.0, "decode_tokens": 0, "decode_time_s": 0.0}

    # ---- requests -----------------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model!r} has no tokenizer: pass prompts as lists of token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError(f"a prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("a prompt must have at least one token, got an empty prompt")
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        return ids

    def _make_sequence(self, prompt, sampling_params: SamplingParams) -> Sequence:
        """Validate one request and build its Sequence; nothing is queued here."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        ids = self._prompt_ids(prompt)
        if len(ids) + sampling_params.max_tokens > self.config.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens plus max_tokens={sampling_params.max_tokens} exceeds "
                             f"max_model_len={self.config.max_model_len}")
        seed = sampling_params.seed if sampling_params.seed is not None else self._seed_rng.getrandbits(63)
        return Sequence(ids, sampling_params, seed)

    def add_request(self, prompt, sampling_params: SamplingParams) -> Sequence:
        seq = self._make_sequence(prompt, sampling_params)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence):
        if not seq.is_finished:
            self.scheduler.finish(seq)
            seq.finish_reason = "abort"

    # ---- running ------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One scheduler iteration. Returns the sequences that finished."""
        start = perf_counter()
        seqs = self.scheduler.schedule()
        assert seqs or self.scheduler.is_finished(), "scheduler made no progress"
        if not seqs:
            return []
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        sampled = self.model_runner.run(seqs)
        finished = self.scheduler.postprocess(seqs, sampled)
        kind = "decode" if num_tokens == len(seqs) else "prefill"
        self.counters[f"{kind}_tokens"] += num_tokens
        self.counters[f"{kind}_time_s"] += perf_counter() - start
        return finished

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def output(self, seq: Sequence) -> dict:
        ids = seq.completion_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None
        return {"text": text, "token_ids": ids, "num_cached_tokens": seq.num_cached_tokens,
                "finish_reason": seq.finish_reason, "metrics": seq.metrics()}

    def generate(self, prompts, sampling_params, use_tqdm: bool = True) -> list[dict]:
        """Complete every prompt; outputs come back in input order.

        prompts: a str, a list of token ids, or a list of either. sampling_params: one
        SamplingParams for all, or a list with one per prompt. Every request is validated before
        any is queued, so a bad one leaves the engine untouched.
        """
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        else:
            sampling_params = [sampling_params] * len(prompts)
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        for seq in seqs:
            self.scheduler.add(seq)
        pending = {seq.seq_id for seq in seqs}
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            while pending:
                finished = self.step()
                c = self.counters
                bar.set_postfix_str(f"prefill {c['prefill_tokens'] / max(c['prefill_time_s'], 1e-9):.0f} tok/s, "
                                    f"decode {c['decode_tokens'] / max(c['decode_time_s'], 1e-9):.0f} tok/s",
                                    refresh=False)
                done = [seq for seq in finished if seq.seq_id in pending]
                pending.difference_update(seq.seq_id for seq in done)
                bar.update(len(done))
        except BaseException:
            for seq in seqs:  # leave no half-finished request holding blocks
                self.abort(seq)
            raise
        finally:
            bar.close()
        return [self.output(seq) for seq in seqs]

    def shutdown(self):
        """Stop the tensor-parallel worker processes, if any. Idempotent; also run by `with LLM(...)`,
        garbage collection and interpreter exit."""
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.shutdown()

    def stats(self) -> dict:
        return {"num_blocks": self.block_manager.num_blocks,
                "num_free_blocks": self.block_manager.num_free_blocks,
                "num_preemptions": self.scheduler.num_preemptions,
                "num_cached_tokens": self.block_manager.num_cached_tokens, **self.counters,
                "tp_message_bytes": self.model_runner.last_message_bytes}
