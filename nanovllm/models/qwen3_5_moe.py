"""Qwen3.5-MoE (text; Qwen/Qwen3.5-35B-A3B and up): Qwen3.5's hybrid decoder (models/qwen3_5.py),
every layer's MLP a mixture of experts plus a shared expert, as transformers'
modeling_qwen3_5_moe.py computes it:

    out = sum_k w_k expert_k(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)

the router a softmax over the experts (float32), each token's top-k renormalized to sum to 1;
experts moe_intermediate_size wide, the shared expert shared_expert_intermediate_size. The experts
are the MoE layer's (layers/moe.py: the fused Triton kernel on CUDA); the shared expert a GatedMLP.
"""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.linear import ReplicatedLinear, current_quantization
from nanovllm.layers.moe import SparseMoE
from nanovllm.layers.transformer import GatedMLP
from nanovllm.models.qwen3_5 import Qwen3_5ForCausalLM, check_qwen3_5_config
from nanovllm.models.sparse import check_experts_per_token, expert_target, num_experts_of


class SharedExpertMoE(nn.Module):
    """Routed experts (`gate` the router, `experts`) and a gated shared expert beside them."""

    def __init__(self, config: PretrainedConfig, prefix: str):
        super().__init__()
        quantization = current_quantization()
        if quantization is not None and quantization.skips(f"{prefix}.experts"):
            quantization = None
        self.routed = SparseMoE(config.hidden_size, config.moe_intermediate_size, num_experts_of(config),
                                config.num_experts_per_tok, True, quantization)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, False,
                                      f"{prefix}.shared_expert")
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE's text model (Qwen3_5MoeTextConfig)."""

    @classmethod
    def check_config(cls, config: PretrainedConfig, max_model_len: int | None = None):
        check_qwen3_5_config(config)
        check_experts_per_token(config, "num_experts")

    @staticmethod
    def build_mlp(config: PretrainedConfig, prefix: str) -> nn.Module:
        return SharedExpertMoE(config, prefix)

    def checkpoint_target(self, name: str) -> tuple[str | None, object]:
        """The routed experts' tensors into w13 / w2 (and the router, `mlp.gate`) under `mlp.routed`."""
        text_name = name.replace("model.language_model.", "model.", 1)
        for part in (".mlp.experts.", ".mlp.gate.weight"):
            if part in text_name:
                text_name = text_name.replace(".mlp.", ".mlp.routed.", 1)
                return expert_target(text_name, num_experts_of(self.config)) or (text_name, None)
        return super().checkpoint_target(name)
