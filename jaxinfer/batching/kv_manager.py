"""Each request's KV pages, kept by request id behind the scheduler, over the page allocator.

``paged.BlockManager`` hands out pages and keeps the prefix cache; this adds what a request needs of
it: its page table, grown as it computes, cut back when a verification rejects proposals, published
to the prefix cache page by page as its tokens become known, and freed when it finishes or is
preempted. Only the scheduler calls it (as vLLM's scheduler owns its KV cache manager); the model
runner reads page tables through the scheduler's output and never changes them.
"""

from __future__ import annotations

from jaxinfer.batching.request import Request
from jaxinfer.paged.block_manager import BlockManager


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        self.blocks = BlockManager(num_pages, page_size, enable_prefix_caching)
        self.page_size = page_size
        self._tables: dict[str, list[int]] = {}
        self._committed: dict[str, tuple[int, int | None]] = {}  # full pages published, and the last's key

    # ------------------------------------------------------------------------------- reading

    @property
    def num_free(self) -> int:
        return self.blocks.num_free

    def pages_needed(self, num_tokens: int) -> int:
        return self.blocks.pages_needed(num_tokens)

    def page_table(self, request_id: str) -> list[int]:
        """The request's pages, in position order (read only: the model runner copies it into a step)."""
        return self._tables.get(request_id, [])

    def num_pages(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def short(self, req: Request, num_tokens: int) -> bool:
        """Whether growing ``req`` by ``num_tokens`` computed tokens needs more pages than are free."""
        return self.pages_needed(req.num_computed_tokens + num_tokens) - self.num_pages(req.request_id) > \
            self.blocks.num_free

    # ------------------------------------------------------------------------------- changing

    def allocate(self, req: Request) -> int | None:
        """Pages for every known token of a request being admitted, prefix-cache hits first; the number
        of tokens found cached, or None (nothing claimed) if the pages do not fit."""
        tokens = req.token_ids
        if not self.blocks.can_allocate(tokens):
            return None
        self._tables[req.request_id], cached = self.blocks.allocate(tokens)
        return cached

    def allocate_fresh(self, req: Request, num_tokens: int) -> list[int] | None:
        """Empty pages for ``num_tokens`` tokens (a swapped-out request coming back, its K/V copied in
        by the caller), or None if they do not fit."""
        if self.pages_needed(num_tokens) > self.blocks.num_free:
            return None
        table = self._tables[req.request_id] = []
        self.blocks.grow(table, num_tokens)
        return table

    def grow(self, req: Request, num_tokens: int) -> None:
        """Pages for ``num_tokens`` tokens of ``req`` in all (``OutOfPages`` if they do not fit)."""
        self.blocks.grow(self._tables.setdefault(req.request_id, []), num_tokens)

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Free the pages past those ``num_tokens`` tokens need (rejected proposals' pages)."""
        table = self._tables.get(req.request_id)
        if table is None:
            return
        keep = self.pages_needed(num_tokens)
        self.blocks.free_pages(table[keep:])
        del table[keep:]

    def free(self, req: Request) -> None:
        """Drop the request's pages (those published stay in the prefix cache until reused)."""
        table = self._tables.pop(req.request_id, None)
        if table:
            self.blocks.free_pages(table)
        self._committed.pop(req.request_id, None)

    def commit(self, req: Request) -> None:
        """Publish the full pages of tokens whose K/V exist and whose ids the host knows (an in-flight
        token's and a proposal's are not yet) to the prefix cache; each page is hashed once."""
        known = min(req.num_computed_tokens, req.num_known)
        done, key = self._committed.get(req.request_id, (0, None))
        if known // self.page_size > done:
            self._committed[req.request_id] = self.blocks.commit(self._tables[req.request_id], req.token_ids, known,
                                                                 done, key)

    def stats(self) -> dict:
        b = self.blocks
        return dict(kv_pages_used=b.num_used, kv_pages_total=b.num_pages, prefix_cache_pages=len(b.cached),
                    prefix_cache_queries=b.prefix_queries, prefix_cache_hits=b.prefix_hits)

    def reset_prefix_cache(self) -> None:
        """Forget every published page (after the pool's contents were lost: ``Scheduler.recover``)."""
        self.blocks.forget_cached()
