"""The router simulation's step-time model, in one place: what one engine step costs as a
function of what the scheduler put in it. bench/bench_engine.py fits it from measured step
timings (`--cost-model FILE`); bench/bench_router_sim.py loads a fit (`--cost-model FILE`)
or runs the assumed model, and prints which.

    step_ms = fixed_ms + per_batched_token_ms x tokens computed this step
                       + per_kv_token_read_ms x KV positions attention reads

New terms enter here and nowhere else: a host KV tier's copies (per byte over the link,
issue 23) are a term of this model, as the step's batched tokens and KV reads are; the
simulation's replicas charge whatever this class charges.

The files are JSON: the three coefficients, `source` (what produced them: the machine,
model, device and date of the fit, or "assumed") and the fit's quality (`fit_steps`,
`fit_r2`) where it was fitted.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from replica.core.scheduler import SchedulerOutput

# Where the shipped fits live: bench/cost_models/<name>.json.
SHIPPED_DIR = Path(__file__).resolve().parent / "cost_models"


@dataclass(frozen=True)
class CostModel:
    """step time = fixed + per_batched_token x tokens + per_kv_token_read x context tokens read."""

    fixed_ms: float
    per_batched_token_ms: float
    per_kv_token_read_ms: float
    source: str = "assumed"
    fit_steps: int = 0  # steps the coefficients were fitted on (0: not fitted)
    fit_r2: Optional[float] = None  # coefficient of determination of that fit

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "per_batched_token_ms", "per_kv_token_read_ms"):
            value = getattr(self, name)
            if not value >= 0:  # also rejects NaN
                raise ValueError(f"cost model: {name} must be >= 0, got {value!r}")

    def step_ms(self, num_tokens: int, kv_tokens_read: int) -> float:
        return self.fixed_ms + self.per_batched_token_ms * num_tokens + self.per_kv_token_read_ms * kv_tokens_read

    def step_time_s(self, output: "SchedulerOutput") -> float:
        return self.step_ms(output.num_scheduled_tokens, kv_tokens_read(output)) / 1000.0

    def describe(self) -> str:
        fitted = f", fitted on {self.fit_steps} steps, R^2 {self.fit_r2:.3f}" if self.fit_steps else ""
        return (f"step time = {self.fixed_ms:.4g} ms + {self.per_batched_token_ms:.4g} ms/batched token + "
                f"{self.per_kv_token_read_ms:.4g} ms/KV token read ({self.source}{fitted})")

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
