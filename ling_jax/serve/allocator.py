"""Host-side page bookkeeping: the pool's sizes (`PoolSizes`) and which slot holds which pages
(`PageAllocator`). Standard library and numpy only (no jax): the scheduler and the prefix cache,
host-only themselves, build on it; the device pools these numbers describe are `pools.py`'s.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class PoolSizes:
    """How many slots and pages, and what they cost. `max_blocks` = pages one sequence may hold
    (ceil(max_seq_len / page_size)): the width of the block table."""
    max_slots: int
    page_size: int
    num_pages: int
    max_seq_len: int
    with_mtp: bool
    page_bytes: int
    slot_bytes: int
    stats_bytes: int = 0  # of slot_bytes: the token statistics (not part of a prefix-cache snapshot)
    kv_cache_dtype: str = "auto"  # "fp8": the MLA pages as float8 + per-token scales (`ling_jax.kv_quant`)
    kpe_stored: int = 0  # values a token's k_pe row takes as stored, when padded (`pools.stored_kpe_values`); 0 = dr

    @property
    def snapshot_bytes(self) -> int:
        """What a prefix-cache snapshot row holds of a slot: KDA state + conv state + hidden."""
        return self.slot_bytes - self.stats_bytes

    @property
    def max_blocks(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes + self.max_slots * self.slot_bytes


class PageAllocator:
    """Which slots hold which pages (in block order), and which are free; deterministic (a LIFO list of
    empty pages). `ensure(slot, n_tokens)` grows a slot to hold n_tokens, all or nothing; `release`
    gives its pages back. With a prefix cache (`cache`) a page may be held by several slots (`refs[p]`
    counts them) and by the cache (`cached`); a cached page the cache could evict counts as free, and
    `ensure` takes empty pages first, then evicts, so cached pages go before anything is preempted."""

    def __init__(self, sizes: PoolSizes):
        self.sizes = sizes
        self.empty = list(range(sizes.num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self.pages: dict[int, list[int]] = {}
        # each slot's block-table row, kept beside `pages` as they change (row max_slots: zeros, for
        # padding rows): a step reads its rows with one take, not a list -> array conversion of every
        # page of every row (16K pages a row at 262K tokens: ~1 ms a step on the host, BENCHMARKS.md)
        self._table = np.zeros((sizes.max_slots + 1, sizes.max_blocks), np.int32)
        self.refs = [0] * sizes.num_pages
        self.cached: set[int] = set()
        self.cache = None  # set by PrefixCache: evict_one() / evictable / evictable_pages()

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.sizes.page_size)

    @property
    def num_free(self) -> int:
        """Pages a slot could get now: empty ones plus cached ones the prefix cache can evict."""
        return len(self.empty) + (self.cache.evictable if self.cache is not None else 0)

    @property
    def free(self) -> list[int]:
        """The free pages (empty, then evictable cached ones); a list for checks, see num_free."""
        return self.empty + (self.cache.evictable_pages() if self.cache is not None else [])

    def ensure(self, slot: int, n_tokens: int) -> bool:
        have = self.pages.setdefault(slot, [])
        need = self.pages_for(n_tokens) - len(have)
        if need > self.num_free:
            return False
        for _ in range(max(need, 0)):
            if not self.empty and not self.cache.evict_one():
                raise AssertionError("page accounting out of step: no empty page and nothing to evict")
            p = self.empty.pop()
            assert self.refs[p] == 0 and p not in self.cached, p
            self.refs[p] = 1
            if len(have) < self.sizes.max_blocks:
                self._table[slot, len(have)] = p
            have.append(p)
        return True

    def share(self, slot: int, pages) -> None:
        """Start the (empty) slot with pages another holder keeps too: a cached prefix."""
        if self.pages.get(slot):
            raise AssertionError(f"slot {slot} already holds pages")
        self.pages[slot] = list(pages)
        n = min(len(pages), self.sizes.max_blocks)
        self._table[slot, :n] = self.pages[slot][:n]
        for p in pages:
            self.refs[p] += 1

    def release(self, slot: int) -> None:
        self._table[slot] = 0
        for p in reversed(self.pages.pop(slot, [])):
            self.refs[p] -= 1
            if self.refs[p] == 0 and p not in self.cached:
                self.empty.append(p)

    def cache_page(self, page: int) -> None:
        """The prefix cache keeps `page` (it stays allocated when its slots release it)."""
        self.cached.add(page)

    def uncache_page(self, page: int) -> None:
        """The prefix cache dropped `page`; it is empty again once no slot holds it."""
        self.cached.remove(page)
        if self.refs[page] == 0:
            self.empty.append(page)

    @property
    def used(self) -> int:
        return self.sizes.num_pages - self.num_free

    def block_rows(self, slots, width: int | None = None) -> np.ndarray:
        """[len(slots), width] int32 block table rows (None = a padding row; unused entries 0: masked
        by length); width defaults to max_blocks."""
        idx = np.fromiter((self.sizes.max_slots if s is None else s for s in slots), np.int64, len(slots))
        return self._table[idx, :width]
