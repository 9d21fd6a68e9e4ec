"""Gated DeltaNet on flash-linear-attention's Triton kernels (the `fla-core` package), for CUDA.

The layer is layers/gated_delta_net.py's (its projections, its state pool, its PyTorch reference);
this is the same computation done by the kernels the field maintains, each launched once per step
for all of the step's sequences (varlen, by cu_seqlens) where the reference loops over sequences:

  prefill chunks   fla.modules.causal_conv1d.causal_conv1d               the convolution, from each row's conv state
                   fla.ops.gated_delta_rule.chunk_gated_delta_rule       the delta rule, chunked (64 tokens a chunk)
  decodes          fla.modules.causal_conv1d.causal_conv1d_update        one token's convolution
                   fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule   one token's delta rule

fla normalizes q and k itself (use_qk_l2norm_in_kernel) and maps each value head to its key head
(grouped value attention: value head h reads key head h // (Hv / Hk), as the reference's
repeat_interleave), so q and k go in unrepeated. Its conv state is the last K inputs where ours
holds K - 1 (the oldest is never read again): a zero column is put before ours going in and the
oldest column dropped coming out, so the pool's layout and the reference are unchanged.

The convolution is fla's Triton one, not the causal-conv1d package's CUDA one: that is a source
distribution built against one torch with nvcc, and fla's is varlen with a state per sequence,
which is what a step needs; one extra dependency instead of two.

A prompt-end snapshot (features/state_cache.py) may fall inside a sequence's chunk; the kernels
return only final states, so such a step runs the delta rule in two launches: every sequence up to
its snapshot (the heads), then the rest of those that take one (the tails) from the snapshot.

Chosen at start-up by features/state_cache.py (delta_rule_kernels): on CUDA where fla-core is
installed (`pip install 'nanovllm[linear]'`), unless attention_backend='torch' asks for the
references. On CPU the reference runs; the tests run these kernels on CPU under Triton's interpreter.
"""
import numpy as np
import torch
import torch.nn.functional as F
from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

from nanovllm.layers.gated_delta_net import GatedDeltaNet, StateStep
from nanovllm.utils.context import Context, to_device


class FlaDeltaRule:
    """GatedDeltaNet.forward's kernels (its `kernels` attribute): forward(layer, mixed, g, beta,
    weight, context, states) -> out [T, Hv, Dv], the states of `states.rows` advanced in place
    (states None: the start-up warm-up, every sequence from zeros, nothing kept)."""

    def forward(self, layer: GatedDeltaNet, mixed, g, beta, weight, context: Context,
                states: StateStep | None) -> torch.Tensor:
        if states is not None and context.decode_only:
            return self._decode(layer, mixed, g, beta, weight, states.rows[:mixed.shape[0]])
        return self._prefill(layer, mixed, g, beta, weight, context, states)

    def _decode(self, layer, mixed, g, beta, weight, rows: torch.Tensor) -> torch.Tensor:
        cache = F.pad(layer.conv_state[rows], (1, 0))                                  # [B, C, K]
        conv_out, cache = causal_conv1d_update(mixed, cache, weight=weight, activation="silu")
        layer.conv_state[rows] = cache[..., 1:]
        q, k, v = _heads(layer, conv_out[:, None])                                     # [B, 1, H, D]
        out, state = fused_recurrent_gated_delta_rule(
            q, k, v, g[:, None], beta=beta[:, None], scale=layer.head_k_dim ** -0.5,
            initial_state=layer.ssm_state[rows], output_final_state=True, use_qk_l2norm_in_kernel=True)
        layer.ssm_state[rows] = state
        return out[:, 0]

    def _prefill(self, layer, mixed, g, beta, weight, context, states) -> torch.Tensor:
        cu_cpu = context.cu_seqlens_q_cpu or [0, mixed.shape[0]]
        cu_host = np.asarray(cu_cpu, dtype=np.int64)
        cu = to_device(cu_host, mixed.device)
        rows = states.rows if states is not None else None
        splits = _snapshot_splits(context, cu_cpu, states)
        kernel = layer.kernel_size
        for i, (split, slot) in splits.items():  # (the conv state at a snapshot: the K - 1 inputs before it)
            before = torch.cat([layer.conv_state[states.rows_cpu[i]], mixed[cu_cpu[i]:cu_cpu[i] + split].t()], -1)
            layer.conv_state[slot] = before[:, -(kernel - 1):]
        conv_init = F.pad(layer.conv_state[rows], (1, 0)) if rows is not None else None
        conv_out, conv_final = causal_conv1d(mixed[None], weight, initial_state=conv_init,
                                             output_final_state=rows is not None, activation="silu", cu_seqlens=cu)
        if rows is not None:
            layer.conv_state[rows] = conv_final[..., 1:]
        q, k, v = _heads(layer, conv_out)                                              # [1, T, H, D]
        initial = layer.ssm_state[rows] if rows is not None else None
        out, final = _delta_rule(layer, q, k, v, g[None], beta[None], cu_host, cu, initial, splits)
        if rows is not None:
            layer.ssm_state[rows] = final
        return out[0]


