"""A step's sampled-token logprobs as the host returns them (SampledTokens.result): per sampling
row, {token id: logprob} with the chosen token and its row's `logprobs` most likely alternatives."""
import torch


def logprob_dicts(tokens: list[int], chosen: list[float], top_values: torch.Tensor | None,
                  top_ids: torch.Tensor | None, num_logprobs: list[int | None]) -> list[dict | None]:
    """The dict of each row (None where its request asked for no logprobs); top_values and top_ids
    [S, k] are the top-k of the step's largest k (None when that is 0)."""
    top_values = top_values.tolist() if top_values is not None else None
    top_ids = top_ids.tolist() if top_ids is not None else None
    dicts = []
    for i, k in enumerate(num_logprobs):
        if k is None:
            dicts.append(None)
            continue
        d = dict(zip(top_ids[i][:k], top_values[i][:k])) if k else {}
        d[tokens[i]] = chosen[i]
        dicts.append(d)
    return dicts
