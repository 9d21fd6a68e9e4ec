"""Tensor parallelism on CPU (gloo): TP=2 must give Hugging Face's greedy tokens, and the worker
processes must never outlive their engine."""
import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hf_reference import assert_greedy_matches_hf, assert_matches_hf_with_caching_chunking_and_preemption
from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.gpu_memory import warmup
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.utils.tiny_model import build_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_pids(pid=None):
    """Live or zombie children of `pid` (default: this process), read from /proc; multiprocessing's
    resource tracker, one per parent process for its whole life, is not an engine's."""
    pid = pid or os.getpid()
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if int(fields[1]) == pid and b"resource_tracker" not in cmdline:
                children.append(int(entry))
    return children


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def one_kv_head_dir(tmp_path_factory):
    """Fewer KV heads (1) than ranks (2): each rank holds a copy of it."""
    return build_model(str(tmp_path_factory.mktemp("qwen3_mqa")), seed=5, num_key_value_heads=1)


def check(llm, path, prompts, reference, params=GREEDY):
    return assert_greedy_matches_hf(llm, path, prompts, reference, params)


def test_tp2_matches_hf_with_caching_chunking_and_preemption(model_dir, prompts, reference):
    with LLM(model_dir, tensor_parallel_size=2, max_model_len=400, max_num_batched_tokens=96,
             num_kvcache_blocks=30) as llm:
        assert_matches_hf_with_caching_chunking_and_preemption(llm, model_dir, prompts, reference)
        assert 0 < llm.stats()["tp_message_bytes"] < 1024  # the last step: two decodes


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_tp2_with_fewer_kv_heads_than_ranks(one_kv_head_dir, prompts, reference, async_scheduling):
    with LLM(one_kv_head_dir, tensor_parallel_size=2, max_model_len=400, async_scheduling=async_scheduling) as llm:
        check(llm, one_kv_head_dir, prompts, reference)


def assert_mixed_workload_equals_one_rank_synchronous(model_dir, **parallel):
    """Seeded sampling, penalties, n=2, logprobs, stop strings and a tight KV budget (preemption)
    give an engine of these parallel options one rank's outputs from the synchronous loop."""
    from test_async_scheduling import MAX_MODEL_LEN, WORKLOAD, assert_same_logprobs, comparable
    shared = list(range(40, 90))
    prompts = [shared + [i] * (i + 1) for i in range(len(WORKLOAD))]
    options = dict(max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=14, kvcache_block_size=16)
    reference = LLM(model_dir, async_scheduling=False, **options).generate(prompts, WORKLOAD, use_tqdm=False)
    with LLM(model_dir, **parallel, **options) as llm:
        outputs = llm.generate(prompts, WORKLOAD, use_tqdm=False)
        assert llm.stats()["num_preemptions"] > 0
    assert comparable(outputs) == comparable(reference)
    assert_same_logprobs(outputs, reference)


