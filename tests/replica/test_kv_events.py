"""KV events as the engine produces them: every prefix-cache registration is a BLOCK_STORED
with the router-computable chain hash, a reused block's hash leaves with a BLOCK_REMOVED,
applying the events in order reproduces the cache's index, and an undrained backlog stays
bounded."""

from __future__ import annotations

from protos.block_hash import block_hashes
from replica.core.block_pool import MAX_PENDING_EVENTS_PER_BLOCK
from replica.core.kv_events import KVEventKind
from sched_harness import make_request, make_scheduler, run_step, run_to_completion

BLOCK = 16


def replay(events, index=None) -> dict[bytes, bytes | None]:
    """What a subscriber's index holds after applying `events` in order."""
    index = {} if index is None else index
    for kind, block_hash, parent_hash in events:
        if kind == KVEventKind.BLOCK_STORED:
            index[block_hash] = parent_hash
        elif kind == KVEventKind.BLOCK_REMOVED:
            del index[block_hash]  # a removal always follows its store
        else:
            index.clear()
    return index


def test_a_prefill_stores_its_full_blocks_under_the_hashes_a_router_computes_from_the_prompt():
    scheduler = make_scheduler(num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=256)
    prompt = list(range(50, 90))  # 40 tokens: two full blocks and a partial one
    scheduler.add_request(make_request("a", prompt, max_tokens=4))
    run_step(scheduler)
    events = scheduler.kv_cache.take_kv_events()
    expected = block_hashes(prompt, BLOCK)
    assert events == [
        (KVEventKind.BLOCK_STORED, expected[0], None),
        (KVEventKind.BLOCK_STORED, expected[1], expected[0]),
    ]
    assert scheduler.kv_cache.take_kv_events() == []  # taken once


def test_replaying_the_events_gives_the_pool_index_through_eviction_and_reuse():
    # 12 usable blocks: later prompts must reuse the freed blocks of earlier ones.
    scheduler = make_scheduler(num_kv_blocks=13, max_model_len=128, max_num_batched_tokens=128)
    index: dict = {}
    for i in range(8):
        prompt = [i * 97 % 1000 + t for t in range(48)]
        run_to_completion(scheduler, [make_request(f"r{i}", prompt, max_tokens=20)],
                          on_step=lambda *_: replay(scheduler.kv_cache.take_kv_events(), index))
        replay(scheduler.kv_cache.take_kv_events(), index)
        pool_index = {h: block.parent_hash for h, block in scheduler.kv_cache.pool.cached_blocks.items()}
        assert index == pool_index
    assert len(index) <= 12


def test_reusing_a_cached_free_block_removes_its_hash():
    scheduler = make_scheduler(num_kv_blocks=5, max_model_len=64, max_num_batched_tokens=64)
    first = list(range(100, 132))  # 2 full blocks, cached after the request ends
    run_to_completion(scheduler, [make_request("a", first, max_tokens=1)])
    scheduler.kv_cache.take_kv_events()
    run_to_completion(scheduler, [make_request("b", list(range(500, 563)), max_tokens=1)])  # needs all 4 blocks
    removed = {block_hash for kind, block_hash, _ in scheduler.kv_cache.take_kv_events() if kind == KVEventKind.BLOCK_REMOVED}
    assert removed == set(block_hashes(first, BLOCK))


def test_an_undrained_backlog_is_replaced_by_the_state_it_leads_to():
    scheduler = make_scheduler(num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=128)
    for i in range(40):  # far more events than 4 per block, never taken
        run_to_completion(scheduler, [make_request(f"r{i}", [i * 131 % 900 + t for t in range(64)], max_tokens=1)])
    pool = scheduler.kv_cache.pool
    events = scheduler.kv_cache.take_kv_events()
    assert len(events) <= MAX_PENDING_EVENTS_PER_BLOCK * pool.num_blocks
    assert events[0][0] == KVEventKind.ALL_BLOCKS_CLEARED  # compacted at least once
    assert replay(events) == {h: block.parent_hash for h, block in pool.cached_blocks.items()}


def test_an_aborted_pass_removes_the_hashes_of_the_blocks_it_never_wrote():
    scheduler = make_scheduler(num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=256, scheduling_policy="slo")
    prompt = list(range(10, 58))
    scheduler.add_request(make_request("victim", prompt, max_tokens=4))
    output = scheduler.schedule()
    scheduler.abort_step(output, "victim", num_discarded_layers=1)
    assert replay(scheduler.kv_cache.take_kv_events()) == {}
