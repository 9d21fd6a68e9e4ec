"""Gated DeltaNet (Qwen3.5's and Qwen3-Next's linear-attention layers), over a state per sequence.

Where a softmax-attention layer keeps every past token's K/V, a linear-attention layer keeps a
fixed-size state per sequence, whatever its length:
  conv state       [conv_dim, K - 1]   the last K - 1 inputs of a short causal depthwise convolution
                                       (K = linear_conv_kernel_dim, 4) over the q/k/v projections
  recurrent state  [Hv, Dk, Dv] fp32   S, updated by each token t by the gated delta rule:
                     S <- exp(g_t) * S                      (decay, g_t <= 0)
                     S <- S + beta_t * k_t (v_t - S^T k_t)^T (write the correction of what S predicts for k_t)
                     o_t = S^T q_t                           (q, k l2-normalized, q scaled by Dk ** -0.5)
The engine keeps these states in a pool of slots (features/state_cache.py): one slot per row of the
running batch, which is where a sequence's state lives while it runs, and snapshot slots that hold
the state at the end of a prompt for the prefix cache. A step tells each layer, through the forward
context (`Context.layer_group`, a StateStep), the slot of each sequence and where to take snapshots; the
runner has already zeroed the slots of sequences that start from position 0 and copied snapshots
into those that resume from one.

The kernels here are the readable PyTorch forms (on CUDA, fla-core's Triton kernels take their place
where installed: gated_delta_net_fla.py), computed as transformers' torch fallbacks compute
them (modeling_qwen3_5.py): the chunked form of the delta rule for prefill chunks (64 tokens a
chunk: a few matmuls and a triangular solve per chunk instead of a loop over tokens), the recurrent
form for decodes (all decoding sequences at once), and the causal conv1d with its state.

Tensor parallelism: the key and value heads split across ranks like attention heads (the value
heads of a key head stay on its rank), the convolution's channels with them; out_proj is row-parallel.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear, divide
from nanovllm.utils.context import get_context
from nanovllm.utils.loader import check_shape
from nanovllm.utils.parallel import tp_rank, tp_size

CHUNK_SIZE = 64  # tokens per chunk of the chunked delta rule (transformers' and fla's default)
L2NORM_EPS = 1e-6  # as transformers' l2norm (and fla's kernels)


@dataclass
class StateStep:
    """What a step tells the linear-attention layers (set on the Context by features/state_cache.py).

    rows       [B] int64 device  each sequence's state slot (its row of the batch)
    rows_cpu   the same, a host list (the prefill loop indexes with it)
    saves      {sequence index in the step: (position, snapshot slot)}: copy its state after
               `position` tokens into that slot (a prompt's end, for the prefix cache)
    """
    rows: torch.Tensor
    rows_cpu: list[int]
    saves: dict[int, tuple[int, int]]


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's n tokens through the delta rule, chunk by chunk, from `state`.

    q, k [H, n, Dk] (l2-normalized, q scaled), v [H, n, Dv], g, beta [H, n], state [H, Dk, Dv]:
    all float32, H the value heads (q and k repeated to them). Returns (out [H, n, Dv], final state).
    Within a chunk of C tokens the n sequential updates are solved at once: with A = the strictly
    lower-triangular (beta_i k_i . k_j) decayed from j to i, the corrections u the chunk writes solve
    (I + A) u = beta (v - decayed S^T k) (the UT transform); then the outputs are the old state's
    read plus the causal (q_i . k_j)-weighted corrections, and S moves to the chunk's end."""
    num_heads, n, _ = k.shape
    pad = (-n) % CHUNK_SIZE
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    chunks = lambda x: x.reshape(num_heads, -1, CHUNK_SIZE, *x.shape[2:])  # [H, n / C, C, ...]
    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    k_beta, v_beta = k * chunks(beta)[..., None], v * chunks(beta)[..., None]
    cum_g = g.cumsum(-1)                                                           # [H, N, C]
    upper = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum_g[..., :, None] - cum_g[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [H, N, C, C]
    system = (k_beta @ k.transpose(-1, -2)) * decay          # the UT system, unit lower-triangular once solved
    intra = (q @ k.transpose(-1, -2)) * decay                # the chunk's causal scores
    corrections = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum_g.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum_g.exp()[..., None]
    k = k * (cum_g[..., -1:] - cum_g).exp()[..., None]
    chunk_decay = cum_g[..., -1].exp()[..., None, None]                            # [H, N, 1, 1]
    out = torch.empty_like(corrections)
    for i in range(q.shape[1]):
        u = corrections[:, i] - k_cum[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ u
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ u
    return out.reshape(num_heads, -1, out.shape[-1])[:, :n], state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv]
    (float32, as in chunk_gated_delta_rule) -> (out [B, H, Dv], new state)."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., None]).sum(-2)                                      # S^T k: [B, H, Dv]
    state = state + k[..., None] * ((v - predicted) * beta[..., None])[..., None, :]
    return (state * q[..., None]).sum(-2), state


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution of one sequence's new inputs, then SiLU.
    x [n, C]; conv_state [C, K - 1] (the inputs before them; zeros at a sequence's start);
    weight [C, K] -> (out [n, C], the inputs [C, K - 1 + n] the convolution read, state first)."""
    inputs = torch.cat([conv_state, x.t().to(conv_state.dtype)], -1)
    out = F.conv1d(inputs[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(out).t().contiguous().to(x.dtype), inputs


class GatedRMSNorm(nn.Module):
    """Per head: weight * rms-normalized x (rounded to x's dtype) * silu(gate), in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class StackedColumnParallelLinear(MergedColumnParallelLinear):
    """A MergedColumnParallelLinear whose parts come as one checkpoint tensor (in_proj_qkv: q, k and
    v rows stacked): each part's rows are split across ranks."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        check_shape(loaded, (sum(self.full_output_sizes), self.input_size))
        for shard_id, part in enumerate(loaded.split(self.full_output_sizes)):
            super().weight_loader(param, part, shard_id)


class ShardedChannels(nn.Module):
    """A per-channel parameter over [q | k | v] channels (the convolution's weight), each part split
    across ranks like MergedColumnParallelLinear's output features."""

    def __init__(self, full_sizes: list[int], *trailing: int):
        super().__init__()
        self.full_sizes, self.tp_rank = full_sizes, tp_rank()  # (the loader runs outside the build's TP scope)
        self.sizes = [divide(size, tp_size()) for size in full_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), *trailing), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        check_shape(loaded, (sum(self.full_sizes), *param.shape[1:]))
        parts, start = [], 0
        for full, size in zip(self.full_sizes, self.sizes):
            parts.append(loaded[start + self.tp_rank * size:start + (self.tp_rank + 1) * size])
            start += full
        param.data.copy_(torch.cat(parts))


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer: [T, hidden] -> [T, hidden]; checkpoint names as transformers'
    (linear_attn.in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d.weight, A_log, dt_bias,
    norm.weight, out_proj); A_log and dt_bias ([Hv], its own parameters) load through its weight_loader.

    conv_state [slots, conv_dim, K - 1] and ssm_state [slots, Hv, Dk, Dv] (this rank's heads) are
    bound by the runner (features/state_cache.py); before that, and in the start-up warm-up step,
    every sequence starts from zeros and nothing is kept. `kernels`, bound there too, replaces the
    PyTorch reference of this module with fla-core's Triton kernels on CUDA (gated_delta_net_fla.py)."""

    def __init__(self, config: PretrainedConfig, prefix: str):
        super().__init__()
        tp = tp_size()
        total_k, total_v = config.linear_num_key_heads, config.linear_num_value_heads
        if total_k % tp or total_v % tp or total_v % total_k:
            raise ValueError(f"linear_num_key_heads={total_k} and linear_num_value_heads={total_v} must both be "
                             f"multiples of tensor_parallel_size={tp}, and the value heads of the key heads")
        self.num_k_heads, self.num_v_heads, self.num_v_heads_total = total_k // tp, total_v // tp, total_v
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        key_dim, value_dim = total_k * self.head_k_dim, total_v * self.head_v_dim
        self.kernel_size = config.linear_conv_kernel_dim
        self.in_proj_qkv = StackedColumnParallelLinear(config.hidden_size, [key_dim, key_dim, value_dim],
                                                       prefix=f"{prefix}.in_proj_qkv")
        self.in_proj_z = ColumnParallelLinear(config.hidden_size, value_dim, prefix=f"{prefix}.in_proj_z")
        self.in_proj_b = ColumnParallelLinear(config.hidden_size, total_v, prefix=None)
        self.in_proj_a = ColumnParallelLinear(config.hidden_size, total_v, prefix=None)
        self.conv1d = ShardedChannels([key_dim, key_dim, value_dim], 1, self.kernel_size)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.tp_rank = tp_rank()  # (the loader runs outside the build's TP scope)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, config.hidden_size, prefix=f"{prefix}.out_proj")
        self.conv_dim = self.conv1d.weight.shape[0]
        self.conv_state = self.ssm_state = None
        self.kernels = None  # the PyTorch reference below; fla-core's (gated_delta_net_fla.py) where bound

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        """A_log or dt_bias: this rank's value heads of the checkpoint's [Hv]."""
        local = param.shape[0]
        check_shape(loaded, (self.num_v_heads_total,))
        param.data.copy_(loaded[self.tp_rank * local:(self.tp_rank + 1) * local])

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's conv state and recurrent state shapes (this rank's share)."""
        return (self.conv_dim, self.kernel_size - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        context = get_context()
        num_tokens = hidden.shape[0]
        mixed = self.in_proj_qkv(hidden)                                            # [T, conv_dim]
        z = self.in_proj_z(hidden).view(num_tokens, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(hidden).sigmoid().float()                             # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias)
        weight = self.conv1d.weight[:, 0]                                           # [conv_dim, K]
        states = context.layer_group if self.conv_state is not None else None
        if self.kernels is not None:
            out = self.kernels.forward(self, mixed, g, beta, weight, context, states)
        elif states is not None and context.decode_only:
            out = self._decode(mixed, g, beta, weight, states.rows[:num_tokens])
        else:
            out = torch.empty(num_tokens, self.num_v_heads, self.head_v_dim, dtype=hidden.dtype, device=hidden.device)
            cu_q = context.cu_seqlens_q_cpu or [0, num_tokens]
            for i in range(len(cu_q) - 1):
                start, end = cu_q[i], cu_q[i + 1]
                out[start:end] = self._prefill(mixed[start:end], g[start:end], beta[start:end], weight, context, i,
                                               states)
        return self.out_proj(self.norm(out, z).flatten(1))

    def _split_heads(self, mixed: torch.Tensor):
        """[n, conv_dim] (after the convolution) -> q, k [n, Hv, Dk] (l2-normalized, q scaled, repeated to
        the value heads), v [n, Hv, Dv], all float32."""
        n = mixed.shape[0]
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = mixed.float().split([key_dim, key_dim, self.num_v_heads * self.head_v_dim], -1)
        group = self.num_v_heads // self.num_k_heads
        q = l2norm(q.view(n, self.num_k_heads, self.head_k_dim)).repeat_interleave(group, 1) * self.head_k_dim ** -0.5
        k = l2norm(k.view(n, self.num_k_heads, self.head_k_dim)).repeat_interleave(group, 1)
        return q, k, v.view(n, self.num_v_heads, self.head_v_dim)

    def _prefill(self, x, g, beta, weight, context, i: int, states: StateStep | None) -> torch.Tensor:
        """Sequence i's new tokens (x [n, conv_dim]) from its slot's state (zeros unbound), the state
        written back; a snapshot taken on the way where `states.saves` asks (the rule split there)."""
        n = x.shape[0]
        conv_shape, ssm_shape = self.state_shapes()
        if states is None:
            row, conv_state = None, x.new_zeros(conv_shape)
            ssm_state = torch.zeros(ssm_shape, dtype=torch.float32, device=x.device)
        else:
            row = states.rows_cpu[i]
            conv_state, ssm_state = self.conv_state[row], self.ssm_state[row]
        conv_out, inputs = causal_conv1d(x, conv_state, weight)
        q, k, v = (t.transpose(0, 1) for t in self._split_heads(conv_out))          # [H, n, D]
        g, beta = g.t(), beta.t()
        save = states.saves.get(i) if states is not None else None
        split = save[0] - (context.seq_lens_k_cpu[i] - n) if save is not None else n  # tokens before the snapshot
        out, state = chunk_gated_delta_rule(q[:, :split], k[:, :split], v[:, :split], g[:, :split], beta[:, :split],
                                            ssm_state)
        if save is not None:
            self.conv_state[save[1]] = inputs[:, split:split + self.kernel_size - 1]
            self.ssm_state[save[1]] = state
            if split < n:
                rest, state = chunk_gated_delta_rule(q[:, split:], k[:, split:], v[:, split:], g[:, split:],
                                                     beta[:, split:], state)
                out = torch.cat([out, rest], 1)
        if row is not None:
            self.conv_state[row] = inputs[:, -(self.kernel_size - 1):]
            self.ssm_state[row] = state
        return out.transpose(0, 1).to(x.dtype)

    def _decode(self, x, g, beta, weight, rows: torch.Tensor) -> torch.Tensor:
        """One token for each sequence (x [B, conv_dim]) from the slots `rows` [B], states written back."""
        inputs = torch.cat([self.conv_state[rows], x[:, :, None].to(self.conv_state.dtype)], -1)  # [B, C, K]
        self.conv_state[rows] = inputs[:, :, 1:]
        conv_out = F.silu((inputs.to(weight.dtype) * weight).sum(-1)).to(x.dtype)
        q, k, v = self._split_heads(conv_out)
        out, state = recurrent_gated_delta_rule(q, k, v, g, beta, self.ssm_state[rows])
        self.ssm_state[rows] = state
        return out.to(x.dtype)
