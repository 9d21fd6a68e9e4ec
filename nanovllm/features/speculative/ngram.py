"""N-gram (prompt lookup) proposer for speculative decoding: if the last n tokens occurred earlier
in the prompt or completion, the tokens that followed that occurrence are proposed, and the target
model verifies them all in one forward pass. It pays off on text that repeats its own context (code
editing, quoting, extraction, summaries that reuse the source's phrases, multi-turn chat), and its
drafts cost only a search over the token ids the host already holds; a miss proposes nothing.
speculative_config's method "ngram" (config.py) configures it, with vLLM's names.
"""
from collections.abc import Sequence

import numpy as np


def _check_int(name: str, value: object, low: int) -> None:
    # bool is an int subclass, but True as a token count is a bug in the caller.
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


class TokenBuffer:
    """A sequence's tokens as a growing numpy array, for the proposer: converting the whole list at
    every step costs more than the search (2 to 21 ms per 256-sequence step at 512 to 8,192 tokens
    per sequence), and a running sequence's list only grows, so only its new tail is copied."""

    def __init__(self):
        self.array = np.empty(256, dtype=np.int64)
        self.length = 0

    def view(self, token_ids: list[int]) -> np.ndarray:
        """token_ids as an array (its new tail copied in)."""
        n = len(token_ids)
        assert n >= self.length, "a running sequence's tokens only grow"
        if n > len(self.array):  # (doubling: appends cost O(1) each, amortized)
            grown = np.empty(max(n, 2 * len(self.array)), dtype=np.int64)
            grown[:self.length] = self.array[:self.length]
            self.array = grown
        if n > self.length:
            self.array[self.length:n] = token_ids[self.length:]
        self.length = n
        return self.array[:n]


class NgramProposer:
    """Proposes up to `num_speculative_tokens` draft tokens per sequence by prompt lookup, trying
    n-grams of `prompt_lookup_max` tokens down to `prompt_lookup_min` (the longest match wins)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        _check_int("num_speculative_tokens", num_speculative_tokens, 1)
        _check_int("prompt_lookup_min", prompt_lookup_min, 1)
        _check_int("prompt_lookup_max", prompt_lookup_max, 1)
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.k, self.min_n, self.max_n = int(num_speculative_tokens), int(prompt_lookup_min), int(prompt_lookup_max)

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_len: int | None = None) -> list[int]:
        """Draft tokens for one sequence (its prompt + completion tokens): what followed the most
        recent earlier occurrence of its longest matching suffix n-gram (the most recent that the
        full count follows, if any), at most min(k, max_len) of them; [] on no match."""
        limit = self.k if max_len is None else min(self.k, max_len)
        # (a list's conversion costs more than the search on long sequences, ~0.3 ms for 32k tokens
        # against ~5-170 us: a caller that keeps a numpy array, TokenBuffer's, saves it)
        tokens = token_ids if isinstance(token_ids, np.ndarray) else np.fromiter(token_ids, np.int64, len(token_ids))
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be one-dimensional, got shape {tokens.shape}")
        length = len(tokens)
        if limit <= 0 or length < self.min_n + 1:
            return []

        # An occurrence is named by the index of its last token, `end`, strictly before the suffix
        # (end <= length - 2: a token follows it). The n = 1 candidates are the earlier copies of
        # the last token; n-gram n + 1 matches at `end` iff n-gram n does and the token n places
        # before `end` equals tokens[-(n + 1)], so each longer n filters the survivors of the
        # shorter: a search from prompt_lookup_max down, in one vectorized pass and then over few.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        best_end = -1
        for n in range(1, self.max_n + 1):
            if n > 1:
                ends = ends[ends >= n - 1]  # the n-gram must start inside the sequence
                ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
            if ends.size == 0:
                break  # no longer n-gram can match either
            if n >= self.min_n:
                # The most recent occurrence (the largest end): repeated text tends to continue
                # as it did the last time (vLLM's n-gram proposers take the first match instead);
                # but the most recent one that `limit` tokens follow, if any: in a run of one
                # token ("a a a a"), the latest match is followed by one token only.
                full = ends[ends <= length - 1 - limit]
                best_end = int(full[-1]) if full.size else int(ends[-1])
        if best_end < 0:
            return []
        # Fewer than `limit` when the sequence ends first.
        return tokens[best_end + 1:best_end + 1 + limit].tolist()
