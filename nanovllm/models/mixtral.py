"""Mixtral: Mistral's attention (a sliding window is accepted only when it is at least max_model_len
long); every layer's MLP is a router over `num_local_experts` experts `intermediate_size` wide, top-k
weights always renormalized. Its checkpoints name the MLP `block_sparse_moe` and the experts'
gate/up/down `w1`/`w3`/`w2`."""
from nanovllm.models.sparse import SparseDecoderForCausalLM


class MixtralForCausalLM(SparseDecoderForCausalLM):
    def checkpoint_target(self, name: str) -> tuple[str | None, object]:
        return super().checkpoint_target(name.replace(".block_sparse_moe.", ".mlp."))
