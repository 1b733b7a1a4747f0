"""Paged KV cache: random writes / compactions / frees against a dense per-sequence model."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from specdec.kv_cache import CacheConfig, CacheFullError, PagedKVCache
from specdec.launches import Launches


def _random_run(seed: int, block_size: int, steps: int = 200):
    rng = random.Random(seed)
    layers, heads, dim = 2, 2, 3
    cache = PagedKVCache(layers, heads, dim, num_blocks=64, block_size=block_size)
    dense: dict[int, torch.Tensor] = {}  # seq -> [layers, 2, length, heads, dim]
    next_id = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.15 or not dense:
            cache.add(next_id)
            dense[next_id] = torch.zeros(layers, 2, 0, heads, dim)
            next_id += 1
        elif op < 0.25:
            sid = rng.choice(list(dense))
            cache.free(sid)
            del dense[sid]
        else:  # a speculative step: write n new tokens, keep a random increasing subset starting at 0
            sid = rng.choice(list(dense))
            n = rng.randint(1, 9)
            try:
                cache.reserve(sid, n)
            except CacheFullError:  # only when the blocks the sequences hold positions in leave too few
                held = sum(-(-cache.lengths[s] // block_size) for s in dense if s != sid)
                assert held + -(-(cache.lengths[sid] + n) // block_size) > cache.num_blocks
                continue
            length = cache.lengths[sid]
            slots = cache.slots(sid, length, length + n)
            new = torch.randn(layers, 2, n, heads, dim)
            for layer in range(layers):
                cache.write(layer, slots, new[layer, 0], new[layer, 1])
            keep = [0] + sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))
            cache.commit({sid: keep})
            dense[sid] = torch.cat([dense[sid], new[:, :, keep]], dim=2)
        # invariants after every operation
        used = sum(len(t) for t in cache.block_tables.values())
        assert used + cache.num_free_blocks == cache.num_blocks
        owned = [b for t in cache.block_tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        for sid, ref in dense.items():
            length = cache.lengths[sid]
            assert length == ref.shape[2]
            # the blocks that hold it, and at most its spare (the next block): waste stays under two blocks
            assert -(-length // block_size) <= len(cache.block_tables[sid]) <= -(-length // block_size) + 1
            got = cache.kv[:, :, cache.slots(sid, 0, length)]
            torch.testing.assert_close(got, ref, rtol=0, atol=0)
    return cache


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_random_ops_match_dense(seed, block_size):
    _random_run(seed, block_size)


def test_commit_moves_tree_path_into_place():
    cache = PagedKVCache(1, 1, 1, num_blocks=4, block_size=2)
    cache.add(0)
    cache.reserve(0, 6)
    slots = cache.slots(0, 0, 6)
    vals = torch.arange(6.0).view(6, 1, 1)
    cache.write(0, slots, vals, vals + 10)
    cache.commit({0: [0, 2, 5]})
    assert cache.lengths[0] == 3 and len(cache.block_tables[0]) == 3  # 2 blocks hold it; the third is its spare
    got = cache.kv[0, :, cache.slots(0, 0, 3)].flatten(1)
    assert got.tolist() == [[0, 2, 5], [10, 12, 15]]


def test_a_batch_commit_moves_every_sequences_kv_with_one_copy_of_the_slots():
    """Slots are computed on the host from the block tables: a commit of many tree paths is one copy of the slots
    and one move, not an upload and a gather per sequence (on a GPU, each a launch and a pinned copy)."""
    cache = PagedKVCache(2, 1, 1, num_blocks=64, block_size=4)
    keep, want = {}, {}
    for seq in range(8):
        cache.add(seq)
        cache.reserve(seq, 3 + seq)  # 3 + seq committed, then 6 rows of a step
        cache.commit({seq: range(3 + seq)})
        cache.reserve(seq, 6)
        slots = cache.slots(seq, 3 + seq, 9 + seq)
        vals = (100 * seq + torch.arange(6.0)).view(6, 1, 1)
        cache.write(1, slots, vals, -vals)
        keep[seq] = [0, 2, 5] if seq % 2 else [0, 1, 4]
        want[seq] = [100 * seq + o for o in keep[seq]]
    with Launches() as counter:
        cache.commit(keep)
    assert sum(counter.ops.values()) <= 3, counter.ops  # the slots' copy, the gather, the scatter
    for seq in range(8):
        got = cache.kv[1, :, cache.slots(seq, 3 + seq, 6 + seq)].flatten(1)
        assert got.tolist() == [want[seq], [-x for x in want[seq]]]


def test_a_reservation_uploads_every_sequences_new_slots_in_one_copy():
    cache = PagedKVCache(1, 1, 1, num_blocks=64, block_size=4)
    for seq in range(8):
        cache.add(seq)
        cache.reserve(seq, 3 + seq % 2)
        cache.commit({seq: range(3 + seq % 2)})
    with Launches() as counter:
        cache.reserve_many({seq: 6 for seq in range(8)})  # each needs a new block, half of them two
    ops = counter.ops
    assert ops["_to_copy"] + ops["copy_"] <= 1 and sum(ops.values()) <= 1 + 8 + 2, ops
    for seq, table in cache.block_tables.items():
        want = [table[p // 4] * 4 + p % 4 for p in range(len(table) * 4)]
        assert cache._slot_rows[seq].tolist() == want


def test_a_rejected_tree_keeps_its_next_block_and_the_next_step_reuses_it():
    """A tree that spills into the next block and is rejected keeps that block (the spare): the next step's
    reservation adds no block and rebuilds no slot row. Spares go back when another sequence needs the blocks."""
    cache = PagedKVCache(1, 1, 1, num_blocks=4, block_size=8)
    cache.add(0)
    cache.reserve(0, 6)
    cache.commit({0: range(6)})
    for _ in range(2):  # root + 3 nodes at positions 6..9 and 7..10 reach the second block; only the root is kept
        cache.reserve(0, 4)
        row = cache._slot_rows[0]
        cache.commit({0: [0]})
        assert len(cache.block_tables[0]) == 2 and cache._slot_rows[0].data_ptr() == row.data_ptr()
    with pytest.raises(IndexError, match="not reserved"):
        cache.slots(0, 0, cache.lengths[0] + 1)  # the spare's positions are not writable until reserved
    cache.add(1)
    cache.reserve(1, 24)  # three blocks: only with sequence 0's spare given back
    assert len(cache.block_tables[0]) == 1 and len(cache.block_tables[1]) == 3 and cache.num_free_blocks == 0
    with pytest.raises(CacheFullError):
        cache.reserve(1, 25)


def test_out_of_blocks_is_clear_and_writes_nothing():
    cache = PagedKVCache(1, 1, 1, num_blocks=2, block_size=4)
    cache.add(0)
    cache.add(1)
    cache.reserve(0, 5)
    with pytest.raises(CacheFullError, match="out of blocks"):
        cache.reserve_many({1: 4, 0: 4})
    assert len(cache.block_tables[1]) == 0 and len(cache.block_tables[0]) == 2


def test_a_reservation_interrupted_during_its_copy_loses_no_block(monkeypatch):
    """Blocks were taken off the free list before their slots were copied to the device: an interrupt (or an
    out-of-memory error) there lost them for good in a cache that outlives a call (a model's graph cache)."""
    cache = PagedKVCache(1, 1, 1, num_blocks=8, block_size=4)
    cache.add(0)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("specdec.kv_cache.to_device", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.reserve(0, 12)
    monkeypatch.undo()
    assert cache.num_free_blocks == 8 and cache.block_tables[0] == []
    cache.reserve(0, 32)  # every block is still there
    assert cache.num_free_blocks == 0


def test_bad_keep_offsets_rejected():
    cache = PagedKVCache(1, 1, 1, num_blocks=2, block_size=4)
    cache.add(0)
    cache.reserve(0, 3)
    with pytest.raises(ValueError):
        cache.commit({0: [1, 0]})
    with pytest.raises(IndexError):
        cache.commit({0: [0, 9]})


def test_config_validation():
    with pytest.raises(ValueError):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError):
        CacheConfig(num_blocks=0)


def test_bad_commit_changes_nothing_for_any_sequence():
    """commit() is all-or-nothing: a bad entry for one sequence used to fail after the sequences before it had
    advanced their lengths and released blocks, with their K/V never moved into place (found by
    tests/test_properties.py)."""
    cache = PagedKVCache(1, 1, 1, num_blocks=4, block_size=2)
    for s in (0, 1):
        cache.add(s)
        cache.reserve(s, 3)
        slots = cache.slots(s, 0, 3)
        vals = torch.arange(3.0).view(3, 1, 1) + 10 * s
        cache.write(0, slots, vals, vals)
    before = (cache.kv.clone(), {s: list(t) for s, t in cache.block_tables.items()}, dict(cache.lengths),
              cache.num_free_blocks)
    for keep, err in (({0: [0, 2], 1: [1, 0]}, ValueError), ({0: [0, 2], 1: [0, 7]}, IndexError),
                      ({0: [0, 2], 7: [0]}, KeyError)):
        with pytest.raises(err):
            cache.commit(keep)
        # the pool's unwritten slots are uninitialised memory (NaN under torch's fill_uninitialized_memory)
        torch.testing.assert_close(cache.kv, before[0], rtol=0, atol=0, equal_nan=True)
        assert (cache.block_tables, cache.lengths, cache.num_free_blocks) == before[1:]
    cache.commit({0: [0, 2], 1: [1]})
    assert cache.lengths == {0: 2, 1: 1} and cache.num_free_blocks == 0  # each keeps a spare block
    assert cache.kv[0, 0, cache.slots(0, 0, 2)].flatten().tolist() == [0, 2]
    assert cache.kv[0, 0, cache.slots(1, 0, 1)].flatten().tolist() == [11]


def test_room_shares_the_free_blocks_and_spares_and_one_reservation_takes_it_all():
    """PagedKVCache.room: what each sequence may reserve in one reserve_many of them all; its own blocks' room (the
    partly filled last one, its spare) and, for the sharing ones, an equal share of the rest (free blocks, the others'
    spares): that reservation succeeds and leaves no block free, one position more for a sharing sequence raises."""
    rng = random.Random(0)
    for _ in range(200):
        block_size, num_seqs = rng.choice([1, 3, 4]), rng.randint(1, 4)
        cache = PagedKVCache(1, 1, 1, num_blocks=rng.randint(num_seqs, 16), block_size=block_size)
        for s in range(num_seqs):
            cache.add(s)
        for _ in range(rng.randint(0, 6)):  # steps: a tree of n positions reserved, its root and a path kept
            s, n = rng.randrange(num_seqs), rng.randint(1, 2 * block_size + 1)
            try:
                cache.reserve(s, n)
            except CacheFullError:
                continue
            cache.commit({s: range(rng.randint(1, n))})
        sharing = {s for s in range(num_seqs) if rng.random() < 0.6}
        room = cache.room(list(range(num_seqs)), sharing)
        roots = sum(-(-(cache.lengths[s] + 1) // block_size) for s in range(num_seqs))
        if roots > cache.num_blocks:  # not even every sequence's next position fits
            assert set(room.values()) == {1}
            with pytest.raises(CacheFullError):
                cache.reserve_many(room)
            continue
        extra = {s: (cache.lengths[s] + room[s]) // block_size - -(-(cache.lengths[s] + 1) // block_size)
                 for s in range(num_seqs)}
        assert all((cache.lengths[s] + room[s]) % block_size == 0 for s in range(num_seqs))
        assert all(extra[s] == 0 for s in range(num_seqs) if s not in sharing)
        if sharing:
            assert max(extra[s] for s in sharing) - min(extra[s] for s in sharing) <= 1
            more = rng.choice(sorted(sharing))
            with pytest.raises(CacheFullError):
                copy.deepcopy(cache).reserve_many({**room, more: room[more] + 1})
        cache.reserve_many(room)
        assert cache.num_free_blocks == 0 or not sharing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copy_prefix_gives_each_copy_the_sources_kv_in_its_own_blocks(dtype):
    """Engine.add prefills identical prompts once and copies the K/V (Engine.add): every layer's K and V of the
    source's positions land, bit for bit, in each copy's own blocks; nothing else is written, no block is shared."""
    cache = PagedKVCache(3, 2, 4, num_blocks=16, block_size=4, dtype=dtype)
    cache._free = torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist()  # shuffled block tables
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(1)))
    for s in range(4):
        cache.add(s)
    cache.reserve_many({0: 10, 1: 10, 2: 10, 3: 7})
    before = cache.kv.clone()
    cache.copy_prefix(0, [2, 1], 10)
    source = cache.kv[:, :, cache.slots(0, 0, 10)]
    for s in (1, 2):
        assert torch.equal(cache.kv[:, :, cache.slots(s, 0, 10)], source)
    owned = [b for t in cache.block_tables.values() for b in t]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    untouched = torch.ones(cache.kv.shape[2], dtype=torch.bool)
    untouched[torch.cat([cache.slots(1, 0, 10), cache.slots(2, 0, 10)])] = False
    assert torch.equal(cache.kv[:, :, untouched], before[:, :, untouched])
    cache.commit({s: range(10) for s in (0, 1, 2)})
    assert all(cache.committed_length(s) == 10 for s in (0, 1, 2))
    with pytest.raises(IndexError, match="not reserved"):  # sequence 3 holds 7 positions: nothing copied
        cache.copy_prefix(0, [3], 10)
    with pytest.raises(ValueError, match="distinct"):
        cache.copy_prefix(0, [1, 1], 4)


@pytest.mark.parametrize("n", [0, 1, 2])
def test_copy_prefix_of_the_shortest_prompts(n):
    """A 2-token prompt's copies get one position (every other test copies more), a 1-token prompt's none."""
    cache = PagedKVCache(2, 1, 4, num_blocks=8, block_size=4)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(1)))
    for s in range(3):
        cache.add(s)
    cache.reserve_many({0: 3, 1: 3, 2: 3})
    before = cache.kv.clone()
    cache.copy_prefix(0, [1, 2], n)
    for s in (1, 2):
        assert torch.equal(cache.kv[:, :, cache.slots(s, 0, n)], before[:, :, cache.slots(0, 0, n)])
        assert torch.equal(cache.kv[:, :, cache.slots(s, n, 3)], before[:, :, cache.slots(s, n, 3)])


def test_keep_offsets_must_lie_in_the_reserved_positions():
    """Positions 0..2 are reserved, in a block of 4: offset 3 lies in that block but was never reserved, and a
    negative first offset would keep a position before the length. Both are refused and nothing changes."""
    cache = PagedKVCache(1, 1, 1, num_blocks=2, block_size=4)
    cache.add(0)
    cache.reserve(0, 3)
    with pytest.raises(IndexError, match="never reserved"):
        cache.commit({0: [0, 3]})
    with pytest.raises(ValueError, match=">= 0"):
        cache.commit({0: [-1, 0]})
    assert cache.lengths[0] == 0 and cache.reserved[0] == 3
    cache.commit({0: [0, 2]})
    assert cache.lengths[0] == 2


def test_a_smaller_reservation_keeps_the_positions_reserved_before():
    """reserve(0, 5) then reserve(0, 2): positions 0..4 stay writable (a verify after a larger scratch reservation)."""
    cache = PagedKVCache(1, 1, 1, num_blocks=4, block_size=2)
    cache.add(0)
    cache.reserve(0, 5)
    cache.reserve(0, 2)
    assert cache.reserved[0] == 5
    assert cache.slots(0, 0, 5).numel() == 5


def test_adding_a_sequence_twice_is_refused_and_keeps_its_blocks():
    cache = PagedKVCache(1, 1, 1, num_blocks=4, block_size=2)
    cache.add(0)
    cache.reserve(0, 3)  # 2 blocks of 2
    with pytest.raises(ValueError, match="already in the cache"):
        cache.add(0)
    assert len(cache.block_tables[0]) == 2 and cache.num_free_blocks == 2 and cache.reserved[0] == 3


def test_a_discarded_cache_holds_nothing_and_refuses_any_reservation():
    cache = PagedKVCache(2, 1, 3, num_blocks=4, block_size=2)
    cache.add(0)
    cache.reserve(0, 3)
    cache.discard()
    assert cache.kv.shape == (2, 2, 0, 1, 3) and cache.num_free_blocks == 0 and cache.block_tables == {}
    cache.add(1)
    with pytest.raises(CacheFullError, match="1 more block of 2 tokens is needed, 0 of 0 are free"):  # not "blocks"
        cache.reserve(1, 1)
    assert cache.block_tables[1] == []


def test_scratch_takes_only_the_blocks_left_once_every_sequence_holds_its_next_position():
    """block_size 4, 4 blocks; sequences 0 and 1 hold 4 committed positions each (a block each), 2 blocks are free.
    Each one's next position (its 5th) needs a second block, so both free blocks are spoken for: 0 left for scratch."""
    cache = PagedKVCache(1, 1, 1, num_blocks=4, block_size=4)
    for s in (0, 1):
        cache.add(s)
        cache.reserve(s, 4)
        cache.commit({s: range(4)})
    # sequence 1's 8 scratch positions reach position 11: blocks_for(12) = 3, one past the 2 it holds anyway;
    # sequence 0 asking none gives back nothing of the block its next position needs
    with pytest.raises(CacheFullError, match="for drafting: 1 more block of 4 tokens is needed, 0 are left"):
        cache.reserve_scratch({0: 0, 1: 8})
    assert [len(cache.block_tables[s]) for s in (0, 1)] == [1, 1] and cache.num_free_blocks == 2
    cache.reserve_scratch({1: 4})  # positions 4..7: blocks_for(8) = 2, no block past the ones it needs: fits exactly
    assert cache.slots(1, 4, 8).numel() == 4 and cache.num_free_blocks == 1
    cache.reserve(0, 1)  # sequence 0's next position still has its block
    assert cache.num_free_blocks == 0


def test_copy_prefix_refuses_the_source_among_its_copies():
    cache = PagedKVCache(1, 1, 1, num_blocks=4, block_size=2)
    for s in (0, 1):
        cache.add(s)
    cache.reserve_many({0: 2, 1: 2})
    with pytest.raises(ValueError, match="differ from 0"):
        cache.copy_prefix(0, [1, 0], 2)
