"""Which KV blocks each request owns, prefix-cache lookups, and caching blocks once their tokens are final."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.hashing import BlockHash
from services.engine.block_pool import BlockPool, KVCacheBlock
from services.engine.kv_events import KVEventQueue
from services.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 kv_events: KVEventQueue | None = None) -> None:
        """`kv_events`: the queue the block pool records its cache changes into (None: none kept)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, block_size, enable_caching, kv_events)
        # request id -> its blocks, in token order (block i holds tokens [i*B, (i+1)*B)).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many of its leading blocks are cached (hashed) already.
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache stats, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request`, as (blocks, number of hit tokens).

        Never the whole prompt: at most num_tokens - 1 tokens hit, so the last token is computed and
        yields logits. Call once per admission (it counts stats); ref counts are left alone.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def num_matched_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of a hash chain the prefix cache holds now (no stats, no refs).
        Single dict lookups only, so another thread may call it while the engine loop runs: the
        answer is a moment's truth, as the router needs."""
        if not self.enable_caching:
            return 0
        for i, block_hash in enumerate(block_hashes):
            if self.block_pool.get_cached_block(block_hash) is None:
                return i
        return len(block_hashes)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make `request` own blocks for every token computed after this step; None (and no change) if
        there are not enough free blocks. Returns the newly allocated blocks (not the prefix hits).

        ```
        | < computed  > | < new computed > | < new tokens > |      (tokens)
        | owned blocks  | new_computed_blocks | new blocks   |      (blocks)
        0       request.num_computed_tokens                num_computed_after
        ```
        `new_computed_blocks` (prefix hits) are only given at admission, when the request owns nothing.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}")
        if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
            raise ValueError(
                f"{num_new_computed_tokens} hit tokens do not fill {len(new_computed_blocks)} hit blocks")
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        if new_computed_blocks and (req_blocks or request.num_computed_tokens):
            raise ValueError(f"prefix hits for request {request.request_id} that has computed tokens already")

        num_computed_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = max(0, cdiv(num_computed_after, self.block_size) - len(req_blocks)
                             - len(new_computed_blocks))
        # Free hit blocks sit in the free queue and leave it on touch(): they cannot be handed out too.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None

        self.block_pool.touch(new_computed_blocks)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, req_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            num_cached = self.num_cached_blocks.get(request.request_id, len(new_computed_blocks))
            # Only blocks whose tokens are all known (not beyond num_tokens) and hashed are final.
            num_full = min(min(num_computed_after, request.num_tokens) // self.block_size,
                           len(request.block_hashes))
            if num_full > num_cached:
                self.block_pool.cache_full_blocks(
                    req_blocks, request.block_hashes, num_cached, num_full, request.all_token_ids)
                num_cached = num_full
            self.num_cached_blocks[request.request_id] = num_cached
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its last blocks are evicted before its first."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks in token order (the manager's own list: do not mutate)."""
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def record_cache_snapshot(self) -> None:
        self.block_pool.record_snapshot()

    def check_integrity(self) -> None:
        self.block_pool.check_integrity()
        owners: dict[int, int] = {}
        for request_id, blocks in self.req_to_blocks.items():
            ids = [block.block_id for block in blocks]
            assert len(ids) == len(set(ids)), f"request {request_id} owns a block twice"
            for block in blocks:
                owners[block.block_id] = owners.get(block.block_id, 0) + 1
        for block_id, num_owners in owners.items():
            ref_cnt = self.block_pool.blocks[block_id].ref_cnt
            assert ref_cnt >= num_owners, f"block {block_id} has ref_cnt {ref_cnt} but {num_owners} owners"
        for request_id, num_cached in self.num_cached_blocks.items():
            assert num_cached <= len(self.req_to_blocks.get(request_id, ())), (
                f"request {request_id} has more cached blocks than blocks")
