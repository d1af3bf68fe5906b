"""The router simulation's step-time model, in one place: what one engine step costs as a
function of what the scheduler put in it. bench/bench_engine.py fits it from measured step
timings (`--cost-model FILE`); bench/bench_router_sim.py loads a fit (`--cost-model FILE`)
or runs the assumed model, and prints which.

    step_ms = fixed_ms + per_batched_token_ms x tokens computed this step
                       + per_kv_token_read_ms x KV positions attention reads
                       + blocks copied between device and host x block bytes / swap_bytes_per_s

New terms enter here and nowhere else: the host KV tier's copies (issue 23: swapped victims
out and back, host prefix hits back) are charged at the
link's bandwidth for the model's KV bytes per token, serially with the step's compute, as the
engine's compute stream waits for them (replica/executor/kv_swap.py); the spilling prefix
cache's write-throughs and the prefetched swap-ins of requests resuming next step
(BlockCopies.write_through, .prefetch) are not part of the step: they overlap its compute on
the link, and the simulation's replicas queue them there (bench_router_sim.py's
start_replica_step), so a step waits for them only where the link is still busy with them
when its own copies or compute would start. The same model gives the rates the engine
measures at start-up for its per-victim swap-or-recompute choice (`preemption_costs`).

The files are JSON: the three step coefficients, `source` (what produced them: the machine,
model, device and date of the fit, or "assumed") and the fit's quality (`fit_steps`,
`fit_r2`) where it was fitted; the model's KV bytes per token, the link's bandwidth and
`swap_source` (measured or assumed). A file without the last three (fitted before issue 23)
gets the assumed GPU link.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from replica.core.preemption_mode import PreemptionCosts, prefill_probe_tokens

if TYPE_CHECKING:
    from replica.config import EngineConfig
    from replica.core.scheduler import SchedulerOutput

# Where the shipped fits live: bench/cost_models/<name>.json.
SHIPPED_DIR = Path(__file__).resolve().parent / "cost_models"
# An 8B-class model's KV (Llama-3-8B: 32 layers x 8 KV heads x 128 dims x key and value x 2
# bytes of bf16) over PCIe 4.0 x16 at ~25 GB/s effective (of 32 GB/s): a 16-token block is
# 2 MiB and crosses one way in ~0.08 ms. Not measured.
ASSUMED_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
ASSUMED_SWAP_BYTES_PER_S = 25e9
ASSUMED_SWAP_SOURCE = "assumed: an 8B-class model's 128 KiB of KV per token over PCIe 4.0 x16 at ~25 GB/s, not measured"


@dataclass(frozen=True)
class CostModel:
    """step time = fixed + per_batched_token x tokens + per_kv_token_read x context tokens read
    + the step's block copies over the host link."""

    fixed_ms: float
    per_batched_token_ms: float
    per_kv_token_read_ms: float
    source: str = "assumed"
    fit_steps: int = 0  # steps the coefficients were fitted on (0: not fitted)
    fit_r2: Optional[float] = None  # coefficient of determination of that fit
    # The host KV tier's link: a block copied one way costs block_size x kv_bytes_per_token /
    # swap_bytes_per_s.
    kv_bytes_per_token: float = ASSUMED_KV_BYTES_PER_TOKEN  # across layers, keys and values
    swap_bytes_per_s: float = ASSUMED_SWAP_BYTES_PER_S  # device <-> host, one way at a time
    swap_source: str = ASSUMED_SWAP_SOURCE

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "per_batched_token_ms", "per_kv_token_read_ms"):
            value = getattr(self, name)
            if not value >= 0:  # also rejects NaN
                raise ValueError(f"cost model: {name} must be >= 0, got {value!r}")
        for name in ("kv_bytes_per_token", "swap_bytes_per_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"cost model: {name} must be > 0, got {value!r}")

    def step_ms(self, num_tokens: int, kv_tokens_read: int) -> float:
        return self.fixed_ms + self.per_batched_token_ms * num_tokens + self.per_kv_token_read_ms * kv_tokens_read

    def block_copy_ms(self, block_size: int) -> float:
        """One KV block copied one way between the device and the host tier."""
        return self.kv_block_bytes(block_size) / self.swap_bytes_per_s * 1000.0

    def step_time_s(self, output: "SchedulerOutput", block_size: int) -> float:
        """The step's compute, after its copies between the tiers (the forward pass waits for
        them); not its write-throughs, which overlap it."""
        return self.compute_time_s(output) + blocks_copied(output) * self.block_copy_ms(block_size) / 1000.0

    def compute_time_s(self, output: "SchedulerOutput") -> float:
        """The step's forward pass alone."""
        return self.step_ms(output.num_scheduled_tokens, kv_tokens_read(output)) / 1000.0

    def preemption_costs(self, config: "EngineConfig") -> PreemptionCosts:
        """The rates an engine running this model measures at start-up
        (replica/executor/preemption_profile.py): one prompt of the probe's size prefilled
        alone, per token, and a block's copy one way."""
        num_tokens = prefill_probe_tokens(config)
        recompute_s_per_token = self.step_ms(num_tokens, num_tokens) / num_tokens / 1000.0
        return PreemptionCosts.of(recompute_s_per_token, self.swap_bytes_per_s, self.kv_block_bytes(config.block_size))

    def kv_block_bytes(self, block_size: int) -> int:
        return round(block_size * self.kv_bytes_per_token)

    def describe(self) -> str:
        fitted = f", fitted on {self.fit_steps} steps, R^2 {self.fit_r2:.3f}" if self.fit_steps else ""
        return (f"step time = {self.fixed_ms:.4g} ms + {self.per_batched_token_ms:.4g} ms/batched token + "
                f"{self.per_kv_token_read_ms:.4g} ms/KV token read ({self.source}{fitted}); host link "
                f"{self.swap_bytes_per_s / 1e9:.3g} GB/s for {self.kv_bytes_per_token / 1024:.4g} KiB of KV per token "
                f"({self.swap_source})")

    # ---- files ---------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        """A model from a JSON file; a one-line error naming the file and what is wrong."""
        try:
            fields = json.loads(Path(path).read_text())
            if not isinstance(fields, dict):
                raise ValueError("expected a JSON object")
            unknown = set(fields) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)}")
            return cls(**fields)
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(f"--cost-model {path}: {error}") from None


