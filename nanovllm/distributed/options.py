"""Config's checks of the parallel options: tensor_parallel_size > 1 (check_tensor_parallel),
pipeline_parallel_size > 1 (check_pipeline), both through check_parallel, and several nodes
(check_nodes), each a ValueError or TypeError that names the option.

Config calls them when the option asks for them. They live here, apart from the layers they check
(engine/workers.py, distributed/stages.py and nodes.py), because this module imports nothing of
nanovllm, not even for a type: `config` is the Config being checked. The layers import Config
(for their types), so checks kept in them made Config import its own importers, an import cycle
(tests/test_core_size.py counts `if TYPE_CHECKING:` imports as edges: they are a dependency all
the same, which a reader and a type checker follow)."""
import os

import torch


def check_parallel(config) -> None:
    """Config's checks when tensor_parallel_size or pipeline_parallel_size is over 1."""
    if config.tensor_parallel_size > 1:
        check_tensor_parallel(config)
    if config.pipeline_parallel_size > 1:
        check_pipeline(config)


def check_tensor_parallel(config) -> None:
    """A ValueError unless every split the sharded layers make is exact (Config, when tensor_parallel_size > 1)."""
    tp, c = config.tensor_parallel_size, config.hf_config
    check_gpus(config)
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    checks = [("num_attention_heads", c.num_attention_heads, c.num_attention_heads % tp == 0),
              ("num_key_value_heads", kv_heads, kv_heads % tp == 0 or tp % kv_heads == 0),
              ("vocab_size", c.vocab_size, c.vocab_size % tp == 0),
              ("intermediate_size", c.intermediate_size, c.intermediate_size % tp == 0)]
    for name, value, ok in checks:
        if not ok:
            raise ValueError(f"tensor_parallel_size={tp} cannot split the model's {name}={value}: it must be "
                             f"divisible by {tp}" + (f" (or divide {tp})" if name == "num_key_value_heads" else ""))


def check_pipeline(config) -> None:
    """Config's checks of pipeline_parallel_size > 1: a ValueError naming the option."""
    pp, layers = config.pipeline_parallel_size, config.hf_config.num_hidden_layers
    if pp > layers:
        raise ValueError(f"pipeline_parallel_size={pp} is more than the model's num_hidden_layers={layers}: "
                         f"every stage needs a layer")
    if config.speculative is not None:
        raise ValueError("speculative_config is not supported with pipeline_parallel_size > 1")
    check_gpus(config)


def check_gpus(config) -> None:
    """A ValueError unless each node sees a GPU for each of its ranks (one GPU a rank: NCCL's rule)."""
    local = config.world_size // config.nnodes  # (ranks on this node)
    if config.device == "cuda" and local > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} x pipeline_parallel_size="
                         f"{config.pipeline_parallel_size} over nnodes={config.nnodes} needs {local} GPUs on each "
                         f"node; {torch.cuda.device_count()} are visible")


def check_nodes(config) -> None:
    """Config's check of the multi-node options (when nnodes != 1 or node_rank != 0); fills
    master_addr / master_port from MASTER_ADDR / MASTER_PORT where not given."""
    for name in ("nnodes", "node_rank"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if config.nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {config.nnodes}")
    if not 0 <= config.node_rank < config.nnodes:
        raise ValueError(f"node_rank must be in [0, nnodes={config.nnodes}), got {config.node_rank}")
    if config.nnodes == 1:
        raise ValueError(f"master_addr and master_port are for nnodes > 1, got master_addr={config.master_addr!r}, "
                         f"master_port={config.master_port!r} with nnodes=1")
    if config.world_size % config.nnodes:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} x pipeline_parallel_size="
                         f"{config.pipeline_parallel_size} ranks cannot be split over nnodes={config.nnodes}: each "
                         f"node runs tensor_parallel_size x pipeline_parallel_size / nnodes ranks")
    if launched_by_torchrun():  # (one process a node: torchrun --nproc-per-node 1; its RANK is the node's)
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if config.nnodes != world:
            raise ValueError(f"under torchrun, nnodes must be its WORLD_SIZE={world} (one process a node: "
                             f"--nproc-per-node 1), got nnodes={config.nnodes}")
        if config.node_rank not in (0, rank):
            raise ValueError(f"under torchrun, node_rank is its RANK={rank}, got node_rank={config.node_rank}")
        config.node_rank = rank
    if config.master_addr is None:
        config.master_addr = os.environ.get("MASTER_ADDR")
    if config.master_port is None and os.environ.get("MASTER_PORT"):
        config.master_port = int(os.environ["MASTER_PORT"])
    if not isinstance(config.master_addr, str) or not config.master_addr:
        raise ValueError(f"nnodes={config.nnodes} needs master_addr (node 0's address; --master-addr, or "
                         f"MASTER_ADDR in the environment), got {config.master_addr!r}")
    port = config.master_port
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"nnodes={config.nnodes} needs master_port (a free port on node 0, 1-65535; "
                         f"--master-port, or MASTER_PORT in the environment), got {port!r}")
    if isinstance(config.node_timeout, bool) or not isinstance(config.node_timeout, (int, float)) \
            or not config.node_timeout > 0:
        raise ValueError(f"node_timeout must be a positive number of seconds, got {config.node_timeout!r}")


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ
