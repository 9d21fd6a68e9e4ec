"""BlockManager unit tests: allocation accounting, ref counts, the chained-hash prefix cache,
LRU reuse of freed blocks, hash-collision safety and grow()."""
import pytest

import nanovllm.engine.block_manager as bm_module
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BS = 4  # block size used throughout: small so that a few tokens span several blocks


def make_seq(token_ids, max_tokens=4):
    return Sequence(token_ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), seed=0)


def admit(bm: BlockManager, seq: Sequence) -> bool:
    """What the scheduler does with allocate(): the tokens the cache serves count as computed,
    and the first admission's count is the request's num_cached_tokens."""
    num_cached = bm.allocate(seq)
    if num_cached is None:
        return False
    seq.admit(num_cached)
    return True


def release(bm: BlockManager, seq: Sequence):
    """What the scheduler does with free_blocks(): the K/V are gone with the blocks."""
    bm.free_blocks(seq)
    seq.evict()


def compute_all(bm: BlockManager, seq: Sequence, num_tokens=None):
    """What a step does once seq's K/V are written: mark tokens computed, publish full blocks."""
    seq.advance(seq.num_tokens if num_tokens is None else num_tokens, samples=False)
    bm.cache_full_blocks(seq, seq.num_computed_tokens)


def check_invariants(bm: BlockManager, live: list[Sequence]):
    """Ref count of every block == number of live block tables holding it; free <=> ref 0."""
    for block in bm.blocks:
        holders = sum(t == block.block_id for s in live for t in s.block_table)
        assert block.ref_count == holders, (block.block_id, block.ref_count, holders)
        assert (block.block_id in bm.free) == (block.ref_count == 0)


# ---------------------------------------------------------------- allocation accounting

