"""Tensor (and pipeline) parallelism over two "nodes": node 0 is an LLM in this process, node 1 a separate process
tree (`python -m nanovllm serve MODEL --headless ...`), both on this machine over loopback; and
the launches that must fail fast, naming the option, with every process gone."""
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from hf_reference import assert_greedy_matches_hf, assert_matches_hf_with_caching_chunking_and_preemption
from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.distributed.nodes import gpu_index, local_ranks
from nanovllm.distributed.options import check_gpus
from test_tensor_parallel import child_pids

NODE_TIMEOUT = 5  # seconds: the launches where a node never comes end within a few of these
# ... and where it does come, a node waits this long for the other: a new interpreter that imports
# torch and transformers takes over 5 s on a loaded 2-core machine (and took so in CI).
ARRIVAL_TIMEOUT = 120
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def headless(path, port, *extra, env=None, explicit=True, timeout=ARRIVAL_TIMEOUT):
    """Node 1 of 2 (tensor_parallel_size 2: one rank each), the master given as flags or as torchrun's
    environment variables."""
    master = ["--master-addr", "127.0.0.1", "--master-port", str(port)] if explicit else []
    return subprocess.Popen([sys.executable, "-m", "nanovllm", "serve", path, "--headless", "--device", "cpu",
                             "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", *master,
                             "--node-timeout", str(timeout), "--log-level", "warning", *extra],
                            env={**os.environ, **(env or {})}, stderr=subprocess.PIPE, text=True)


def node0(path, port, timeout=ARRIVAL_TIMEOUT, **options):
    return LLM(path, device="cpu", tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
               master_port=port, node_timeout=timeout, **options)


def test_tp2_over_two_nodes_matches_hf_with_caching_chunking_and_preemption(model_dir, prompts, reference):
    port = free_port()
    node1 = headless(model_dir, port, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, explicit=False)
    with node0(model_dir, port, max_model_len=400, max_num_batched_tokens=96, num_kvcache_blocks=30) as llm:
        assert_matches_hf_with_caching_chunking_and_preemption(llm, model_dir, prompts, reference)
    assert node1.wait(timeout=60) == 0, node1.stderr.read()
    assert child_pids() == [] and child_pids(node1.pid) == []


