"""Weights updated in place, and the prefix cache reset (issue 50: the engine as an RL rollout worker).

    llm.update_weights(trainer_model.state_dict().items())   # (Hugging Face name, tensor) pairs
    llm.reset_prefix_cache()                                  # (update_weights does it too)

update_weights takes any subset of a checkpoint's tensors, of any dtype and device, through the
loader mapping the checkpoint itself takes (LLMEngine's model: checkpoint_target for stacked q/k/v
and gate/up and the experts, each parameter's weight_loader for its shard), in two passes: first
every tensor is loaded into a scratch copy of its parameter, so that an unknown name or a wrong
shape is a ValueError naming the tensor before any weight changes; then into the parameters
themselves, in place (their storage stays where it is: a captured CUDA graph still reads them).

The KV (and state) computed with the old weights must never be reused, so the prefix cache is
emptied after an update: every cached block forgets its key, the host tier its entries, the state
cache its snapshots, the window pool its keys. Both need the engine idle (no request in flight):
an update between a request's steps would mix two models in one completion.

With tensor parallelism rank 0 checks the tensors, then every rank loads them into its shard
(each parameter's weight_loader takes its rank's slice): the workers get CPU copies through their
pipes, or a checkpoint's folder to read themselves (update_weights_from_disk); a trainer's group
over torch.distributed is features/weight_sync.py's. Not here: quantized checkpoints (their layers
would have to be quantized again) and pipeline parallelism (a stage holds some layers' weights).
"""
import glob
import os

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanovllm.features.idle_engine import check_idle, reset_prefix_cache
from nanovllm.features.sleep_mode import wake_up
from nanovllm.utils.loader import IGNORED_TENSOR_SUFFIXES, ShapeMismatch, load_param


def update_weights(llm, named_tensors) -> int:
    """Load (name, tensor) pairs (or a dict) into llm's model in place, on every rank, then reset
    the prefix cache; returns how many parameter loads that took (a fused experts tensor: one per
    expert and part). TypeError / ValueError, before any change, for a name the model has no weight
    for, a wrong shape, or an engine that cannot take an update now."""
    return _update(llm, "update_weights", list(named_tensors.items() if isinstance(named_tensors, dict)
                                               else named_tensors))


def update_weights_from_disk(llm, model_path: str) -> int:
    """Every tensor of the *.safetensors files in model_path, as update_weights (the workers read
    the files themselves). ValueError, before any change, for a folder without them or a bad tensor."""
    return _update(llm, "update_weights_from_disk", checkpoint_tensors(model_path), model_path)


def _update(llm, what: str, pairs: list, for_workers: str | None = None) -> int:
    """Check pairs on rank 0 into scratch copies (nothing changes on an error), then load them in
    place on every rank (the workers: CPU copies of pairs, a pickled tensor travels through their
    pipe; or for_workers, the checkpoint's folder), then reset the prefix cache."""
    begin_update(llm, what)
    runner = llm.model_runner
    plan = load_param_check(runner.model, pairs, what)
    if runner.workers is not None:
        runner.workers.call(load_in_place, for_workers or [(name, t.detach().cpu()) for name, t in pairs])
    _load_plan(runner.model, plan)
    reset_prefix_cache(llm)
    return len(plan)


def load_param_check(model: nn.Module, pairs: list, what: str) -> list[tuple]:
    """The plan of pairs (_plan), each tensor loaded into a scratch copy of its parameter: a wrong
    shape is a ValueError naming it, and nothing has changed."""
    plan = _plan(model, pairs)
    for name, target, shard_id, tensor, param in plan:
        try:
            load_param(model, target, nn.Parameter(torch.empty_like(param), requires_grad=False), tensor, shard_id)
        except ShapeMismatch as e:
            raise ValueError(f"{what}: {name!r}: {e}") from e
    return plan


def begin_update(llm, what: str):
    """A ValueError unless an update can run now (requests in flight, pipeline stages, a quantized
    model); asleep, the weights are woken first (after sleep(level=2): the checkpoint's), the KV cache
    left asleep, so a subset of tensors updates a whole model."""
    check_idle(llm, what)
    config = llm.config
    if config.pipeline_parallel_size > 1:
        raise ValueError(f"{what} is not supported yet with pipeline parallelism")
    if config.quant_config is not None:
        raise ValueError(f"{what} is not supported for a quantized model "
                         f"({config.quant_config.method!r}: its layers would have to be quantized again)")
    if llm.asleep:
        wake_up(llm, ["weights"])


def load_in_place(runner, source):
    """A rank's part of an update: source, (name, tensor) pairs or a checkpoint folder, into its
    shard of the weights (rank 0 checked them first)."""
    pairs = checkpoint_tensors(source) if isinstance(source, str) else source
    _load_plan(runner.model, _plan(runner.model, pairs))


def _load_plan(model: nn.Module, plan: list[tuple]):
    with torch.no_grad():
        for _, target, shard_id, tensor, param in plan:
            load_param(model, target, param, tensor, shard_id)


def checkpoint_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the *.safetensors files of folder path (on the host)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"model_path must be a path, got {type(path).__name__}")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {os.fspath(path)!r}")
    pairs = []
    for file in files:
        try:
            with safe_open(file, "pt", "cpu") as f:
                pairs += [(name, f.get_tensor(name)) for name in f.keys() if not name.endswith(IGNORED_TENSOR_SUFFIXES)]
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read weights file {file!r}: {e}") from e
    return pairs


def _plan(model: nn.Module, pairs) -> list[tuple]:
    """(name, our parameter's name, shard id, tensor, parameter) for each pair, checked."""
    params = dict(model.named_parameters(remove_duplicate=False))  # (a tied head's name too)
    plan = []
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(f"update_weights takes (name, tensor) pairs or a dict, got {type(pair).__name__}")
        name, tensor = pair
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update_weights takes (str, torch.Tensor) pairs, got ({type(name).__name__}, "
                            f"{type(tensor).__name__})")
        targets = [(*_target(model, name), tensor)]
        if targets[0][0] not in params and name.endswith(FUSED_EXPERTS) and tensor.dim() == 3:
            targets = [(*_target(model, part_name), part) for part_name, part in per_expert(name, tensor)]
        for target, shard_id, part in targets:
            if target not in params:
                raise ValueError(f"update_weights: {name!r} is not a weight of this model")
            plan.append((name, target, shard_id, part.detach(), params[target]))
    return plan


def _target(model: nn.Module, name: str) -> tuple[str | None, object]:
    return model.checkpoint_target(name) if hasattr(model, "checkpoint_target") else (name, None)


# transformers >= 5 keeps a mixture of experts' tensors fused in memory (a trainer's state_dict):
# gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]; its checkpoints, one per expert
FUSED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def per_expert(name: str, tensor: torch.Tensor):
    """A fused experts tensor as the checkpoint's per-expert (name, tensor) pairs."""
    prefix, fused = name.rsplit(".", 1)
    for e, expert in enumerate(tensor):
        if fused == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", expert
        else:
            gate, up = expert.chunk(2)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up
