"""Host overhead of a decode step: what the engine spends between two forward calls.

The decoder stack is replaced by a stub that returns zeros at once, so what remains is the host's
share of a step: scheduling, block bookkeeping, building the step's inputs, the LM head and
sampling, appending tokens and stop checks. On a GPU all of that is added to every decode step
unless it overlaps the device's work.

    python scripts/bench_host.py            # median µs per pure-decode step at 256 sequences,
                                            # with 16- and 256-token KV blocks, both modes
    python scripts/bench_host.py --upstream /tmp/nano-vllm-upstream --repeats 2
                                            # the same, beside upstream nano-vllm, interleaved

Two workloads per block size: prompts of lengths drawn from 100-600 tokens (seed 0; as real
prompts vary, some sequence crosses a block boundary, and takes a block, almost every step), and
prompts all of 64 tokens (every sequence crosses a boundary on the same step, so the median step
takes no block at all). Every sequence makes --steps tokens (greedy, ignore_eos); the figure is
the median of the intervals between consecutive forward calls of which both had all the
sequences decoding (about --steps of them).

Two modes (--modes):
  stub  the LM head returns zero logits [rows, 512] and the sampler zero token ids: what is left
        is the engine's own bookkeeping;
  real  the tiny model's real LM head (64 -> 512, float32) and a real greedy sampler over its
        512-token vocabulary (on the zero hidden states the stubbed decoder returns). Both run
        on the host here; on a GPU they would be device work, so this mode is the upper bound.
Threads: --threads N calls torch.set_num_threads(N) (default: torch's own default, printed). On a
machine whose cores are busy with other work, more than one thread makes every small torch op
wait for an OpenMP team member that is not running (milliseconds per step, on either side):
use --threads 1 there.
Clock: --clock wall (perf_counter, the default) or cpu (process_time: the CPU time of the whole
process, all its threads, so it leaves out the time spent waiting for a core on a shared
machine; meant for --threads 1, where no intra-op thread spins).
Quantile: --quantile 0.1 takes a run's 10th-percentile interval in place of its median: on a
shared machine whose other tenants slow down bursts of steps, the low quantile stays put while
the median swings by tens of percent (seen here: ours/upstream 0.41-0.73 by the median, within a
few percent by the 0.1-quantile). The last column is the median of the ratios.

Comparison with upstream nano-vllm (github.com/GeeeekExplorer/nano-vllm), --upstream PATH: PATH
is a checkout of it, imported from there at run time (never copied here). Each side runs in its
own interpreter (this script re-invokes itself with --side ours|upstream, the upstream one with
PATH first on sys.path and this repository off it, and checks which `nanovllm` it got), on the
same tiny checkpoint, the same prompts and the same counts. Both workers stay up and take
turns figure by figure (one measures while the other waits), ours first in one case and
upstream first in the next; --repeats R goes round all the cases R times, so a slow spell on a
shared machine shows up as noise in both sides' columns rather than as a bias against one.

What each side's timed interval (forward call N to forward call N + 1) holds:
  ours      after forward N: the LM head (stub or real), sampling_batch (the sampler's input
            tensors), the sampler (stub, or Sampler.forward greedy: numpy's argmax on CPU), the
            tokens into the device token table; then LLMEngine.step's accounting of the step
            before (overlap scheduling: tokens .tolist(), Scheduler.complete: append, stop
            checks, full blocks into the prefix cache; _deliver), generate()'s _run loop (the
            inbox), then Scheduler.schedule (block growth) of step N + 1, its StepBatch and
            sampling inputs, ModelRunner.launch -> prepare (numpy arrays -> tensors, the
            attention context) up to the forward call.
  upstream  after forward N: compute_logits (stub, or upstream's ParallelLMHead, world size 1),
            the sampler (stub, or greedy: logits.argmax(-1), see below), .tolist(), reset_context,
            Scheduler.postprocess (hash_blocks, append_token, stop checks), step()'s output list,
            generate()'s loop (two perf_counter calls, tqdm's set_postfix on its disabled bar:
            about 3 µs), then Scheduler.schedule (can_append / may_append), ModelRunner.call ->
            run -> prepare_decode (Python lists -> tensors, the padded block tables),
            prepare_sample (the temperatures tensor), set_context, run_model (eager) up to the
            forward call. That is upstream's own code throughout: the stubs are the model, the
            sampler, the KV cache and CUDA graphs (not built: ModelRunner.__init__, which needs
            NCCL and CUDA, is skipped, and enforce_eager is set), flash_attn (a fake module: its
            layers import it) and pinned host memory: its prepare_* build tensors with
            pin_memory=True and .cuda(non_blocking=True), which here become a plain torch.tensor
            and a no-op (a Python call each, well under 1 µs a step; ours on CPU pins nothing
            either).
  Excluded on both: the decoder (a stub), KV-cache writes and attention, host-to-device copies
  and pinning, CUDA-graph replay and its input copies (both run eagerly on CPU; on a GPU both
  replay graphs, each with its own copy-in), tensor parallelism, detokenization (neither side
  has a tokenizer in the loop; upstream decodes once at the end, after the last forward).
Where the two differ:
  - Greedy: upstream has no greedy path (its SamplingParams refuses temperature 0, and its
    Sampler, torch.compile'd, draws with exponential noise), so its greedy stand-in is the last op
    of its Sampler, torch's argmax, while ours runs its own Sampler at temperature 0, which on CPU
    takes numpy's argmax (about 150 µs against 20 µs at [256, 512] on one thread). Upstream's
    requests carry temperature 1.0 (it refuses 0), which only fills its temperatures tensor.
  - 16-token blocks: upstream's Config asserts kvcache_block_size % 256 == 0 (its flash-attn
    paged-KV call), so for 16 the script sets the field past that check; its scheduler, block
    manager and input building are written for any block size, so this is what its host work
    would cost at 16, not a configuration upstream ships.
  - Features: ours' step checks stop-token sets, min_tokens and length per sequence, has
    logprobs, penalties and structured outputs to look for (all inactive here: their checks are
    still paid), and runs overlap scheduling (the host work of step N + 1 while step N is on the
    device); upstream checks EOS and max_tokens, and its host work is serialized with the device.
    This measures host work per step, not how much of it a GPU would hide.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("stub", "real")
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]  # what the forward stubs read (--clock)
quantile = 0.5  # which quantile of a run's intervals is its figure (--quantile)


def make_prompts(prompt_lens: list[int], vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in prompt_lens]


def workloads(args) -> dict[str, list[int]]:
    rng = random.Random(0)
    lo, hi = args.prompt_lens
    return {f"prompts of {lo}-{hi} tokens": [rng.randint(lo, hi) for _ in range(args.num_seqs)],
            f"prompts of {args.equal_prompt_len} tokens": [args.equal_prompt_len] * args.num_seqs}


def sizes(block_size: int, prompt_lens: list[int], steps: int) -> tuple[int, int, int]:
    """(max model length, KV blocks, max batched tokens): room for every sequence, one prefill."""
    blocks = sum(-(-(n + steps) // block_size) for n in prompt_lens)
    return max(prompt_lens) + steps + 1, blocks, max(sum(prompt_lens), 1024)


def median_gap(calls: list[tuple[float, int]], num_seqs: int) -> float:
    """The median µs (--quantile) between consecutive forward calls that were both full
    pure-decode steps."""
    gaps = sorted((t1 - t0) * 1e6 for (t0, n0), (t1, n1) in zip(calls, calls[1:]) if n0 == n1 == num_seqs)
    return gaps[min(len(gaps) - 1, int(quantile * len(gaps)))] if quantile != 0.5 else statistics.median(gaps)


def zero_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The stubbed sampler of both sides."""
    return torch.zeros(len(logits), dtype=torch.int64)


