"""The GPU check's steps (scripts/gpu_check.py runs them; its PLAN gives their order and boxes).

Each step is a function of the run's Context returning (verdict, figure, result): the verdict
PASS, FAIL or SKIP (or TIME, from a pytest step that ran out of its box), the figure one line
for the record's table, the result (JSON-able) for the record's .jsonl. A step that raises is a FAIL
with the exception as its figure. The benchmarks are called in this process (their main(argv));
ctx.note() keeps a step's figures as it goes, so that a step cut by its box still reports them.

With ctx.warm (a warm-up job, gpu_check.py --warm-up STEP[:PART]) a step runs small: bench.py
with WARM_BENCH appended (argparse: the last value wins), micro-benchmarks with --iters 1; its
engine and kernels are the step's own, so Triton compiles what the step will need.
"""
import gc
import importlib
import importlib.util
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The warm-up jobs: a step, or one part of one (STEP:PART), each in its own process, all at once.
WARM_UP = ["headline", "profile", "decode_kernel", "bench_moe", "batch1:plain", "batch1:ngram", "batch1:draft",
           "quant_gemm", "fp8_kv_decode", "quantized:bf16", "quantized:fp8", "quantized:fp8_block", "quantized:awq",
           "quantized:fp8_kv", "multiturn", "families:qwen3.5-0.8b", "families:gemma-3-1b"]
# (a KV cache of two max_model_len=4096 sequences: 512 blocks of 16 tokens, under 1 GB for Qwen3-0.6B,
# or flash-attn's 32 blocks of 256)
WARM_BENCH = ["--min-output-len", "16", "--max-output-len", "16", "--num-kvcache-blocks", "512"]
WARM_BENCH_FLASH_ATTN_BLOCKS = "32"
# The MoE preset's weights are ~61 GB: its step needs an 80 GB GPU, its warm-up (beside 14 other
# jobs) more room than that. (gpt-oss-20b's ~41 GB are not warmed up either: its step compiles.)
MOE_MIN_GPU_BYTES = 80e9
MOE_WARM_UP_MIN_GPU_BYTES = 120e9

# Step 1: prompts of these lengths (1 to 300 tokens: one block to many, a decode graph batch of 6),
# each greedy for CORRECTNESS_TOKENS tokens.
CORRECTNESS_PROMPT_LENS = (1, 7, 33, 80, 150, 300)
CORRECTNESS_TOKENS = 24
# Step 3: a workload whose decode steps dominate (128 sequences, 128-256 new tokens each), once with
# overlap scheduling and once synchronous.
PROFILE_WORKLOAD = ["--num-seqs", "128", "--min-input-len", "128", "--max-input-len", "512", "--min-output-len", "128",
                    "--max-output-len", "256", "--json"]
MAX_KERNELS_PER_LAYER = 15
# Step 4: the redraw protocol (layers/top_k_top_p.py: top-p from the 1024 most likely tokens, rows
# it cannot vouch for drawn again) is worth its ~45 lines only if a plain full sort costs more than
# this times temperature-only sampling (issue 30).
REDRAW_WORTH_IT = 1.5
BATCH1 = ["--num-seqs", "1", "--min-input-len", "512", "--max-input-len", "512", "--min-output-len", "256",
          "--max-output-len", "256", "--repetitive", "--temperature", "0", "--json"]
SPECULATION = {"plain": [],
               "ngram": ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'],
               "draft": ["--min-acceptance-rate", "0.9", "--speculative-config",
                         '{"method": "draft_model", "model": "dummy:qwen3-0.6b", "num_speculative_tokens": 4}']}
# The new families' step, a short workload each: Qwen3.5 0.8B's shape (Gated DeltaNet + full attention,
# features/state_cache.py; 16 rows and 16 snapshots of ~19 MiB of recurrent state each), Gemma 3 1B's
# (the local layers' own pool of blocks, features/window_blocks.py) and gpt-oss-20b's (sinks and windows
# in the Triton kernels, its experts ~38 GB of bf16: the torch expert loop), and Qwen2.5-VL 3B's with images.
FAMILY_WORKLOAD = ["--num-seqs", "16", "--max-num-seqs", "16", "--max-input-len", "256", "--max-output-len", "64",
                   "--json"]
