from array import array
from collections import OrderedDict

import xxhash

from nanovllm.engine.sequence import Sequence


def chain_hash(prev_hash: int | None, token_ids: list[int]) -> int:
    """Key of a full block: xxh64 of its token ids, seeded with the previous block's key (0 for the
    first block).

    Chaining makes a key stand for the whole prefix up to and including this block, so equal keys
    mean equal prefixes (up to hash collisions, which `BlockManager` rules out by checking tokens and parent blocks).
    """
    return xxhash.xxh64_intdigest(array("q", token_ids).tobytes(), prev_hash or 0)


class Block:
    """One physical KV block. A cached block records what its K/V were computed from: its own
    tokens and its parent, the block (id, generation) before it in the sequence (None for the
    first). `generation` counts reallocations, so a parent that was since overwritten no longer
    matches. Together they verify a hit exactly, whatever the hash does."""
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent", "generation")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None          # set once the block is full, computed and published
        self.token_ids: list[int] | None = None
        self.parent: tuple[int, int] | None = None
        self.generation = 0


class BlockManager:
    """Owns the physical KV blocks: allocation, reference counts and the prefix cache.

    A block is free when no sequence holds it (ref_count == 0). A free block keeps its hash and
    contents until it is handed out again, so a later request with the same prefix can revive it.
    Free blocks are handed out least recently freed first (`self.free` is kept in that order).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_cached_tokens = 0  # cumulative prefix-cache hits, in tokens
        self.peak_used_blocks = 0   # most blocks held at once since start

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # its old contents are about to be overwritten
        block.hash = block.token_ids = block.parent = None
        block.generation += 1
        block.ref_count = 1
        return block_id

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Block ids and keys of the longest cached run of seq's full blocks, read-only.

        The last token is never served from the cache: the step must compute at least one token
        to produce the logits the next token is sampled from.
        """
        block_ids, hashes = [], []
        if not self.enable_prefix_caching:
            return block_ids, hashes
        prev_hash = parent = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block_tokens(i, self.block_size)
            h = chain_hash(prev_hash, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent != parent:  # a hash collision
                break
            block_ids.append(block_id)
            hashes.append(h)
            prev_hash, parent = h, (block_id, block.generation)
        return block_ids, hashes

    def allocate(self, seq: Sequence, use_cache: bool = True) -> int | None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks (unless
        not use_cache: it must compute every token). Returns how many of its tokens the cache
        serves (their K/V are computed already), or None, changing nothing, when too few blocks
        are free."""
        assert not seq.block_table and seq.num_tokens == len(seq.token_ids)
        hit_ids, hashes = self._match_prefix(seq) if use_cache else ([], [])
        num_revived = sum(self.blocks[b].ref_count == 0 for b in hit_ids)
        num_new = self.blocks_needed(seq.num_tokens) - len(hit_ids)
        if num_new + num_revived > len(self.free):
            return None
        for block_id in hit_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
        seq.block_table = hit_ids + [self._take_free_block() for _ in range(num_new)]
        seq.block_hashes = hashes
        num_cached = len(hit_ids) * self.block_size
        self.num_cached_tokens += num_cached
        self._note_usage()
        return num_cached

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make seq's block table cover its first num_tokens tokens; False (changing nothing) if
        too few blocks are free."""
        count = self.blocks_needed(num_tokens) - len(seq.block_table)
        if count > len(self.free):
            return False
        for _ in range(count):
            seq.block_table.append(self._take_free_block())
        self._note_usage()
        return True

    def _note_usage(self):
        self.peak_used_blocks = max(self.peak_used_blocks, len(self.blocks) - len(self.free))

    def cache_full_blocks(self, seq: Sequence, num_tokens: int):
        """Publish the blocks that seq's first num_tokens tokens fill completely, under their
        chained keys. The caller vouches that their K/V are computed, or being computed by a
        launched step (whoever reads a block runs after it), and that the host knows their ids."""
        if not self.enable_prefix_caching:
            return
        bs, hashes = self.block_size, seq.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            tokens = seq.block_tokens(i, bs)
            h = chain_hash(hashes[-1] if hashes else None, tokens)
            hashes.append(h)
            if h in self.hash_to_block:  # an equal block is published already (computed alongside): keep it
                continue
            block = self.blocks[seq.block_table[i]]
            parent = self.blocks[seq.block_table[i - 1]] if i else None
            block.hash, block.token_ids = h, tokens
            block.parent = (parent.block_id, parent.generation) if parent else None
            self.hash_to_block[h] = block.block_id

    def free_blocks(self, seq: Sequence):
        """Drop seq's references. Its tail is freed first, so it is also reused first and the more
        widely shared prefix blocks stay cached longest."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