# ---- ours ---------------------------------------------------------------------------------------
def import_ours():
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import nanovllm
    assert os.path.dirname(os.path.abspath(nanovllm.__file__)) == os.path.join(ROOT, "nanovllm"), nanovllm.__file__
    return nanovllm


def measure(path: str, block_size: int, prompt_lens: list[int], steps: int, mode: str = "stub",
            **llm_options) -> float:
    """Ours: median µs between consecutive forward calls of steps in which all len(prompt_lens)
    sequences decode."""
    import_ours()
    from nanovllm import LLM, SamplingParams
    from nanovllm.utils.context import get_context

    num_seqs = len(prompt_lens)
    max_model_len, blocks, max_batched = sizes(block_size, prompt_lens, steps)
    llm = LLM(path, kvcache_block_size=block_size, max_num_seqs=num_seqs, max_model_len=max_model_len,
              num_kvcache_blocks=blocks, max_num_batched_tokens=max_batched, **llm_options)
    model = llm.model_runner.model
    hidden, vocab = llm.config.hf_config.hidden_size, llm.config.hf_config.vocab_size
    calls = []  # (time, number of input tokens) at each forward call

    def forward(input_ids, positions):
        calls.append((clock(), input_ids.shape[0]))
        return torch.zeros(input_ids.shape[0], hidden)

    model.forward = forward
    if mode == "stub":
        model.compute_logits = lambda h: torch.zeros(len(h[get_context().logits_indices]), vocab)  # sampling rows
        llm.model_runner.sampler.forward = lambda logits, batch: (zero_tokens(logits), None, None)
    try:
        llm.generate(make_prompts(prompt_lens, vocab), SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
                     use_tqdm=False)
    finally:
        llm.shutdown()
    return median_gap(calls, num_seqs)