FAMILIES = {"qwen3.5-0.8b": ["--dummy", "qwen3.5-0.8b"] + FAMILY_WORKLOAD,
            "gemma-3-1b": ["--dummy", "gemma-3-1b", "--attention-backend", "triton"] + FAMILY_WORKLOAD,
            "gpt-oss-20b": ["--dummy", "gpt-oss-20b", "--attention-backend", "triton"] + FAMILY_WORKLOAD,
            # Qwen2.5-VL 3B's shape with 8 of the 16 requests carrying a 448 x 448 image (256 tokens each):
            # its tower on the GPU, M-RoPE, decode steps eager (features/multimodal.py); HF's generate beside it
            "qwen2.5-vl-3b": ["--dummy", "qwen2.5-vl-3b", "--images", "8", "--compare", "hf",
                              "--hf-time-limit", "20"] + FAMILY_WORKLOAD}
QUANT = ["--num-seqs", "64", "--max-input-len", "512", "--max-output-len", "128", "--json"]
# Each quantized run's probe (bench.py: the logprobs of a fixed prompt set; the dummy checkpoints
# are the bf16 random model quantized) against the bf16 run's: bounds of the relative error, about
# twice what qwen3-0.6b's shape gives on CPU in float32 with the GPU kernels' activation quantization
# emulated, at the worst probe step (fp8 online 0.20, fp8 block 0.19, AWQ int4 0.38, fp8 KV cache
# 0.076; bf16's rounding adds to these on the GPU). A broken kernel: about sqrt(2), or NaN.
QUANTIZED = {"bf16": [], "fp8": ["--quantization", "fp8"], "fp8_block": ["--dummy", "qwen3-0.6b-fp8"],
             "awq": ["--dummy", "qwen3-0.6b-awq"], "fp8_kv": ["--kv-cache-dtype", "fp8"],
             "batch_invariant": ["--batch-invariant"]}  # (bf16 in fixed tilings: its cost is the figure)
PROBE_BOUNDS = {"fp8": 0.4, "fp8_block": 0.4, "awq": 0.8, "fp8_kv": 0.2, "batch_invariant": 0.1}
# The pytest steps: each test's own limit; the failures rerun at most.
TEST_TIMEOUT_S = 30
MAX_RERUNS = 3
KERNEL_TEST_FILES = ["tests/test_triton_backend.py", "tests/test_moe_kernel.py", "tests/test_quant_kernels.py",
                     "tests/test_fused_kernels.py"]
KERNEL_TEST_WORKERS = "8"   # (pytest-xdist, where installed: 16 cores, 2 threads a worker)
KILL_AFTER_S = 10           # a pytest step's SIGINT before its box: time for pytest's summary


class Context:
    """What a run's steps share: where to write, whether this is a warm-up (and of which part), the
    running step's box, the failed tests the rerun takes, and the running step's figures (note())."""

    def __init__(self, out: str | None, warm: bool = False, only: str | None = None):
        self.out = out or tempfile.mkdtemp(prefix="gpu_check_")
        self.warm, self.only = warm, only
        self.limit_s = None        # the running step's box (gpu_check.run_steps sets it)
        self.failed_tests: list[str] = []
        self.notes: list[str] = []

    def note(self, text: str):
        print(f"  -> {text}", flush=True)
        self.notes.append(text)

    def after_step(self):
        self.notes = []
        free_gpu_memory()

    def wants(self, part: str) -> bool:
        """Whether a step's part runs: all of them, or a warm-up job's one."""
        return self.only is None or self.only == part


def free_gpu_memory():
    """What an engine that was shut down (or a Hugging Face model) left: the next engine of this
    process sizes its KV cache from the free memory."""
    gc.collect()
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def script(name: str):
    """A benchmark of scripts/ (or bench.py at the top), imported as a module."""
    for folder in (os.path.join(ROOT, "scripts"), ROOT):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    return importlib.import_module(name)


