"""Reads request traces in the Azure LLM inference trace format (TIMESTAMP, ContextTokens,
GeneratedTokens): each request's arrival offset and sizes, for benchmarks to replay.

The project's workload is the Azure Public Dataset "Azure LLM inference trace 2023" (CC-BY
4.0; Patel et al., "Splitwise", ISCA 2024), kept outside the repository in ../shared/traces.
"""

from __future__ import annotations

import csv
import itertools
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional

DEFAULT_TRACE_PATH = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023_conv.csv"


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # from the trace's first request
    prompt_tokens: int
    output_tokens: int


def read_trace(path: str | Path, num_requests: Optional[int], skip: int = 0) -> list[TraceRequest]:
    """The trace's first `num_requests` requests (None: all) after its first `skip` (arrivals
    from the first one read); ValueError naming --trace if it is missing."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--trace: {path} is not a file (columns TIMESTAMP, ContextTokens, GeneratedTokens)")
    requests, start = [], None
    with path.open(newline="") as trace:
        for row in itertools.islice(csv.DictReader(trace), skip, None if num_requests is None else skip + num_requests):
            # Seven fractional digits: more than datetime parses; the 100 ns digit is noise here.
            stamp = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
            start = stamp if start is None else start
            requests.append(TraceRequest(stamp - start, max(1, int(row["ContextTokens"])),
                                         max(1, int(row["GeneratedTokens"]))))
    return requests
