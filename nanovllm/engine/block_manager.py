import struct
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence

if TYPE_CHECKING:
    from nanovllm.features.host_tier import HostEntry


def chain_hash(prev_hash: int | None, token_ids: list[int]) -> int:
    """Key of a full block: xxh64 of its token ids, seeded with the previous block's key (0 for the first).

    Chaining makes a key stand for the whole prefix up to and including this block, so equal keys
    mean equal prefixes (up to hash collisions, which `BlockManager` rules out by checking tokens and parents)."""
    # (struct packs the ints as int64 bytes in about half the time that array("q", ...) takes)
    return xxhash.xxh64_intdigest(struct.pack(f"{len(token_ids)}q", *token_ids), prev_hash or 0)


def host_tier(num_slots: int):
    """The host tier of the prefix cache (features/host_tier.py: a layer, loaded when one is asked for)."""
    from nanovllm.features.host_tier import HostTier
    return HostTier(num_slots)


class Block:
    """One physical KV block. A full block records what its K/V were computed from: its own tokens
    and its parent's contents, by id. `uid` names one computation of a block's K/V: given when a
    sequence fills the block, kept by its copies (a host slot, a block reloaded from there), dropped
    when the block is handed out for other tokens; `parent_uid` is the previous block's (None for
    the first). A hit must have the tokens asked for and, as parent, the contents the lookup
    matched before it: together they verify the whole prefix exactly, whatever the hash does."""
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "uid", "parent_uid")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None          # set once the block is full, computed and published
        self.token_ids: list[int] | None = None
        self.uid: int | None = None
        self.parent_uid: int | None = None