def bench(ctx: Context, argv: list[str], probe: str | None = None) -> dict:
    """bench.py's main(argv); warm: small, no Hugging Face. probe: "save" the bf16 reference, or the
    scheme whose bound the run's probe is checked against."""
    argv = list(argv)
    if ctx.warm:
        if "--compare" in argv:
            del argv[argv.index("--compare"):argv.index("--compare") + 2]
        blocks = WARM_BENCH_FLASH_ATTN_BLOCKS if importlib.util.find_spec("flash_attn") else WARM_BENCH[-1]
        argv += WARM_BENCH[:-1] + [blocks] + (["--probe-save", os.devnull] if probe else [])
    elif probe == "save":
        argv += ["--probe-save", probe_reference(ctx)]
    elif probe:
        argv += ["--probe-check", probe_reference(ctx), "--probe-max-error", str(PROBE_BOUNDS[probe])]
    free_gpu_memory()
    return script("bench").main(argv)


def micro(ctx: Context, name: str, argv: list[str]):
    free_gpu_memory()
    return script(name).main(argv + (["--iters", "1"] if ctx.warm else []))


def probe_reference(ctx: Context) -> str:
    return os.path.join(ctx.out, "probe_bf16.json")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def tok_s(result: dict) -> str:
    return f"{result['output_tok_per_s']:,.0f} tok/s"


def share(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{fraction:.1%}"  # (None: no CUDA events, on CPU)


def gpu_memory() -> int:
    import torch
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0


# ---- 1-4: the figures that matter most -----------------------------------------------------------------
def correctness(ctx: Context):
    """A tiny random Qwen3 on the GPU in float32: our greedy tokens against Hugging Face's (eager
    decode), then CUDA-graph decode against eager, token for token. (On CPU, as its test runs it,
    the same without graphs.)"""
    import torch
    from transformers import AutoModelForCausalLM

    from nanovllm import LLM, SamplingParams
    from nanovllm.utils.tiny_model import build_model
    path = build_model(tempfile.mkdtemp(prefix="gpu_check_tiny_"), tokenizer=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in CORRECTNESS_PROMPT_LENS]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    with torch.inference_mode():
        ids = [torch.tensor([p], device=device) for p in prompts]
        refs = [hf.generate(i, attention_mask=torch.ones_like(i), max_new_tokens=CORRECTNESS_TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, i.shape[1]:].tolist() for i in ids]
    del hf
    params = SamplingParams(temperature=0, max_tokens=CORRECTNESS_TOKENS, ignore_eos=True)
    outputs = {}
    for eager in (True, False):  # (a fixed KV cache: the warm-up's jobs share the GPU meanwhile)
        llm = LLM(path, dtype="float32", enforce_eager=eager, max_model_len=512, num_kvcache_blocks=256,
                  max_num_seqs=len(prompts))
        backend = llm.config.attention_backend
        outputs[eager] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    equal_hf = [a == b for a, b in zip(outputs[True], refs)]
    graph_equal = [a == b for a, b in zip(outputs[False], outputs[True])]
    figure = (f"fp32 greedy = HF on {sum(equal_hf)}/{len(prompts)} prompts x {CORRECTNESS_TOKENS} tokens; "
              f"CUDA-graph decode = eager on {sum(graph_equal)}/{len(prompts)} ({backend})")
    for name, flags, theirs in (("HF", equal_hf, refs), ("eager", graph_equal, outputs[True])):
        if not all(flags):
            i = flags.index(False)
            ours = outputs[True] if name == "HF" else outputs[False]
            at = next(j for j, (a, b) in enumerate(zip(ours[i], theirs[i])) if a != b)
            figure += f"; vs {name}: prompt {i} ({len(prompts[i])} tokens) first differs at token {at}"
    return verdict(all(equal_hf) and all(graph_equal)), figure, {"hf": refs, "eager": outputs[True],
                                                                   "graphs": outputs[False]}


def headline(ctx: Context):
    """bench.py's standard workload (nano-vllm's: 256 sequences, U(100, 1024) in and out, the
    Qwen3-0.6B shape, random weights) against Hugging Face in the same run."""
    r = bench(ctx, ["--compare", "hf", "--hf-time-limit", "15", "--json"])
    if ctx.warm:
        return "PASS", "warm", None
    b = r["baseline"]
    figure = (f"{tok_s(r)} ({r['attention_backend']}, {r['output_tokens']:,} tokens in {r['elapsed_s']:.1f} s) vs "
              f"HF {tok_s(b)} ({b['method']}) = {r['ratio']:.2f}x; TTFT p50 {r['ttft_s']['p50'] * 1e3:.0f} ms, "
              f"TPOT p50 {r['tpot_s']['p50'] * 1e3:.1f} ms; GPU idle in decode {share(r['gpu_idle_between_decode_steps'])}")
    return verdict(not r["failed_checks"]), figure + "".join(f"; {f}" for f in r["failed_checks"]), r


def profile(ctx: Context):
    """Kernels a decoder layer and a decode step launch (the profiler, scripts/count_kernels.py),
    and the GPU's idle share between decode steps with overlap scheduling and without."""
    results, ok = {}, True
    if ctx.wants("kernels"):
        k = results["kernels"] = script("count_kernels").main(["--ops", "--max-per-layer", str(MAX_KERNELS_PER_LAYER)])
        ok &= not k["over_limit"]
        ctx.note(f"{max(k['per_layer'])} kernels a layer (at most {MAX_KERNELS_PER_LAYER}), {k['outside']} outside "
                 f"the layers, {k['total']} a decode step")
    for mode, extra in (("overlap", []), ("synchronous", ["--no-async-scheduling"])):
        r = results[mode] = bench(ctx, PROFILE_WORKLOAD + extra)
        if not ctx.warm:
            ok &= not r["failed_checks"]
            ctx.note(f"{mode}: GPU idle {share(r['gpu_idle_between_decode_steps'])} between decode steps, {tok_s(r)}")
    return verdict(ok), "; ".join(ctx.notes), results


def top_p(ctx: Context):
    """The sampler's step at batch 256 over a 151,936-token vocabulary: a plain full-sort top-p
    against temperature alone (decides the redraw protocol), and ours."""
    r = micro(ctx, "bench_sampler", ["--device", "cuda"])
    ratio = r["plain: sort-based top_p"] / r["plain: temperature"]
    keep = "keep the redraw protocol" if ratio > REDRAW_WORTH_IT else "a plain sort will do: drop the redraw protocol"
    figure = (f"plain sort top-p {r['plain: sort-based top_p'] * 1e3:.2f} ms vs temperature "
              f"{r['plain: temperature'] * 1e3:.2f} ms = {ratio:.2f}x ({keep}, threshold {REDRAW_WORTH_IT}x); ours: "
              f"top-p {r['temperature+top_p'] * 1e3:.2f} ms, temperature {r['temperature'] * 1e3:.2f} ms")
    return "PASS", figure, r


# ---- the tests ------------------------------------------------------------------------------------------
def pytest_command(*args: str) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "--durations=10", *args]
    if importlib.util.find_spec("pytest_timeout"):
        return cmd + ["--timeout", str(TEST_TIMEOUT_S)]
    return cmd + ["-o", f"faulthandler_timeout={TEST_TIMEOUT_S}"]  # (tracebacks at the limit; the box ends it)


