"""scripts/gpu_check.py (bash scripts/gpu_check.sh), run here without a GPU: the plan's order and
boxes, the record a dry run writes, what a failing, a slow and a stuck step leave in the record
(each its row, written as it ends, and every later step still run), the warm-up's jobs at once
beside step 1 alone, and the pytest steps' rerun of the real failures only (scripts/gpu_steps.py)."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from serving import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_check  # noqa: E402
import gpu_steps  # noqa: E402

SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def run_script(*args: str, env: dict) -> subprocess.CompletedProcess:
    # (python3 is the one running the tests: the script calls python3, as the GPU image has it)
    env = {**os.environ, **env, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    return subprocess.run(["bash", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=120)


def rows(record_path: str) -> list[list[str]]:
    """The record's table rows, each [number, step, verdict, figure, seconds]."""
    with open(record_path) as f:
        lines = [line for line in f if line.startswith("| ") and not line.startswith("| # ")]
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in lines]


def test_the_plan_puts_the_headline_first_and_fits_its_limits(tmp_path):
    full = run_script("--plan", env={})
    assert full.returncode == 0, full.stdout + full.stderr
    total = int(re.search(r"^ *(\d+) s  in all \(at most 480\)$", full.stdout, re.M).group(1))
    assert total == gpu_check.plan_seconds(False) <= 480
    quick = run_script("--quick", "--plan", env={})
    assert quick.returncode == 0 and "in all (at most 240)" in quick.stdout, quick.stdout
    assert [s.name for s in gpu_check.plan_of(True)] == ["correctness", "headline", "profile"]
    assert gpu_check.plan_seconds(True) <= 240
    # the order of value: warm-up (beside step 1), correctness, the headline, the profile, top-p, then the rest
    assert [s.name for s in gpu_check.PLAN[:5]] == ["warm_up", "correctness", "headline", "profile", "top_p"]
    # every step has its function, every warm-up job names a later step (and a part it has)
    for step in gpu_check.PLAN[1:]:
        assert callable(getattr(gpu_steps, step.name)), step.name
    parts = {"batch1": gpu_steps.SPECULATION, "quantized": gpu_steps.QUANTIZED, "families": gpu_steps.FAMILIES}
    for job in gpu_steps.WARM_UP:
        name, _, part = job.partition(":")
        assert name in {s.name for s in gpu_check.PLAN[2:]}, job
        assert not part or part in parts[name], job