# ---- upstream -----------------------------------------------------------------------------------
def import_upstream(upstream: str) -> types.SimpleNamespace:
    """Upstream nano-vllm's engine from the checkout `upstream`, with what it needs from outside
    (flash_attn, CUDA, pinned memory) stubbed for a CPU-only interpreter."""
    upstream = os.path.abspath(upstream)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != ROOT]
    sys.path.insert(0, upstream)

    def unavailable(*args, **kwargs):
        raise RuntimeError("flash_attn is stubbed: the decoder should not run")

    flash_attn = types.ModuleType("flash_attn")
    flash_attn.flash_attn_varlen_func = flash_attn.flash_attn_with_kvcache = unavailable
    sys.modules["flash_attn"] = flash_attn
    import importlib.util
    if importlib.util.find_spec("triton") is None:  # (its attention layer defines a Triton kernel)
        triton = types.ModuleType("triton")
        triton.jit = lambda fn: fn
        triton.language = types.ModuleType("triton.language")
        triton.language.constexpr = int
        sys.modules.update({"triton": triton, "triton.language": triton.language})

    import nanovllm
    assert os.path.abspath(nanovllm.__file__).startswith(upstream + os.sep), \
        f"imported {nanovllm.__file__}, not upstream's nanovllm under {upstream}"
    from nanovllm.config import Config
    from nanovllm.engine import model_runner
    from nanovllm.engine.llm_engine import LLMEngine
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.engine.sequence import Sequence
    from nanovllm.layers.embed_head import ParallelLMHead
    from nanovllm.sampling_params import SamplingParams
    from nanovllm.utils.context import get_context

    # its prepare_* build tensors with pin_memory=True and .cuda(non_blocking=True): plain CPU tensors here
    cpu_torch = types.ModuleType("torch")
    cpu_torch.__dict__.update(vars(torch))
    cpu_torch.__getattr__ = lambda name: getattr(torch, name)
    cpu_torch.tensor = lambda data, *, pin_memory=False, **kwargs: torch.tensor(data, **kwargs)
    model_runner.torch = cpu_torch
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    return types.SimpleNamespace(Config=Config, ModelRunner=model_runner.ModelRunner, LLMEngine=LLMEngine,
                                 Scheduler=Scheduler, Sequence=Sequence, ParallelLMHead=ParallelLMHead,
                                 SamplingParams=SamplingParams, get_context=get_context)


class UpstreamStubModel(torch.nn.Module):
    """What upstream's ModelRunner calls as its model: the decoder's forward returns zeros (and
    notes the call), compute_logits is upstream's own LM head (real mode) or zero logits."""

    def __init__(self, up, hidden: int, vocab: int, lm_head, calls: list):
        super().__init__()
        self.up, self.hidden, self.vocab, self.lm_head, self.calls = up, hidden, vocab, lm_head, calls

    def forward(self, input_ids, positions):
        self.calls.append((clock(), input_ids.shape[0]))
        return torch.zeros(input_ids.shape[0], self.hidden)

    def compute_logits(self, hidden):
        if self.lm_head is not None:
            return self.lm_head(hidden)
        context = self.up.get_context()  # (a prefill samples one row per sequence)
        return torch.zeros(len(context.cu_seqlens_q) - 1 if context.is_prefill else len(hidden), self.vocab)


class NoTokenizer:
    eos_token_id = -1

    @staticmethod
    def decode(token_ids):
        return ""