def test_pp2_over_two_nodes_one_stage_each_matches_hf(model_dir, prompts, reference):
    """Pipeline parallelism across nodes: stage 0 on node 0, stage 1 on node 1, the hidden states
    between them over the network (loopback here)."""
    port = free_port()
    node1 = headless(model_dir, port, "--tensor-parallel-size", "1", "--pipeline-parallel-size", "2")
    with LLM(model_dir, device="cpu", pipeline_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
             master_port=port, node_timeout=ARRIVAL_TIMEOUT, max_model_len=400, max_num_batched_tokens=96,
             num_kvcache_blocks=30) as llm:
        assert_greedy_matches_hf(llm, model_dir, prompts, reference,
                                 SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        assert llm.stats()["num_preemptions"] > 0
    assert node1.wait(timeout=60) == 0, node1.stderr.read()
    assert child_pids() == [] and child_pids(node1.pid) == []


def test_nodes_started_with_other_options_are_refused_on_both(model_dir, tied_model_dir):
    for other, expected in [(["--tensor-parallel-size", "4"], "node 1 was started with tensor_parallel_size=4, "
                                                                "node 0 tensor_parallel_size=2"),
                            (["--pipeline-parallel-size", "2"], "node 1 was started with pipeline_parallel_size=2, "
                                                                "node 0 pipeline_parallel_size=1"),
                            ([], "node 1 was started with a model whose config.json differs from node 0's")]:
        port = free_port()
        node1 = headless(tied_model_dir if not other else model_dir, port, *other)
        start = time.monotonic()
        with pytest.raises(ValueError) as error:
            node0(model_dir, port)
        assert expected in str(error.value)
        assert node1.wait(timeout=60) == 2 and expected in node1.stderr.read()
        assert time.monotonic() - start < 60 and child_pids() == []


def test_a_node_that_does_not_come_is_named_with_its_command(model_dir):
    port = free_port()
    with pytest.raises(ValueError, match=r"node\(s\) \[1\] of nnodes=2 did not join within node_timeout=5 s; start "
                                         rf"each with: nanovllm serve MODEL --headless .*--node-rank 1 .*{port}"):
        node0(model_dir, port, timeout=NODE_TIMEOUT)
    assert child_pids() == []


def test_node_0_on_a_port_in_use(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"node 0 cannot listen on master_port={port} .*--master-port"):
            node0(model_dir, port)


def test_a_headless_node_without_node_0_ends_naming_the_master(model_dir):
    start = time.monotonic()
    node1 = headless(model_dir, free_port(), timeout=NODE_TIMEOUT)
    assert node1.wait(timeout=60) == 2
    assert "could not reach node 0 at master_addr=127.0.0.1" in node1.stderr.read()
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("options, message", [
    (dict(nnodes=2, tensor_parallel_size=2), r"nnodes=2 needs master_addr .*MASTER_ADDR"),
    (dict(nnodes=2, tensor_parallel_size=2, master_addr="127.0.0.1"), r"nnodes=2 needs master_port"),
    (dict(nnodes=2, tensor_parallel_size=3, master_addr="a", master_port=1),
     r"tensor_parallel_size=3 x pipeline_parallel_size=1 ranks cannot be split over nnodes=2"),
    (dict(nnodes=2, node_rank=2, tensor_parallel_size=2), r"node_rank must be in \[0, nnodes=2\), got 2"),
    (dict(nnodes=0), r"nnodes must be >= 1, got 0"),
    (dict(master_port=29500), r"master_addr and master_port are for nnodes > 1, got .*master_port=29500"),
    (dict(nnodes=2, tensor_parallel_size=2, master_addr="a", master_port=1, node_timeout=0), r"node_timeout must"),
    (dict(nnodes=2, node_rank=1, tensor_parallel_size=2, master_addr="a", master_port=1),
     r"an engine .* runs on node 0; node_rank=1 runs ranks only: nanovllm serve MODEL --headless"),
])
def test_multinode_options_are_checked(model_dir, monkeypatch, options, message):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match=message):
        LLM(model_dir, device="cpu", **options)


def nodes_config(model_dir, **options) -> Config:
    return Config(model_dir, device="cpu", master_addr="127.0.0.1", master_port=29500, **options)


@pytest.mark.parametrize("options", [dict(tensor_parallel_size=4, nnodes=2), dict(pipeline_parallel_size=2, nnodes=2),
                                     dict(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=4),
                                     dict(tensor_parallel_size=4, pipeline_parallel_size=2, nnodes=2)])
def test_ranks_that_nnodes_divides_are_split_over_the_nodes(model_dir, options):
    """world_size = tensor x pipeline ranks, world_size / nnodes on each node: more ranks than
    nodes is the rule (TP=4 over 2 nodes, 2 ranks a node), and a rank a node is fine too."""
    config = nodes_config(model_dir, **options)
    local = config.world_size // config.nnodes
    assert [list(local_ranks(config, k)) for k in range(config.nnodes)] == [
        list(range(k * local, (k + 1) * local)) for k in range(config.nnodes)]


@pytest.mark.parametrize("options", [dict(tensor_parallel_size=3, nnodes=2), dict(tensor_parallel_size=2, nnodes=4),
                                     dict(tensor_parallel_size=4, nnodes=3), dict(pipeline_parallel_size=2, nnodes=4)])
def test_ranks_that_nnodes_does_not_divide_are_refused(model_dir, options):
    """(fewer ranks than nodes too: a node with no rank)"""
    with pytest.raises(ValueError, match=r"ranks cannot be split over nnodes="):
        nodes_config(model_dir, **options)


