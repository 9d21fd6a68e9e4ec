from array import array
from collections import OrderedDict

import numpy as np
import xxhash

from nanovllm.engine.host_tier import HostTier
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
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent", "parent_hash", "generation")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None          # set once the block is full, computed and published
        self.token_ids: list[int] | None = None
        self.parent: tuple[int, int] | None = None
        self.parent_hash: int | None = None   # the parent's key (what a host copy of it records)
        self.generation = 0


class BlockManager:
    """Owns the physical KV blocks: allocation, reference counts and the prefix cache.

    A block is free when no sequence holds it (ref_count == 0). A free block keeps its hash and
    contents until it is handed out again, so a later request with the same prefix can revive it.
    Free blocks are handed out least recently freed first (`self.free` is kept in that order).

    With a host tier (num_host_blocks > 0, engine/host_tier.py) a cached block about to be handed
    out is first copied to the host (write-back on eviction), and a lookup that misses on the
    device continues there: a host hit is copied back into a freshly allocated device block before
    the step runs. The copies a step needs are queued in `offloads` (device block -> host slot)
    and `reloads` (host slot -> device block), in the order they must run (every offload first:
    a block may be offloaded and then reloaded into in one step), and taken with take_copies().
    A block's key is then on the device (hash_to_block), on the host (host.entries), or both;
    in flight while its copy is queued.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_host_blocks: int = 0):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.host = HostTier(num_host_blocks) if num_host_blocks and enable_prefix_caching else None
        self.offloads: list[tuple[int, int]] = []  # (device block, host slot), queued for the next step
        self.reloads: list[tuple[int, int]] = []   # (host slot, device block)
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
            self._offload(block)                # the host tier keeps them
        block.hash = block.token_ids = block.parent = block.parent_hash = None
        block.generation += 1
        block.ref_count = 1
        return block_id

    def _offload(self, block: Block):
        """Queue a copy of a cached block's K/V to the host tier, unless it is there already."""
        if self.host is None or block.hash in self.host.entries:
            return
        slot = self.host.reserve(block.hash, block.token_ids, block.parent_hash)
        if slot is not None:
            self.offloads.append((block.block_id, slot))

    def take_copies(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The copies the step being planned needs before its forward, [n, 2] int32 each (None:
        none): offloads (device block, host slot), then reloads (host slot, device block)."""
        offloads = np.array(self.offloads, dtype=np.int32) if self.offloads else None
        reloads = np.array(self.reloads, dtype=np.int32) if self.reloads else None
        self.offloads, self.reloads = [], []
        if self.host is not None:
            self.host.unpin()
        return offloads, reloads

    def _match_prefix(self, seq: Sequence) -> list[tuple[int, int | None, int | None, list[int]]]:
        """The longest cached run of seq's full blocks, read-only: per block (key, device block id
        or None, host slot or None, tokens), the device tried first. A device hit must also have
        the parent the run matched before it (block, generation); a host hit its parent's key.

        The last token is never served from the cache: the step must compute at least one token
        to produce the logits the next token is sampled from.
        """
        hits = []
        if not self.enable_prefix_caching:
            return hits
        prev_hash = parent = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block_tokens(i, self.block_size)
            h = chain_hash(prev_hash, tokens)
            block_id, slot = self.hash_to_block.get(h), None
            if block_id is not None:
                block = self.blocks[block_id]
                if block.token_ids != tokens or block.parent != parent:  # a hash collision, or a stale parent
                    block_id = None
            if block_id is None and self.host is not None:
                slot = self.host.lookup(h, tokens, prev_hash)
            if block_id is None and slot is None:
                break
            hits.append((h, block_id, slot, tokens))
            # (a host hit's device block is allocated later: its identity is not known yet, and
            # no device block can have it as its parent: the walk continues on the host)
            prev_hash, parent = h, (block_id, self.blocks[block_id].generation) if block_id is not None else None
        return hits

    def allocate(self, seq: Sequence, use_cache: bool = True) -> int | None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks (unless
        not use_cache: it must compute every token), from either tier. Returns how many of its
        tokens the cache serves (their K/V are computed already, or reloaded before the step
        runs), or None, changing nothing, when too few blocks are free."""
        assert not seq.block_table and seq.num_tokens == len(seq.token_ids)
        hits = self._match_prefix(seq) if use_cache else []
        num_revived = sum(b is not None and self.blocks[b].ref_count == 0 for _, b, _, _ in hits)
        num_device_hits = sum(b is not None for _, b, _, _ in hits)
        num_new = self.blocks_needed(seq.num_tokens) - num_device_hits
        if num_new + num_revived > len(self.free):
            return None
        for h, block_id, _, _ in hits:  # pinned first: no offload below may take a slot a reload reads
            if block_id is None:
                self.host.use(h)
        table, seq_hashes = [], []
        for h, block_id, slot, tokens in hits:
            if block_id is not None:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free[block_id]
                block.ref_count += 1
            else:  # a host hit: a fresh device block, published once its reload is queued
                block = self.blocks[self._take_free_block()]
                self.reloads.append((slot, block.block_id))
                parent = self.blocks[table[-1]] if table else None
                self._publish(block, h, tokens, parent, seq_hashes[-1] if seq_hashes else None)
            table.append(block.block_id)
            seq_hashes.append(h)
        seq.block_table = table + [self._take_free_block() for _ in range(num_new - (len(hits) - num_device_hits))]
        seq.block_hashes = seq_hashes
        num_cached = len(hits) * self.block_size
        self.num_cached_tokens += num_cached
        self.num_host_hit_tokens += (len(hits) - num_device_hits) * self.block_size
        if use_cache and self.enable_prefix_caching:
            self.num_queried_tokens += (seq.num_tokens - 1) // self.block_size * self.block_size
        self._note_usage()
        return num_cached

    def _publish(self, block: Block, h: int, tokens: list[int], parent: Block | None, parent_hash: int | None):
        """Register block under key h. parent: the block before it in its sequence (which may be
        unpublished: an equal block was published first); parent_hash: the previous key of the chain."""
        block.hash, block.token_ids, block.parent_hash = h, tokens, parent_hash
        block.parent = (parent.block_id, parent.generation) if parent else None
        self.hash_to_block[h] = block.block_id

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
            parent = self.blocks[seq.block_table[i - 1]] if i else None
            self._publish(self.blocks[seq.block_table[i]], h, tokens, parent, hashes[i - 1] if i else None)

    def free_blocks(self, seq: Sequence, swap: bool = False):
        """Drop seq's references. Its tail is freed first, so it is also reused first and the more
        widely shared prefix blocks stay cached longest. swap (a preemption with
        preemption_mode="swap"): copy its cached blocks to the host tier now, not when they are
        reused, so its prefix comes back from there if the device reuses them first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free[block_id] = None
                if swap and block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                    self._offload(block)
        seq.block_table = []
        seq.block_hashes = []
