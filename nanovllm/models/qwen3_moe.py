"""Qwen3-MoE: Qwen3's attention (QK-norm); a layer's MLP is sparse unless `mlp_only_layers` lists
it or `decoder_sparse_step` skips it. Experts are `moe_intermediate_size` wide; the router's top-k
weights are renormalized when `norm_topk_prob`."""
from transformers import PretrainedConfig

from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.sparse import SparseDecoderForCausalLM, num_experts_of


class Qwen3MoeForCausalLM(SparseDecoderForCausalLM):
    flags = staticmethod(Qwen3ForCausalLM.flags)

    @staticmethod
    def is_sparse(config: PretrainedConfig, layer_index: int) -> bool:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
                and num_experts_of(config) > 0 and (layer_index + 1) % step == 0)

    @staticmethod
    def expert_size(config: PretrainedConfig) -> int:
        return config.moe_intermediate_size

    @staticmethod
    def renormalize(config: PretrainedConfig) -> bool:
        return bool(getattr(config, "norm_topk_prob", False))
