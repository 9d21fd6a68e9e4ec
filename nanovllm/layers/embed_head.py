import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import divide
from nanovllm.utils.context import get_context
from nanovllm.utils.loader import check_shape
from nanovllm.utils.parallel import tp_group, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank embeds the ids it owns, then all-reduce."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_group = tp_rank(), tp_size(), tp_group()
        self.num_embeddings = num_embeddings
        self.num_local = divide(num_embeddings, self.tp_size)
        self.vocab_start = self.num_local * self.tp_rank
        self.weight = nn.Parameter(torch.empty(self.num_local, embedding_dim), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        check_shape(loaded, (self.num_embeddings, param.shape[1]))  # the whole vocabulary, every rank
        param.data.copy_(loaded.narrow(0, self.vocab_start, self.num_local))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_local)
        y = F.embedding(local.masked_fill(~mine, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp_group.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits, for the sampling rows only; rank 0 gathers the full vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False):
        assert not bias, "LM heads with a bias are not supported"
        super().__init__(num_embeddings, embedding_dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        context = get_context()
        if context.logits_indices is not None:
            hidden = hidden[context.logits_indices]
        logits = F.linear(hidden, self.weight)  # [S, vocab / tp]
        if self.tp_size == 1:
            return logits
        parts = self.tp_group.gather(logits)
        return torch.cat(parts, -1) if parts is not None else None
