"""Attention backends: one interface, chosen once at start-up.

A backend is a class with two static methods, and `elementwise`: the module of fused RMSNorm and
SiLU-and-mul kernels its path runs (layers/fused_triton.py for triton's and CUDA flash_attn's; None: torch's):
  store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
      write the step's new K/V ([T, Hkv, D]) into the paged cache ([num_blocks, block_size, Hkv, D])
  forward(q, k, v, k_cache, v_cache, context, scale, k_scale, v_scale) -> [T, H, D]
      attention of the new queries over each sequence's context (cache + new tokens)
k_scale, v_scale (the layer's 0-dim float32 tensors; None: 1.0) are read only when the cache is
fp8: store_kv quantizes with them and forward dequantizes (torch_ref.py says how).

flash_attn  flash-attn's varlen / kv-cache kernels (CUDA; needs block_size % 256 == 0; no fp8 cache)
triton      our own kernels (CUDA; on CPU they run under the Triton interpreter, slowly: for tests;
            one of the two per process, see utils/triton_mode.py)
torch       plain PyTorch, any device: the reference the others are tested against
"""
import importlib.util

from nanovllm.layers.backends.torch_ref import TorchBackend

BACKENDS = ("flash_attn", "triton", "torch")
# Backends whose kernels read an fp8 KV cache with our per-layer scales. flash-attn 2's paged
# kernels take K/V in the query's dtype only.
FP8_KV_BACKENDS = ("triton", "torch")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def available_backends(device: str) -> list[str]:
    """The backends that can run on `device`, best first."""
    found = [name for name in ("flash_attn", "triton") if _installed(name)]
    return found + ["torch"]


def resolve_backend(name: str | None, device: str, fp8_kv: bool = False) -> str:
    """The named backend if it is available, else (None) the best for device (fp8_kv: that reads an
    fp8 KV cache). On CPU the default is torch: the others run there only as integration tests."""
    available = available_backends(device)
    if name is None:
        if device != "cuda":
            return "torch"
        return next(b for b in available if not fp8_kv or b in FP8_KV_BACKENDS)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be None or one of {BACKENDS}, got {name!r}")
    if name not in available:
        raise ValueError(f"attention_backend={name!r} is not available on device={device!r} "
                         f"(is the {name} package installed?); available here: {available}")
    if fp8_kv and name not in FP8_KV_BACKENDS:
        raise ValueError(f"attention_backend={name!r} cannot read an fp8 KV cache (kv_cache_dtype='fp8'): use "
                         f"attention_backend='triton' or 'torch', or kv_cache_dtype='auto'")
    return name


def get_backend(name: str, device: str):
    if name == "flash_attn":  # (imported here: flash-attn is an optional package)
        from nanovllm.layers.backends.flash_attn import FlashAttnBackend
        return FlashAttnBackend.on(device)
    if name == "triton":
        # Interpreted on CPU, compiled on CUDA: one mode per process, an engine needing the other one is
        # refused (utils/triton_mode.py, loaded here: the torch backend needs no Triton)
        from nanovllm.utils.triton_mode import import_kernels
        return import_kernels("nanovllm.layers.backends.triton_attn", device, "attention_backend='triton'").TritonBackend
    return TorchBackend
