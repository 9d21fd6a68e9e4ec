"""NgramProposer (prompt lookup): hand-made cases, a property test against a plain-Python
reference, and configuration checks."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.features.speculative.ngram import NgramProposer, TokenBuffer


def reference(tokens: list[int], k: int, lo: int, hi: int, max_len: int | None = None) -> list[int]:
    """The definition, spelled out: longest n first, then the most recent earlier occurrence that
    the full `limit` tokens follow, else the most recent one."""
    limit = k if max_len is None else min(k, max_len)
    if limit <= 0:
        return []
    length = len(tokens)
    for n in range(hi, lo - 1, -1):
        if length < n + 1:
            continue
        suffix = tokens[length - n:]
        # Occurrences tokens[start:start + n] that end before the last token, latest first.
        starts = [start for start in range(length - n - 1, -1, -1) if tokens[start:start + n] == suffix]
        if starts:
            full = [start for start in starts if start + n + limit <= length]
            start = full[0] if full else starts[0]
            return tokens[start + n:start + n + limit]
    return []


def test_repeated_phrase_proposes_its_continuation():
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert NgramProposer(3, 2, 4).propose(tokens) == [8, 9, 1]


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # [2, 3] last occurred before 20, but the longer [1, 2, 3] occurred (earlier) before 10.
    tokens = [1, 2, 3, 10, 0, 2, 3, 20, 0, 1, 2, 3]
    assert NgramProposer(1, 2, 3).propose(tokens) == [10]
    assert NgramProposer(1, 2, 2).propose(tokens) == [20]  # without n = 3, the 2-gram decides


def test_most_recent_occurrence_wins():
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    assert NgramProposer(1, 2, 2).propose(tokens) == [8]
    assert NgramProposer(2, 2, 2).propose(tokens) == [8, 1]


def test_a_run_of_one_token_proposes_k_of_it():
    """The most recent match in "a a a a a" is followed by one token only: the most recent one
    that k tokens follow is taken instead."""
    assert NgramProposer(3, 2, 2).propose([5, 4, 4, 4, 4, 4, 4]) == [4, 4, 4]
    assert NgramProposer(3, 2, 2).propose([5, 4, 4, 4]) == [4]  # (none has 3 after it: the latest)


def test_continuation_shorter_than_k_near_the_end():
    assert NgramProposer(5, 2, 2).propose([1, 2, 3, 1, 2]) == [3, 1, 2]
    assert NgramProposer(5, 1, 1).propose([4, 9, 4]) == [9, 4]


def test_no_match_proposes_nothing():
    assert NgramProposer(4, 2, 4).propose([1, 2, 3, 4, 5, 6, 7, 8]) == []
    # The last token recurs, but no 2-gram does.
    assert NgramProposer(4, 2, 4).propose([1, 3, 2, 3]) == []
    assert NgramProposer(4, 1, 4).propose([1, 3, 2, 3]) == [2, 3]


def test_too_short_proposes_nothing():
    p = NgramProposer(4, 2, 4)
    assert p.propose([]) == []
    assert p.propose([1]) == []
    assert p.propose([1, 1]) == []          # shorter than prompt_lookup_min + 1
    assert p.propose([1, 1, 1]) == [1]      # just long enough


def test_max_len_caps_the_drafts():
    p = NgramProposer(4, 2, 2)
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert p.propose(tokens) == [3, 4, 5, 1]
    assert p.propose(tokens, max_len=2) == [3, 4]
    assert p.propose(tokens, max_len=1) == [3]
    assert p.propose(tokens, max_len=0) == []
    assert p.propose(tokens, max_len=-3) == []
    assert p.propose(tokens, max_len=100) == [3, 4, 5, 1]  # k still caps


def test_match_must_be_strictly_earlier():
    # The suffix matching itself is no occurrence: nothing would follow it.
    assert NgramProposer(2, 1, 4).propose([1, 2, 3, 4]) == []
    assert NgramProposer(2, 3, 3).propose([5, 1, 1, 1]) == []
    # An earlier occurrence may overlap the suffix: [1, 1] at positions 1-2, followed by 1.
    assert NgramProposer(2, 2, 2).propose([5, 1, 1, 1]) == [1]


def test_numpy_input_and_python_ints_out():
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    p = NgramProposer(3, 2, 4)
    for dtype in (np.int32, np.int64):
        out = p.propose(np.array(tokens, dtype=dtype))
        assert out == [8, 9, 1] and all(type(t) is int for t in out)
    with pytest.raises(ValueError, match="one-dimensional"):
        p.propose(np.array([tokens, tokens]))


def test_long_sequence():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150_000, 32_768)
    tokens[1000:1006] = [7, 8, 9, 10, 11, 12]   # an early copy of the phrase
    tokens[-3:] = [7, 8, 9]                     # the sequence ends in the phrase again
    assert NgramProposer(4, 2, 4).propose(tokens) == [10, 11, 12, int(tokens[1006])]


@settings(max_examples=500, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 3), max_size=60), k=st.integers(1, 5),
       bounds=st.tuples(st.integers(1, 4), st.integers(1, 4)).map(sorted),
       max_len=st.none() | st.integers(-1, 6))
def test_matches_reference(tokens, k, bounds, max_len):
    lo, hi = bounds
    p = NgramProposer(k, lo, hi)
    expected = reference(tokens, k, lo, hi, max_len)
    assert p.propose(tokens, max_len) == expected
    assert p.propose(np.array(tokens, dtype=np.int64), max_len) == expected


@pytest.mark.parametrize("args, name", [
    ((0, 2, 4), "num_speculative_tokens"),
    ((-1, 2, 4), "num_speculative_tokens"),
    ((2.0, 2, 4), "num_speculative_tokens"),
    ((True, 2, 4), "num_speculative_tokens"),
    ((4, 0, 4), "prompt_lookup_min"),
    ((4, 2, 0), "prompt_lookup_max"),
    ((4, 5, 4), "prompt_lookup_min"),
])
def test_invalid_config_raises(args, name):
    with pytest.raises(ValueError, match=name):
        NgramProposer(*args)


def test_token_buffer_follows_a_growing_list():
    rng = np.random.default_rng(3)
    tokens, buffer = [], TokenBuffer()
    for _ in range(50):
        tokens.extend(rng.integers(0, 1000, rng.integers(1, 40)).tolist())
        assert buffer.view(tokens).tolist() == tokens
    assert NgramProposer(3, 2, 4).propose(buffer.view(tokens)) == NgramProposer(3, 2, 4).propose(tokens)
