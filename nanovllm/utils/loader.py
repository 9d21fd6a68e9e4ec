"""Weights: safetensors shards into our (packed, possibly sharded) parameters (random ones: dummy_weights.py)."""
import glob
import os

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanovllm.utils.logging import progress
from nanovllm.utils.parallel import HeldElsewhere

# Checkpoint tensors that hold no weights: old checkpoints saved RoPE's inverse frequencies.
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


class ShapeMismatch(Exception):
    """A checkpoint tensor's shape is not the one config.json implies. Weight loaders raise it (they
    know neither the tensor's name nor its file); load_model turns it into a ValueError naming both."""

    def __init__(self, expected: tuple[int, ...], found: tuple[int, ...]):
        super().__init__(f"expected shape {expected}, found {found}")
        self.expected, self.found = expected, found


def check_shape(loaded: torch.Tensor, expected) -> None:
    """`expected` is the full, unsharded checkpoint shape: a loader checks it before taking its
    rank's slice, since slicing a too-large tensor would silently succeed."""
    expected, found = tuple(expected), tuple(loaded.shape)
    if found != expected:
        raise ShapeMismatch(expected, found)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor):
    """For parameters that are never sharded (norms): the checkpoint tensor is the whole parameter."""
    check_shape(loaded, param.shape)
    param.data.copy_(loaded)


def load_param(model: nn.Module, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
    """Copy `loaded` into parameter `name` through its owning module's weight_loader, if it has one.
    Looked up on the module, not stored on the parameter: a bound method there would make a cycle
    (module -> param -> method -> module) keeping the weights alive until the garbage collector runs."""
    module = model.get_submodule(name.rpartition(".")[0])
    loader = getattr(module, "weight_loader", None)
    if shard_id is not None:  # a part of a packed matrix: only packed layers know where it goes
        loader(param, loaded, shard_id)
    else:
        (loader or default_weight_loader)(param, loaded)


def load_model(model: nn.Module, path: str, show_progress: bool = True):
    """Copy every checkpoint tensor into its parameter through its module's weight_loader.

    Checkpoint names are Hugging Face's; the model's `checkpoint_target(name)` redirects the parts
    of packed matrices (q/k/v, gate/up, a layer's experts) to the packed parameter with their shard
    id. Raises ValueError when a file cannot be read, a tensor's shape is not the one config.json
    implies, a parameter (or a part of a packed one: `missing_shards()`) gets no weight, or a
    checkpoint tensor has no parameter (a model option unknown here would otherwise be dropped
    silently). show_progress: a bar over the shards (rank 0 only: every rank reads every shard)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r} (use load_format='dummy' for random weights)")
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    unexpected: list[str] = []
    elsewhere = tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, HeldElsewhere))
    for file in progress(files, "Loading safetensors shards", enabled=show_progress, unit="shard"):
        load_file(model, file, params, elsewhere, loaded, unexpected)
    if unexpected:
        raise ValueError(f"checkpoint in {path!r} has tensors this model does not use: {unexpected[:5]}"
                         f"{' and more' if len(unexpected) > 5 else ''}; is config.json right for these weights?")
    shared = {n for n, p in params.items() if any(p is params[m] for m in loaded)}  # tied weights
    # (parameters marked optional, such as the KV-cache scales, keep their defaults when absent)
    missing = sorted(n for n in set(params) - loaded - shared if not getattr(params[n], "optional", False))
    missing += [f"{name}.{shard}" for name, module in model.named_modules() if hasattr(module, "missing_shards")
                for shard in module.missing_shards()]
    if missing:
        raise ValueError(f"checkpoint in {path!r} has no weights for {missing[:5]}"
                         f"{' and more' if len(missing) > 5 else ''}")
    process_weights_after_loading(model)


def load_file(model: nn.Module, file: str, params: dict, elsewhere: tuple, loaded: set[str], unexpected: list[str]):
    """One safetensors file's tensors into their parameters, noted in `loaded` (those with none: `unexpected`)."""
    try:
        f = safe_open(file, "pt", "cpu")
    except (SafetensorError, OSError) as e:  # truncated, empty, not safetensors, unreadable
        raise ValueError(f"cannot read weights file {file!r}: {e}") from e
    with f:
        for name in f.keys():
            target, shard_id = model.checkpoint_target(name)
            if target not in params:
                if target is not None and target.startswith(elsewhere):  # (pipeline parallelism: another stage's)
                    continue
                if shard_id is not None or not name.endswith(IGNORED_TENSOR_SUFFIXES):
                    unexpected.append(name)
                continue
            try:
                tensor = f.get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise ValueError(f"cannot read tensor {name!r} from weights file {file!r}: {e}") from e
            try:
                load_param(model, target, params[target], tensor, shard_id)
            except ShapeMismatch as e:
                raise ValueError(f"tensor {name!r} in {file!r} has shape {e.found}, but config.json implies "
                                 f"{e.expected}; is config.json right for these weights?") from None
            except ValueError as e:  # a loader that refuses the values (a KV-cache scale of 0)
                raise ValueError(f"tensor {name!r} in {file!r}: {e}") from None
            loaded.add(target)


def process_weights_after_loading(model: nn.Module):
    """Let each layer repack what it loaded (quantization="fp8" quantizes its weights here)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
        elif hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
