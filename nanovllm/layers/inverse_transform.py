"""Inverse transform sampling, reproducible per request: one uniform number u per row, and the
first token whose cumulative probability reaches u (one pass over the vocabulary).

u is not drawn from a stateful generator but computed by hashing (request seed, position), so a
request's samples depend on its own seed and logits alone, whatever else shares the batch, with no
Python loop. (On a GPU the logits themselves may differ in their last bits with the batch's size.)"""
import torch


_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # an arbitrary well-mixed constant: it makes the two 24-bit draws of a row differ


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche ("lowbias32"), on int64 tensors holding values in
    [0, 2**32). Products may overflow int64; they wrap, and the low 32 bits stay exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_per_row(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] float64 in (0, 1) with 48 random bits, a pure function of (seed, position).
    seeds, positions: [B] int64 (seeds in [0, 2**63))."""
    row = _mix32((seeds & _MASK32) ^ _mix32(((seeds >> 32) ^ _mix32(positions & _MASK32)) & _MASK32))
    high, low = _mix32((row + _GOLDEN32) & _MASK32) >> 8, _mix32(row ^ _GOLDEN32) >> 8  # 24 bits each
    return ((high << 24) + low).double().add(0.5).mul(2.0 ** -48)


# sample_from's chunk of the vocabulary: the draw finds its chunk from per-chunk float64 sums, then
# its token from a float64 cumulative sum within that chunk, so it never builds a [B, V] float64
# array (the cost of one pass over the float32 probabilities instead of three over twice the bytes).
CDF_CHUNK = 1024


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Token i with probability probs[i] / sum(probs), per row: the first index where the cumulative
    sum reaches u * total, found in two levels (CDF_CHUNK). Zero-probability tokens are never chosen
    (their cumulative sum equals their predecessor's, which fell short). probs [B, V], uniform [B]."""
    num_rows, vocab = probs.shape
    size = min(CDF_CHUNK, vocab)
    num_chunks = -(-vocab // size)
    if num_chunks * size != vocab:  # (padded with zeros: never chosen)
        probs = torch.nn.functional.pad(probs, (0, num_chunks * size - vocab))
    chunks = probs.view(num_rows, num_chunks, size)
    chunk_cdf = chunks.sum(-1, dtype=torch.float64).cumsum(-1)                       # [B, C]
    target = (uniform * chunk_cdf[:, -1])[:, None]                                   # [B, 1]
    chunk = torch.searchsorted(chunk_cdf, target).clamp_(max=num_chunks - 1)         # [B, 1]
    before = torch.where(chunk > 0, chunk_cdf.gather(-1, (chunk - 1).clamp(min=0)), 0.0)
    picked = chunks.gather(1, chunk[:, :, None].expand(num_rows, 1, size))[:, 0]     # [B, size]
    cdf = picked.double().cumsum(-1) + before                                        # [B, size]
    i = torch.searchsorted(cdf, target)
    # The chunk's sum and its cumulative sum round apart by an ulp or so: a target between them
    # would fall off the chunk's end; it takes the chunk's last token of nonzero probability.
    last = size - 1 - (picked.flip(-1) > 0).int().argmax(-1, keepdim=True)
    i = torch.where(i >= size, last, i)
    return (chunk * size + i)[:, 0]