def run_pytest(ctx: Context, cmd: list[str], env: dict | None = None, rerun: bool = False) -> tuple[str, str, str]:
    """(verdict, figure, output) of a pytest run, SIGINTed KILL_AFTER_S before the step's box so
    that its summary still prints; its output streamed to this step's log as it comes. Its real
    failures (not pytest-timeout's) are noted for the rerun, unless it is the rerun. (COLUMNS:
    pytest cuts its summary lines to the terminal's width, a time-out's reason with them.)"""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "400", **(env or {})}, start_new_session=True)
    signal.setitimer(signal.ITIMER_REAL, 0)  # (this step ends pytest itself, before its box)
    cut = threading.Event()

    def stop(sig):  # (its whole process group: xdist's workers too)
        cut.set()
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    budget = max((ctx.limit_s or 600) - KILL_AFTER_S - 1, 1)
    timers = [threading.Timer(budget, stop, (signal.SIGINT,)), threading.Timer(budget + KILL_AFTER_S, stop, (signal.SIGKILL,))]
    for t in timers:
        t.start()
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    proc.wait()
    for t in timers:
        t.cancel()
    output = "".join(lines)
    counts = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", output.splitlines()[-1] if lines else "")
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+::\S+)", output, re.M)
    figure = ", ".join(f"{n} {what}" for n, what in counts) or f"no summary (exit {proc.returncode})"
    if failed:
        figure += "; failed: " + ", ".join(t.split("/")[-1] for t in failed[:4]) + (" ..." if len(failed) > 4 else "")
    real = [t for t in failed if not re.search(rf"^(?:FAILED|ERROR) {re.escape(t)} - Failed: Timeout", output, re.M)]
    if not rerun:
        ctx.failed_tests += real[:MAX_RERUNS - len(ctx.failed_tests)]
    if cut.is_set():
        return "TIME", f"cut at its box: {figure}", output
    return verdict(proc.returncode in (0, 5)), figure, output  # (5: no test collected)


