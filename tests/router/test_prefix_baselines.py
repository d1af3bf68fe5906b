"""The prefix-aware baselines doing what their sources do: SGLang's approximate tree with its
imbalance fallback, llm-d's 3/2/2 scorers over KV-event hits, Dynamo's prefill + decode cost."""

from __future__ import annotations

import random

from router.policies import RoutingRequest, make_policy
from router.prefix_baselines import ApproxPrefixPolicy, DynamoPolicy, PrecisePrefixPolicy
from test_policies import make_load, view

SYSTEM = list(range(1000, 1000 + 640))  # 40 blocks shared by every turn of a tenant


def prompt(suffix: int, length: int = 160) -> RoutingRequest:
    tokens = tuple(SYSTEM + [suffix] * length)
    return RoutingRequest(prompt_tokens=len(tokens), max_tokens=100, prompt_token_ids=tokens)


def cached(replica_id: str, blocks: int, **kwargs):
    return view(replica_id, make_load(replica_id, **kwargs), cached_blocks=blocks)


# ---- approx_prefix (SGLang) ---------------------------------------------------------------
def test_approx_prefix_returns_to_the_replica_it_sent_the_prefix_to():
    policy = ApproxPrefixPolicy(rng=random.Random(0))
    replicas = [view("a", queue_len=3), view("b", queue_len=3), view("c", queue_len=3)]
    first = policy.rank(prompt(1), replicas)[0]
    policy.on_routed(prompt(1), first, "k1", 0)
    for suffix in range(2, 12):
        assert policy.rank(prompt(suffix), replicas)[0] == first  # 640 of 800 tokens match: 0.8 > 0.3


def test_approx_prefix_sends_unmatched_prompts_to_the_smallest_tree():
    policy = ApproxPrefixPolicy(rng=random.Random(0))
    replicas = [view("a"), view("b")]
    policy.on_routed(prompt(1), "a", "k1", 0)
    unrelated = RoutingRequest(prompt_tokens=320, max_tokens=10, prompt_token_ids=tuple(range(5000, 5320)))
    assert policy.rank(unrelated, replicas)[0] == "b"


def test_approx_prefix_falls_back_to_the_shortest_queue_only_past_both_thresholds():
    policy = ApproxPrefixPolicy(rng=random.Random(0))
    policy.on_routed(prompt(1), "holder", "k1", 0)
    # 100 vs 40 in flight: 60 apart (not > 64): still affinity.
    assert policy.rank(prompt(2), [view("holder", queue_len=100), view("idle", queue_len=40)])[0] == "holder"
    # 110 vs 40: 70 apart and 2.75x: shortest queue.
    assert policy.rank(prompt(2), [view("holder", queue_len=110), view("idle", queue_len=40)])[0] == "idle"


# ---- precise_prefix (llm-d) ---------------------------------------------------------------
def test_precise_prefix_sums_prefix_3_queue_2_kv_2():
    # prefix raw 40 / 20 / none -> 1.0 / 0.0 / 0.0 (min-max over pods with a hit); queue
    # scores (fewest waiting) 0.0 / 1.0 / 0.5; kv 1 - usage 0.5 / 0.5 / 0.9.
    # Totals: a 3 + 0 + 1 = 4.0, b 0 + 2 + 1 = 3.0, c 0 + 1 + 1.8 = 2.8.
    replicas = [
        cached("a", 40, free_blocks=500, num_waiting=8),
        cached("b", 20, free_blocks=500, num_waiting=0),
        cached("c", 0, free_blocks=900, num_waiting=4),
    ]
    assert PrecisePrefixPolicy(rng=random.Random(0)).rank(prompt(1), replicas) == ["a", "b", "c"]


def test_precise_prefix_gives_a_lone_holder_the_full_prefix_score_for_a_single_block():
    # One pod with a hit: min == max, so it scores 1.0 x 3 although it caches 1 of 49
    # blocks, and beats a less loaded pod: 3 + 0 + 1.4 = 4.4 against 0 + 2 + 1.8 = 3.8.
    replicas = [cached("holder", 1, free_blocks=700, num_waiting=2), cached("idle", 0, free_blocks=900)]
    assert PrecisePrefixPolicy(rng=random.Random(0)).rank(prompt(1), replicas)[0] == "holder"


# ---- dynamo -------------------------------------------------------------------------------
def test_dynamo_picks_the_lowest_prefill_plus_decode_cost():
    policy = DynamoPolicy(rng=random.Random(0))
    request = prompt(1)  # 800 tokens = 50 blocks, 49 of them hashable
    # Nothing active: cost = prefill blocks of the uncached prompt + its new blocks.
    replicas = [view("cold", cached_blocks=0), view("warm", cached_blocks=40)]
    assert policy.rank(request, replicas) == ["warm", "cold"]
    # Load "warm" with active sequences until its decode blocks outweigh the 40-block saving.
    for i in range(3):
        other = RoutingRequest(prompt_tokens=800, max_tokens=10, prompt_token_ids=tuple(range(i * 1000, i * 1000 + 800)))
        policy.on_routed(other, "warm", f"busy{i}", 0)
        policy.on_first_token(f"busy{i}")  # decoding: blocks stay, prefill tokens leave
    assert policy.rank(request, replicas)[0] == "cold"
    for i in range(3):
        policy.on_finished(f"busy{i}")
    assert policy.rank(request, replicas)[0] == "warm"


def test_every_baseline_is_registered_by_name():
    for name in ("approx_prefix", "precise_prefix", "dynamo"):
        assert make_policy(name).name == name
