import hashlib
import struct

from pagedllm.core.block_hash import NONE_HASH, append_block_hashes, hash_block_tokens

from .utils import create_requests


def test_hash_is_sha256_of_documented_encoding():
    expected = hashlib.sha256(NONE_HASH + b"T" + struct.pack("<I", 2) + struct.pack("<2q", 7, 8)).digest()
    assert hash_block_tokens(NONE_HASH, [7, 8]) == expected
    salted = hashlib.sha256(NONE_HASH + b"T" + struct.pack("<I", 2) + struct.pack("<2q", 7, 8)
                            + b"S" + struct.pack("<I", 3) + b"abc").digest()
    assert hash_block_tokens(NONE_HASH, [7, 8], cache_salt="abc") == salted


def test_only_full_blocks_are_hashed_incrementally():
    tokens = list(range(10))
    hashes: list[bytes] = []
    append_block_hashes(hashes, tokens[:3], block_size=4)
    assert hashes == []
    append_block_hashes(hashes, tokens[:9], block_size=4)
    assert len(hashes) == 2
    h0 = hash_block_tokens(NONE_HASH, tokens[0:4])
    assert hashes == [h0, hash_block_tokens(h0, tokens[4:8])]
    batch: list[bytes] = []
    append_block_hashes(batch, tokens[:8], block_size=4)
    assert batch == hashes


def test_salt_enters_first_block_only_but_chains():
    tokens = list(range(8))
    plain, salted = [], []
    append_block_hashes(plain, tokens, 4)
    append_block_hashes(salted, tokens, 4, cache_salt="tenant-a")
    h0 = hash_block_tokens(NONE_HASH, tokens[:4], cache_salt="tenant-a")
    assert salted == [h0, hash_block_tokens(h0, tokens[4:])]
    assert not set(plain) & set(salted)


def test_parent_changes_hash():
    assert hash_block_tokens(NONE_HASH, [1, 2]) != hash_block_tokens(hash_block_tokens(NONE_HASH, [0, 0]), [1, 2])


def test_request_hashes_grow_with_outputs():
    (request,) = create_requests(1, num_tokens=6, block_size=4)
    assert len(request.block_hashes) == 1
    request.append_output_token_ids(100)
    assert len(request.block_hashes) == 1
    request.append_output_token_ids([101])
    assert len(request.block_hashes) == 2
    expected: list[bytes] = []
    append_block_hashes(expected, request.all_token_ids, 4)
    assert request.block_hashes == expected
    assert request.num_tokens == 8 and request.num_output_tokens == 2 and request.num_prompt_tokens == 6