def measure_upstream(up, path: str, block_size: int, prompt_lens: list[int], steps: int, mode: str = "stub") -> float:
    """Upstream: the same figure as measure(), through upstream's LLMEngine.generate."""
    num_seqs = len(prompt_lens)
    max_model_len, blocks, max_batched = sizes(block_size, prompt_lens, steps)
    config = up.Config(path, max_num_batched_tokens=max_batched, max_num_seqs=num_seqs,
                       max_model_len=max_model_len, enforce_eager=True)
    config.kvcache_block_size = block_size  # (past __post_init__'s "% 256 == 0": see the docstring)
    config.num_kvcache_blocks, config.eos = blocks, NoTokenizer.eos_token_id
    up.Sequence.block_size = block_size      # (what LLMEngine.__init__ does)
    hidden, vocab = config.hf_config.hidden_size, config.hf_config.vocab_size
    lm_head = None
    if mode == "real":
        import torch.distributed as dist
        from safetensors.torch import load_file
        if not dist.is_initialized():  # (its LM head asks for its rank and the world size)
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        lm_head = up.ParallelLMHead(vocab, hidden)
        lm_head.weight.data.copy_(load_file(os.path.join(path, "model.safetensors"))["lm_head.weight"])
    calls = []
    # ModelRunner.__init__ (NCCL, CUDA, weights, KV cache, CUDA graphs) skipped: the fields its run() reads
    runner = object.__new__(up.ModelRunner)
    runner.config, runner.block_size, runner.enforce_eager = config, block_size, True
    runner.world_size, runner.rank, runner.event = 1, 0, []
    runner.model = UpstreamStubModel(up, hidden, vocab, lm_head, calls)
    runner.sampler = (lambda logits, temperatures: logits.argmax(-1)) if mode == "real" else \
        (lambda logits, temperatures: zero_tokens(logits))
    engine = object.__new__(up.LLMEngine)  # (LLMEngine.__init__ would build a ModelRunner and load a tokenizer)
    engine.model_runner, engine.scheduler, engine.tokenizer = runner, up.Scheduler(config), NoTokenizer()
    engine.ps, engine.events = [], []
    engine.generate(make_prompts(prompt_lens, vocab), up.SamplingParams(temperature=1.0, max_tokens=steps, ignore_eos=True),
                    use_tqdm=False)
    return median_gap(calls, num_seqs)


