"""Model registry: config.json's architectures[0] -> the class that implements it. A family's
module is imported when a checkpoint names it (the mixtures of experts bring the MoE layer)."""
import importlib

from transformers import PretrainedConfig

REGISTRY = {  # architecture -> its module under nanovllm.models
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3", "GptOssForCausalLM": "gpt_oss",
    "Qwen3_5ForCausalLM": "qwen3_5", "Qwen3_5ForConditionalGeneration": "qwen3_5_vl",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration": "qwen3_5_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl", "Qwen3VLForConditionalGeneration": "qwen3_vl",
}


def resolve_model_class(hf_config: PretrainedConfig, max_model_len: int | None = None):
    """The class for hf_config, after its check_config: ValueError for an unsupported architecture
    or option (those that depend on max_model_len, a sliding window, only when it is given)."""
    architectures = getattr(hf_config, "architectures", None) or []  # (a str: a hand-written config.json's one name)
    name = architectures if isinstance(architectures, str) else next(iter(architectures), None)
    if name not in REGISTRY:
        raise ValueError(f"unsupported model architecture {name!r}; supported: {sorted(REGISTRY)}")
    model_class = getattr(importlib.import_module(f"nanovllm.models.{REGISTRY[name]}"), name)
    model_class.check_config(hf_config, max_model_len)
    return model_class
