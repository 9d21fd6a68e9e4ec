import logging
import random
from dataclasses import dataclass

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.batch_state import Need
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.frontend import Frontend
from nanovllm.engine.model_runner import ModelRunner, SampledTokens
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.scheduler import ScheduledStep, Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.models import resolve_model_class
from nanovllm.sampling_params import SamplingParams, is_integer
from nanovllm.utils.logging import format_bytes

logger = logging.getLogger(__name__)

SAMPLE_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: the n samples of a request get n distinct seeds


@dataclass
class InFlightStep:
    """A step launched on the device and not yet accounted for; `deferred` until its sampling is
    queued too (its grammar masks wait for the step before: Grammars.launch)."""
    step: ScheduledStep
    sampled: SampledTokens | None
    deferred: tuple | None = None  # (DeferredSampling, SamplingInputs)


class LLMEngine(Frontend):
    """Requests in, completions out: a Frontend (engine/frontend.py: the tokenizer, the checks of
    requests) that owns the scheduler, block manager and model runner (and, with tensor or pipeline
    parallelism, the worker processes of ranks 1..)."""

    def __init__(self, config: Config):
        super().__init__(config)  # the tokenizer and the request checks
        runner_class, scheduler_class, block_manager_class = ModelRunner, Scheduler, BlockManager
        if config.speculative is not None:  # the scheduler that plans drafts; the runner that verifies them
            from nanovllm.features.speculative.runner import SpeculativeRunner  # (a layer: loaded when asked for)
            from nanovllm.features.speculative.scheduling import SpeculativeScheduler
            runner_class, scheduler_class = SpeculativeRunner, SpeculativeScheduler
        if config.pipeline_parallel_size > 1:  # a runner that runs its stage's layers
            from nanovllm.distributed.pipeline import PipelineRunner  # (a layer: loaded when asked for)
            runner_class = PipelineRunner
        if getattr(resolve_model_class(config.hf_config), "engine_layers", False):  # layers of other kinds, images
            from nanovllm.features.layer_groups import group_classes  # (a layer: loaded when a model asks)
            runner_class, scheduler_class, block_manager_class = group_classes(config, runner_class, scheduler_class)
        if config.batch_invariant:  # GEMMs and attention of fixed tilings
            from nanovllm.features.batch_invariant import invariant_runner  # (a layer: loaded when asked for)
            runner_class = invariant_runner(runner_class)
        workers = None
        if config.world_size > 1:  # ranks 1.. in processes of their own, each with a runner_class
            from nanovllm.engine.workers import start_workers  # (tensor parallelism's: loaded when asked for)
            workers = start_workers(config, runner_class)
        self.model_runner = runner_class(config, workers.group if workers is not None else None, workers)
        self.block_manager = block_manager_class(self.model_runner.num_kv_blocks, config.block_size,
                                                 config.enable_prefix_caching, self.model_runner.num_host_blocks)
        self.scheduler = scheduler_class(config, self.block_manager, self.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler.finish)
        self._seed_rng = random.Random()  # seeds for requests that bring none
        self.in_flight: InFlightStep | None = None  # overlap scheduling: the step launched, not yet accounted for
        # Speculative steps do not overlap: the next step's layout (positions, slots, blocks, drafts
        # verified) depends on how many drafts this one accepts (n-gram drafts on their ids too), so
        # it cannot be planned before they are in; a draft model's positions are not on the device.
        self.overlap = config.async_scheduling and config.speculative is None
        self.recorder = None  # bench.py's StepRecorder, when attached (attach_recorder)
        self.asleep = 0  # sleep()'s level while asleep (features/sleep_mode.py), 0 awake
        self._log_summary()

    def _log_summary(self):
        """The start-up summary, what a deployment is sized by (logged once: the engine is rank 0's)."""
        c, runner, num_blocks = self.config, self.model_runner, self.block_manager.num_blocks
        per_rank = " per rank (rank 0's)" if c.world_size > 1 else ""
        num_tokens = num_blocks * c.block_size
        graphs = runner.graphs
        logger.info("Model %s: %s, dtype %s, device %s, attention backend %s, tensor_parallel_size %d, "
                    "pipeline_parallel_size %d", c.model, type(runner.model).__name__,
                    str(c.dtype).removeprefix("torch."), c.device, c.attention_backend, c.tensor_parallel_size,
                    c.pipeline_parallel_size)
        logger.info("Weights: %s%s. KV cache: %d blocks x %d tokens = %d tokens, %s%s, %s",
                    format_bytes(sum(p.nbytes for p in runner.model.parameters())), per_rank, num_blocks,
                    c.block_size, num_tokens, format_bytes(runner.kv_cache.nbytes), per_rank,
                    str(c.kv_dtype).removeprefix("torch."))
        if runner.num_host_blocks:
            logger.info("Host tier of the prefix cache: %d blocks = %d tokens, %s%s (preemption_mode=%s)",
                        runner.num_host_blocks, runner.num_host_blocks * c.block_size,
                        format_bytes(runner.host_copies.cache.nbytes), per_rank, c.preemption_mode)
        logger.info("Maximum concurrency for %d tokens per request: %.2fx. CUDA graphs: %s", c.max_model_len,
                    num_tokens / c.max_model_len,
                    f"{len(graphs.sizes)} batch sizes captured in {graphs.capture_s:.1f} s" if graphs else "off")

    # ---- requests -----------------------------------------------------------------------------
    def _make_request(self, prompt, sampling_params: SamplingParams, index: int, stream: bool) -> list[Sequence]:
        """Validate one request and build its n samples (2..n ride on the first as forks); none queued."""
        self.check_awake()
        ids = self.encode_prompt(prompt)
        self.check_request(len(ids), sampling_params)
        grammar = (self.grammar_compiler().compile_request(sampling_params)
                   if sampling_params.structured_outputs is not None else None)
        seed = sampling_params.seed if sampling_params.seed is not None else self._seed_rng.getrandbits(63)
        # each sample gets its own noise stream: seeds spaced by an odd 64-bit constant
        sequence_class = getattr(ids, "sequence_class", Sequence)  # (a prompt with images: features/multimodal.py)
        samples = [sequence_class(ids, sampling_params, (seed + j * SAMPLE_SEED_STRIDE) % 2**63, index, j)
                   for j in range(sampling_params.n)]
        if grammar is not None:  # each sample follows the grammar on its own
            for seq in samples:
                seq.matcher = self.grammars.matcher(grammar)
        self.outputs.watch(samples, stream)
        samples[0].forks = samples[1:]
        return samples

    def _make_requests(self, prompts, sampling_params, stream: bool) -> list[list[Sequence]]:
        """Normalize generate()/stream() arguments and validate every request; nothing is queued."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(is_integer(t) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        else:
            sampling_params = [sampling_params] * len(prompts)
        return [self._make_request(p, sp, i, stream) for i, (p, sp) in enumerate(zip(prompts, sampling_params))]

    def _add_requests(self, prompts, sampling_params, stream: bool) -> list[list[Sequence]]:
        """Validate every request, then queue them all (a bad one leaves the engine untouched)."""
        requests = self._make_requests(prompts, sampling_params, stream)
        for samples in requests:
            self.scheduler.add(samples[0])
        return requests

    def add_request(self, prompt, sampling_params: SamplingParams, stream: bool = False) -> list[Sequence]:
        """Queue one request; returns its n sample Sequences (drive them with step(), read their
        news with stream_update(); stream: text in every update)."""
        return self._add_requests([prompt], sampling_params, stream=stream)[0]

    def abort(self, seq: Sequence):
        """End seq now (finish_reason "abort"); its samples not queued yet end with it."""
        if not seq.is_finished:
            ended = [seq, *seq.forks]
            self.scheduler.finish(seq, "abort")
            self._notify(ended)

    # ---- running ------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One scheduler iteration. Returns the sequences that got a token (finished ones included).

        Synchronous (async_scheduling=False): schedule a step, run it, wait for its tokens, account
        for them. Overlapped (the default): schedule and launch step N+1, then account for step N
        while N+1 runs, so the device never waits for the host's bookkeeping. N+1 takes N's tokens
        from the device's token table, so it may run a sequence that N finished: complete() drops
        that token. A step whose grammar masks need N's tokens has its sampling queued once N is accounted for.
        """
        launched = done = self._launch()
        if self.overlap:  # the one difference between the two loops
            done, self.in_flight = self.in_flight, launched
        if done is None:
            assert launched is not None or self.scheduler.is_finished(), "scheduler made no progress"
            return []
        tokens, logprobs = done.sampled.result()
        if done.sampled.corrected:  # (rare) tokens redrawn after the device's token table had the first draw
            self.scheduler.correct(done.step, done.sampled.corrected, tokens,
                                   self.in_flight.step if self.in_flight is not None else None)
        if done.sampled.prompt_logprobs:
            from nanovllm.features.prompt_logprobs import collect  # (prompt logprobs' layer: loaded when used)
            collect(done.step.seqs, done.sampled.prompt_logprobs)
        updated = self.scheduler.complete(done.step, tokens, logprobs)
        if launched is not None and launched.deferred is not None:  # (structured outputs) its masks can be built now
            launched.sampled = self.grammars.sample_deferred(self.model_runner, launched.deferred)
            launched.deferred = None
        self._deliver(updated)
        if self.recorder is not None:
            self.recorder.step_accounted(done, self, tokens)
        return updated

    def _launch(self) -> InFlightStep | None:
        """Schedule a step and start it on the device; None when nothing can be scheduled."""
        step = self.scheduler.schedule()
        if step is None:
            return None
        batch = step.batch()
        sampling = self.scheduler.sampling_inputs(step, batch)
        if sampling.needs & Need.GRAMMAR:  # structured outputs' hook: each constrained row's mask
            return InFlightStep(step, *self.grammars.launch(self.model_runner, batch, sampling, step.sampling,
                                                            self.overlap))
        return InFlightStep(step, self.model_runner.launch(batch, sampling))

    def _deliver(self, updated: list[Sequence]):
        """The text of each updated sequence (where wanted: it may end at a stop string), then to its caller's inbox."""
        for seq in updated:
            if seq.detokenizer is not None:
                self.outputs.update_text(seq)
            if seq.inbox is not None:
                seq.inbox.append(seq)

    @staticmethod
    def _notify(seqs: list[Sequence]):
        """Put each of seqs in its caller's inbox (see _run)."""
        for seq in seqs:
            if seq.inbox is not None:
                seq.inbox.append(seq)

    def check_awake(self):
        if self.asleep:
            raise RuntimeError(f"the engine is asleep (sleep(level={self.asleep})): call wake_up() first")

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self.in_flight is None

    def _run(self, seqs: list[Sequence]):
        """Step until every sequence in seqs has finished, yielding after each step those with news.

        The engine is shared: generate() and stream() calls may interleave, and any caller's step
        advances every queued request. So each caller gives its sequences an inbox, where the
        engine puts each one it updates or ends, whoever stepped: each call sees all the news of
        its own sequences exactly once, and steps only while its inbox is empty. On any exception
        (or the generator closed) they are aborted, so no half-finished request keeps its blocks.
        """
        inbox: list[Sequence] = []
        for seq in seqs:
            seq.inbox = inbox
        unfinished = {seq for seq in seqs if not seq.is_finished}
        releases = self.scheduler.num_releases
        try:
            while unfinished:
                if not inbox:
                    self.step()
                    continue
                news = list(dict.fromkeys(inbox))  # (a sequence is there once per step that updated it)
                inbox.clear()
                if self.scheduler.num_releases != releases:  # (some sequence ended: maybe one of these)
                    releases = self.scheduler.num_releases
                    unfinished.difference_update([seq for seq in news if seq.is_finished])
                yield news
        except BaseException:
            for seq in seqs:
                self.abort(seq)
            raise

    def generate(self, prompts, sampling_params, use_tqdm: bool = True) -> list[dict]:
        """Complete every prompt; outputs come back in input order.

        prompts: a str, a list of token ids, or a list of either. sampling_params: one SamplingParams
        for all, or one per prompt. All are validated before any is queued.
        """
        requests = self._add_requests(prompts, sampling_params, stream=False)
        seqs = [seq for samples in requests for seq in samples]
        with tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm) as bar:
            num_tokens = 0
            for news in self._run(seqs):
                if use_tqdm:
                    finished = [seq for seq in news if seq.is_finished]
                    num_tokens += sum(seq.num_completion_tokens for seq in finished)
                    bar.update(len(finished))
                    bar.set_postfix_str(f"{num_tokens / max(bar.format_dict['elapsed'], 1e-9):.0f} tok/s",
                                        refresh=False)
        return [self.outputs.output(samples) for samples in requests]

    def stream(self, prompts, sampling_params):
        """Like generate(), but yields updates as tokens are produced, continuous batching running
        across all requests: dicts with `index` (the prompt's position), `sample` (which of its n),
        `text` and `token_ids` (new since that sample's last update; the `text` pieces concatenate
        to generate()'s) and `finished`, with `logprobs` (the new tokens' dicts) when asked for; a
        sample's last update also has `finish_reason`, `stop_reason`, `num_cached_tokens`, `metrics`.

        Requests are validated at the call and queued at the first next(). Closing the returned
        generator, or dropping it, aborts its unfinished requests.
        """
        requests = self._make_requests(prompts, sampling_params, stream=True)
        return self._stream(requests)

    def _stream(self, requests: list[list[Sequence]]):
        self.check_awake()  # (asleep since the call?)
        for samples in requests:
            self.scheduler.add(samples[0])
        for updated in self._run([seq for samples in requests for seq in samples]):
            # All of them now, before the caller runs again: a step it makes in between (another
            # generate, say) must not change what this batch of news reports.
            updates = [self.outputs.stream_update(seq) for seq in updated]
            yield from (u for u in updates if u is not None)

    def stream_update(self, seq: Sequence) -> dict | None:
        """What is new in seq since its last update (OutputProcessor.stream_update; the server's)."""
        return self.outputs.stream_update(seq)

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

    def attach_recorder(self, recorder):
        """Record every step from now on (bench.py: features/recorder.py's StepRecorder); None detaches."""
        self.recorder = recorder
        self.model_runner.recorder = recorder

    def stats(self) -> dict:
        """The engine's state now and its cumulative counts (features/stats.py's engine_stats)."""
        from nanovllm.features.stats import engine_stats  # (the server's and bench's: loaded when asked for)
        return engine_stats(self)
