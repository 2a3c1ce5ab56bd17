"""Which KV blocks each request owns, prefix-cache lookups, and caching blocks once their tokens are final."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

from services.common.hashing import BlockHash
from services.engine.block_pool import BlockPool, KVCacheBlock
from services.engine.kv_event_queue import KVEventQueue
from services.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TransferBlocks(NamedTuple):
    """A decode engine's blocks for a prompt another engine computes (disaggregation):
    blocks `first_block ..` of the prompt (those before are cached here already)."""

    first_block: int
    block_ids: list[int]


class Lease(NamedTuple):
    blocks: list[KVCacheBlock]
    expires_at: float  # time.monotonic()


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
        # Disaggregation. Prefill side: requests whose blocks outlive them under a lease
        # (request id -> lease seconds until freed; then -> the lease). Decode side: blocks
        # allocated for a transfer in flight, owned by no request yet.
        self._hold_on_free: dict[str, float] = {}
        self.leases: dict[str, Lease] = {}
        self.transfers: dict[str, list[KVCacheBlock]] = {}

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
        """Release the request's blocks, tail first so its last blocks are evicted before its first;
        held under a lease instead if hold_on_free() asked for it."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        lease_seconds = self._hold_on_free.pop(request.request_id, None)
        if blocks and lease_seconds is not None:
            self.leases[request.request_id] = Lease(blocks, time.monotonic() + lease_seconds)
        elif blocks:
            self.block_pool.free_blocks(reversed(blocks))

    # ------------------------------------------------------------------ disaggregation: prefill side

    def hold_on_free(self, request_id: str, lease_seconds: float) -> None:
        """When the request is freed (finished or aborted), keep its blocks for `lease_seconds` more:
        their KV is on its way to a decode engine."""
        self._hold_on_free[request_id] = lease_seconds

    def leased_block_ids(self, request_id: str) -> list[int]:
        lease = self.leases.get(request_id)
        return [] if lease is None else [block.block_id for block in lease.blocks]

    def release_lease(self, request_id: str) -> bool:
        """Free a lease's blocks (the decode engine has them, or gave up). Idempotent; False if none."""
        self._hold_on_free.pop(request_id, None)
        lease = self.leases.pop(request_id, None)
        if lease is not None:
            self.block_pool.free_blocks(reversed(lease.blocks))
        return lease is not None

    def expire_leases(self, now: float) -> list[str]:
        """Free every lease past its expiry; their request ids."""
        expired = [request_id for request_id, lease in self.leases.items() if lease.expires_at <= now]
        for request_id in expired:
            self.release_lease(request_id)
        return expired

    def next_lease_expiry(self) -> float | None:
        return min((lease.expires_at for lease in self.leases.values()), default=None)

    # ------------------------------------------------------------------ disaggregation: decode side

    def allocate_transfer(self, request: Request) -> TransferBlocks | None:
        """Fresh blocks for the prompt's full blocks beyond the cached prefix, owned by the transfer
        until commit_transfer / cancel_transfer. None when there is nothing to transfer (prefix
        caching off, the prompt cached or shorter than a block) or not enough free blocks.

            | cached here | transferred from P | tail < 1 block, computed here |   (prompt)
            0         first_block        num_prompt_tokens // B

        The blocks are not cached (no hash) until their KV has arrived: no other request may hit
        them before."""
        if not self.enable_caching:
            return None
        num_full = request.num_prompt_tokens // self.block_size
        first = self.num_matched_blocks(request.block_hashes[:num_full])
        num_new = num_full - first
        if num_new <= 0 or num_new > self.block_pool.get_num_free_blocks():
            return None
        blocks = self.block_pool.get_new_blocks(num_new)
        self.transfers[request.request_id] = blocks
        return TransferBlocks(first, [block.block_id for block in blocks])

    def commit_transfer(self, request: Request, transfer: TransferBlocks) -> None:
        """The transferred KV has arrived: cache the blocks under the prompt's hashes and free them to
        the prefix cache, where the request's admission hits them (like any cached prefix)."""
        blocks = self.transfers.pop(request.request_id)
        # cache_full_blocks indexes a request's blocks from its first: the cached prefix before ours
        # is not touched (num_cached_blocks = first_block), so it needs no entries.
        padded: list = [None] * transfer.first_block + blocks
        self.block_pool.cache_full_blocks(padded, request.block_hashes, transfer.first_block, len(padded),
                                          request.all_token_ids)
        self.block_pool.free_blocks(reversed(blocks))

    def cancel_transfer(self, request_id: str) -> bool:
        """Free a transfer's blocks uncached (it failed: their contents are undefined). Idempotent."""
        blocks = self.transfers.pop(request_id, None)
        if blocks is not None:
            self.block_pool.free_blocks(reversed(blocks))
        return blocks is not None

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
        held = {f"lease:{r}": lease.blocks for r, lease in self.leases.items()}
        held.update({f"transfer:{r}": blocks for r, blocks in self.transfers.items()})
        for request_id, blocks in [*self.req_to_blocks.items(), *held.items()]:
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