# ---- driver -------------------------------------------------------------------------------------
class Side:
    """One side's measurements: in this interpreter (ours, when nothing is compared), or in a
    worker process of its own (--side), which measures one (mode, block size, workload) per line
    it reads and answers with a line of JSON, so the two sides can take turns figure by figure."""

    def __init__(self, name: str, args, path: str, own_process: bool):
        self.name, self.args, self.path, self.proc = name, args, path, None
        if not own_process:
            self.up = import_upstream(args.upstream) if name == "upstream" else None
            self.threads = torch.get_num_threads()
            return
        argv = [sys.executable, os.path.abspath(__file__), "--side", name, "--model", path, "--clock", args.clock,
                "--quantile", str(args.quantile)]
        if args.threads:
            argv += ["--threads", str(args.threads)]
        if name == "upstream":
            argv += ["--upstream", os.path.abspath(args.upstream)]
        env = dict(os.environ)
        if name == "upstream":
            env.pop("PYTHONPATH", None)  # (it may name this repository, whose nanovllm must not be found)
        self.log = tempfile.TemporaryFile("w+")  # (its stderr: the engine's log lines, a traceback)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env)
        self.threads = self._reply()["threads"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.seek(0)
            raise RuntimeError(f"the {self.name} side failed (exit status {self.proc.returncode}):\n"
                               f"{self.log.read()[-4000:]}")
        return json.loads(line)

    def measure(self, mode: str, block_size: int, prompt_lens: list[int]) -> float:
        if self.proc is not None:
            self.proc.stdin.write(json.dumps([mode, block_size, prompt_lens, self.args.steps]) + "\n")
            self.proc.stdin.flush()
            return self._reply()["us"]
        if self.up is not None:
            return measure_upstream(self.up, self.path, block_size, prompt_lens, self.args.steps, mode)
        return measure(self.path, block_size, prompt_lens, self.args.steps, mode)

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()
            self.log.close()


def serve_side(args):
    """--side: measure what each line of stdin asks ([mode, block size, prompt lengths, steps])."""
    up = import_upstream(args.upstream) if args.side == "upstream" else None
    if up is None:
        import_ours()
    print(json.dumps({"threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        mode, bs, lens, steps = json.loads(line)
        us = measure_upstream(up, args.model, bs, lens, steps, mode) if up is not None else \
            measure(args.model, bs, lens, steps, mode)
        print(json.dumps({"us": us}), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[100, 600], metavar=("MIN", "MAX"),
                   help="the varied workload's prompt lengths are drawn from [MIN, MAX]")
    p.add_argument("--equal-prompt-len", type=int, default=64, help="the equal-length workload's prompt length")
    p.add_argument("--steps", type=int, default=200, help="decode steps per sequence")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 256])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="stub: LM head and sampler stubbed; real: both real over the 512-token vocabulary")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--clock", choices=CLOCKS, default="wall",
                   help="wall: perf_counter; cpu: the process's CPU time (process_time), which leaves out the "
                        "time it waits for a core on a shared machine")
    p.add_argument("--quantile", type=float, default=0.5,
                   help="a run's figure: this quantile of its step intervals (0.5, the median; on a noisy shared "
                        "machine 0.1 leaves out the steps another tenant slowed down)")
    p.add_argument("--upstream", metavar="PATH", help="a checkout of upstream nano-vllm to compare with")
    p.add_argument("--repeats", type=int, default=1, help="figures per side and case (interleaved with --upstream)")
    p.add_argument("--side", choices=("ours", "upstream"), help=argparse.SUPPRESS)  # (a worker: see Side)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global clock, quantile
    clock, quantile = CLOCKS[args.clock], args.quantile
    if not 0 <= quantile < 1:
        p.error(f"--quantile must be in [0, 1), got {quantile}")
    if args.threads and (args.side or not args.upstream):  # (with --upstream the sides set their own)
        torch.set_num_threads(args.threads)
    if args.side:
        return serve_side(args)
    if args.upstream and not os.path.isdir(os.path.join(args.upstream, "nanovllm")):
        p.error(f"--upstream {args.upstream}: no nanovllm package there")

    import_ours()
    from nanovllm.utils.tiny_model import build_model
    names = ("ours", "upstream") if args.upstream else ("ours",)
    cases = [(mode, bs, name, lens) for mode in args.modes for bs in args.block_sizes
             for name, lens in workloads(args).items()]
    results = {side: {(mode, bs, name): [] for mode, bs, name, _ in cases} for side in names}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(tmp, tokenizer=False)
        sides = [Side(name, args, path, own_process=bool(args.upstream)) for name in names]
        try:
            for r in range(args.repeats):
                for i, (mode, bs, name, lens) in enumerate(cases):
                    for side in (sides if (r + i) % 2 == 0 else sides[::-1]):  # (ours first, then upstream first)
                        results[side.name][mode, bs, name].append(side.measure(mode, bs, lens))
        finally:
            for side in sides:
                side.close()
    threads = "/".join(str(t) for t in sorted({side.threads for side in sides}))
    figure = "median" if args.quantile == 0.5 else f"{args.quantile:g}-quantile"
    print(f"{args.num_seqs} sequences, {args.steps} tokens each: {figure} µs between consecutive forward calls "
          f"of full decode steps ({args.clock} clock); torch threads {threads}; {args.repeats} figure(s) per "
          f"side and case" + (", the sides taking turns" if args.upstream else ""))
    columns = ["ours µs"] + (["upstream µs", "ours/upstream", "median"] if args.upstream else [])
    rows = []
    for (mode, bs, name), ours in results["ours"].items():
        values = [[f"{v:5.0f}" for v in ours]]
        if args.upstream:
            theirs = results["upstream"][mode, bs, name]
            ratios = [a / b for a, b in zip(ours, theirs)]
            values += [[f"{v:5.0f}" for v in theirs], [f"{r:5.2f}" for r in ratios],
                       [f"{statistics.median(ratios):5.2f}"]]
        rows.append((f"{mode:4s}  {bs:5d}  {name:26s}", ["  ".join(v) for v in values]))
    widths = [max(len(c), *(len(r[1][i]) for r in rows)) for i, c in enumerate(columns)]
    print(f"{'mode':4s}  {'block':>5s}  {'workload':26s}  " + "  ".join(f"{c:>{w}s}" for c, w in zip(columns, widths)))
    for label, cols in rows:
        print(f"{label}  " + "  ".join(f"{c:>{w}s}" for c, w in zip(cols, widths)))
    return results


if __name__ == "__main__":
    main()