def test_tp2_overlapped_equals_tp1_synchronous_on_a_mixed_workload(model_dir):
    """Overlap scheduling with two ranks: rank 0 broadcasts each step's sampled tokens on the
    device, which every rank reads as the next step's input ids."""
    assert_mixed_workload_equals_one_rank_synchronous(model_dir, tensor_parallel_size=2)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tp2_speculative_equals_tp1_plain(model_dir, method):
    """Speculative decoding with two ranks: n-gram drafts go to every rank's token table in the
    step's message; a draft model runs on rank 0, which broadcasts its drafts; rank 0 broadcasts
    where each sequence's next token goes. Greedy output equals one rank's plain decoding, under
    preemption too."""
    prompts = [[11, 22, 33, 44, 55, 66, 77, 88] * 5, [5, 6, 7] * 9, list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    options = dict(max_model_len=256, num_kvcache_blocks=16, kvcache_block_size=16)
    reference = LLM(model_dir, **options).generate(prompts, params, use_tqdm=False)
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        config["model"] = model_dir  # (identical: every draft is accepted)
    with LLM(model_dir, tensor_parallel_size=2, speculative_config=config, **options) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    assert [o["token_ids"] for o in outputs] == [r["token_ids"] for r in reference]
    assert stats["spec_num_accepted_tokens"] > 0 and stats["num_preemptions"] > 0


def test_tp2_prompt_logprobs_equal_tp1(model_dir):
    """Every rank takes part in the LM head of the prompt's rows (its gather); rank 0 has them."""
    prompt = [5, 17, 33, 2, 9, 100, 200, 300] * 4
    params = SamplingParams(max_tokens=2, prompt_logprobs=2)
    expected = LLM(model_dir, max_model_len=128, max_num_batched_tokens=16).generate([prompt], params, use_tqdm=False)
    with LLM(model_dir, tensor_parallel_size=2, max_model_len=128, max_num_batched_tokens=16) as llm:
        got = llm.generate([prompt], params, use_tqdm=False)
    for mine, theirs in zip(got[0]["prompt_logprobs"][1:], expected[0]["prompt_logprobs"][1:], strict=True):
        assert mine.keys() == theirs.keys() and all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)


def test_two_engines_at_once_and_shutdown(model_dir, tied_model_dir, prompts, reference):
    before = set(child_pids())
    a = LLM(model_dir, tensor_parallel_size=2, max_model_len=400)
    b = LLM(tied_model_dir, tensor_parallel_size=2, max_model_len=400)
    workers = set(child_pids()) - before
    assert len(workers) >= 2
    check(a, model_dir, prompts[:4], reference)
    check(b, tied_model_dir, prompts[:4], reference)
    check(a, model_dir, prompts[4:], reference)
    a.shutdown()
    b.shutdown()
    assert not (set(child_pids()) & workers), "worker processes (or zombies) remain after shutdown()"
    with pytest.raises(RuntimeError, match="shut down"):
        a.generate(prompts[:1], GREEDY, use_tqdm=False)


def test_exception_inside_with_block_ends_workers(model_dir):
    before = set(child_pids())
    with pytest.raises(KeyError):
        with LLM(model_dir, tensor_parallel_size=2, max_model_len=200):
            assert set(child_pids()) - before
            raise KeyError("the caller failed")
    assert set(child_pids()) <= before


