"""The block-hash chain: canonical, chained, salted in the first block only, and identical in
every process (the Redis prefix index relies on it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.common.hashing import hash_block, hash_token_blocks


def test_only_full_blocks_are_hashed_and_each_is_chained_to_its_parent():
    tokens = list(range(40))
    hashes = hash_token_blocks(tokens, 16, "m")
    assert len(hashes) == 2
    assert hashes[0] == hash_block(None, tokens[:16], ("m",))
    assert hashes[1] == hash_block(hashes[0], tokens[16:32], ("m",))
    assert all(len(h) == 32 for h in hashes)
    # Resuming from a parent gives the same chain as hashing from the start.
    assert hash_token_blocks(tokens, 16, "m", parent=hashes[0], start_block=1) == hashes[1:]


def test_same_block_with_different_history_differs():
    a = hash_token_blocks([1] * 16 + [2] * 16, 16)
    b = hash_token_blocks([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]


def test_model_id_and_cache_salt_separate_chains_salt_in_first_block_only():
    tokens = list(range(32))
    plain = hash_token_blocks(tokens, 16, "m")
    assert hash_token_blocks(tokens, 16, "other") != plain
    salted = hash_token_blocks(tokens, 16, "m", cache_salt="tenant-a")
    assert salted[0] != plain[0] and salted[1] != plain[1]  # the salt poisons the whole chain
    assert salted[1] == hash_block(salted[0], tokens[16:], ("m",))  # but is only hashed once


def test_encoding_is_canonical_not_ambiguous():
    assert hash_block(None, [1, 2], ("ab",)) != hash_block(None, [1, 2], ("a", "b"))
    assert hash_block(None, [1, 2], (1,)) != hash_block(None, [1, 2], ("1",))
    assert hash_block(None, [258], ()) != hash_block(None, [2, 1], ())
    with pytest.raises(TypeError):
        hash_block(None, [1], (1.5,))


def test_hashes_are_identical_in_a_fresh_process():
    code = ("from services.common.hashing import hash_token_blocks;"
            "print(hash_token_blocks(list(range(100)), 16, 'model', 'salt')[-1].hex())")
    other = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={"PYTHONHASHSEED": str(seed)}).stdout.strip() for seed in (1, 2)]
    here = hash_token_blocks(list(range(100)), 16, "model", "salt")[-1].hex()
    assert other == [here, here]


def test_the_encoding_is_pinned():
    """Engines of two versions share one Redis index: a change to the encoding must be deliberate
    (a new ROOT_SEED version), never a side effect. These are the digests of today's encoding."""
    assert [h.hex() for h in hash_token_blocks(list(range(1, 33)), 16, "smollm2", "tenant-a")] == [
        "0c9ec852bd3e78926452c1964c8d72ec3f6169a6a7306fda96d9ac8034c6f851",
        "657f0edff942cf4f1b9dacf1990472b8719d2050a8a1ace58d19fa6dd3571145",
    ]
