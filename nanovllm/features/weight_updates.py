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

Not here yet: quantized checkpoints (their layers would have to be quantized again), tensor
parallelism (each rank's shard), updates over torch.distributed, sleep and wake, batch invariance.
"""
import torch
from torch import nn

from nanovllm.engine.block_manager import BlockManager
from nanovllm.utils.loader import ShapeMismatch, load_param


def update_weights(llm, named_tensors) -> int:
    """Load (name, tensor) pairs (or a dict) into llm's model in place, then reset the prefix cache;
    returns how many parameter loads that took (a fused experts tensor: one per expert and part).
    TypeError / ValueError, before any change, for a name the model has no weight for, a wrong
    shape, or an engine that cannot take an update now."""
    check_idle(llm, "update_weights")
    config = llm.config
    if config.world_size > 1:
        raise ValueError("update_weights is not supported yet with tensor or pipeline parallelism")
    if config.quant_config is not None:
        raise ValueError(f"update_weights is not supported for a quantized model "
                         f"({config.quant_config.method!r}: its layers would have to be quantized again)")
    model = llm.model_runner.model
    plan = _plan(model, named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    for name, target, shard_id, tensor, param in plan:  # (into scratch copies: nothing changes on an error)
        try:
            load_param(model, target, nn.Parameter(torch.empty_like(param), requires_grad=False), tensor, shard_id)
        except ShapeMismatch as e:
            raise ValueError(f"update_weights: {name!r}: {e}") from e
    with torch.no_grad():
        for _, target, shard_id, tensor, param in plan:
            load_param(model, target, param, tensor, shard_id)
    reset_prefix_cache(llm)
    return len(plan)


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


def check_idle(llm, what: str):
    if not llm.is_finished():
        raise ValueError(f"{what} needs the engine idle: requests are in flight (let them finish, or abort them)")


def reset_prefix_cache(llm):
    """Forget every cached prefix (the engine idle): no later request reuses KV or state computed before."""
    check_idle(llm, "reset_prefix_cache")
    forget_cached_blocks(llm.block_manager)


def forget_cached_blocks(manager: BlockManager):
    """Every block's key and contents forgotten (all free: the engine is idle), and with them the
    host tier's entries, the state cache's snapshots and the window pool's keys."""
    for block in manager.blocks:
        block.hash, block.token_ids, block.uid, block.parent_uid = None, None, None, None
    manager.hash_to_block.clear()
    if manager.host is not None:
        manager.host = type(manager.host)(manager.host.num_slots)
    snapshots = getattr(manager, "snapshots", None)  # (features/state_cache.py's)
    if snapshots:
        manager.free_snapshot_slots.extend(snapshots.values())
        snapshots.clear()
    window = getattr(manager, "window", None)  # (features/window_blocks.py's pool of its own)
    if isinstance(window, BlockManager):
        forget_cached_blocks(window)
