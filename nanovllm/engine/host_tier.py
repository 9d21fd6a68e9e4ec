"""The prefix cache's second tier: KV blocks in host memory, keyed by the same chained hash.

A cached device block (published, no sequence holding it) that is about to be reused for other
tokens is first copied here (write-back on eviction), so a later request with that prefix reloads
it instead of recomputing it. Slots are evicted least recently used first. The copies themselves
are the model runner's (StepBatch.offloads / .reloads); this class only decides where things go.

A host entry records what its K/V were computed from, as a device block does (block_manager.Block):
its tokens, the id of its contents (uid) and of its parent's (parent_uid). A hit verifies its
tokens and that its parent is the contents the lookup matched before it, so a chain of verified
blocks stands for exactly the prefix's tokens, whatever the hash does.
"""
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class HostEntry:
    slot: int
    token_ids: list[int]
    uid: int                # the contents' id, kept from the device block it was copied from
    parent_uid: int | None


class HostTier:
    def __init__(self, num_slots: int):
        assert num_slots > 0
        self.num_slots = num_slots
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()  # chained hash -> entry, least recently used first
        self.free_slots = list(range(num_slots - 1, -1, -1))       # (pop() hands out slot 0 first)
        self.pinned: set[int] = set()  # hashes whose slot a reload of the step being planned reads

    def lookup(self, h: int, token_ids: list[int], parent_uid: int | None) -> HostEntry | None:
        """The entry of key h if it holds these tokens after this parent (read-only)."""
        entry = self.entries.get(h)
        if entry is None or entry.token_ids != token_ids or entry.parent_uid != parent_uid:
            return None
        return entry

    def use(self, h: int):
        """A reload of h is queued: h is the most recently used, and pinned until the step's copies
        are taken (no offload of the same step may overwrite its slot before the reload reads it)."""
        self.entries.move_to_end(h)
        self.pinned.add(h)

    def reserve(self, h: int, token_ids: list[int], uid: int, parent_uid: int | None) -> int | None:
        """A slot to write the block of key h into (h must not be here), evicting the least
        recently used entry when none is free; None when every entry is pinned by this step."""
        assert h not in self.entries
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((k for k in self.entries if k not in self.pinned), None)
            if victim is None:
                return None
            slot = self.entries.pop(victim).slot
        self.entries[h] = HostEntry(slot, token_ids, uid, parent_uid)
        return slot

    def unpin(self):
        """The step's copies are issued: its reloads read their slots before any later write."""
        self.pinned.clear()

    @property
    def num_used(self) -> int:
        return len(self.entries)
