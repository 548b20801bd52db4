"""Host-side page allocator: free list, reference counts, and prefix caching by chained page hashes.

A full page is keyed by ``hash((parent_key, its token ids))``, so equal keys mean equal prefixes.
Pages whose reference count drops to zero go back to the free list but keep their key: they stay
reusable by a later request with the same prefix until their space is handed out again, oldest
freed first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class OutOfPages(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_pages
        self.page_key: list[int | None] = [None] * num_pages
        self.page_tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self.free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self.cached: dict[int, int] = {}  # key -> page
        self.prefix_queries = 0  # pages looked up in the prefix cache
        self.prefix_hits = 0  # pages found

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _take(self) -> int:
        if not self.free:
            raise OutOfPages("no free KV pages")
        page, _ = self.free.popitem(last=False)
        if self.page_key[page] is not None:
            del self.cached[self.page_key[page]]
            self.page_key[page] = self.page_tokens[page] = None
        self.ref_count[page] = 1
        return page

    def _page_keys(self, token_ids: Sequence[int], num_full: int):
        key = None
        for i in range(num_full):
            chunk = tuple(token_ids[i * self.page_size:(i + 1) * self.page_size])
            key = hash((key, chunk))
            yield key, chunk

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Pages that already hold the longest cached full-page prefix of ``token_ids`` (not claimed).

        At least one token is always left to compute, so the last token's logits can be sampled.
        """
        if not self.enable_prefix_caching:
            return []
        pages = []
        for key, chunk in self._page_keys(token_ids, (len(token_ids) - 1) // self.page_size):
            page = self.cached.get(key)
            if page is None or self.page_tokens[page] != chunk:
                break
            pages.append(page)
        return pages

    def can_allocate(self, token_ids: Sequence[int], num_tokens: int | None = None) -> bool:
        """Whether pages for ``num_tokens`` (default all) of ``token_ids`` fit, counting cache hits."""
        need = self.pages_needed(len(token_ids) if num_tokens is None else num_tokens)
        hits = self.match_prefix(token_ids)
        free_hits = sum(1 for p in hits if self.ref_count[p] == 0)
        return need - len(hits) <= self.num_free - free_hits

    def allocate(self, token_ids: Sequence[int], num_tokens: int | None = None) -> tuple[list[int], int]:
        """Claim pages for a new sequence; returns its page table and how many tokens were cached."""
        hits = self.match_prefix(token_ids)
        self.prefix_queries += (len(token_ids) - 1) // self.page_size if self.enable_prefix_caching else 0
        self.prefix_hits += len(hits)
        for p in hits:
            if self.ref_count[p] == 0:
                del self.free[p]
            self.ref_count[p] += 1
        need = self.pages_needed(len(token_ids) if num_tokens is None else num_tokens) - len(hits)
        if need > self.num_free:
            self.free_pages(hits)
            raise OutOfPages(f"need {need} pages, {self.num_free} free")
        return hits + [self._take() for _ in range(need)], len(hits) * self.page_size

    def grow(self, page_table: list[int], num_tokens: int) -> None:
        """Extend ``page_table`` in place to hold ``num_tokens`` tokens."""
        need = self.pages_needed(num_tokens) - len(page_table)
        if need > self.num_free:
            raise OutOfPages(f"need {need} pages, {self.num_free} free")
        page_table.extend(self._take() for _ in range(need))

    def free_pages(self, page_table: Sequence[int]) -> None:
        """Drop one reference to each page; pages left unreferenced become free (keeping their key).

        Freed in reverse so a sequence's tail pages are evicted before its prefix pages."""
        for p in reversed(page_table):
            self.ref_count[p] -= 1
            assert self.ref_count[p] >= 0, f"page {p} freed twice"
            if self.ref_count[p] == 0:
                self.free[p] = None

    def forget_cached(self) -> None:
        """Unpublish every page: their contents are no longer what their keys say (the pool was lost)."""
        for page in self.cached.values():
            self.page_key[page] = self.page_tokens[page] = None
        self.cached.clear()

    def commit(self, page_table: Sequence[int], token_ids: Sequence[int], num_computed: int,
               done: int = 0, key: int | None = None) -> tuple[int, int | None]:
        """Publish full pages among the first ``num_computed`` tokens (their K/V now exist).

        ``done`` pages (ending in ``key``) were published by earlier calls; returns the new pair, so
        each page is hashed once over a sequence's life."""
        if not self.enable_prefix_caching:
            return done, key
        ps = self.page_size
        for i in range(done, num_computed // ps):
            chunk = tuple(token_ids[i * ps:(i + 1) * ps])
            key = hash((key, chunk))
            page = page_table[i]
            if self.page_key[page] is None and key not in self.cached:
                self.page_key[page], self.page_tokens[page] = key, chunk
                self.cached[key] = page
            done = i + 1
        return done, key
