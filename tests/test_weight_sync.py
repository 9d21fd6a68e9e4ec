"""Weights from a trainer over torch.distributed (features/weight_sync.py, issue 50): a trainer
process, rank 0 of a gloo group with the engine's ranks, broadcasts model B's tensors; the engine
serving A (one rank, or two tensor-parallel ranks, each receiving and loading its shard) then equals
HF greedy of B, a prompt cached under A included. A trainer that never joins, or never sends, is a
clear error after the timeout, and the engine serves on."""
import multiprocessing as mp
import socket

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.features.weight_sync import WeightUpdateGroup

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MODELS = {"qwen3_a": ("qwen3", 0, {}), "qwen3_b": ("qwen3", 1, {})}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_main(port: int, world_size: int, path: str, conn, send: bool = True):
    """The trainer: rank 0 of the group; tells the engine what it sends, then broadcasts it in order."""
    group = WeightUpdateGroup("127.0.0.1", port, rank=0, world_size=world_size, backend="gloo", timeout_s=60)
    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    conn.send([(name, str(t.dtype), list(t.shape)) for name, t in state.items()])
    if send:
        for t in state.values():
            group.broadcast(t.contiguous())
    conn.recv()  # (the group lives until the engine is done with it)
    group.shutdown()


def start_trainer(port: int, world_size: int, path: str, send: bool = True):
    parent, child = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(target=trainer_main, args=(port, world_size, path, child, send),
                                              daemon=True)
    process.start()
    return process, parent


@pytest.mark.parametrize("tp", [1, 2])
def test_a_trainers_broadcast_of_b_gives_hf_b(tp, tiny_models, prompts, reference):
    a, b = tiny_models(MODELS, "qwen3_a"), tiny_models(MODELS, "qwen3_b")
    port = free_port()
    trainer, conn = start_trainer(port, 1 + tp, b)
    try:
        with LLM(a, tensor_parallel_size=tp, max_model_len=400) as llm:
            cached = prompts[5]
            assert llm.generate([cached], GREEDY, use_tqdm=False)[0]["token_ids"] == reference(a, cached, 12)
            llm.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=1 + tp)
            names, dtypes, shapes = zip(*conn.recv())
            assert llm.update_weights_from_distributed(list(names), list(dtypes), list(shapes)) >= len(names)
            again = llm.generate([cached], GREEDY, use_tqdm=False)[0]
            assert again["num_cached_tokens"] == 0 and again["token_ids"] == reference(b, cached, 12)
            assert [o["token_ids"] for o in llm.generate(prompts[:4], GREEDY, use_tqdm=False)] == \
                [reference(b, p, 12) for p in prompts[:4]]
            conn.send("done")
    finally:
        trainer.join(30)
        trainer.kill()


def test_a_trainer_that_never_joins_or_never_sends_is_an_error_and_the_engine_serves_on(tiny_models, prompts,
                                                                                      reference):
    a, b = tiny_models(MODELS, "qwen3_a"), tiny_models(MODELS, "qwen3_b")
    with LLM(a, max_model_len=400) as llm:
        with pytest.raises(ValueError, match="call init_weight_update_group first"):
            llm.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]])
        with pytest.raises(ValueError, match="do not fit"):
            llm.init_weight_update_group("127.0.0.1", free_port(), rank_offset=0, world_size=2)
        with pytest.raises(ValueError, match="backend must be"):
            llm.init_weight_update_group("127.0.0.1", free_port(), rank_offset=1, world_size=2, backend="mpi")
        with pytest.raises(RuntimeError, match="could not be joined within 2 s"):  # (nobody listens there)
            llm.init_weight_update_group("127.0.0.1", free_port(), rank_offset=1, world_size=2, timeout_s=2)
        port = free_port()
        trainer, conn = start_trainer(port, 2, b, send=False)
        try:
            llm.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=2, timeout_s=3)
            names, dtypes, shapes = zip(*conn.recv())
            with pytest.raises(ValueError, match="expected shape"):  # (checked before anything is received)
                llm.update_weights_from_distributed(list(names), list(dtypes), [[3]] + list(shapes[1:]))
            with pytest.raises(ValueError, match="dtypes must be"):
                llm.update_weights_from_distributed(list(names), ["float99"] * len(names), list(shapes))
            with pytest.raises(RuntimeError, match="receiving 'model.embed_tokens.weight' failed"):
                llm.update_weights_from_distributed(list(names), list(dtypes), list(shapes))
            conn.send("done")
        finally:
            trainer.join(30)
            trainer.kill()
        assert llm.generate([prompts[3]], GREEDY, use_tqdm=False)[0]["token_ids"] == reference(a, prompts[3], 12)


def test_the_rl_example_raises_its_reward():
    """examples/rl_loop.py: the trainer's policy-gradient steps, pushed to the engine over gloo each
    step, raise the toy reward (seeded: on this CPU, 0.08 at step 1 and 0.91 at step 8)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "examples", "rl_loop.py"), "--steps", "8"],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    rewards = [float(line.split()[3]) for line in out.stdout.splitlines() if line.startswith("step")]
    mismatches = [float(line.split("<=")[1].split()[0]) for line in out.stdout.splitlines() if line.startswith("step")]
    assert len(rewards) == 8 and rewards[-1] > rewards[0] + 0.3, out.stdout
    assert max(mismatches) < 1e-4, out.stdout  # (the engine's logprobs are the trainer's, up to float32 rounding)