class BlockManager:
    """Owns the physical KV blocks: allocation, reference counts and the prefix cache.

    A block is free when no sequence holds it (ref_count == 0). A free block keeps its hash and
    contents until it is handed out again, so a later request with the same prefix can revive it.
    Free blocks are handed out least recently freed first (`self.free` is kept in that order), but
    those that no lookup can find (never published, or unpublished) before any cached one.

    With a host tier (`host`, num_host_blocks > 0: features/host_tier.py) a cached block about to
    be handed out is first offered to it (write-back on eviction), and a lookup that misses on the
    device continues there: a host hit is copied back into a fresh device block before the step runs."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_host_blocks: int = 0):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.host = host_tier(num_host_blocks) if num_host_blocks and enable_prefix_caching else None
        self.next_uid = 0  # the next block contents' id
        self.num_cached_tokens = 0  # cumulative prefix-cache hits, in tokens, both tiers
        self.num_queried_tokens = 0  # cumulative tokens looked up (full prompt blocks but the last token's)
        self.num_host_hit_tokens = 0  # of num_cached_tokens, those the host tier served
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
            del self.hash_to_block[block.hash]  # its old contents are about to be overwritten:
            if self.host is not None:           # the host tier keeps them
                self.host.offload(block)
        block.hash = block.token_ids = block.uid = block.parent_uid = None
        block.ref_count = 1
        return block_id

    def take_copies(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The planned step's host-tier copies (HostTier.take_copies): offloads, reloads, or None each."""
        return self.host.take_copies() if self.host is not None else (None, None)

    def _match_prefix(self, seq: Sequence) -> list[tuple[int, int | None, "HostEntry | None", list[int]]]:
        """The longest cached run of seq's full blocks, read-only: per block (key, device block id
        or None, host entry or None, tokens), the device tried first. The last token is never
        served from the cache: the step must compute one token for the logits to sample from."""
        hits = []
        if not self.enable_prefix_caching:
            return hits
        prev_hash = prev_uid = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block_tokens(i, self.block_size)
            h = chain_hash(prev_hash, tokens)
            block_id, entry = self.hash_to_block.get(h), None
            if block_id is not None:
                block = self.blocks[block_id]
                if block.token_ids != tokens or block.parent_uid != prev_uid:  # a hash collision
                    block_id = None
            if block_id is None and self.host is not None:
                entry = self.host.lookup(h, tokens, prev_uid)
            if block_id is None and entry is None:
                break
            hits.append((h, block_id, entry, tokens))
            prev_hash, prev_uid = h, self.blocks[block_id].uid if block_id is not None else entry.uid
        return hits

    def allocate(self, seq: Sequence, use_cache: bool = True) -> int | None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks from either
        tier (unless not use_cache). Returns how many of its tokens the cache serves (computed, or
        reloaded before the step runs), or None, changing nothing, when too few blocks are free."""
        assert not seq.block_table and seq.num_tokens == len(seq.token_ids)
        hits = self._match_prefix(seq) if use_cache else []
        num_revived = sum(b is not None and self.blocks[b].ref_count == 0 for _, b, _, _ in hits)
        num_host_hits = sum(b is None for _, b, _, _ in hits)
        num_new = self.blocks_needed(seq.num_tokens) - len(hits)
        if num_new + num_host_hits + num_revived > len(self.free):
            return None
        # Claim the device hits and pin the host hits first: a block taken for a reload below
        # must be none of them, and no offload it causes may take a slot a reload reads.
        for h, block_id, _, _ in hits:
            if block_id is None:
                self.host.use(h)
            else:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free[block_id]
                block.ref_count += 1
        table = []
        for h, block_id, entry, tokens in hits:
            if block_id is None:  # a host hit: a fresh device block, published as its reload is queued
                block_id = self._take_free_block()
                self.host.reload(entry, block_id)
                self._publish(self.blocks[block_id], h, tokens, entry.uid, entry.parent_uid)
            table.append(block_id)
        seq.block_table = table + [self._take_free_block() for _ in range(num_new)]
        seq.block_hashes = [h for h, _, _, _ in hits]
        num_cached = len(hits) * self.block_size
        self.num_cached_tokens += num_cached
        self.num_host_hit_tokens += num_host_hits * self.block_size
        if use_cache and self.enable_prefix_caching:
            self.num_queried_tokens += (seq.num_tokens - 1) // self.block_size * self.block_size
        self._note_usage()
        return num_cached

    def _publish(self, block: Block, h: int, tokens: list[int], uid: int, parent_uid: int | None):
        """Register block under key h, as holding the contents `uid` (tokens after parent_uid's)."""
        block.hash, block.token_ids, block.uid, block.parent_uid = h, tokens, uid, parent_uid
        self.hash_to_block[h] = block.block_id

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make seq's block table cover num_tokens tokens; False (changing nothing) if too few are free."""
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
        """Publish the blocks seq's first num_tokens tokens fill, under their chained keys; the caller vouches
        their K/V are computed (or are being, by a launched step that readers follow) and the host knows their ids."""
        if not self.enable_prefix_caching:
            return
        bs, hashes = self.block_size, seq.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            tokens = seq.block_tokens(i, bs)
            h = chain_hash(hashes[-1] if hashes else None, tokens)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            parent_uid = self.blocks[seq.block_table[i - 1]].uid if i else None
            block.uid, block.parent_uid, self.next_uid = self.next_uid, parent_uid, self.next_uid + 1
            if h in self.hash_to_block:  # an equal block is published already (computed alongside): keep it
                continue
            self._publish(block, h, tokens, block.uid, parent_uid)

    def release(self, block_id: int):
        """Free an unreferenced block: last out if a lookup can find it, else first (no hit can come from it)."""
        self.free[block_id] = None
        block = self.blocks[block_id]
        if block.hash is None or self.hash_to_block.get(block.hash) != block_id:
            self.free.move_to_end(block_id, last=False)

    def free_blocks(self, seq: Sequence, swap: bool = False):
        """Drop seq's references. Its tail is freed first, so it is also reused first and the more
        widely shared prefix blocks stay cached longest. swap (preemption_mode="swap"): copy its
        cached blocks to the host tier now, so its prefix comes back from there if the device reuses them."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.release(block_id)
                if swap and block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                    self.host.offload(block)
        seq.block_table = []
        seq.block_hashes = []
