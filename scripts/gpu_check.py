"""The GPU check: what the lent GPU machine runs in one try, most valuable first, each step's
verdict and figures written to a Markdown record the moment the step ends.

    bash scripts/gpu_check.sh              # the whole plan: at most MAX_PLAN_S (480 s) of boxes
    bash scripts/gpu_check.sh --quick      # steps 1-3 alone: at most MAX_QUICK_S (240 s)
    bash scripts/gpu_check.sh --plan       # the plan (and --quick --plan); exit 1 past its limit
    GPU_CHECK_DRY=1 bash scripts/gpu_check.sh   # every GPU step skipped: the plumbing, on CPU

Why it is built so. The first try (an H200, 2026-12-04) spent most of its boxes starting Python
(~9 s of imports a process there) and left nothing in the repository. So:
- Steps go in order of value (PLAN): 1. a tiny model on the GPU equals Hugging Face greedy and
  CUDA-graph decode equals eager; 2. bench.py's standard workload against Hugging Face: the
  headline figure; 3. kernels per layer and step, and the GPU's idle share of decode steps with
  overlap on and off; 4. the sampler's top-p against temperature alone; then the rest.
- The steps of a group run one after another in one process (`--run-group`), engines built and
  shut down in turn, so imports and Triton's in-memory kernels are paid once a group. The pytest
  steps run pytest's own processes.
- Each step has a time box: SIGALRM in its process ends it (StepTimeout). A group's process gets
  its steps' boxes plus GROUP_START_S; past that it is sent SIGINT, then SIGKILL, and this driver
  writes the rows its steps did not (TIME for the one running, SKIP for those not reached).
- The record, RECORD_DIR/<date>-<time>-<gpu>.md: the GPU, driver, versions, commit and mode at the top,
  then a table row a step (step, verdict, figure, seconds) appended and fsynced as the step ends,
  so a run cut off anywhere keeps every finished step; at the end the table is printed (at most
  MAX_SUMMARY_LINES lines). Every step's full result goes to the .jsonl of the same name. On the
  device machine RECORD_DIR is $OUT (what comes back); copy the record into docs/gpu-runs/ and
  commit it before anything else.
- Warm-up (the full plan only): the later steps' engines and kernels run small, all at once, in
  processes of their own beside step 1 (whose figure is no timing), so that Triton's compiles fill
  its cache in parallel; the timed steps wait for it (WARM_UP_BOX_S at most).
Verdicts: PASS, FAIL (a check failed or the step raised), TIME (its box ran out), SKIP (not run
here: no GPU of that kind, a dry run, or no time left). Exit status 0 only if none FAILed or TIMEd.
"""
import argparse
import dataclasses
import datetime
import importlib
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_PLAN_S = 480
MAX_QUICK_S = 240
GROUP_START_S = 15      # a group process's imports before its first step (~9 s measured on the H200)
KILL_AFTER_S = 10       # after a group's SIGINT: enough for pytest's summary, not for a hang
MIN_STEP_S = 5          # less than this left of the plan: skip a step rather than start it to be killed
MAX_SUMMARY_LINES = 60
FIGURE_CHARS = 220      # a figure's cell, cut to this: the table must stay readable


@dataclass(frozen=True)
class Step:
    name: str        # its function in scripts/gpu_steps.py
    group: str       # the process that runs it ("warm": beside the first group, in processes of its own)
    box_s: int       # its time box. Estimates: no run has yet finished a step. Set them from a record's seconds.
    quick: bool      # part of --quick
    title: str
    beside_warm_up: bool = False  # runs while the warm-up's jobs do (its figure is no timing); the others wait