def _heads(layer: GatedDeltaNet, conv_out: torch.Tensor):
    """[..., conv_dim] -> q, k [..., Hk, Dk] and v [..., Hv, Dv] (views; fla normalizes q and k)."""
    key_dim = layer.num_k_heads * layer.head_k_dim
    q, k, v = conv_out.split([key_dim, key_dim, layer.num_v_heads * layer.head_v_dim], -1)
    lead = conv_out.shape[:-1]
    key_shape = (*lead, layer.num_k_heads, layer.head_k_dim)
    return q.reshape(key_shape), k.reshape(key_shape), v.reshape(*lead, layer.num_v_heads, layer.head_v_dim)


def _snapshot_splits(context: Context, cu_cpu: list[int], states: StateStep | None) -> dict[int, tuple[int, int]]:
    """{sequence index: (tokens of its chunk before its snapshot, the snapshot's slot)}."""
    if states is None:
        return {}
    return {i: (position - (context.seq_lens_k_cpu[i] - (cu_cpu[i + 1] - cu_cpu[i])), slot)
            for i, (position, slot) in states.saves.items()}


def _delta_rule(layer, q, k, v, g, beta, cu: np.ndarray, cu_device: torch.Tensor, initial, splits):
    """The chunked delta rule over the step's sequences (cu: their offsets, on the host and the
    device) -> (out [1, T, Hv, Dv], final states [N]), each snapshot written to its slot on the way:
    heads first, then tails (see the docstring)."""
    def run(index, cu: np.ndarray, cu_device: torch.Tensor, state):
        return chunk_gated_delta_rule(
            q[:, index], k[:, index], v[:, index], g[:, index], beta[:, index], scale=layer.head_k_dim ** -0.5,
            initial_state=state, output_final_state=state is not None, use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_device, cu_seqlens_cpu=torch.from_numpy(cu))

    starts, ends = cu[:-1], cu[1:]
    head_ends = starts + np.asarray([splits[i][0] if i in splits else end - start
                                     for i, (start, end) in enumerate(zip(starts, ends))], dtype=np.int64)
    tails = [i for i in splits if head_ends[i] < ends[i]]
    if tails:
        out = torch.empty_like(v)
        head_index = to_device(np.concatenate([np.arange(s, e) for s, e in zip(starts, head_ends)]), q.device)
        head_cu = np.concatenate([[0], np.cumsum(head_ends - starts)])
        out[:, head_index], final = run(head_index, head_cu, to_device(head_cu, q.device), initial)
    else:  # (the common step: one launch over the flat tokens as they are)
        out, final = run(slice(None), cu, cu_device, initial)
    for i, (_, slot) in splits.items():
        layer.ssm_state[slot] = final[i]
    if tails:
        tail_index = to_device(np.concatenate([np.arange(head_ends[i], ends[i]) for i in tails]), q.device)
        tail_cu = np.concatenate([[0], np.cumsum([ends[i] - head_ends[i] for i in tails])])
        tail_rows = to_device(np.asarray(tails, dtype=np.int64), q.device)
        out[:, tail_index], final[tail_rows] = run(tail_index, tail_cu, to_device(tail_cu, q.device), final[tail_rows])
    return out, final
