"""Weights: safetensors shards into our (packed, possibly sharded) parameters, or dummy weights."""
import glob
import os

import torch
from safetensors import safe_open
from torch import nn

# Checkpoint tensors that hold no weights: old checkpoints saved RoPE's inverse frequencies.
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
# Dummy weights: small uniform values keep activations finite through any depth; throughput does
# not depend on the values.
DUMMY_WEIGHT_RANGE = 1e-3


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor):
    param.data.copy_(loaded)


def load_model(model: nn.Module, path: str):
    """Copy every checkpoint tensor into its parameter through that parameter's weight_loader.

    Checkpoint names are Hugging Face's; `packed_modules_mapping` redirects the parts of packed
    matrices (q/k/v, gate/up) to the packed parameter with their shard id. Raises ValueError when
    a parameter gets no weight, or a checkpoint tensor has no parameter to go to (a model option
    this implementation does not know would otherwise be silently dropped).
    """
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r} (use load_format='dummy' for random weights)")
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                for part, (packed_part, shard_id) in packed.items():
                    if part in name:
                        target = name.replace(part, packed_part)
                        if target in params:
                            params[target].weight_loader(params[target], f.get_tensor(name), shard_id)
                            loaded.add(target)
                        else:
                            unexpected.append(name)
                        break
                else:
                    if name in params:
                        param = params[name]
                        getattr(param, "weight_loader", default_weight_loader)(param, f.get_tensor(name))
                        loaded.add(name)
                    elif not name.endswith(IGNORED_TENSOR_SUFFIXES):
                        unexpected.append(name)
    if unexpected:
        raise ValueError(f"checkpoint in {path!r} has tensors this model does not use: {unexpected[:5]}"
                         f"{' and more' if len(unexpected) > 5 else ''}; is config.json right for these weights?")
    shared = {n for n, p in params.items() if any(p is params[m] for m in loaded)}  # tied weights
    missing = sorted(set(params) - loaded - shared)
    if missing:
        raise ValueError(f"checkpoint in {path!r} has no weights for {missing[:5]}"
                         f"{' and more' if len(missing) > 5 else ''}")


@torch.no_grad()
def load_dummy(model: nn.Module, seed: int = 0):
    """Random weights of the right shapes; norms stay at 1 so activations keep a sane scale."""
    generators = {}
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generators[param.device])