PLAN = [
    Step("warm_up", "warm", 35, False, "warm-up: the later steps' engines small, all at once (Triton compiles)"),
    Step("correctness", "first", 30, True, "tiny Qwen3 on the GPU, fp32: greedy vs HF; CUDA-graph decode vs eager",
         beside_warm_up=True),
    Step("headline", "first", 70, True, "bench.py standard workload (256 seqs, Qwen3-0.6B shape) vs HF"),
    Step("profile", "first", 40, True, "kernels per layer and step; GPU idle in decode steps, overlap on/off"),
    Step("top_p", "first", 12, False, "sampler: plain sort-based top-p vs temperature alone (redraw protocol?)"),
    Step("gpu_tests", "tests", 50, False, "gpu-marked tests"),
    Step("kernel_tests", "tests", 30, False, "Triton kernel tests on the GPU"),
    Step("rerun_failures", "tests", 10, False, "failed tests again, CUDA_LAUNCH_BLOCKING=1"),
    Step("decode_kernel", "more", 12, False, "decode kernel micro-benchmark; a verify step's, vs the prefill kernel"),
    Step("bench_moe", "more", 20, False, "bench.py qwen3-30b-a3b (MoE, CUDA graphs; 80 GB GPUs)"),
    Step("batch1", "more", 22, False, "batch-1 greedy decode: plain, n-gram (k=4), draft model = target (k=4)"),
    Step("quant_gemm", "more", 8, False, "quantized GEMM micro-benchmark: planned tiles vs fixed"),
    Step("fp8_kv_decode", "more", 6, False, "decode kernel micro-benchmark, fp8 KV cache"),
    Step("quantized", "more", 28, False, "bench.py short workload: bf16, fp8, fp8 block, AWQ, fp8 KV, batch-invariant; "
                                         "probe vs bf16"),
    Step("multiturn", "more", 15, False, "bench_multiturn.py qwen3-0.6b, host tier off and on"),
    Step("families", "more", 46, False, "bench.py qwen3.5-0.8b, gemma-3-1b, gpt-oss-20b (new layer kinds), "
                                        "qwen2.5-vl-3b (8 images, vs HF), 16 seqs"),
    # (1 s: a lent machine has one GPU, where it skips)
    Step("pipeline", "more", 1, False, "bench.py over 2 pipeline stages: each stage's busy share (2 GPUs)"),
]
GROUPS = ["first", "tests", "more"]  # (in this order; "warm" runs beside "first")


class StepTimeout(Exception):
    """Raised in a step's process when its box runs out (SIGALRM)."""


def plan_of(quick: bool) -> list[Step]:
    return [s for s in PLAN if s.quick or not quick]


def plan_seconds(quick: bool) -> int:
    """The plan's wall time at most: its steps' boxes and each group process's start."""
    steps = plan_of(quick)
    return sum(s.box_s for s in steps) + GROUP_START_S * len({s.group for s in steps} & set(GROUPS))


def print_plan(quick: bool) -> bool:
    steps, limit = plan_of(quick), MAX_QUICK_S if quick else MAX_PLAN_S
    for i, s in enumerate(steps, 1):
        print(f"{i:2d}. {s.box_s:4d} s  {s.group:6s} {s.title}")
    groups = len({s.group for s in steps} & set(GROUPS))
    print(f"    {GROUP_START_S * groups:4d} s  the start of {groups} group processes ({GROUP_START_S} s each)")
    print(f"    {plan_seconds(quick):4d} s  in all (at most {limit})")
    return plan_seconds(quick) <= limit


# ---- the record ---------------------------------------------------------------------------------------
class Record:
    """The Markdown record and its JSON-lines twin: rows appended and fsynced one at a time."""

    def __init__(self, path: str):
        self.path, self.jsonl = path, path.removesuffix(".md") + ".jsonl"

    def _append(self, path: str, text: str):
        with open(path, "a") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def header(self, lines: list[str]):
        self._append(self.path, "\n".join(lines) + "\n\n| # | step | verdict | figure | s |\n|---|---|---|---|---|\n")

    def row(self, number: int, step: Step, verdict: str, figure: str, seconds: float, result=None):
        figure = " ".join(str(figure).split())[:FIGURE_CHARS].replace("|", "\\|")
        self._append(self.path, f"| {number} | {step.name} | {verdict} | {figure} | {seconds:.0f} |\n")
        self._append(self.jsonl, json.dumps({"event": "end", "number": number, "step": step.name, "verdict": verdict,
                                             "figure": figure,
                                             "seconds": round(seconds, 1), "result": result}, default=str) + "\n")

    def started(self, number: int, step: Step):
        self._append(self.jsonl, json.dumps({"event": "start", "number": number, "step": step.name,
                                             "time": time.time()}) + "\n")

    def events(self) -> list[dict]:
        if not os.path.exists(self.jsonl):
            return []
        with open(self.jsonl) as f:
            return [json.loads(line) for line in f if line.strip()]

    def table(self) -> list[str]:
        with open(self.path) as f:
            return [line.rstrip("\n") for line in f if line.startswith("|")]


