"""Model registry: config.json's architectures[0] -> the class that implements it."""
from transformers import PretrainedConfig

from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.mistral import MistralForCausalLM
from nanovllm.models.mixtral import MixtralForCausalLM
from nanovllm.models.qwen2 import Qwen2ForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM

REGISTRY = {cls.__name__: cls for cls in (LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM,
                                          Qwen3ForCausalLM, Qwen3MoeForCausalLM)}


def resolve_model_class(hf_config: PretrainedConfig, max_model_len: int | None = None):
    """The class for hf_config, after its check_config: ValueError for an unsupported architecture
    or option. Options that depend on the sequence length (a sliding window) are checked only when
    max_model_len is given; the model's constructor checks them again with its max_position."""
    architectures = getattr(hf_config, "architectures", None) or []
    if isinstance(architectures, str):  # a hand-written config.json may give one name, not a list
        architectures = [architectures]
    registry = REGISTRY
    if not architectures or architectures[0] not in registry:
        name = architectures[0] if architectures else None
        raise ValueError(f"unsupported model architecture {name!r}; supported: {sorted(registry)}")
    model_class = registry[architectures[0]]
    model_class.check_config(hf_config, max_model_len)
    return model_class
