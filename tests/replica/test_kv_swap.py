"""The host KV tier in the scheduler: preemption that swaps victims to host blocks and back
(or recomputes them, per victim), checked against a simulation of what every device and
host block slot holds, so a copy planned in the wrong order, to the wrong block or not at
all fails the step that reads it; outputs equal the reference token for token."""

from __future__ import annotations

import pytest

from replica.config import ConfigError, make_engine_config
from replica.core.preemption_mode import RECOMPUTE, SWAP, PreemptionCosts
from replica.core.request import RequestStatus
from replica.core.scheduler import SchedulerOutput
from tests.replica.sched_harness import make_request, make_scheduler, reference_outputs, run_step, run_to_completion


class SimulatedKV:
    """Each device and host block slot as the token prefix whose K/V it holds. Every step runs
    the step's copies, writes its new tokens' slots, then checks that each scheduled request's
    block table holds its own prefix at every position its attention reads."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.tables: dict[str, list[int]] = {}
        self.num_checked_positions = 0

    def _slots(self, tier: dict[int, list], block_id: int) -> list:
        return tier.setdefault(block_id, [None] * self.block_size)

    def __call__(self, step: int, output: SchedulerOutput) -> None:
        for request_id in output.finished_req_ids + output.preempted_req_ids:
            self.tables.pop(request_id, None)
        if output.block_copies is not None:
            for device_id, host_id in output.block_copies.swap_out:  # all swap-outs first
                self.host[host_id] = list(self._slots(self.device, device_id))
            for host_id, device_id in output.block_copies.swap_in:
                self.device[device_id] = list(self._slots(self.host, host_id))
        for entry in output.scheduled:  # the forward pass writes every new K/V...
            request_id = entry.request.request_id
            table = self.tables[request_id] = (list(entry.new_block_ids) if entry.is_new
                                               else self.tables[request_id] + list(entry.new_block_ids))
            tokens = entry.request.all_token_ids
            for position in range(entry.start_pos, entry.start_pos + entry.num_new_tokens):
                slots = self._slots(self.device, table[position // self.block_size])
                slots[position % self.block_size] = tuple(tokens[:position + 1])
        for entry in output.scheduled:  # ...before any attention reads the cache
            table, tokens = self.tables[entry.request.request_id], entry.request.all_token_ids
            for position in range(entry.start_pos + entry.num_new_tokens):
                held = self._slots(self.device, table[position // self.block_size])[position % self.block_size]
                assert held == tuple(tokens[:position + 1]), (
                    f"step {step}: {entry.request.request_id} reads the wrong K/V at position {position}")
            self.num_checked_positions += entry.start_pos


def _run(requests, **config):
    """Run to completion under `config` with the K/V simulation; returns (outputs, scheduler)."""
    scheduler = make_scheduler(**{"block_size": 4, "max_model_len": 64, "max_num_batched_tokens": 64, **config})
    outputs = run_to_completion(scheduler, requests, on_step=SimulatedKV(scheduler.config.block_size))
    return outputs, scheduler


def _requests(prefix=(), num_requests=6, max_tokens=30):
    return [make_request(f"r{i}", list(prefix) + [i + 1, 2 * i + 3, 5], max_tokens) for i in range(num_requests)]


def test_cramped_pool_swaps_victims_and_resumes_them_without_recomputing_a_token():
    # 16 usable blocks of 4 tokens for six requests growing to 33 tokens (9 blocks) each.
    outputs, scheduler = _run(_requests(), num_kv_blocks=17, num_host_kv_blocks=64, preemption_mode="swap")
    assert outputs == reference_outputs(_requests())
    counters = scheduler.counters
    assert counters.swap_preemptions == counters.preemptions > 0, "the cramped pool must really swap"
    assert counters.recomputed_tokens == 0 and counters.recompute_tokens_avoided > 0
    kv_cache = scheduler.kv_cache
    assert kv_cache.swapped_out_blocks == kv_cache.swapped_in_blocks > 0


def test_the_load_reports_the_host_tier_and_what_swapping_moved():
    scheduler = make_scheduler(block_size=4, max_model_len=64, max_num_batched_tokens=64, num_kv_blocks=17,
                               num_host_kv_blocks=64, preemption_mode="swap")
    scheduler.kv_block_bytes = 1024
    for request in _requests():
        scheduler.add_request(request)
    while not scheduler.kv_cache.req_to_host_blocks:
        run_step(scheduler)
    load = scheduler.load()
    held = sum(len(blocks) for blocks in scheduler.kv_cache.req_to_host_blocks.values())
    assert (load.host_kv_blocks_total, load.host_kv_blocks_free) == (64, 64 - held)
    assert load.host_kv_usage == pytest.approx(held / 64)
    assert load.swap_preemptions_total == scheduler.counters.swap_preemptions > 0
    assert load.swapped_out_blocks_total == held and load.swapped_out_bytes_total == held * 1024
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    load = scheduler.load()
    assert load.host_kv_blocks_free == 64 and load.swapped_in_blocks_total == load.swapped_out_blocks_total
    assert load.recompute_tokens_avoided_total == scheduler.counters.recompute_tokens_avoided > 0
    assert make_scheduler().load().host_kv_blocks_total == 0  # no host tier: all zero


def test_swap_recompute_and_a_roomy_pool_agree_and_recompute_really_recomputes():
    swapped, _ = _run(_requests(), num_kv_blocks=17, num_host_kv_blocks=64, preemption_mode="swap")
    recomputed, recompute_scheduler = _run(_requests(), num_kv_blocks=17, num_host_kv_blocks=64,
                                           preemption_mode="recompute")
    roomy, roomy_scheduler = _run(_requests(), num_kv_blocks=128)
    assert swapped == recomputed == roomy
    assert recompute_scheduler.counters.recomputed_tokens > 0 and recompute_scheduler.counters.swap_preemptions == 0
    assert roomy_scheduler.counters.preemptions == 0


def test_a_swapped_request_whose_prefix_blocks_were_shared_resumes_on_the_device_copy_of_them():
    prefix = list(range(100, 116))  # four full blocks every request shares through the prefix cache
    requests = _requests(prefix, max_tokens=20)
    outputs, scheduler = _run(requests, num_kv_blocks=25, num_host_kv_blocks=64, preemption_mode="swap")
    assert outputs == reference_outputs(_requests(prefix, max_tokens=20))
    assert scheduler.counters.swap_preemptions > 0
    # Resuming, a victim takes the shared prefix from the device cache and copies back only
    # the rest: fewer blocks come back than went out.
    assert 0 < scheduler.kv_cache.swapped_in_blocks < scheduler.kv_cache.swapped_out_blocks


def test_aborting_a_request_on_the_host_frees_its_host_blocks():
    scheduler = make_scheduler(block_size=4, max_model_len=64, max_num_batched_tokens=64, num_kv_blocks=17,
                               num_host_kv_blocks=64, preemption_mode="swap")
    requests = _requests()
    for request in requests:
        scheduler.add_request(request)
    simulated = SimulatedKV(4)
    step = 0
    while not scheduler.kv_cache.req_to_host_blocks:
        simulated(step, run_step(scheduler))
        step += 1
    swapped_id = next(iter(scheduler.kv_cache.req_to_host_blocks))
    held = len(scheduler.kv_cache.req_to_host_blocks[swapped_id])
    free_before = scheduler.kv_cache.num_free_host_blocks
    aborted = scheduler.abort_request(swapped_id)
    assert aborted.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache.num_free_host_blocks == free_before + held
    scheduler.check_invariants()
    others = [r for r in requests if r.request_id != swapped_id]
    while scheduler.has_unfinished_requests():
        simulated(step, run_step(scheduler))
        step += 1
    expected = reference_outputs(_requests())
    assert {r.request_id: r.output_token_ids for r in others} == {r.request_id: expected[r.request_id] for r in others}
    assert scheduler.kv_cache.num_free_host_blocks == scheduler.kv_cache.num_host_blocks


def test_a_full_host_pool_falls_back_to_recompute():
    # Three host blocks hold at most one small victim at a time: the others are recomputed.
    outputs, scheduler = _run(_requests(), num_kv_blocks=17, num_host_kv_blocks=3, preemption_mode="swap")
    assert outputs == reference_outputs(_requests())
    counters = scheduler.counters
    assert 0 < counters.swap_preemptions < counters.preemptions, "some victims swap, some find the host full"
    assert counters.recomputed_tokens > 0


def test_auto_mode_swaps_a_victim_only_where_the_round_trip_costs_less_than_its_recompute():
    scheduler = make_scheduler(block_size=4, max_model_len=64, num_kv_blocks=64, num_host_kv_blocks=64)
    request = make_request("r", list(range(1, 18)), 4)  # its 17 prompt tokens computed: 5 blocks to swap
    scheduler.add_request(request)
    run_step(scheduler)
    planner = scheduler.preemption
    assert scheduler.kv_cache.rebuild_cost(request) == 17 and scheduler.kv_cache.num_swap_blocks(request) == 5
    planner.costs = PreemptionCosts(recompute_s_per_token=1e-3, swap_s_per_block=1e-3)  # 17 ms vs 10 ms
    assert planner.choose(request) == (SWAP, pytest.approx(10e-3))
    planner.costs = PreemptionCosts(recompute_s_per_token=1e-4, swap_s_per_block=1e-3)  # 1.7 ms vs 10 ms
    assert planner.choose(request) == (RECOMPUTE, pytest.approx(1.7e-3))
    planner.mode = "swap"  # swap mode swaps whatever it costs
    assert planner.choose(request)[0] == SWAP


def test_cheapest_victim_ranks_by_the_cost_of_the_mode_chosen_for_each():
    # Recompute-only, the shortest request is cheapest; with swapping cheap, each victim's
    # cost is its blocks' round trip, so the one with fewest blocks is cheapest either way,
    # and with recompute cheaper per token than a block's copy, its tokens decide.
    scheduler = make_scheduler(block_size=4, max_model_len=64, num_kv_blocks=64, num_host_kv_blocks=64,
                               victim_policy="cheapest", max_num_batched_tokens=256)
    long = make_request("long", list(range(1, 30)), 4)
    short = make_request("short", list(range(40, 50)), 4)
    for request in (long, short):
        scheduler.add_request(request)
    run_step(scheduler)
    select = scheduler.select_victim
    scheduler.preemption.costs = PreemptionCosts(recompute_s_per_token=1e-3, swap_s_per_block=1e-4)
    assert scheduler.running[select(scheduler.running, scheduler.preemption.cost)] is short
    assert scheduler.preemption.choose(long)[0] == SWAP


@pytest.mark.parametrize("overrides, field", [
    (dict(preemption_mode="swap"), "preemption_mode"),
    (dict(host_kv_bytes=1 << 62), "host_kv_bytes"),
    (dict(host_kv_bytes=1 << 20, num_host_kv_blocks=4), "host_kv_bytes"),
    (dict(num_host_kv_blocks=-1), "num_host_kv_blocks"),
    (dict(preemption_swap_bytes_per_s=0), "preemption_swap_bytes_per_s"),
])
def test_a_bad_host_tier_configuration_fails_with_one_line_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as error:
        make_engine_config(**overrides)
    assert str(error.value).startswith(f"{field}:") and "\n" not in str(error.value)
