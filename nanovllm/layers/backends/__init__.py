"""Attention backends: one interface, chosen once at start-up.

A backend is a class with two static methods:
  store_kv(k, v, k_cache, v_cache, slot_mapping)  write the step's new K/V ([T, Hkv, D]) into the
                                                    paged cache ([num_blocks, block_size, Hkv, D])
  forward(q, k, v, k_cache, v_cache, context, scale) -> [T, H, D]
                                                    attention of the new queries over each
                                                    sequence's context (cache + new tokens)
"""
BACKENDS = ("flash_attn", "triton", "torch")


def available_backends(device: str) -> list[str]:
    """The backends that can run on `device`, best first."""
    return ["torch"]


def resolve_backend(name: str | None, device: str) -> str:
    available = available_backends(device)
    if name is None:
        return available[0]
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be None or one of {BACKENDS}, got {name!r}")
    if name not in available:
        raise ValueError(f"attention_backend={name!r} is not available on device={device!r}; "
                         f"available here: {available}")
    return name


def get_backend(name: str):
    from nanovllm.layers.backends.torch_ref import TorchBackend
    return {"torch": TorchBackend}[name]
