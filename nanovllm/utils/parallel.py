"""The tensor-parallel group the layers being built see (utils/tp_group.py's TPGroup; None: one rank).
Layers read it through tp_rank() / tp_size() / tp_group() when built inside `tensor_parallel(group)`."""
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanovllm.utils.tp_group import TPGroup

_GROUP: "TPGroup | None" = None


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
