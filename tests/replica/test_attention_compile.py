"""Every kernel config the launch planner can pick compiles for an H100 (sm_90) without spilling,
in registers that let an SM hold the warps split-KV sizes its grid for (issue 20 item 6).

No GPU needed: Triton compiles ahead of time for a GPUTarget, and the ptxas it ships reports
registers and spills (replica/attention/aot.py). The compiles run in a subprocess without
TRITON_INTERPRET, since this process may hold the interpreted kernels; about 20 s on 2 cores cold,
a few seconds from Triton's cache.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replica.attention.aot import H100, check_variants, programs_per_sm
from replica.attention.launch_plan import DEFAULT_TUNING, KernelConfig, split_programs_per_sm

REPO_ROOT = Path(__file__).resolve().parents[2]


def _cuda_compiler_missing() -> str | None:
    try:
        from triton.backends import backends
        from triton.backends.nvidia.compiler import get_ptxas

        if "nvidia" not in backends:
            return "Triton has no CUDA backend here"
        if not os.path.exists(get_ptxas(90).path):
            return "Triton's ptxas is missing"
    except Exception as error:  # noqa: BLE001 (any import or lookup failure means: cannot compile here)
        return f"Triton cannot compile for CUDA here: {type(error).__name__}: {error}"
    return None


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    reason = _cuda_compiler_missing()
    if reason:
        pytest.skip(reason)
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "replica.attention.aot", "--check", "--json", "--jobs", "2"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return {record["description"]: record for record in json.loads(result.stdout)}


def test_every_config_the_planner_can_pick_is_compiled(measured):
    assert set(measured) == {variant.describe() for variant in check_variants()}
    configs = {(record["head_dim"], record["key_tile"], record["config_warps"], record["num_stages"])
               for record in measured.values() if record["kernel"] == "attention"}
    for table in (DEFAULT_TUNING.decode_configs, DEFAULT_TUNING.split_configs, DEFAULT_TUNING.prefill_configs):
        for head_dim, config in table.items():
            assert (head_dim, config.key_tile, config.num_warps, config.num_stages) in configs


def test_no_kernel_spills_registers(measured):
    spilling = [f"{name}: {record['spill_stores']} B stored, {record['spill_loads']} B loaded"
                for name, record in measured.items() if record["spill_stores"] or record["spill_loads"]]
    assert not spilling


def test_split_kv_configs_hold_the_warps_the_planner_sizes_grids_for(measured):
    """A split grid is num_SMs x split_programs_per_sm programs: one wave only if each SM holds them."""
    short = []
    for name, record in measured.items():
        if record["kernel"] != "attention" or record["num_segments"] == 1:
            continue
        config = KernelConfig(record["key_tile"], record["config_warps"], record["num_stages"])
        wanted = split_programs_per_sm(config, DEFAULT_TUNING)
        if record["programs_per_sm"] < wanted:
            short.append(f"{name}: {record['registers']} registers, {record['shared_bytes']} B shared -> "
                         f"{record['programs_per_sm']} programs per SM, the plan wants {wanted}")
    assert not short


def test_every_kernel_fits_an_sm_with_another_program_beside_most(measured):
    """Single-pass tiles need no occupancy target, but must fit; merge and write_kv are small."""
    for name, record in measured.items():
        assert record["programs_per_sm"] >= 1, name
        if record["kernel"] != "attention":
            assert record["programs_per_sm"] >= 4, name


def test_programs_per_sm_counts_registers_per_warp_in_units_of_256():
    assert programs_per_sm(128, 4, 20 << 10) == 4  # 128 x 32 x 4 = 16K registers per program
    assert programs_per_sm(129, 4, 20 << 10) == 3  # 136 per thread once granted per warp
    assert programs_per_sm(64, 4, 100 << 10) == 2  # shared memory bound: 228 KB / (100 KB + 1 KB)
    assert programs_per_sm(32, 2, 0) == H100.max_programs
    assert programs_per_sm(32, 16, 0) == 4  # 64 warps per SM
