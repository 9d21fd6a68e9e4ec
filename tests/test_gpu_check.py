"""scripts/gpu_check.sh, run here without a GPU: its time boxes add up to at most 8 minutes, a
step that fails does not stop the ones after it, every step ends with a verdict in the summary, and
only the tests that really failed (not those that ran out of time) are run again."""
import json
import os
import re
import shutil
import subprocess
import sys

from serving import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def gpu_check(root: str, tmp_path, *args: str, steps: str | None = None) -> subprocess.CompletedProcess:
    # python3 is the one running the tests (the script calls python3, as the GPU image has it)
    env = {**os.environ, "OUT": str(tmp_path / "out"),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    if steps is not None:
        env["GPU_CHECK_STEPS"] = steps
    return subprocess.run(["bash", os.path.join(root, "scripts", "gpu_check.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_boxes_add_up_to_at_most_eight_minutes(tmp_path):
    out = gpu_check(ROOT, tmp_path, "--plan")
    assert out.returncode == 0, out.stdout + out.stderr
    boxes = [int(m.group(1)) for m in re.finditer(r"^ *(\d+) s  (?!in all)", out.stdout, re.M)]
    total = int(re.search(r"^ *(\d+) s  in all \(at most 480\)$", out.stdout, re.M).group(1))
    assert len(boxes) >= 15 and sum(boxes) == total <= 480, out.stdout
    script = open(SCRIPT).read()
    assert not re.search(r"pytest[^\n]*\s-x\b", script), "a pytest step must not stop at its first failure"


def test_a_failed_step_does_not_stop_the_next_and_each_gets_a_verdict(tmp_path):
    """No CUDA here: the decode micro-benchmark fails; the rerun step still runs (nothing to rerun)."""
    out = gpu_check(ROOT, tmp_path, steps="decode_kernel rerun_failures")
    summary = out.stdout.split("=== summary")[1].splitlines()[1:3]
    assert summary[0].startswith("PASS") and "failed tests again" in summary[0], out.stdout
    assert summary[1].startswith("FAIL") and "decode kernel micro-benchmark" in summary[1], out.stdout
    assert "no test failed: nothing to rerun" in out.stdout
    assert out.returncode == 1 and "gpu_check exit status 1" in out.stdout
    assert "gpu_check exit status 1" in (tmp_path / "out" / "gpu_check.log").read_text()


def test_only_real_failures_are_run_again(tmp_path):
    """A copy of the script over a tree whose one gpu-marked test file has a passing test, a failing
    one and one that pytest-timeout failed ("Failed: Timeout"): the rerun step takes the failing one alone."""
    root = tmp_path / "tree"
    (root / "scripts").mkdir(parents=True)
    (root / "tests").mkdir()
    shutil.copy(SCRIPT, root / "scripts")
    (root / "tests" / "test_fake.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.gpu\n"
        "def test_passes():\n    pass\n"
        "def test_fails():\n    assert 1 == 2\n"
        "def test_timed_out():\n    pytest.fail('Timeout (>30.0s) from pytest-timeout.')\n")
    out = gpu_check(str(root), tmp_path, steps="gpu_tests rerun_failures")
    rerun = out.stdout.split("=== failed tests again")[1]
    assert "test_fake.py::test_fails FAILED" in rerun and "test_timed_out" not in rerun, out.stdout
    assert "test_passes" not in rerun
    verdicts = [line.split()[0] for line in out.stdout.split("=== summary")[1].splitlines()[1:3]]
    assert verdicts == ["FAIL", "FAIL"] and out.returncode == 1, out.stdout


FAKE_SCRIPT = """import json, os, sys, time
start = time.time()
time.sleep(2)
with open(os.path.join(os.environ["OUT"], "calls", f"{os.getpid()}.json"), "w") as f:
    json.dump({"script": sys.argv[0], "args": sys.argv[1:], "start": start, "end": time.time()}, f)
"""


def test_warm_up_runs_the_steps_small_and_at_once_then_the_quantized_runs_check_their_probe(tmp_path):
    """A copy of the script over a tree whose bench.py and scripts record how they were called: the
    warm-up runs each of its steps' commands with the small-run arguments last, all at once, and
    the quantized steps then save the probe (bf16) and check against it (AWQ, with its bound)."""
    root = tmp_path / "tree"
    (root / "scripts").mkdir(parents=True)
    (root / "tests").mkdir()
    (tmp_path / "out" / "calls").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts")
    for name in ("bench.py", "scripts/bench_decode_attention.py", "scripts/count_kernels.py",
                 "scripts/bench_quant_gemm.py", "scripts/bench_multiturn.py"):
        (root / name).write_text(FAKE_SCRIPT)
    out = gpu_check(str(root), tmp_path, steps="warm_up quant_bf16 quant_awq")
    assert out.returncode == 0, out.stdout + out.stderr
    calls = sorted((json.loads(p.read_text()) for p in (tmp_path / "out" / "calls").glob("*.json")),
                   key=lambda c: c["start"])
    warm, steps = calls[:-2], calls[-2:]
    # decode_kernel 2 calls, count_kernels, bench_sync, 3 batch-1 runs, quant_gemm, fp8_kv_decode, 5
    # quantized runs, multiturn (bench_moe: no GPU of 80 GB here)
    assert len(warm) == 15 and "warm-up bench_moe: done" in out.stdout, out.stdout
    for call in warm:
        if call["script"] == "bench.py":
            tail = ["--min-output-len", "16", "--max-output-len", "16", "--num-kvcache-blocks", "512"]
            assert call["args"][-len(tail):] == tail or call["args"][-len(tail) - 2:-2] == tail, call
        elif call["script"].endswith("bench_multiturn.py"):
            assert call["args"][-4:] == ["--conversations", "2", "--turns", "2"], call
        elif not call["script"].endswith("count_kernels.py"):
            assert call["args"][-2:] == ["--iters", "1"], call
    # (each fake takes 2 s: all at once, every job's first call overlaps every other's)
    running = max(sum(c["start"] <= t < c["end"] for c in warm) for t in (c["start"] for c in warm))
    assert running >= 14, [(c["script"], c["start"] - warm[0]["start"]) for c in warm]
    reference = str(tmp_path / "out" / "probe_bf16.json")
    assert steps[0]["args"][-2:] == ["--probe-save", reference], steps[0]
    bound = re.search(r"\[awq\]=([\d.]+)", open(SCRIPT).read()).group(1)
    assert steps[1]["args"][-4:] == ["--probe-check", reference, "--probe-max-error", bound], steps[1]
    assert re.search(r"^PASS +\d+s +warm-up", out.stdout, re.M), out.stdout