def test_a_dry_run_writes_a_record_with_one_row_per_step(tmp_path):
    out = run_script(env={"GPU_CHECK_DRY": "1", "OUT": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    [record] = tmp_path.glob("*-dry-run.md")
    text = record.read_text()
    assert text.startswith("# GPU check ") and "- GPU: no GPU" in text, text
    assert re.search(r"- python 3[\d.]+, torch \S+, triton", text) and "mode dry run" in text, text
    table = rows(str(record))
    assert [r[1] for r in table] == [s.name for s in gpu_check.PLAN], table
    assert [r[0] for r in table] == [str(i) for i in range(1, len(gpu_check.PLAN) + 1)]
    assert {r[2] for r in table} == {"SKIP"}, table
    # the table printed at the end, within 60 lines; the log beside the record
    summary = out.stdout.split("=== summary")[1].splitlines()
    assert len(summary) <= 60 and summary[-1].startswith(f"| {len(gpu_check.PLAN)} | pipeline | SKIP"), summary
    assert "=== summary" in (tmp_path / "gpu_check.log").read_text()


FAKE_STEPS = '''
import glob, os, signal, time

WARM_UP = ["job:a", "job:b", "job:c"]


class Context:
    def __init__(self, out, warm=False, only=None):
        self.out, self.warm, self.only, self.notes = out, warm, only, []

    def after_step(self):
        self.notes = []


def ok(ctx):
    return "PASS", "fine", None


def boom(ctx):
    raise ValueError("bad input 7")


def slow(ctx):
    ctx.notes.append("half done")
    time.sleep(60)  # (SIGALRM ends it at its box)


def after(ctx):  # the rows of the steps before it are on disk already
    [record] = glob.glob(os.path.join(ctx.out, "*.md"))
    seen = sum(1 for line in open(record) if line.startswith("| ") and not line.startswith("| #"))
    return "PASS", f"saw {seen} rows", None


def stuck(ctx):  # as a step stuck in a C call: deaf to SIGALRM and SIGINT alike
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    time.sleep(120)


def stamp(ctx, name):
    with open(os.path.join(os.environ["FAKE_OUT"], name), "a") as f:
        f.write(f"{time.time()}\\n")


def job(ctx):  # a warm-up job
    stamp(ctx, f"job-{ctx.only}-start")
    time.sleep(2)
    stamp(ctx, f"job-{ctx.only}-end")


def beside(ctx):
    stamp(ctx, "beside")
    return "PASS", "", None


def timed(ctx):
    stamp(ctx, "timed")
    return "PASS", "", None
'''


@pytest.fixture
def fake_steps(tmp_path, monkeypatch):
    """A steps module of fakes, importable here and by the driver's processes; the record in tmp_path/out."""
    (tmp_path / "fake_steps.py").write_text(FAKE_STEPS)
    (tmp_path / "out").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("GPU_CHECK_RECORD_DIR", str(tmp_path / "out"))
    monkeypatch.setenv("FAKE_OUT", str(tmp_path / "out"))
    monkeypatch.delenv("GPU_CHECK_DRY", raising=False)
    monkeypatch.setattr(gpu_check, "GROUP_START_S", 3)
    monkeypatch.setattr(gpu_check, "KILL_AFTER_S", 1)
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 1)
    return tmp_path / "out"


def test_each_step_gets_its_row_whatever_it_does_and_the_later_ones_still_run(fake_steps, monkeypatch, capsys):
    Step = gpu_check.Step
    monkeypatch.setattr(gpu_check, "PLAN", [
        Step("ok", "first", 2, False, "passes"), Step("boom", "first", 2, False, "raises"),
        Step("slow", "first", 2, False, "runs past its box"), Step("after", "first", 2, False, "reads the record"),
        Step("stuck", "tests", 2, False, "deaf to signals"), Step("ok", "tests", 2, False, "never reached"),
        Step("ok", "more", 2, False, "the next group")])
    start = time.time()
    status = gpu_check.main(["--steps-module", "fake_steps"])
    [record] = fake_steps.glob("*.md")
    table = [(r[1], r[2], r[3]) for r in rows(str(record))]
    assert table[:4] == [("ok", "PASS", "fine"), ("boom", "FAIL", "ValueError: bad input 7"),
                         ("slow", "TIME", "its box of 2 s ran out; so far: half done"), ("after", "PASS", "saw 3 rows")]
    # the stuck step's process is stopped when the plan's time less the last group's (2 + 3 s) runs
    # out, SIGKILLed 1 s after its SIGINT: the driver writes its row and the one it never reached;
    # the next group runs
    assert table[4][:2] == ("stuck", "TIME") and re.search(r"stopped at \d+ s", table[4][2]), table
    assert table[5][:2] == ("ok", "SKIP") and table[5][2].startswith("not reached"), table
    assert table[6] == ("ok", "PASS", "fine") and len(table) == 7
    assert status == 1 and time.time() - start < gpu_check.plan_seconds(False) + 5
    events = [json.loads(line) for line in open(str(record).removesuffix(".md") + ".jsonl")]
    assert [e["step"] for e in events if e["event"] == "end"] == [t[0] for t in table]
    out = capsys.readouterr().out
    assert "=== summary: 3 PASS, 1 FAIL, 2 TIME, 1 SKIP" in out, out


def test_the_warm_up_runs_its_jobs_at_once_beside_step_1_and_the_timed_steps_wait(fake_steps, monkeypatch):
    Step = gpu_check.Step
    monkeypatch.setattr(gpu_check, "PLAN", [
        Step("warm_up", "warm", 20, False, "warm-up"), Step("beside", "first", 5, False, "beside", beside_warm_up=True),
        Step("timed", "first", 5, False, "timed")])
    assert gpu_check.main(["--steps-module", "fake_steps"]) == 0
    [record] = fake_steps.glob("*.md")
    table = {r[1]: (r[2], r[3]) for r in rows(str(record))}
    assert table["warm_up"] == ("PASS", "3 of 3 jobs done"), table
    read = lambda name: float((fake_steps / name).read_text().split()[0])  # noqa: E731
    starts = [read(f"job-{p}-start") for p in "abc"]
    ends = [read(f"job-{p}-end") for p in "abc"]
    assert max(starts) < min(ends), "the jobs ran one after another"
    assert read("beside") < min(ends) and read("timed") >= max(ends)


FAKE_TESTS = """
import pytest
def test_passes():
    pass
def test_fails():
    assert 1 == 2
def test_timed_out():  # (as pytest-timeout fails a test)
    pytest.fail('Timeout (>30.0s) from pytest-timeout.')
"""


def test_a_pytest_step_notes_the_real_failures_alone_and_the_rerun_takes_them(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_steps, "TEST_TIMEOUT_S", 30)
    (tmp_path / "test_fake.py").write_text(FAKE_TESTS)
    ctx = gpu_steps.Context(out=str(tmp_path))
    ctx.limit_s = 60
    verdict, figure, _ = gpu_steps.run_pytest(ctx, gpu_steps.pytest_command("-p", "no:cacheprovider", "-p", "no:xdist",
                                                                             str(tmp_path / "test_fake.py")))
    assert verdict == "FAIL" and figure.startswith("2 failed, 1 passed"), figure
    assert len(ctx.failed_tests) == 1 and ctx.failed_tests[0].endswith("test_fake.py::test_fails"), ctx.failed_tests
    verdict, figure, _ = gpu_steps.rerun_failures(ctx)
    assert verdict == "FAIL" and figure.startswith("1 failed; failed: test_fake.py::test_fails"), figure
    assert len(ctx.failed_tests) == 1


def test_a_pytest_step_past_its_box_is_cut_with_its_summary(tmp_path):
    (tmp_path / "test_slow.py").write_text("import time\ndef test_quick():\n    pass\ndef test_slow():\n    time.sleep(60)\n")
    ctx = gpu_steps.Context(out=str(tmp_path))
    ctx.limit_s = gpu_steps.KILL_AFTER_S + 4  # (pytest gets 3 s, then SIGINT)
    start = time.time()
    verdict, figure, output = gpu_steps.run_pytest(ctx, gpu_steps.pytest_command("-p", "no:xdist",
                                                                                 str(tmp_path / "test_slow.py")))
    assert verdict == "TIME" and "1 passed" in figure and time.time() - start < 30, output


def test_the_correctness_step_compares_with_hugging_face(tmp_path):
    """Step 1's own code, on CPU (no CUDA graphs here: both of its engines run eagerly)."""
    verdict, figure, result = gpu_steps.correctness(gpu_steps.Context(out=str(tmp_path)))
    assert verdict == "PASS", figure
    assert figure.startswith("fp32 greedy = HF on 6/6 prompts x 24 tokens; CUDA-graph decode = eager on 6/6")
    assert result["hf"] == result["eager"] and len(result["hf"][0]) == gpu_steps.CORRECTNESS_TOKENS
