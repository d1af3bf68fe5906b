"""What preemption does with a victim's KV: recompute (drop it and re-prefill the victim's
tokens when it is readmitted, vLLM v1's only choice) or swap (copy its blocks to the host
tier and back before its next step, without recomputing a token).

Which is cheaper depends on the victim: recompute costs the tokens the prefix cache will not
give back (`KVCacheManager.rebuild_cost`) times the time a token takes to prefill; swap
costs the blocks the host lacks out now (a spilling prefix cache has written its full cached
blocks through already) and all of them back later over the device<->host link, and host space. Under
`preemption_mode: auto` each victim gets the cheaper; `swap` swaps whenever the host tier has
room; `recompute` never swaps. The two rates are measured when the engine starts
(replica/executor/preemption_profile.py) or set in the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from replica.core.kv_cache_manager import KVCacheManager
from replica.core.request import Request

if TYPE_CHECKING:
    from replica.config import EngineConfig

RECOMPUTE, SWAP = "recompute", "swap"
# The recompute rate is one prompt of this many tokens prefilled alone, over its tokens (a
# chunk of a typical re-prefill); fewer where the step budget or the context is smaller.
PREFILL_PROBE_TOKENS = 256


def prefill_probe_tokens(config: "EngineConfig") -> int:
    return min(PREFILL_PROBE_TOKENS, config.max_num_batched_tokens, config.max_model_len)


@dataclass(frozen=True)
class PreemptionCosts:
    recompute_s_per_token: float  # prefill time of one token
    swap_s_per_block: float  # one block copied one way between device and host

    @classmethod
    def of(cls, recompute_s_per_token: float, swap_bytes_per_s: float, bytes_per_block: int) -> "PreemptionCosts":
        return cls(recompute_s_per_token, bytes_per_block / swap_bytes_per_s)


# A scheduler without an engine (the router simulation, scheduler tests) has measured
# nothing: a small model on a CPU, where a 16-token block re-prefills in ~1.6 ms and copies
# in ~0.1 ms. The engine replaces these with measured rates.
UNMEASURED_COSTS = PreemptionCosts(recompute_s_per_token=1e-4, swap_s_per_block=1e-4)


class PreemptionPlanner:
    def __init__(self, mode: str, kv_cache: KVCacheManager, costs: PreemptionCosts = UNMEASURED_COSTS):
        self.mode = mode
        self.kv_cache = kv_cache
        self.costs = costs

    def recompute_cost(self, request: Request) -> float:
        return self.kv_cache.rebuild_cost(request) * self.costs.recompute_s_per_token

    def swap_cost(self, request: Request) -> Optional[float]:
        """Seconds to copy out now the blocks the host tier lacks (full cached blocks written
        through are there already) and back later all but its shared prefix blocks (those stay
        on the device, where its resumption finds them, as recompute_cost has it too); None when
        it cannot swap (no host tier, no room there, or nothing computed worth keeping)."""
        kv_cache = self.kv_cache
        if self.mode == RECOMPUTE or not kv_cache.can_swap_out(request):
            return None
        num_back = max(0, kv_cache.num_swap_blocks(request) - kv_cache.num_shared_prefix_blocks(request))
        return (kv_cache.num_swap_out_copies(request) + num_back) * self.costs.swap_s_per_block

    def choose(self, request: Request) -> tuple[str, float]:
        """(mode, its estimated cost in seconds) for preempting `request` now."""
        recompute = self.recompute_cost(request)
        swap = self.swap_cost(request)
        if swap is None:
            return RECOMPUTE, recompute
        if self.mode == SWAP or swap < recompute:
            return SWAP, swap
        return RECOMPUTE, recompute

    def host_hit_cost_ratio(self, block_size: int) -> float:
        """A block copied back from the host over the same block prefilled again."""
        return self.costs.swap_s_per_block / (block_size * self.costs.recompute_s_per_token)

    def cost(self, request: Request) -> float:
        return self.choose(request)[1]
