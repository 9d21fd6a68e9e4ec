"""What the mixture-of-experts families share: the decoder, with some layers' MLP a router plus
experts (layers/moe.py), whose checkpoint tensors (`...experts.E.{gate,up,down}_proj.weight`, Mixtral's
`w1`/`w3`/`w2`, and FP8's `...weight_scale_inv`) are packed into w13 / w2 (and their scales) as they load."""
import re

from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.moe import SparseMoE
from nanovllm.layers.linear import current_quantization
from nanovllm.layers.transformer import DecoderFlags, DecoderForCausalLM, check_decoder_config

EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight(_scale_inv)?$")
EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# Options of other mixture-of-experts designs: a config that sets one is refused, naming it.
UNSUPPORTED = {
    "shared_expert_intermediate_size": "shared experts", "n_shared_experts": "shared experts",
    "num_shared_experts": "shared experts",
}
SUPPORTED_ROUTER = {"scoring_func": ("softmax",), "topk_method": ("greedy",)}


def num_experts_of(config: PretrainedConfig) -> int:
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0


def check_experts_per_token(config: PretrainedConfig, experts_field: str):
    """ValueError unless num_experts_per_tok is an int in [1, the config's `experts_field`]."""
    num_experts, top_k = num_experts_of(config), getattr(config, "num_experts_per_tok", None)
    if num_experts < 1 or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k!r} must be in [1, {experts_field}={num_experts}]")


class SparseDecoderForCausalLM(DecoderForCausalLM):
    """A family says which layers are sparse, how wide its experts are, whether top-k is renormalized."""

    @staticmethod
    def is_sparse(config: PretrainedConfig, layer_index: int) -> bool:
        return True

    @staticmethod
    def expert_size(config: PretrainedConfig) -> int:
        return config.intermediate_size

    @staticmethod
    def renormalize(config: PretrainedConfig) -> bool:
        return True

    @classmethod
    def check_config(cls, config: PretrainedConfig, max_model_len: int | None = None):
        check_decoder_config(config, max_model_len)
        for option, what in UNSUPPORTED.items():
            if getattr(config, option, None):
                raise ValueError(f"{option}={getattr(config, option)!r}: {what} are not supported")
        for option, allowed in SUPPORTED_ROUTER.items():
            value = getattr(config, option, None)
            if value is not None and value not in allowed:
                raise ValueError(f"{option}={value!r} is not supported; supported: {list(allowed)}")
        num_experts, top_k = num_experts_of(config), getattr(config, "num_experts_per_tok", None)
        if any(cls.is_sparse(config, i) for i in range(config.num_hidden_layers)):
            if num_experts < 1:
                raise ValueError("the config has sparse layers but no num_experts / num_local_experts")
            if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
                raise ValueError(f"num_experts_per_tok={top_k!r} must be in [1, {num_experts}] (the number of experts)")

    @classmethod
    def build_mlp(cls, config: PretrainedConfig, layer_index: int, flags: DecoderFlags) -> nn.Module:
        if not cls.is_sparse(config, layer_index):
            return DecoderForCausalLM.build_mlp(config, layer_index, flags)
        quantization = current_quantization()  # (the engine's; None when unquantized or listed as not converted)
        if quantization is not None and quantization.skips(f"model.layers.{layer_index}.mlp.experts"):
            quantization = None
        return SparseMoE(config.hidden_size, cls.expert_size(config), num_experts_of(config),
                         config.num_experts_per_tok, cls.renormalize(config), quantization)

    def checkpoint_target(self, name: str) -> tuple[str | None, object]:
        return expert_target(name, num_experts_of(self.config)) or super().checkpoint_target(name)


def expert_target(name: str, num_experts: int) -> tuple[str | None, object] | None:
    """An expert's checkpoint tensor's packed parameter and (expert, part); (None, None) for an
    expert the config does not have; None for any other tensor."""
    match = EXPERT_TENSOR.search(name)
    if match is None:
        return None
    expert = int(match.group(1))
    if expert >= num_experts:
        return None, None
    packed = "w2" if EXPERT_PART[match.group(2)] == "down" else "w13"
    scale = match.group(3) or ""                       # "_scale_inv": the weight's FP8 block scales
    return f"{name[:match.start()]}.experts.{packed}{scale}", (expert, EXPERT_PART[match.group(2)])
