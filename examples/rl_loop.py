"""A GRPO-style reinforcement-learning loop with nanovllm as the rollout engine, small enough to
run on a laptop's CPU in under half a minute (17 s for 15 steps on 2 cores):

    python examples/rl_loop.py                       # a tiny random model, built here
    python examples/rl_loop.py --steps 30 --group 16  # longer, larger groups

Two processes, as in the RL frameworks (verl, OpenRLHF, TRL): this one is the trainer, a plain
Hugging Face transformers model with an optimizer; the engine (nanovllm.LLM) runs in a process of
its own and takes commands over a pipe. Each step:
  1. the engine samples a group of completions of every prompt, with each sampled token's logprob;
  2. the engine goes to sleep (LLM.sleep: its KV cache freed, the memory the trainer's meanwhile);
  3. the trainer scores each completion with a toy reward (the share of its tokens in a target set),
     takes the group-relative advantage (reward minus its group's mean, over the group's std) and
     one policy-gradient step;
  4. the engine wakes up (LLM.wake_up) and receives the new weights from the trainer over
     torch.distributed, the trainer rank 0 of a gloo group broadcasting each tensor
     (LLM.init_weight_update_group once, LLM.update_weights_from_distributed each step); the
     prefix cache is reset with them, so nothing computed with the old weights is reused.
It prints, per step, the mean reward (it rises) and how far the engine's logprobs of the sampled
tokens are from the trainer's own (the same weights: float32 rounding, ~1e-5).
"""
import argparse
import multiprocessing as mp
import socket
import tempfile
from time import perf_counter

import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.features.weight_sync import WeightUpdateGroup

TARGET_TOKENS = range(64)  # the toy reward: the share of a completion's tokens with ids below 64


def reward(tokens: list[int]) -> float:
    return sum(t in TARGET_TOKENS for t in tokens) / len(tokens)


# ---- the engine's process ---------------------------------------------------------------------
def engine_main(model: str, conn):
    """The rollout engine: runs each command it is sent, answers with its result."""
    with LLM(model, max_model_len=256) as llm:
        while (command := conn.recv()) is not None:
            name, args = command
            if name == "generate":
                prompts, params = args
                outputs = llm.generate(prompts, params, use_tqdm=False)
                conn.send([[(s["token_ids"], [lp[t] for lp, t in zip(s["logprobs"], s["token_ids"])])
                            for s in out["samples"]] for out in outputs])
            else:  # sleep, wake_up, init_weight_update_group, update_weights_from_distributed
                conn.send(getattr(llm, name)(*args))


class Engine:
    """The trainer's handle on the engine's process: engine.sleep() runs llm.sleep() there."""

    def __init__(self, model: str):
        self.conn, child = mp.get_context("spawn").Pipe()
        self.process = mp.get_context("spawn").Process(target=engine_main, args=(model, child), daemon=True)
        self.process.start()

    def call(self, name: str, *args):
        self.conn.send((name, args))
        return self.conn.recv()

    def call_async(self, name: str, *args):  # (its answer read later: the engine waits on the trainer)
        self.conn.send((name, args))

    def close(self):
        self.conn.send(None)
        self.process.join(30)


# ---- the trainer --------------------------------------------------------------------------------
def completion_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The trainer's logprob of each completion token after the prompt and the tokens before it."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1:-1]  # [len(completion), vocab]
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def train_step(model, optimizer, prompts, groups) -> tuple[float, float]:
    """One policy-gradient step on the groups' completions; returns (mean reward, the largest
    difference between the engine's logprobs and the trainer's)."""
    losses, rewards, mismatch = [], [], 0.0
    for prompt, group in zip(prompts, groups):
        scores = torch.tensor([reward(tokens) for tokens, _ in group])
        advantages = (scores - scores.mean()) / (scores.std() + 1e-4)  # group-relative: GRPO's baseline
        rewards += scores.tolist()
        for (tokens, engine_logprobs), advantage in zip(group, advantages):
            logprobs = completion_logprobs(model, prompt, tokens)
            mismatch = max(mismatch, (logprobs.detach() - torch.tensor(engine_logprobs)).abs().max().item())
            losses.append(-advantage * logprobs.mean())  # (on-policy: the importance ratio is 1)
    optimizer.zero_grad()
    torch.stack(losses).mean().backward()
    optimizer.step()
    return sum(rewards) / len(rewards), mismatch


def push_weights(engine: Engine, group: WeightUpdateGroup, model):
    """Every tensor of the trainer's model to the engine: it asks for them by name, dtype and shape
    (update_weights_from_distributed), the trainer broadcasts them in that order."""
    state = model.state_dict()
    engine.call_async("update_weights_from_distributed", list(state), [str(t.dtype) for t in state.values()],
                      [list(t.shape) for t in state.values()])
    for tensor in state.values():
        group.broadcast(tensor.detach().contiguous())
    engine.conn.recv()  # (its answer: the loads it made)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face model folder (default: a tiny random Qwen3, built here)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model_path = args.model
    if model_path is None:
        from nanovllm.utils.tiny_model import build_model
        model_path = build_model(tempfile.mkdtemp(prefix="rl_loop_"))
    trainer = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=args.lr)
    vocab = trainer.config.vocab_size
    prompts = [torch.randint(64, vocab, (8,)).tolist() for _ in range(args.prompts)]  # (none of the targets)

    engine = Engine(model_path)
    port = free_port()  # the trainer hosts the group's store; the engine joins as ranks 1..
    engine.call_async("init_weight_update_group", "127.0.0.1", port, 1, 2)
    group = WeightUpdateGroup("127.0.0.1", port, rank=0, world_size=2)
    engine.conn.recv()
    try:
        for step in range(1, args.steps + 1):
            start = perf_counter()
            params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.group, logprobs=0,
                                    ignore_eos=True, seed=step)
            groups = engine.call("generate", prompts, params)
            engine.call("sleep", 1)
            mean_reward, mismatch = train_step(trainer, optimizer, prompts, groups)
            engine.call("wake_up")
            push_weights(engine, group, trainer)
            print(f"step {step:3d}  reward {mean_reward:.3f}  |engine - trainer logprob| <= {mismatch:.1e}  "
                  f"({perf_counter() - start:.2f} s)", flush=True)
    finally:
        engine.close()
        group.shutdown()


if __name__ == "__main__":
    main()