@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 9, 17])
def test_allocate_gives_ceil_blocks_and_free_returns_them(n):
    bm = BlockManager(num_blocks=10, block_size=BS)
    seq = make_seq(list(range(100, 100 + n)))
    assert admit(bm, seq)
    expected = -(-n // BS)
    assert len(seq.block_table) == expected
    assert len(set(seq.block_table)) == expected
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    assert bm.num_free_blocks == 10 - expected
    assert seq.num_computed_tokens == 0  # empty cache: nothing served
    check_invariants(bm, [seq])

    table = list(seq.block_table)
    release(bm, seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 10
    assert all(bm.blocks[b].ref_count == 0 for b in table)
    check_invariants(bm, [])


def test_allocate_fails_without_change_when_too_few_free():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(list(range(10)))          # 3 blocks
    assert admit(bm, a)
    assert bm.num_free_blocks == 1
    b = make_seq(list(range(50, 55)))      # needs 2 blocks, 1 free
    free_before = list(bm.free)
    refs_before = [blk.ref_count for blk in bm.blocks]
    assert not admit(bm, b)
    assert b.block_table == [] and b.num_computed_tokens == 0 and not b.admitted
    assert list(bm.free) == free_before
    assert [blk.ref_count for blk in bm.blocks] == refs_before
    # Exactly enough free is fine.
    c = make_seq(list(range(60, 64)))      # 1 block
    assert admit(bm, c)
    assert bm.num_free_blocks == 0
    check_invariants(bm, [a, c])


def test_allocate_fails_without_change_when_cache_hit_needs_revival_but_too_few_free():
    """A cached-but-free block that would be revived counts against the free blocks."""
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(list(range(9)))                 # blocks [0, 1, 2]; 0 and 1 full and published
    assert admit(bm, a)
    compute_all(bm, a)
    release(bm, a)
    assert list(bm.free) == [2, 3, 1, 0]         # (2 holds no published contents: first out)
    hog = make_seq(list(range(500, 508)))        # takes blocks 2 and 3; cached 1 and 0 stay free
    assert admit(bm, hog)
    b = make_seq(list(range(8)) + [77, 78, 79])  # 2 hits to revive + 1 new = 3 > 2 free
    free_before, hashes_before = list(bm.free), dict(bm.hash_to_block)
    stat_before = bm.num_cached_tokens
    assert not admit(bm, b)
    assert b.block_table == [] and b.num_computed_tokens == 0 and not b.admitted
    assert list(bm.free) == free_before and dict(bm.hash_to_block) == hashes_before
    assert bm.num_cached_tokens == stat_before
    assert all(bm.blocks[i].ref_count == 0 for i in (0, 1))
    check_invariants(bm, [hog])
    # With one more block free it fits, reviving both cached blocks.
    release(bm, hog)
    assert admit(bm, b)
    assert b.block_table[:2] == [0, 1] and b.num_computed_tokens == 8
    check_invariants(bm, [b])


# ---------------------------------------------------------------- prefix caching

def test_prefix_hit_after_free_reuses_same_physical_blocks():
    bm = BlockManager(num_blocks=10, block_size=BS)
    prompt = list(range(1, 11))            # 10 tokens: 2 full blocks + 2 tokens
    a = make_seq(prompt)
    assert admit(bm, a)
    compute_all(bm, a)
    assert len(a.block_hashes) == 2
    a_table, a_hashes = list(a.block_table), list(a.block_hashes)
    release(bm, a)

    b = make_seq(prompt[:8] + [99, 98, 97])  # same 2 full blocks, different tail
    assert admit(bm, b)
    assert b.num_computed_tokens == 8
    assert b.num_cached_tokens == 8 and b.admitted
    assert b.block_table[:2] == a_table[:2]
    assert len(b.block_table) == 3
    assert b.block_hashes == a_hashes
    assert bm.num_cached_tokens == 8
    check_invariants(bm, [b])


def test_last_prompt_token_never_served_from_cache():
    bm = BlockManager(num_blocks=10, block_size=BS)
    prompt = list(range(1, 2 * BS + 1))    # exactly 2 full blocks
    a = make_seq(prompt)
    assert admit(bm, a)
    compute_all(bm, a)
    assert len(a.block_hashes) == 2
    release(bm, a)

    b = make_seq(list(prompt))             # identical prompt
    assert admit(bm, b)
    assert b.num_computed_tokens == BS     # only block 0: block 1 holds the last prompt token
    assert b.num_cached_tokens == BS
    assert len(b.block_table) == 2
    assert b.num_computed_tokens < b.num_tokens

    # A 1-block prompt identical to a cached block gets nothing from the cache.
    release(bm, b)
    c = make_seq(prompt[:BS])
    assert admit(bm, c)
    assert c.num_computed_tokens == 0


def test_different_token_in_first_block_gives_no_hit_chained_hash():
    bm = BlockManager(num_blocks=10, block_size=BS)
    prompt = list(range(1, 14))            # 3 full blocks + 1
    a = make_seq(prompt)
    assert admit(bm, a)
    compute_all(bm, a)
    release(bm, a)

    changed = list(prompt)
    changed[0] = 999                       # blocks 1 and 2 identical, block 0 differs
    b = make_seq(changed)
    assert admit(bm, b)
    assert b.num_computed_tokens == 0
    assert b.num_cached_tokens == 0

    # A change in block 1 keeps block 0's hit and stops there.
    release(bm, b)
    changed = list(prompt)
    changed[BS + 1] = 999
    c = make_seq(changed)
    assert admit(bm, c)
    assert c.num_computed_tokens == BS


def test_hit_on_block_held_by_running_sequence_is_shared():
    bm = BlockManager(num_blocks=10, block_size=BS)
    prefix = list(range(1, 9))             # 2 full blocks
    a = make_seq(prefix + [50, 51])
    assert admit(bm, a)
    compute_all(bm, a)                     # a keeps running
    free_before = bm.num_free_blocks

    b = make_seq(prefix + [60, 61, 62])
    assert admit(bm, b)
    assert b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    for blk in a.block_table[:2]:
        assert bm.blocks[blk].ref_count == 2
    assert bm.num_free_blocks == free_before - 1   # only b's tail block is new
    check_invariants(bm, [a, b])

    shared = a.block_table[:2]
    release(bm, a)
    for blk in shared:
        assert bm.blocks[blk].ref_count == 1
        assert blk not in bm.free
    check_invariants(bm, [b])
    release(bm, b)
    assert bm.num_free_blocks == bm.num_blocks
    check_invariants(bm, [])


def test_partial_prefill_publishes_only_computed_full_blocks():
    bm = BlockManager(num_blocks=10, block_size=BS)
    prompt = list(range(1, 14))            # 13 tokens
    a = make_seq(prompt)
    assert admit(bm, a)
    compute_all(bm, a, num_tokens=6)       # first chunk: block 0 full, block 1 half
    assert len(a.block_hashes) == 1
    compute_all(bm, a, num_tokens=12)      # second chunk: blocks 1 and 2 full
    assert len(a.block_hashes) == 3
    assert len(bm.hash_to_block) == 3
    release(bm, a)
    b = make_seq(prompt)
    assert admit(bm, b)
    assert b.num_computed_tokens == 12


# ---------------------------------------------------------------- LRU reuse and eviction

def test_freed_blocks_reused_least_recently_freed_first():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_seq(list(range(1, 5)))        # 1 block
    b = make_seq(list(range(11, 15)))      # 1 block
    c = make_seq(list(range(21, 25)))      # 1 block
    for s in (a, b, c):
        assert admit(bm, s)
        compute_all(bm, s)   # (cached blocks: among those, the order is the order freed)
    assert bm.num_free_blocks == 3
    # Exhaust the never-used blocks so only freed ones remain.
    filler = make_seq(list(range(100, 112)))
    assert admit(bm, filler)
    assert bm.num_free_blocks == 0
    ba, bb, bc = a.block_table[0], b.block_table[0], c.block_table[0]
    release(bm, b)
    release(bm, c)
    release(bm, a)
    assert list(bm.free) == [bb, bc, ba]
    x = make_seq([900])
    y = make_seq([901])
    z = make_seq([902])
    for s in (x, y, z):
        assert admit(bm, s)
    assert [x.block_table[0], y.block_table[0], z.block_table[0]] == [bb, bc, ba]


def test_a_block_no_lookup_can_find_is_reused_before_any_cached_one():
    """A freed block that holds no published contents (a partial tail) goes to the front of the
    free list, however recently it was freed: handing it out loses no hit, evicting a cached one may."""
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(list(range(1, 6)))        # a full block, then 1 token
    b = make_seq([50])                     # 1 token
    for s in (a, b):
        assert admit(bm, s)
        compute_all(bm, s)
    spare = ({0, 1, 2, 3} - set(a.block_table) - set(b.block_table)).pop()
    (a_full, a_tail), (b_block,) = a.block_table, b.block_table
    release(bm, a)
    release(bm, b)                         # b's block freed last, yet first out
    assert list(bm.free) == [b_block, a_tail, spare, a_full]   # the one cached block, last out
    c = make_seq(list(range(100, 112)))    # 3 blocks: the spare and both uncached ones
    assert admit(bm, c)
    assert a_full not in c.block_table
    release(bm, c)
    again = make_seq(list(range(1, 6)))
    assert admit(bm, again)
    assert again.num_computed_tokens == BS  # a's full block still served


def test_tail_block_evicted_before_prefix_and_evicted_hash_not_served():
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(1, 13))            # 3 full blocks
    a = make_seq(prompt)
    assert admit(bm, a)
    compute_all(bm, a)
    b0, b1, b2 = a.block_table
    h0, h1, h2 = a.block_hashes
    unused = ({0, 1, 2, 3} - {b0, b1, b2}).pop()
    release(bm, a)
    assert list(bm.free) == [unused, b2, b1, b0]   # tail freed first, so reused first

    # A new 2-block sequence takes the never-used block, then a's tail: its hash is gone,
    # the prefix blocks survive.
    other = make_seq([700, 701, 702, 703, 704])
    assert admit(bm, other)
    assert other.block_table == [unused, b2]
    assert h2 not in bm.hash_to_block
    assert bm.hash_to_block.get(h0) == b0 and bm.hash_to_block.get(h1) == b1
    assert bm.blocks[b2].hash is None and bm.blocks[b2].token_ids is None

    # prompt + 1 token could hit 3 blocks; block 2 was evicted, so only 2 hit.
    release(bm, other)
    c = make_seq(prompt + [5])
    assert admit(bm, c)
    assert c.num_computed_tokens == 2 * BS
    assert c.block_table[:2] == [b0, b1]
    check_invariants(bm, [c])

    # Evict everything: nothing is served any more.
    release(bm, c)
    hog = make_seq(list(range(800, 816)))
    assert admit(bm, hog)
    assert bm.hash_to_block == {}
    release(bm, hog)
    d = make_seq(prompt + [5])
    assert admit(bm, d)
    assert d.num_computed_tokens == 0


def test_a_block_computed_alongside_an_equal_published_one_is_not_cached_the_first_stays():
    """Two equal prompts computed in one step: the first sequence's blocks are published; the
    second's equal blocks are not (their keys are taken), so once both are freed they go out
    before any cached block, and a later hit is served by the first's."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(1, 10))            # 2 full blocks + 1 token
    a, b = make_seq(prompt), make_seq(prompt)
    assert admit(bm, a) and admit(bm, b)   # (nothing is published yet: no hit for b)
    compute_all(bm, a)
    compute_all(bm, b)                     # b's two full blocks duplicate a's
    cached = a.block_table[:2]
    release(bm, b)
    release(bm, a)
    filler = make_seq(list(range(100, 124)))   # 6 blocks: every free block but the 2 cached ones
    assert admit(bm, filler)
    assert not set(filler.block_table) & set(cached)   # b's duplicates went out first, a's stayed
    release(bm, filler)
    c = make_seq(prompt)
    assert admit(bm, c)
    assert c.num_computed_tokens == 2 * BS and c.block_table[:2] == cached
    check_invariants(bm, [c])


def test_revived_block_leaves_free_list():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(list(range(1, 10)))       # 2 full + 1
    assert admit(bm, a)
    compute_all(bm, a)
    release(bm, a)
    b = make_seq(list(range(1, 10)))
    assert admit(bm, b)
    assert b.num_computed_tokens == 8
    for blk in b.block_table:
        assert blk not in bm.free
    assert bm.num_free_blocks == 1
    check_invariants(bm, [b])


# ---------------------------------------------------------------- hash collisions

def test_hash_collision_does_not_give_false_hit(monkeypatch):
    """Every block gets the same key: only a block whose tokens really match may be served."""
    monkeypatch.setattr(bm_module, "chain_hash", lambda prev, tokens: 12345)
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, a)
    compute_all(bm, a)
    cached = a.block_table[0]
    release(bm, a)
    b = make_seq([9, 9, 9, 9, 5])
    assert admit(bm, b)
    assert b.num_computed_tokens == 0
    assert cached not in b.block_table
    c = make_seq([1, 2, 3, 4, 6])
    assert admit(bm, c)
    assert c.num_computed_tokens == BS and c.block_table[0] == cached
    check_invariants(bm, [b, c])


def test_hash_collision_same_block_tokens_different_prefix_is_not_a_hit(monkeypatch):
    # a hash that forgets the prefix: equal blocks at different positions collide
    monkeypatch.setattr(bm_module, "chain_hash", lambda prev, tokens: hash(tuple(tokens)))
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = make_seq([5, 5, 5, 5, 1, 2, 3, 4, 0])   # block 1 = [1,2,3,4] computed after prefix [5,5,5,5]
    assert admit(bm, a)
    compute_all(bm, a)
    release(bm, a)
    # hash_to_block[hash((1, 2, 3, 4))] now names a's block 1, whose tokens are [1,2,3,4].
    b = make_seq([1, 2, 3, 4, 0])               # block 0 = [1,2,3,4] at positions 0..3, no prefix
    assert admit(bm, b)
    # a's block 1 holds K/V for positions 4..7 after [5,5,5,5]: serving it here would be wrong.
    assert b.num_computed_tokens == 0


def test_reused_parent_does_not_vouch_for_its_old_child(monkeypatch):
    """A cached block records its parent by the id of the parent's contents (uid, dropped when a
    block is taken): a parent block that was freed and reused for another prefix does not vouch for
    the child it had. Here a hash that forgets the prefix makes the child's key collide with the
    new prefix's, the child's own tokens match, and the parent's block id matches: only the
    contents' id tells the hit is wrong (the child's K/V were computed after the parent's old
    tokens).

    Today's free order never reuses a parent before its cached child (a sequence's blocks are freed
    tail first, and every holder of a child holds its parent), so the blocks are handed back here
    parent first, through a reordered block table: the order any other eviction policy (such as the
    planned host tier) may produce."""
    monkeypatch.setattr(bm_module, "chain_hash", lambda prev, tokens: hash(tuple(tokens)))
    bm = BlockManager(num_blocks=3, block_size=BS)
    old_prefix, child, new_prefix = [1] * BS, [2] * BS, [3] * BS
    a = make_seq(old_prefix + child + [9])
    assert admit(bm, a)
    parent_id, child_id, tail_id = a.block_table
    compute_all(bm, a, 2 * BS + 1)                    # publishes the parent [1]*BS and the child [2]*BS
    a.block_table = [child_id, tail_id, parent_id]    # freed in reverse: parent first, child last
    release(bm, a)
    filler = make_seq([9])                            # takes the unpublished tail's block (first out)
    assert admit(bm, filler) and filler.block_table == [tail_id]
    b = make_seq(new_prefix)                          # takes the parent's block (the least recently freed)
    assert admit(bm, b) and b.num_computed_tokens == 0
    assert b.block_table[0] == parent_id
    compute_all(bm, b, BS)                            # the parent's block now holds [3]*BS, published
    release(bm, b)
    release(bm, filler)
    c = make_seq(new_prefix + child + [5])
    assert admit(bm, c)
    assert c.block_table[0] == parent_id              # the new prefix is a true hit...
    assert c.num_computed_tokens == BS                # ...the old child is not


def test_hash_collision_never_puts_one_block_twice_in_a_table(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash", lambda prev, tokens: 12345)
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = make_seq([1] * 5)
    assert admit(bm, a)
    compute_all(bm, a)
    release(bm, a)
    b = make_seq([1] * 9)                       # blocks 0 and 1 both equal [1, 1, 1, 1]
    assert admit(bm, b)
    assert len(set(b.block_table)) == len(b.block_table)  # not [0, 0, new] with ref_count 2


# ---------------------------------------------------------------- caching off, stats

def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(1, 14))
    a = make_seq(prompt)
    assert admit(bm, a)
    compute_all(bm, a)
    assert a.block_hashes == [] and bm.hash_to_block == {}
    release(bm, a)
    b = make_seq(prompt)
    assert admit(bm, b)
    assert b.num_computed_tokens == 0 and b.num_cached_tokens == 0
    compute_all(bm, b)
    # Even while b is running, a third copy shares nothing.
    c = make_seq(prompt)
    assert admit(bm, c)
    assert c.num_computed_tokens == 0
    assert not set(b.block_table) & set(c.block_table)
    assert bm.num_cached_tokens == 0
    check_invariants(bm, [b, c])


def test_num_cached_tokens_stat_accumulates():
    bm = BlockManager(num_blocks=20, block_size=BS)
    prefix = list(range(1, 9))             # 2 blocks
    a = make_seq(prefix + [100])
    assert admit(bm, a)
    compute_all(bm, a)
    assert bm.num_cached_tokens == 0
    b = make_seq(prefix + [101])
    assert admit(bm, b)
    assert bm.num_cached_tokens == 8
    c = make_seq(prefix[:4] + [0, 0, 0, 0, 1])
    assert admit(bm, c)
    assert c.num_cached_tokens == 4
    assert bm.num_cached_tokens == 12
    d = make_seq([42] * 9)
    assert admit(bm, d)
    assert bm.num_cached_tokens == 12


def test_sequence_num_cached_tokens_fixed_at_first_admission():
    bm = BlockManager(num_blocks=20, block_size=BS)
    prompt = list(range(1, 10))
    a = make_seq(prompt)
    assert admit(bm, a)
    assert a.num_cached_tokens == 0
    compute_all(bm, a)
    release(bm, a)                      # like a preemption: a is re-admitted later
    assert admit(bm, a)
    assert a.num_computed_tokens == 8      # recompute skips its own cached blocks
    assert a.num_cached_tokens == 0        # but its per-request stat stays the first admission's
    assert bm.num_cached_tokens == 8


# ---------------------------------------------------------------- grow

def test_grow_adds_blocks_only_when_needed():
    bm = BlockManager(num_blocks=5, block_size=BS)
    seq = make_seq(list(range(1, 6)))      # 5 tokens: 2 blocks
    assert admit(bm, seq)
    table = list(seq.block_table)
    assert bm.grow(seq, 8)                 # still fits in 2 blocks
    assert seq.block_table == table and bm.num_free_blocks == 3
    assert bm.grow(seq, 5)                 # fewer tokens than covered: no-op
    assert seq.block_table == table
    assert bm.grow(seq, 9)                 # needs a 3rd block
    assert len(seq.block_table) == 3 and seq.block_table[:2] == table
    assert bm.num_free_blocks == 2
    new = seq.block_table[2]
    assert bm.blocks[new].ref_count == 1 and new not in bm.free
    assert bm.grow(seq, 17)                # 5 blocks: takes the last two
    assert len(seq.block_table) == 5 and bm.num_free_blocks == 0
    check_invariants(bm, [seq])


def test_grow_fails_without_change_when_none_free():
    bm = BlockManager(num_blocks=3, block_size=BS)
    seq = make_seq(list(range(1, 9)))      # 2 blocks
    assert admit(bm, seq)
    other = make_seq([1])
    assert admit(bm, other)
    assert bm.num_free_blocks == 0
    table = list(seq.block_table)
    assert bm.grow(seq, 8)                 # no block needed: succeeds even with none free
    assert not bm.grow(seq, 9)
    assert seq.block_table == table
    assert bm.num_free_blocks == 0
    check_invariants(bm, [seq, other])
    # Needing two when only one is free also fails without taking the one.
    release(bm, other)
    assert not bm.grow(seq, 16)
    assert seq.block_table == table and bm.num_free_blocks == 1
    assert bm.grow(seq, 12)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 0
    check_invariants(bm, [seq])


def test_grow_takes_lru_block_and_evicts_its_hash():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_seq(list(range(1, 9)))        # 2 full blocks
    assert admit(bm, a)
    compute_all(bm, a)
    a_table, h_tail = list(a.block_table), a.block_hashes[1]
    tail = a_table[1]
    release(bm, a)
    seq = make_seq([100])
    assert admit(bm, seq)                # takes the never-used block first
    assert seq.block_table[0] not in a_table
    assert bm.grow(seq, 5)                 # next LRU free block: a's tail
    assert seq.block_table[1] == tail
    assert h_tail not in bm.hash_to_block


# ---- the host tier ----------------------------------------------------------------------------
def host_manager(num_blocks=4, num_host_blocks=2, block_size=4):
    return BlockManager(num_blocks, block_size, num_host_blocks=num_host_blocks)


def test_an_evicted_cached_block_is_written_back_then_reloaded_on_a_hit():
    bm = host_manager()
    a = make_seq(list(range(1, 10)))                       # 2 full blocks + 1 token: 3 blocks
    assert bm.allocate(a) == 0
    bm.cache_full_blocks(a, 9)
    a_blocks, a_hashes = list(a.block_table[:2]), list(a.block_hashes)
    bm.free_blocks(a)
    assert bm.take_copies() == (None, None)                # nothing is evicted yet
    b = make_seq(list(range(50, 63)))                      # 4 blocks: every block, A's cached ones too
    assert bm.allocate(b) == 0
    offloads, reloads = bm.take_copies()
    assert reloads is None and sorted(offloads[:, 0].tolist()) == sorted(a_blocks)
    assert set(bm.host.entries) == set(a_hashes) and not bm.hash_to_block.keys() & set(a_hashes)
    bm.free_blocks(b)
    again = make_seq(list(range(1, 10)))
    assert bm.allocate(again) == 8                         # both full blocks, from the host
    offloads, reloads = bm.take_copies()
    slots = {bm.host.entries[h].slot for h in a_hashes}
    assert set(reloads[:, 0].tolist()) == slots and reloads[:, 1].tolist() == again.block_table[:2]
    assert again.block_hashes == a_hashes and bm.num_host_hit_tokens == 8 and bm.num_cached_tokens == 8
    assert [bm.hash_to_block[h] for h in a_hashes] == again.block_table[:2]   # published on the device again


def test_the_device_tier_is_tried_first_and_nothing_is_copied_for_its_hits():
    bm = host_manager(num_blocks=8)
    a = make_seq(list(range(1, 10)))
    bm.allocate(a)
    bm.cache_full_blocks(a, 9)
    bm.free_blocks(a)
    again = make_seq(list(range(1, 10)))
    assert bm.allocate(again) == 8 and bm.take_copies() == (None, None) and bm.num_host_hit_tokens == 0


def test_host_slots_are_evicted_least_recently_used_and_never_under_a_pending_reload():
    bm = host_manager(num_blocks=3, num_host_blocks=1, block_size=2)
    first = make_seq([1, 2, 3])                            # one full block
    bm.allocate(first)
    bm.cache_full_blocks(first, 3)
    bm.free_blocks(first)
    other = make_seq([7, 8, 9, 10, 11])                    # 3 blocks: evicts first's block to the host
    bm.allocate(other)
    assert len(bm.take_copies()[0]) == 1 and bm.host.num_used == 1
    bm.cache_full_blocks(other, 5)
    bm.free_blocks(other)
    # a hit on first's block (host) and a write-back of other's blocks in the same allocation:
    # the only slot is pinned by the reload, so those offloads are dropped, not written over it
    again = make_seq([1, 2, 3, 4, 5])
    assert bm.allocate(again) == 2
    offloads, reloads = bm.take_copies()
    assert offloads is None and len(reloads) == 1 and not bm.host.pinned


def test_swap_preemption_writes_a_victims_cached_blocks_back_at_once():
    bm = host_manager(num_blocks=6, num_host_blocks=4)
    seq = make_seq(list(range(1, 10)))
    bm.allocate(seq)
    bm.cache_full_blocks(seq, 9)
    blocks = list(seq.block_table[:2])
    bm.free_blocks(seq, swap=True)
    offloads, _ = bm.take_copies()
    assert sorted(offloads[:, 0].tolist()) == sorted(blocks) and bm.host.num_used == 2
    assert all(h in bm.hash_to_block for h in bm.host.entries)     # on both tiers until the device reuses them


def test_a_block_whose_key_another_block_took_goes_out_before_the_cached_ones(monkeypatch):
    """A running sequence's block stops being the one a lookup finds when a hit from the host tier
    publishes another block under its key (a key collision: a hash that forgets the prefix makes
    T after A and T after B one key; the host holds T after B). Freed, that block can serve no hit:
    it goes out first, before every block a lookup can still find."""
    monkeypatch.setattr(bm_module, "chain_hash", lambda prev, tokens: hash(tuple(tokens)))
    bm = host_manager(num_blocks=6, num_host_blocks=4)
    first, second, shared = [1] * 4, [2] * 4, [3] * 4
    b = make_seq(second + shared + [9])
    assert bm.allocate(b) == 0
    bm.cache_full_blocks(b, 9)
    bm.free_blocks(b)
    hog = make_seq(list(range(100, 124)))                    # every block: b's two go to the host
    assert bm.allocate(hog) == 0
    bm.take_copies()
    bm.free_blocks(hog)
    a = make_seq(first + shared + [8])                      # runs: its `shared` block takes the key
    assert bm.allocate(a) == 0
    bm.cache_full_blocks(a, 9)
    c = make_seq(second + shared + [7])                      # both from the host: `shared` collides on the device
    assert bm.allocate(c) == 8
    bm.take_copies()
    unfindable = {a.block_table[1], a.block_table[2], c.block_table[2]}
    bm.free_blocks(c)
    bm.free_blocks(a)                                        # a's `shared` block: its key is c's now
    filler = make_seq(list(range(200, 212)))                # 3 blocks
    assert bm.allocate(filler) == 0
    assert set(filler.block_table) == unfindable and bm.take_copies() == (None, None)   # (no cached one evicted)
    again = make_seq(second + shared + [5])
    bm.free_blocks(filler)
    assert bm.allocate(again) == 8 and bm.take_copies() == (None, None) and bm.num_host_hit_tokens == 8
