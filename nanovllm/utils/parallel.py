"""The tensor-parallel group the layers being built see (utils/tp_group.py's TPGroup; None: one rank).
Layers read it through tp_rank() / tp_size() / tp_group() when built inside `tensor_parallel(group)`.
A pipeline stage's model is built inside distributed/stages.py's pipeline_stage(layers) too."""
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from nanovllm.utils.tp_group import TPGroup

_GROUP: "TPGroup | None" = None
_STAGE_LAYERS: range | None = None  # (pipeline_stage's: the decoder layers of the stage being built)


@contextmanager
def tensor_parallel(group: "TPGroup | None"):
    """Layers built inside see `group` through tp_rank() / tp_size() / tp_group()."""
    global _GROUP
    previous, _GROUP = _GROUP, group
    try:
        yield
    finally:
        _GROUP = previous


def tp_group() -> "TPGroup | None":
    return _GROUP


def tp_rank() -> int:
    return _GROUP.rank if _GROUP is not None else 0


def tp_size() -> int:
    return _GROUP.size if _GROUP is not None else 1


class HeldElsewhere(nn.Module):
    """In place of a part of the model another pipeline stage holds, or none runs: the loader skips its tensors."""


def stage_layers(num_layers: int) -> range:
    """The decoder layers the model being built holds: all, but for a pipeline stage."""
    return _STAGE_LAYERS if _STAGE_LAYERS is not None else range(num_layers)
