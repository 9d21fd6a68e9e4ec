import json
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, PretrainedConfig

from nanovllm.layers.backends import resolve_backend
from nanovllm.models import resolve_model_class

if TYPE_CHECKING:
    from nanovllm.features.speculative.config import SpeculativeConfig
    from nanovllm.layers.quantization import QuantizationConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "dummy")
# kv_cache_dtype (vLLM's names) -> the paged cache's element type; "auto" (None): the model's dtype.
# fp8 is e4m3 (3 mantissa bits, range +-448), as vLLM's: K/V need its precision more than e5m2's range.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
# flash-attn's paged kernels index the KV cache in pages of 256 tokens; other backends take any size,
# and 16 keeps the last, partly filled block of each sequence small.
FLASH_ATTN_BLOCK_SIZE = 256
DEFAULT_BLOCK_SIZE = 16
GENERATION_CONFIG = "generation_config.json"


@dataclass
class Config:
    """Every engine option (LLM's keyword options, the CLI's flags), validated once; derived values are properties.

    model: a Hugging Face folder (config.json, *.safetensors, optional tokenizer files), or a Hub
        repository id such as "Qwen/Qwen3-0.6B" (downloaded into the Hub cache, or read offline).
    device: "cuda" when available, else "cpu".  dtype: the config's dtype on CUDA (bf16 if it
        says float32), float32 on CPU; or "float32" / "bfloat16" / "float16" / a torch dtype.
    tensor_parallel_size: ranks to shard the model over.  enforce_eager: no CUDA graphs.
    pipeline_parallel_size: stages to split the decoder layers over, each of tensor_parallel_size
        ranks (distributed/pipeline.py).
    nnodes, node_rank, master_addr, master_port, node_timeout: tensor parallelism over nnodes machines
        (distributed/nodes.py; node 0 runs the engine, the others `nanovllm serve MODEL --headless ...`):
        node 0's address and a free port there (None: MASTER_ADDR / MASTER_PORT); seconds to wait for nodes.
    max_num_seqs: sequences per step.  max_num_batched_tokens: tokens per step (longer prompts
        are prefilled in chunks).  max_model_len: prompt + completion cap, at most the model's
        max_position_embeddings (the default is capped).  gpu_memory_utilization: GPU memory share to use.
    kvcache_block_size: tokens per KV block (None: 256 for flash_attn, else 16).
    num_kvcache_blocks: KV blocks (None: sized from free GPU memory, or a fixed budget on CPU).
    enable_prefix_caching: share KV blocks between requests with a common prefix.
    async_scheduling: overlap the host's work for the next step with the device's work on this
        one (False: the plain synchronous loop; the outputs are the same).
    attention_backend: "flash_attn", "triton", "torch" or None (the best available).
    load_format: "auto" (safetensors) or "dummy" (random weights, for benchmarks).
    kv_cache_dtype: "auto" (the model's dtype) or "fp8" (= "fp8_e4m3"): the paged KV cache holds
        float8_e4m3fn, twice the tokens of bf16; each layer's K and V are divided by its k_scale /
        v_scale on store (1.0, or the checkpoint's model.layers.N.self_attn.k_scale / .v_scale)
        and dequantized inside the attention kernels. Backends "triton" and "torch" only.
    speculative_config: speculative decoding, with vLLM's names (README's "Speculative decoding";
        features/speculative/config.py validates it): {"method": "ngram", "num_speculative_tokens": k, ...}
        or {"method": "draft_model", "model": DRAFT_PATH, "num_speculative_tokens": k}; None: off.
    quantization: "fp8" quantizes the linear layers' weights at load; None reads the checkpoint's
        config.json (FP8 block and AWQ int4 checkpoints load as they are; layers/quantization).
    kv_offloading_size: GiB of host memory, over all ranks, for a second tier of the prefix cache
        (features/host_tier.py); 0: off.  preemption_mode: "recompute" (a preempted sequence's
        tokens are computed again) or "swap" (its blocks kept in the host tier).
    batch_invariant: a sequence's tokens and logprobs bitwise the same whatever else is in the
        batch and however its prompt is chunked (features/batch_invariant.py: fixed tilings; slower).
    """
    model: str
    device: str | None = None
    dtype: str | torch.dtype | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    node_timeout: float = 60.0
    enforce_eager: bool = False
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    kvcache_block_size: int | None = None
    num_kvcache_blocks: int | None = None
    enable_prefix_caching: bool = True
    async_scheduling: bool = True
    attention_backend: str | None = None
    load_format: str = "auto"
    kv_cache_dtype: str = "auto"
    speculative_config: dict | str | None = None
    quantization: str | None = None
    kv_offloading_size: float = 0
    preemption_mode: str = "recompute"
    batch_invariant: bool = False
    speculative: "SpeculativeConfig | None" = field(init=False, default=None)
    quant_config: "QuantizationConfig | None" = field(init=False, default=None)
    draft_hf_config: PretrainedConfig | None = field(init=False, default=None, repr=False)
    hf_config: PretrainedConfig = field(init=False, repr=False)
    eos_token_ids: set[int] = field(init=False, repr=False)

    @classmethod
    def from_options(cls, model: str, options: dict) -> "Config":
        """The config of LLM(model, **options): a TypeError names an option it does not have."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"LLM() has no option {unknown[0]!r}; its options are: {', '.join(OPTIONS)}")
        return cls(model, **options)

    def __post_init__(self):
        if not (isinstance(self.model, (str, os.PathLike)) and os.path.isdir(self.model)):
            from nanovllm.utils.hub import resolve_model  # (a Hub repository id, or an error: loaded for those)
            self.model = resolve_model(self.model)
        self.model = os.fspath(self.model)
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model folder {self.model!r} has no config.json")
        self._check_options()
        if (self.nnodes, self.node_rank, self.master_addr, self.master_port) != (1, 0, None, None):
            from nanovllm.distributed.options import check_nodes  # (multi-node's checks: loaded when asked for)
            check_nodes(self)
        if self.speculative_config is not None:
            from nanovllm.features.speculative.config import SpeculativeConfig  # (a layer: loaded when asked for)
            self.speculative = SpeculativeConfig.parse(self.speculative_config)
        if self.kv_offloading_size != 0 or self.preemption_mode != "recompute":  # (not the defaults)
            from nanovllm.features.host_tier import check_options  # (the host tier's layer: loaded when asked for)
            check_options(self)
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or None, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
        self._read_model_config()
        self.attention_backend = resolve_backend(self.attention_backend, self.device,
                                                 fp8_kv=KV_CACHE_DTYPES[self.kv_cache_dtype] is not None)
        if self.attention_backend == "flash_attn" and self.block_size % FLASH_ATTN_BLOCK_SIZE:
            raise ValueError(f"the flash_attn backend needs kvcache_block_size to be a multiple of "
                             f"{FLASH_ATTN_BLOCK_SIZE}, got {self.block_size}")
        self.dtype = self._resolve_dtype()
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            from nanovllm.distributed.options import check_parallel  # (TP's and PP's checks: loaded when asked for)
            check_parallel(self)

    def _positive_int(self, name: str, allow_none: bool = False):
        value = getattr(self, name)
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")

    def _check_options(self):
        """The options' types and ranges (those checked against the model come later)."""
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            self._positive_int(name)
        self._positive_int("kvcache_block_size", allow_none=True)
        self._positive_int("num_kvcache_blocks", allow_none=True)
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float)):
            raise TypeError(f"gpu_memory_utilization must be a number, got {self.gpu_memory_utilization!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("enforce_eager", "enable_prefix_caching", "async_scheduling", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")

    def _read_model_config(self):
        """hf_config, and what follows: max_model_len, the EOS ids, the architecture, quantization, a draft's config."""
        try:
            self.hf_config = AutoConfig.from_pretrained(self.model)
        except Exception as e:  # an unknown model_type, a broken config.json, ...
            raise ValueError(f"cannot read {self.model}/config.json: {e}") from e
        text = self.hf_config.get_text_config()  # a multimodal checkpoint's text model (Qwen3.5's); else itself
        text.architectures, self.hf_config = self.hf_config.architectures, text
        max_positions = getattr(self.hf_config, "max_position_embeddings", None) or self.max_model_len
        if self.max_model_len > max_positions and self.max_model_len != type(self).max_model_len:  # (asked for)
            raise ValueError(f"max_model_len={self.max_model_len} is beyond max_position_embeddings={max_positions}")
        self.max_model_len = min(self.max_model_len, max_positions)  # (the default: capped)
        # EOS ids of config.json and generation_config.json together (instruct checkpoints, Qwen2.5/3,
        # list their chat turn's end besides <|endoftext|>; HF and vLLM stop at either; empty: the
        # tokenizer's), read here so that a broken generation_config.json is a ValueError at start-up.
        self.eos_token_ids = token_id_set(getattr(self.hf_config, "eos_token_id", None), "config.json") | token_id_set(
            read_generation_config(self.model).get("eos_token_id"), GENERATION_CONFIG)
        # ValueError for an unsupported architecture or option (a sliding window < max_model_len)
        resolve_model_class(self.hf_config, self.max_model_len)
        if self.quantization is not None or getattr(self.hf_config, "quantization_config", None) is not None:
            from nanovllm.layers.quantization import QuantizationConfig  # (quantization's layer: loaded when asked for)
            self.quant_config = QuantizationConfig.resolve(self.quantization, self.hf_config)
        if self.speculative is not None and self.speculative.method == "draft_model":
            self.draft_hf_config = self.speculative.draft_hf_config(self.hf_config, self.max_model_len)

    def _resolve_dtype(self) -> torch.dtype:
        dtype = self.dtype
        if dtype is None:
            if self.device == "cpu":  # CPU kernels are fastest and exact in float32
                return torch.float32
            dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
            if dtype is None or dtype == torch.float32 or dtype == "float32":
                return torch.bfloat16  # the models this engine serves are trained and shipped in bf16
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {list(DTYPES)} or a torch dtype, got {dtype!r}")
            return DTYPES[dtype]
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {list(DTYPES)} or a torch dtype, got {dtype!r}")
        return dtype

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size in each of pipeline_parallel_size stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def block_size(self) -> int:
        """Tokens per KV block: the user's choice, else what the attention backend prefers."""
        if self.kvcache_block_size is not None:
            return self.kvcache_block_size
        return FLASH_ATTN_BLOCK_SIZE if self.attention_backend == "flash_attn" else DEFAULT_BLOCK_SIZE

    @property
    def kv_dtype(self) -> torch.dtype:
        """The paged KV cache's element type: float8_e4m3fn for kv_cache_dtype "fp8", else the model's dtype."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


def read_generation_config(folder: str) -> dict:
    """generation_config.json's contents ({} when the folder has none)."""
    path = os.path.join(folder, GENERATION_CONFIG)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def token_id_set(value, source: str) -> set[int]:
    """An eos_token_id field (None, an id, or a list of ids) as a set."""
    ids = [] if value is None else value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"{source}: eos_token_id must be a token id or a list of them, got {value!r}")
    return set(ids)


# LLM's keyword options, in order: Config's fields that a caller sets, the model aside.
OPTIONS = tuple(f.name for f in fields(Config) if f.init and f.name != "model")
