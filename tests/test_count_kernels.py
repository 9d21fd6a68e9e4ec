"""scripts/count_kernels.py on CPU (the Triton kernels interpreted): the kernels a Qwen3-0.6B-shaped
bf16 decode step dispatches per decoder layer, held by a ratchet that may only come down (issue 31's
target is 15; 62 with PyTorch's elementwise ops, 11 with the fused ones: qkv, q/k norm + RoPE, the
KV store, decode attention and its split reduction, o_proj, add + norm, gate_up, SiLU-and-mul,
down, and the next layer's add + norm)."""
import os
import sys

import torch

from serving import ROOT

if not torch.cuda.is_available():  # (the Triton kernels interpreted: set before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import count_kernels  # noqa: E402

KERNELS_PER_LAYER = 11


def test_a_decode_step_launches_at_most_the_ratchet_per_layer():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = count_kernels.count("qwen3-0.6b", device, num_layers=2, num_seqs=2, dtype="bfloat16")
    print(f"\n{result['per_layer']} kernels per layer; layer 0: {result['layer_ops']}")
    # (the second layer also adds the first's residual: its fused add + norm counts the same)
    assert result["per_layer"][0] <= KERNELS_PER_LAYER, result["layer_ops"]
    assert result["layer_ops"]["triton._decode_kernel"] == 1  # (the step counted is one pure decode)
    assert result["layer_ops"]["aten.linear"] == 4  # qkv, o, gate_up, down
    assert result["layer_ops"]["triton._qk_norm_rope_kernel"] == 1