def gpu_tests(ctx: Context):
    """The gpu-marked tests, of the files that have some (a file whose optional package the image
    lacks must not cost the step a collection error)."""
    files = [os.path.join("tests", f) for f in sorted(os.listdir(os.path.join(ROOT, "tests")))
             if f.startswith("test_") and f.endswith(".py") and "mark.gpu" in open(os.path.join(ROOT, "tests", f)).read()]
    v, figure, _ = run_pytest(ctx, pytest_command("-m", "gpu", *files))
    return v, figure, None


def kernel_tests(ctx: Context):
    workers = ["-n", KERNEL_TEST_WORKERS] if importlib.util.find_spec("xdist") else []
    v, figure, _ = run_pytest(ctx, pytest_command(*workers, "-m", "not gpu", *KERNEL_TEST_FILES))
    return v, figure, None


def rerun_failures(ctx: Context):
    if not ctx.failed_tests:
        return "PASS", "no test failed: nothing to rerun", None
    v, figure, _ = run_pytest(ctx, pytest_command(*ctx.failed_tests), env={"CUDA_LAUNCH_BLOCKING": "1"}, rerun=True)
    return v, figure, None


# ---- the rest -------------------------------------------------------------------------------------------
def decode_kernel(ctx: Context):
    """Split-KV decode at batch 256 x 1024 (and its CUDA graph), then a batch-1 verify step of 5
    queries over 4,096 tokens: the decode kernel against the prefill kernel."""
    d = micro(ctx, "bench_decode_attention", ["--batch", "256", "--context", "1024", "--cuda-graph"])
    ctx.note(f"decode {d['batch']} x {d['context']}: {d['time_per_call_s'] * 1e6:.0f} us, {d['bandwidth_gbs']:.0f} GB/s "
             f"({d['fraction_of_copy']:.0%} of a copy), graph = eager: {d.get('graph_matches_eager')}")
    v = micro(ctx, "bench_decode_attention", ["--batch", "1", "--context", "4096", "--queries", "5",
                                              "--vs-prefill-kernel", "--cuda-graph", "--iters", "20"])
    ctx.note(f"verify {v['batch']} x 5 queries x {v['context']}: {v['time_per_call_s'] * 1e6:.0f} us, "
             f"{v['speedup_vs_prefill_kernel']:.2f}x the prefill kernel")
    ok = all(r["check_ok"] and r.get("graph_matches_eager", True) and r.get("prefill_kernel_check_ok", True)
             for r in (d, v))
    return verdict(ok), "; ".join(ctx.notes), {"decode": d, "verify": v}


def bench_moe(ctx: Context):
    if gpu_memory() < (MOE_WARM_UP_MIN_GPU_BYTES if ctx.warm else MOE_MIN_GPU_BYTES):
        return "SKIP", f"needs a GPU of {MOE_MIN_GPU_BYTES / 1e9:.0f} GB (~61 GB of weights)", None
    r = bench(ctx, ["--dummy", "qwen3-30b-a3b", "--num-seqs", "64", "--max-input-len", "512", "--max-output-len", "128",
                    "--json"])
    if ctx.warm:
        return "PASS", "warm", None
    return verdict(not r["failed_checks"]), f"Qwen3-30B-A3B shape, 64 sequences: {tok_s(r)}", r


def families(ctx: Context):
    """bench.py on the new families' shapes (FAMILIES): their layers and kernels on the GPU."""
    results, ok = {}, True
    for name, args in FAMILIES.items():
        if not ctx.wants(name):
            continue
        r = results[name] = bench(ctx, args)
        if ctx.warm:
            continue
        ok &= not r["failed_checks"]
        ratio = f", {r['ratio']:.2f}x HF's generate" if "ratio" in r else ""
        ctx.note(f"{name} shape, 16 sequences: {tok_s(r)}{ratio}")
    if ctx.warm:
        return "PASS", "warm", None
    return verdict(ok), "; ".join(ctx.notes), results


