"""The one block-hash function of the platform.

Engines, processors and the prefix index all name a full block of tokens by a hash chain:

    h_0 = sha256(ROOT_SEED  || enc(tokens[0:B])   || enc(extra_keys))
    h_i = sha256(h_{i-1}    || enc(tokens[iB:(i+1)B]) || enc(extra_keys_i))

`enc` is a canonical byte encoding (little-endian fixed-width integers, length-prefixed UTF-8
strings), never pickle or Python's `hash()`, so the same tokens give the same hashes in every
process, on every pod, after every restart. Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 32 bytes of sha256
BLOCK_HASH_BYTES = 32

# A fixed root seed: every process must use the same one or cross-instance matching fails silently.
ROOT_SEED: BlockHash = hashlib.sha256(b"kvmesh/block-hash/v1").digest()

ExtraKey = str | int


def _encode_extra_keys(extra_keys: Sequence[ExtraKey]) -> bytes:
    parts = [struct.pack("<I", len(extra_keys))]
    for key in extra_keys:
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise TypeError(f"extra keys must be str or int, got {type(key).__name__}")
        if isinstance(key, int):
            parts.append(b"i" + struct.pack("<q", key))
        else:
            raw = key.encode("utf-8")
            parts.append(b"s" + struct.pack("<I", len(raw)) + raw)
    return b"".join(parts)


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()
) -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(ROOT_SEED if parent is None else parent)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(_encode_extra_keys(extra_keys))
    return h.digest()


def block_extra_keys(block_index: int, model_id: str, cache_salt: str | None,
                     lora_name: str | None = None) -> tuple[ExtraKey, ...]:
    """Extra keys of block `block_index`: the model always; the cache salt and the LoRA adapter only
    in the first block (they poison the whole chain from there, and later blocks stay cheap to hash).
    An adapter makes four keys, so no salt can pass for one: KV is never shared across adapters."""
    if block_index == 0 and lora_name:
        return (model_id, cache_salt or "", "lora", lora_name)
    if block_index == 0 and cache_salt:
        return (model_id, cache_salt)
    return (model_id,)


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str = "",
    cache_salt: str | None = None,
    parent: BlockHash | None = None,
    start_block: int = 0,
    lora_name: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids[start_block * block_size:]`, chained from `parent`."""
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block(parent, block, block_extra_keys(i, model_id, cache_salt, lora_name))
        hashes.append(parent)
    return hashes
