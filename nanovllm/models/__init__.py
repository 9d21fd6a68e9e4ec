"""Model registry: config.json's architectures[0] -> the class that implements it."""
from transformers import PretrainedConfig


def _registry() -> dict:
    from nanovllm.models.qwen3 import Qwen3ForCausalLM
    return {"Qwen3ForCausalLM": Qwen3ForCausalLM}


def resolve_model_class(hf_config: PretrainedConfig):
    architectures = getattr(hf_config, "architectures", None) or []
    registry = _registry()
    if not architectures or architectures[0] not in registry:
        name = architectures[0] if architectures else None
        raise ValueError(f"unsupported model architecture {name!r}; supported: {sorted(registry)}")
    model_class = registry[architectures[0]]
    model_class.check_config(hf_config)
    return model_class