def test_garbage_collection_ends_workers(model_dir):
    before = set(child_pids())
    llm = LLM(model_dir, tensor_parallel_size=2, max_model_len=200)
    assert set(child_pids()) - before
    del llm
    gc.collect()
    assert set(child_pids()) <= before


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_dead_worker_is_a_clear_error(model_dir, prompts, parallel):
    """(pp2: the other stage's process is the one killed)"""
    before = set(child_pids())
    llm = LLM(model_dir, max_model_len=200, **parallel)
    [worker] = set(child_pids()) - before
    os.kill(worker, signal.SIGKILL)
    time.sleep(0.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 .* has died"):
        llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 5
    llm.shutdown()
    assert set(child_pids()) <= before


def test_unsplittable_configurations(model_dir):
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        LLM(model_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(model_dir, tensor_parallel_size=0)


SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    # Ctrl-C as in a terminal, even where this test runs with SIGINT ignored (a background CI job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {root!r})
    from nanovllm import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM({path!r}, tensor_parallel_size=2, max_model_len=200)
        print("workers", *[p.pid for p in llm.model_runner.workers.processes], flush=True)
        if {interrupt}:
            print("generating", flush=True)
            llm.generate([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=150, ignore_eos=True),
                         use_tqdm=False)
            time.sleep(60)
        # else: exit without shutdown(): interpreter exit must end the workers
""")


@pytest.mark.parametrize("interrupt", [False, True])
def test_interpreter_exit_and_ctrl_c_end_workers(model_dir, tmp_path, interrupt):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(root=ROOT, path=model_dir, interrupt=interrupt))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = [int(p) for p in proc.stdout.readline().split()[1:]]
    assert workers and all(alive(p) for p in workers)
    if interrupt:
        assert proc.stdout.readline().strip() == "generating"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode != 0 if interrupt else proc.returncode == 0
    deadline = time.monotonic() + 15
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in workers), "orphaned worker processes"


def test_decode_message_is_small():
    """A decode step at 256 sequences sends each one's row and position, not its tokens or its table."""
    from types import SimpleNamespace
    cfg = SimpleNamespace(preemption_mode="recompute", max_num_seqs=256, max_num_batched_tokens=256 * 1000, max_model_len=2048, speculative=None)
    sched = Scheduler(cfg, BlockManager(256 * 64, 16), eos_token_ids=set())
    for i in range(256):
        sched.add(Sequence([i % 500 + 1] * 1000, GREEDY, seed=0))
    first = sched.schedule()  # the prefills: every prompt and block table travels once
    sched.complete(first, [7] * 256)
    decode = sched.schedule()
    sizes = [len(pickle.dumps(step.batch(), pickle.HIGHEST_PROTOCOL)) for step in (first, decode)]
    print(f"\nTP message: first step {sizes[0]} bytes, decode step at 256 sequences {sizes[1]} bytes")
    assert sizes[1] < 8 * 1024 < sizes[0]


def test_warmup_runs_on_every_rank(model_dir, prompts, reference):
    """The start-up warm-up that sizes the KV cache on CUDA (the largest forward, then sampling)
    runs on every rank; ranks above 0 get no logits from the LM head's gather and must not sample.
    On CPU it is not part of start-up, so it is run here by hand, then the engine must still be exact."""
    with LLM(model_dir, tensor_parallel_size=2, max_model_len=128, max_num_batched_tokens=300) as llm:
        runner = llm.model_runner
        runner.workers.call(warmup)
        warmup(runner)
        check(llm, model_dir, prompts[:4], reference)


def test_nccl_group_has_a_timeout(monkeypatch):
    """Without a timeout NCCL waits about ten minutes for a dead peer. (NCCL itself needs CUDA: a
    stand-in records what the group is built with.)"""
    from nanovllm.utils import tp_group

    class FakeNCCL:
        class Options:
            _timeout = None

        def __init__(self, store, rank, size, options=None):
            self.options = options

    monkeypatch.setattr(tp_group.dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    group = tp_group.TPGroup(None, 0, 2, "cuda")
    assert group.pg.options is not None and group.pg.options._timeout == tp_group.COLLECTIVE_TIMEOUT


class _DeadWorker:
    """A worker that died during start-up, as rank 0 may see it: its pipe already at EOF."""
    exitcode = 1

    def is_alive(self):
        return False

    def join(self, timeout=None):
        pass

    def poll(self, timeout=None):
        return True  # EOF counts as readable

    def recv(self):
        raise EOFError


def test_a_worker_dying_at_start_up_is_a_clear_error_even_when_its_pipe_closes_first():
    """Whether rank 0 notices the dead process or its closed pipe first, the error is the
    RuntimeError that says what happened, never a bare EOFError from the pipe."""
    from nanovllm.engine.workers import Workers
    workers = Workers.__new__(Workers)
    workers.processes, workers.conns = [_DeadWorker()], [_DeadWorker()]
    with pytest.raises(RuntimeError, match="rank 1 exited during start-up .*exit code 1.*__main__"):
        workers._wait_started()


UNGUARDED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from nanovllm import LLM
    LLM({path!r}, tensor_parallel_size=2, max_model_len=200)  # no __main__ guard: spawn re-runs this
""")


def test_a_script_without_a_main_guard_gets_the_start_up_error(model_dir, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.format(root=ROOT, path=model_dir))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last_error = proc.stderr.strip().splitlines()[-1]
    assert last_error.startswith("RuntimeError: tensor-parallel worker rank 1 exited during start-up"), proc.stderr