def gpu_facts() -> tuple[str, str]:
    """(the GPU's name, "name, memory, driver") from nvidia-smi, which needs no Python import."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    if not out:
        return "no-gpu", "no GPU (nvidia-smi found none)"
    return out[0].split(",")[0].strip(), f"{len(out)} x {out[0]}"


def versions() -> str:
    """Package versions from their metadata: no import (torch's alone costs seconds there)."""
    found = []
    for name in ("torch", "triton", "flash-attn", "transformers", "pytest-timeout", "pytest-xdist"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} missing")
    return f"python {sys.version.split()[0]}, " + ", ".join(found)


def commit() -> str:
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown (no git here: set GPU_CHECK_COMMIT)"


def record_path(gpu: str) -> str:
    folder = os.environ.get("GPU_CHECK_RECORD_DIR") or os.environ.get("OUT") or os.path.join(ROOT, "docs", "gpu-runs")
    os.makedirs(folder, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M")
    path, n = os.path.join(folder, f"{stamp}-{slug}.md"), 1
    while os.path.exists(path):  # (a second run in the same minute)
        n += 1
        path = os.path.join(folder, f"{stamp}-{slug}-{n}.md")
    return path


# ---- a group's process: its steps in turn --------------------------------------------------------------
def _alarm(signum, frame):
    raise StepTimeout()


def wait_for(path: str, until: float):
    while not os.path.exists(path) and time.time() < until:
        time.sleep(0.2)


def run_steps(steps: list[tuple[int, Step]], funcs, record: Record, until: float, ctx, warm_up_done: str,
              min_step_s: float = MIN_STEP_S) -> None:
    """Each step in turn, in this process, boxed by SIGALRM at min(its box, what is left until
    `until`); its row written as it ends, whatever happened (a raise is a FAIL, never the end).
    A step waits for the warm-up to be done (warm_up_done exists) unless it runs beside it."""
    signal.signal(signal.SIGALRM, _alarm)
    for number, step in steps:
        left = until - time.time()
        if left < min_step_s:
            record.row(number, step, "SKIP", f"out of time ({max(left, 0):.0f} s left of the plan)", 0)
            continue
        if not step.beside_warm_up:
            wait_for(warm_up_done, until)
        limit = min(step.box_s, until - time.time())
        print(f"=== {number}. {step.title} (box {limit:.0f} s)", flush=True)
        record.started(number, step)
        start, result = time.time(), None
        try:
            signal.setitimer(signal.ITIMER_REAL, max(limit, 0.01))
            ctx.limit_s = limit
            verdict, figure, result = funcs[step.name](ctx)
        except StepTimeout:
            notes = getattr(ctx, "notes", [])  # (what the step had measured when its box ran out)
            verdict, figure = "TIME", f"its box of {limit:.0f} s ran out" + (f"; so far: {'; '.join(notes)}" if notes else "")
        except Exception as e:  # noqa: BLE001 (a step's failure is its row; the next step runs)
            traceback.print_exc()
            verdict, figure = "FAIL", f"{type(e).__name__}: {e}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        took = time.time() - start
        print(f"=== {number}. {step.name}: {verdict} in {took:.0f} s: {figure}", flush=True)
        record.row(number, step, verdict, figure, took, result)
        ctx.after_step()


class DryContext:
    """A dry run's context: nothing to clean up."""
    def after_step(self):
        pass


def dry_funcs(steps, module):
    """A dry run's steps: each SKIPped, once the steps module is found to have its function."""
    def skip(ctx):
        return "SKIP", "dry run (GPU_CHECK_DRY=1): not run", None

    def missing(name):
        return lambda ctx: ("FAIL", f"{module.__name__} has no function {name}", None)
    return {s.name: skip if hasattr(module, s.name) else missing(s.name) for _, s in steps}


def group_main(args):
    """A group's process: the steps the driver handed it (--steps, JSON), in turn."""
    record = Record(args.record)
    steps = [(number, Step(**fields)) for number, fields in json.loads(args.steps)]
    module = importlib.import_module(args.steps_module)  # (light: the steps import torch when they run)
    if args.dry:
        run_steps(steps, dry_funcs(steps, module), record, args.until, DryContext(), args.warm_up_done, args.min_step_s)
        return
    run_steps(steps, {s.name: getattr(module, s.name) for _, s in steps}, record, args.until,
              module.Context(out=os.path.dirname(args.record)), args.warm_up_done, args.min_step_s)


# ---- the driver ---------------------------------------------------------------------------------------
def run_group(group: str, args, record: Record, until: float, warm_up_done: str):
    """The group's steps in a process of their own, stopped when what the plan has left, less the
    later groups' boxes and starts, runs out (so an earlier group's unused time, or the warm-up's
    beside the first, passes on); then the rows its process did not write."""
    numbered = [(i, s) for i, s in enumerate(plan_of(args.quick), 1) if s.group == group]
    if not numbered:
        return
    later = [s for s in plan_of(args.quick) if s.group in GROUPS[GROUPS.index(group) + 1:]]
    reserve = sum(s.box_s for s in later) + GROUP_START_S * len({s.group for s in later}) + KILL_AFTER_S
    budget = until - time.time() - reserve  # (less a stop's grace too: it comes out of this group's time)
    steps = json.dumps([(number, dataclasses.asdict(step)) for number, step in numbered])
    cmd = [sys.executable, os.path.abspath(__file__), "--run-group", group, "--steps", steps, "--record", record.path,
           "--until", str(until), "--steps-module", args.steps_module, "--warm-up-done", warm_up_done,
           "--min-step-s", str(MIN_STEP_S)]
    cmd += ["--quick"] * args.quick + ["--dry"] * args.dry
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)  # (its own process group: see stop)
    try:
        proc.wait(timeout=max(budget, 1))
        how = f"its process exited with status {proc.returncode}"
    except subprocess.TimeoutExpired:
        stop(proc, signal.SIGINT)
        try:
            proc.wait(timeout=KILL_AFTER_S)
        except subprocess.TimeoutExpired:
            stop(proc, signal.SIGKILL)
            proc.wait()
        how = f"its group's process was stopped at {budget:.0f} s"
    except BaseException:  # (Ctrl-C, or the driver itself stopped: leave no process behind)
        stop(proc, signal.SIGKILL)
        raise
    fill_missing_rows(numbered, record, how)


def stop(proc: subprocess.Popen, sig: int):
    """Signal a child's whole process group (pytest's workers, a step's engine ranks with it)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def fill_missing_rows(numbered, record: Record, how: str):
    """Rows for the steps a group's process did not finish: the one it had started (TIME if it was
    stopped, else FAIL), and SKIP for those it never reached."""
    events = record.events()
    ended = {e["number"] for e in events if e["event"] == "end"}
    started = {e["number"]: e["time"] for e in events if e["event"] == "start"}
    for number, step in numbered:
        if number in ended:
            continue
        if number in started:
            verdict = "TIME" if "stopped" in how else "FAIL"
            record.row(number, step, verdict, how, time.time() - started[number])
        else:
            record.row(number, step, "SKIP", f"not reached: {how}", 0)


def warm_up(args, record: Record, done_path: str):
    """Start every warm-up job (the steps module's WARM_UP: each a later step run small, in its own process)
    and, on a thread, wait for them within the box; then the row, and done_path for the timed steps."""
    number, step = next((i, s) for i, s in enumerate(plan_of(args.quick), 1) if s.name == "warm_up")
    if args.dry:
        record.row(number, step, "SKIP", "dry run (GPU_CHECK_DRY=1): not run", 0)
        open(done_path, "w").close()
        return None
    logs = os.path.join(os.path.dirname(record.path), "warm_up")
    os.makedirs(logs, exist_ok=True)
    jobs = {}
    start = time.time()
    module = importlib.import_module(args.steps_module)  # (its imports are light: torch is loaded by the steps)
    for name in module.WARM_UP:
        with open(os.path.join(logs, f"{name}.log"), "w") as log:
            jobs[name] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm-up", name, "--steps-module",
                                           args.steps_module], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    def wait():
        outcome = {}
        for name, proc in jobs.items():
            try:
                proc.wait(timeout=max(step.box_s - (time.time() - start), 0.1))
                outcome[name] = "done" if proc.returncode == 0 else f"exit {proc.returncode}"
            except subprocess.TimeoutExpired:
                stop(proc, signal.SIGKILL)
                proc.wait()
                outcome[name] = "cut"
        failed = [f"{n} ({o})" for n, o in outcome.items() if o not in ("done", "cut")]
        cut = [n for n, o in outcome.items() if o == "cut"]
        figure = (f"{len(jobs) - len(failed) - len(cut)} of {len(jobs)} jobs done"
                  + (f"; cut at the box (their steps compile the rest): {', '.join(cut)}" if cut else "")
                  + (f"; failed (logs in warm_up/): {', '.join(failed)}" if failed else ""))
        record.row(number, step, "FAIL" if failed else "PASS", figure, time.time() - start, outcome)
        open(done_path, "w").close()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def driver_main(args) -> int:
    if args.plan:
        return 0 if print_plan(args.quick) else 1
    if not print_plan(args.quick):
        print("the boxes add up to more than the limit: shorten them")
        return 2
    gpu, facts = gpu_facts()
    record = Record(record_path("dry-run" if args.dry else gpu))
    mode = "dry run" if args.dry else "quick" if args.quick else "full"
    record.header([f"# GPU check {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: {gpu}", "",
                   f"- GPU: {facts}", f"- {versions()}", f"- commit {commit()}; mode {mode}; "
                   f"plan {plan_seconds(args.quick)} s ({len(plan_of(args.quick))} steps)",
                   "- written by scripts/gpu_check.py, a row as each step ends; full results in the .jsonl of the same name"])
    print(f"=== the record: {record.path}", flush=True)
    start = time.time()
    until = start + plan_seconds(args.quick)
    done_path = os.path.join(os.path.dirname(record.path), "warm_up.done")
    if os.path.exists(done_path):
        os.remove(done_path)
    thread = None
    if any(s.name == "warm_up" for s in plan_of(args.quick)):
        thread = warm_up(args, record, done_path)
    else:  # (--quick: each timed step's bench.py warms its own engine up)
        open(done_path, "w").close()
    for group in GROUPS:
        run_group(group, args, record, until, done_path)
    if thread is not None:
        thread.join()
    table = record.table()
    verdicts = [line.split("|")[3].strip() for line in table[2:]]
    counts = ", ".join(f"{verdicts.count(v)} {v}" for v in ("PASS", "FAIL", "TIME", "SKIP") if v in verdicts)
    print(f"=== summary: {counts}, in {time.time() - start:.0f} s; the record: {record.path}")
    print("\n".join(table[:MAX_SUMMARY_LINES - 2]))
    return 1 if {"FAIL", "TIME"} & set(verdicts) else 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", action="store_true", help="print the plan and check its boxes' sum")
    p.add_argument("--quick", action="store_true", help="steps 1-3 alone (at most 240 s)")
    p.add_argument("--dry", action="store_true", default=os.environ.get("GPU_CHECK_DRY") == "1",
                   help="skip every GPU step (also GPU_CHECK_DRY=1): the plumbing and the record")
    p.add_argument("--steps-module", default="gpu_steps", help="the module of the step functions (tests: a fake)")
    p.add_argument("--run-group", help=argparse.SUPPRESS)      # (the driver's own: one group's process)
    p.add_argument("--warm-up", help=argparse.SUPPRESS)        # (the driver's own: one warm-up job)
    p.add_argument("--steps", help=argparse.SUPPRESS)
    p.add_argument("--record", help=argparse.SUPPRESS)
    p.add_argument("--until", type=float, help=argparse.SUPPRESS)
    p.add_argument("--warm-up-done", help=argparse.SUPPRESS)
    p.add_argument("--min-step-s", type=float, default=MIN_STEP_S, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (gpu_steps and the benchmarks beside it)
    args = parse_args(argv)
    if args.run_group:
        group_main(args)
        return 0
    if args.warm_up:  # STEP or STEP:PART
        module = importlib.import_module(args.steps_module)
        name, _, part = args.warm_up.partition(":")
        getattr(module, name)(module.Context(out=None, warm=True, only=part or None))
        return 0
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
