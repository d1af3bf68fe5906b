"""Smoke test of bench/bench_attention.py at interpreter size: every section reports, errors are small.

The figures mean nothing on a CPU; this keeps the one-command GPU benchmark from rotting.
"""

import io

import attention_harness  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

from bench import bench_attention as bench  # bench/ is a namespace package under the repository root


def test_attention_bench_smoke_reports_every_section_with_float64_checked_outputs():
    out = io.StringIO()

    report = bench.run(bench.parse_args(["--smoke"]), out=out)

    assert [row.shape for row in report.decode] == bench.SMOKE_DECODE_SHAPES
    # The one-sequence decode over 300 keys splits even on the interpreter's single "SM".
    assert [row.segments for row in report.decode] == [2, 1]
    assert all(row.ours_tbps > 0 and row.sdpa_tbps > 0 for row in report.decode)
    assert len(report.mixed) == len(bench.SMOKE_MIXED_BATCHES)
    errors = [row.ours_error for row in report.decode] + [row.ours_error for row in report.mixed]
    errors += [error for dtype, _, ours, legacy in report.errors if dtype == "fp32" for error in (ours, legacy)]
    assert max(errors) < 1e-5
    assert {dtype for dtype, *_ in report.errors} == {"fp16", "fp32"}  # bf16 only on a GPU
    text = out.getvalue()
    assert "copy roofline" in text and "Targets (issue 10):" in text and "mixed batches vs the old single pass" in text