# An 8B-class model on one H100-class GPU, to an order of magnitude: ~5 ms of weight reads
# per step, ~30k prefill tokens/s, 128 KiB of KV per token at ~3 TB/s. Not measured.
ASSUMED = CostModel(5.0, 0.035, 0.00005, source="assumed: an 8B-class model on one H100-class GPU, not measured")


def kv_tokens_read(output: "SchedulerOutput") -> int:
    """KV positions attention reads in a step: every position up to the end of each
    scheduled chunk (its cached and earlier tokens, and the chunk itself)."""
    return sum(entry.start_pos + entry.num_new_tokens for entry in output.scheduled)


def blocks_copied(output: "SchedulerOutput") -> int:
    """Whole KV blocks the step copies between the device and the host tier, both ways, before
    its forward pass (swaps, host hits)."""
    copies = output.block_copies
    return len(copies.swap_out) + len(copies.swap_in) if copies is not None else 0


def blocks_written_through(output: "SchedulerOutput") -> int:
    """Whole KV blocks the step writes through to the host tier beside its forward pass."""
    copies = output.block_copies
    return len(copies.write_through) if copies is not None else 0


def blocks_copied_beside(output: "SchedulerOutput") -> int:
    """Whole KV blocks the step copies beside its forward pass, both ways: write-throughs to the
    host tier and prefetches of swapped-out requests that resume next step."""
    copies = output.block_copies
    return len(copies.write_through) + len(copies.prefetch) if copies is not None else 0


def fit(samples: Sequence[tuple[int, int, float]], source: str) -> CostModel:
    """Least squares of step_ms on (1, tokens, KV tokens read) over (tokens, kv_tokens_read,
    step_ms) samples, every coefficient >= 0: the best of the unconstrained fits over each
    subset of the terms whose coefficients come out non-negative (three terms: seven
    subsets), the others held at 0."""
    import numpy as np

    if len(samples) < 3:
        raise ValueError(f"cost model fit: need at least 3 step samples, got {len(samples)}")
    data = np.asarray(samples, dtype=float)
    columns = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    target = data[:, 2]
    best: Optional[tuple[float, np.ndarray]] = None
    for size in (3, 2, 1):
        for subset in itertools.combinations(range(3), size):
            solution, *_ = np.linalg.lstsq(columns[:, subset], target, rcond=None)
            if np.any(solution < 0):
                continue
            coefficients = np.zeros(3)
            coefficients[list(subset)] = solution
            residual = float(np.sum((columns @ coefficients - target) ** 2))
            if best is None or residual < best[0] - 1e-12:
                best = (residual, coefficients)
    residual, coefficients = best if best is not None else (float(np.sum(target ** 2)), np.zeros(3))
    total = float(np.sum((target - target.mean()) ** 2))
    r2 = 1.0 - residual / total if total > 0 else 1.0
    return CostModel(float(coefficients[0]), float(coefficients[1]), float(coefficients[2]), source=source,
                     fit_steps=len(data), fit_r2=r2)