def batch1(ctx: Context):
    """Batch-1 greedy decode of a repetitive prompt: plain, n-gram speculation, and a draft model
    equal to the target (every draft accepted: the mechanism's bound)."""
    results, ok = {}, True
    for name, extra in SPECULATION.items():
        if not ctx.wants(name):
            continue
        r = results[name] = bench(ctx, BATCH1 + extra)
        if ctx.warm:
            continue
        ok &= not r["failed_checks"]
        speedup = f", {r['output_tok_per_s'] / results['plain']['output_tok_per_s']:.2f}x plain" if "plain" in results else ""
        accepted = f" ({r['spec_acceptance_rate']:.0%} of drafts accepted{speedup})" if extra else ""
        ctx.note(f"{name} {tok_s(r)}{accepted}")
    return verdict(ok), "; ".join(ctx.notes), results


def quant_gemm(ctx: Context):
    rows = micro(ctx, "bench_quant_gemm", [])
    failed = [f"{r.get('method')} at {r.get('num_tokens')}" for r in rows if not r["check_ok"]]
    return verdict(not failed), f"{len(rows) - len(failed)}/{len(rows)} GEMMs equal their reference" + (
        f"; wrong: {', '.join(failed)}" if failed else ""), rows


def fp8_kv_decode(ctx: Context):
    d = micro(ctx, "bench_decode_attention", ["--batch", "256", "--context", "1024", "--kv-cache-dtype", "fp8"])
    return verdict(d["check_ok"]), (f"fp8 KV decode {d['batch']} x {d['context']}: {d['time_per_call_s'] * 1e6:.0f} us, "
                                    f"{d['bandwidth_gbs']:.0f} GB/s ({d['fraction_of_copy']:.0%} of a copy)"), d


def quantized(ctx: Context):
    """One short workload in bf16 (the probe's reference), then each quantized scheme and bf16 in
    batch-invariant mode (its cost: the ratio to bf16's tok/s), each probe checked against bf16's
    within PROBE_BOUNDS."""
    results, ok = {}, True
    for name, extra in QUANTIZED.items():
        if not ctx.wants(name):
            continue
        r = results[name] = bench(ctx, QUANT + extra, probe="save" if name == "bf16" else name)
        if ctx.warm:
            continue
        ok &= not r["failed_checks"]
        error = f", probe error {max(r['probe_error'].values()):.3f} (bound {PROBE_BOUNDS[name]})" if name != "bf16" else ""
        cost = (f" = {r['output_tok_per_s'] / results['bf16']['output_tok_per_s']:.2f}x bf16's"
                if name == "batch_invariant" and "bf16" in results else "")
        ctx.note(f"{name} {tok_s(r)}{cost}{error}")
    return verdict(ok), "; ".join(ctx.notes), results


def multiturn(ctx: Context):
    argv = ["--dummy", "qwen3-0.6b", "--device", "cuda", "--conversations", "8", "--turns", "4", "--system-len", "1024",
            "--question-len", "128", "--answer-len", "32"]
    r = script("bench_multiturn").main(argv + (["--conversations", "2", "--turns", "2"] if ctx.warm else []))
    last = [r[mode]["ttft_ms_per_turn"][-1] for mode in ("off", "on")]
    return verdict(r["computed_ratio"] > 1), (f"prefill tokens computed, host tier off / on: {r['computed_ratio']:.2f}x; "
                                              f"last turn's TTFT {last[0]:.1f} -> {last[1]:.1f} ms"), r


def pipeline(ctx: Context):
    import torch
    if torch.cuda.device_count() < 2:
        return "SKIP", "one GPU: 2 pipeline stages need 2 (NCCL: one rank a GPU)", None
    r = bench(ctx, ["--pipeline-parallel-size", "2", "--max-input-len", "256", "--min-output-len", "64",
                    "--max-output-len", "64", "--json"])
    busy = ", ".join(f"stage {i} {b:.0%}" for i, b in enumerate(r["pipeline_stage_busy"]))
    return verdict(not r["failed_checks"]), f"{tok_s(r)}; busy in decode steps: {busy}", r
