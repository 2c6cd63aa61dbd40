"""Prefix caching across requests: a KV slot given back after a request keeps what it holds, so a later prompt
that starts the same way (an agent resending its whole conversation every turn) prefills only what differs.

Static slots, no paging (the decode graphs index slots): the index maps each free slot that still holds tokens to
their ids, in order, and to when it was given back. Admission (`choose`) takes, among the free slots, the one
sharing the longest prefix with the prompt when that prefix is at least `min_reuse` tokens; otherwise a slot
holding nothing or, failing that, the least recently given back one (LRU: the entry least likely to be asked for
again is the one overwritten). The taken slot's entry leaves the index: the slot is its request's again.

Why a linear scan and not a token trie: entries exist only for free slots, so there are at most max_batch of them
(a few dozen: the decode graphs' batch buckets), and comparing the prompt against each runs at C speed a block at
a time (`common_prefix`), stopping at the first block that differs, and stops early once a slot gives all that can
be reused. A lookup so costs microseconds next to the prefill it saves, and storing or dropping an entry is one
dict assignment, where a trie would need its paths inserted and pruned on every release and every allocation.

Exactness: the K/V a slot holds at position i is a function of ids[:i+1] alone (causal attention; a sliding
window or attention sinks change what a query reads, not what a position stores; MLA stores its latent the same
way), so continuing a prompt from a cached prefix computes what a prefill from scratch computes. The entry must
therefore list exactly the tokens whose K/V the positions hold (Engine.free_slot keeps only the first
lengths[slot] ids: positions written past what the request accepted are not in it). At least the prompt's last
token is always prefilled, for the logits of the first generated token.
"""

from __future__ import annotations

import itertools

MIN_REUSE = 16  # a shorter shared prefix saves less than the cached entry it would overwrite may be worth
BLOCK = 256  # ids compared per list-slice equality in common_prefix


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids a and b share: compared a block at a time by list equality (C speed), then id by id
    inside the first block that differs."""
    n = min(len(a), len(b))
    i = 0
    while i < n:
        j = min(i + BLOCK, n)
        if a[i:j] != b[i:j]:
            break
        i = j
    else:
        return n
    while a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Which token ids each free KV slot still holds; an Engine keeps one when RuntimeConfig.prefix_cache is on."""

    def __init__(self, min_reuse: int = MIN_REUSE):
        self.min_reuse = min_reuse
        self.entries: dict[int, list[int]] = {}  # free slot -> ids whose K/V its positions 0.. hold
        self.last_use: dict[int, int] = {}  # free slot -> tick of its release (LRU order)
        self._clock = itertools.count()

    def store(self, slot: int, ids: list[int]) -> None:
        """A slot given back holding `ids` (nothing: forgotten)."""
        if not ids:
            self.forget(slot)
            return
        self.entries[slot] = list(ids)
        self.last_use[slot] = next(self._clock)

    def forget(self, slot: int) -> None:
        """The slot's positions no longer hold what its entry says (taken by a request, or its content unknown)."""
        self.entries.pop(slot, None)
        self.last_use.pop(slot, None)

    def match(self, free: list[int], prompt: list[int]) -> tuple[int | None, int]:
        """(the free slot whose entry shares the longest prefix with the prompt, how many of its tokens the prompt can
        take: never the last one), or (None, 0) below min_reuse. Ties go to the least recently used entry."""
        limit = len(prompt) - 1
        best, best_n = None, 0
        for slot in sorted((s for s in free if s in self.entries), key=self.last_use.__getitem__):
            n = min(common_prefix(self.entries[slot], prompt), limit)
            if n > best_n:
                best, best_n = slot, n
                if n == limit:
                    break  # nothing can give more
        return (best, best_n) if best_n >= self.min_reuse else (None, 0)

    def victim(self, free: list[int]) -> int:
        """The free slot to overwrite: one holding nothing (the last such in `free`: the engine's order before the
        cache existed), else the least recently used."""
        empty = [s for s in free if s not in self.entries]
        if empty:
            return empty[-1]
        return min(free, key=self.last_use.__getitem__)

    def choose(self, free: list[int], prompt: list[int]) -> tuple[int, int]:
        """(slot, prompt tokens it already holds) for a new prompt; `free` must not be empty. Changes nothing."""
        slot, n = self.match(free, prompt)
        return (slot, n) if slot is not None else (self.victim(free), 0)