@pytest.mark.parametrize("options, expected", [
    (dict(tensor_parallel_size=4, nnodes=2), [0, 1, 0, 1]),
    (dict(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2), [0, 1, 0, 1]),
    (dict(tensor_parallel_size=4, pipeline_parallel_size=2, nnodes=2), [0, 1, 2, 3, 0, 1, 2, 3]),
    (dict(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=4), [0, 0, 0, 0]),
])
def test_a_rank_takes_the_gpu_of_its_place_on_its_node(model_dir, options, expected):
    """Node k's ranks take cuda:0 .. cuda:local-1 of node k (rank_main's group's local_rank: the
    runner's device), not cuda:rank: rank 2 of TP=4 over 2 nodes is node 1's first, on its GPU 0."""
    config = nodes_config(model_dir, **options)
    assert [gpu_index(config, rank) for rank in range(config.world_size)] == expected
    for k in range(config.nnodes):
        assert [gpu_index(config, rank) for rank in local_ranks(config, k)] == list(range(len(expected) // config.nnodes))


@pytest.mark.parametrize("visible, ok", [(2, True), (1, False), (4, True)])
def test_each_node_needs_a_gpu_for_each_of_its_own_ranks(monkeypatch, visible, ok):
    """TP=4 over 2 nodes needs 2 GPUs a node (its ranks), not 4 (the world's): exactly 2 will do."""
    monkeypatch.setattr("torch.cuda.device_count", lambda: visible)
    config = SimpleNamespace(device="cuda", world_size=4, nnodes=2, tensor_parallel_size=4, pipeline_parallel_size=1)
    if ok:
        check_gpus(config)
    else:
        with pytest.raises(ValueError, match=r"over nnodes=2 needs 2 GPUs on each node; 1 are visible"):
            check_gpus(config)


@pytest.mark.parametrize("port, ok", [(1, True), (65535, True), (0, False), (65536, False)])
def test_master_port_is_1_to_65535(model_dir, port, ok):
    if ok:
        assert Config(model_dir, device="cpu", tensor_parallel_size=2, nnodes=2, master_addr="a",
                      master_port=port).master_port == port
    else:
        with pytest.raises(ValueError, match=rf"needs master_port \(a free port on node 0, 1-65535.*got {port}"):
            Config(model_dir, device="cpu", tensor_parallel_size=2, nnodes=2, master_addr="a", master_port=port)


def test_a_node_that_dies_mid_run_ends_the_engine_and_every_process(model_dir):
    """Node 1's rank killed between steps: node 0's next step fails at once (its collective's peer
    is gone) with an error, not a hang; then shutdown and node 1's process end cleanly."""
    port = free_port()
    node1 = headless(model_dir, port)
    llm = node0(model_dir, port, max_model_len=256)
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    [rank1] = child_pids(node1.pid)
    os.kill(rank1, 9)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="peer|[Bb]roken pipe"):  # (gloo's words for a dead peer)
        llm.generate([[4, 5, 6]], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.shutdown()
    assert node1.wait(timeout=30) == 1
    assert child_pids() == [] and child_pids(node1.pid) == []


TORCHRUN_SCRIPT = """import os, sys
from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.distributed.nodes import run_headless
if __name__ == "__main__":
    path, prompts = sys.argv[1], [[1, 2, 3], list(range(4, 40))]
    if os.environ["RANK"] == "0":
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        with LLM(path, device="cpu", tensor_parallel_size=2, nnodes=2) as llm:
            two_nodes = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        one = [o["token_ids"] for o in LLM(path, device="cpu").generate(prompts, params, use_tqdm=False)]
        print("same tokens" if two_nodes == one else f"differ: {two_nodes} {one}")
    else:
        sys.exit(run_headless(Config(path, device="cpu", tensor_parallel_size=2, nnodes=2)))
"""


def test_torchrun_one_process_a_node(model_dir, tmp_path):
    """Under torchrun (--nproc-per-node 1: each process a node), node_rank is its RANK, the master
    its MASTER_ADDR / MASTER_PORT, and the store its agent's: only nnodes is passed."""
    script = tmp_path / "two_nodes.py"
    script.write_text(TORCHRUN_SCRIPT)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2", str(script),
                          model_dir], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "same tokens" in run.stdout, run.stdout + run.stderr[-3000:]


def test_under_torchrun_nnodes_must_be_its_world_size(model_dir, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match=r"under torchrun, nnodes must be its WORLD_SIZE=2 .*got nnodes=4"):
        LLM(model_dir, device="cpu", tensor_parallel_size=4, nnodes=4, master_addr="a", master_port=1)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"under torchrun, node_rank is its RANK=0, got node_rank=1"):
        LLM(model_dir, device="cpu", tensor_parallel_size=4, nnodes=2, node_rank=1, master_addr="a", master_port=1)
