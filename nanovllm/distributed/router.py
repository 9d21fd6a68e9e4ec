"""Which data-parallel replica runs a prompt (distributed/data_parallel.py asks, one prompt at a time).

prefix       where the prompt's longest run of leading full blocks was sent before, so that their KV is
             likely still in that replica's prefix cache; among the replicas loaded at most `slack`
             sequences (max_num_seqs: a step's batch) above the least loaded one, so that a popular
             prefix cannot pile every request onto one replica. Ties: the less loaded, then the lower
             index; a prompt that matches nowhere: the replica holding the fewest blocks sent (as
             SGLang's cache-aware router does), so that the prefixes spread evenly over the caches.
round_robin  each replica in turn.

A replica's load is its sequences in flight; None marks a dead one, which is never chosen. The prefix
router remembers, per replica, the chained block hashes (block_manager.chain_hash, the prefix cache's
own keys) of what it sent there, least recently sent first out once they outnumber that replica's
KV blocks: a guess at its cache, which evicts least recently used blocks too.
"""
from collections import OrderedDict

from nanovllm.engine.block_manager import chain_hash

ROUTINGS = ("prefix", "round_robin")


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks that a prefix cache can serve (not the last
    token's block: a prompt's last token is always computed)."""
    hashes, h = [], None
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        h = chain_hash(h, token_ids[start:start + block_size])
        hashes.append(h)
    return hashes


def alive(loads: list[int | None]) -> list[int]:
    live = [i for i, load in enumerate(loads) if load is not None]
    if not live:
        raise RuntimeError("no data-parallel replica is alive")  # (the front refuses calls before this)
    return live


class RoundRobinRouter:
    def __init__(self):
        self.next = 0

    def choose(self, token_ids: list[int], loads: list[int | None]) -> int:
        live = alive(loads)
        i = next((i for i in live if i >= self.next), live[0])
        self.next = i + 1
        return i


class PrefixRouter:
    def __init__(self, num_replicas: int, block_size: int, capacity: list[int], slack: int):
        self.block_size, self.capacity, self.slack = block_size, capacity, slack
        self.sent: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]  # per replica, LRU

    def choose(self, token_ids: list[int], loads: list[int | None]) -> int:
        hashes = block_hashes(token_ids, self.block_size)
        live = alive(loads)
        least = min(loads[i] for i in live)
        candidates = [i for i in live if loads[i] <= least + self.slack]
        matched = {i: self.matched(i, hashes) for i in candidates}
        if max(matched.values()) == 0:
            best = min(candidates, key=lambda i: (len(self.sent[i]), loads[i], i))
        else:
            best = max(candidates, key=lambda i: (matched[i], -loads[i], -i))
        self.remember(best, hashes)
        return best

    def matched(self, replica: int, hashes: list[int]) -> int:
        """How many of the prompt's leading blocks were sent to the replica (a chained hash names its whole prefix)."""
        sent = self.sent[replica]
        n = 0
        while n < len(hashes) and hashes[n] in sent:
            n += 1
        return n

    def remember(self, replica: int, hashes: list[int]):
        sent = self.sent[replica]
        for h in hashes:
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > self.capacity[replica]:
            sent.popitem(last=False)


def make_router(routing: str, num_replicas: int, block_size: int, capacity: list[int], slack: int):
    if routing == "prefix":
        return PrefixRouter(num_replicas, block_size, capacity, slack)
    if routing == "round_robin":
        return RoundRobinRouter()
    raise ValueError(f"data_parallel_routing must be one of {ROUTINGS}, got {routing!r}")

