"""ds_profutils against DeepSpeed on real ZeRO-1/2/3 engines, 2 ranks under the deepspeed launcher.

One launcher run (``dist_scripts/check_utils_surface.py``) does all the checks; each test asserts one
finding of it, per rank.
"""
import json

import pytest

from launcher import DIST_SCRIPTS, run_deepspeed

RANKS = (0, 1)
FULL_CHECKS = {
    "safe_get_full_fp32_param", "safe_get_full_grad", "set_full_grad_read_back", "set_full_fp32_read_back",
    "set_full_fp32_seen_by_step", "full_optimizer_state_exp_avg", "full_optimizer_state_exp_avg_sq",
    "set_full_optimizer_state_read_back"
}
ZERO3_LOCAL_CHECKS = {
    "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
    "set_local_fp32_read_back", "set_local_grad_read_back"
}


@pytest.fixture(scope="module")
def surface_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("surface")
    proc = run_deepspeed(DIST_SCRIPTS / "check_utils_surface.py", ["--out", str(out)])
    reports = {rank: json.loads((out / f"rank_{rank}.json").read_text()) for rank in RANKS}
    return reports, proc.stdout


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("stage", ["1", "2"])
def test_accessors_match_deepspeed_zero12(surface_run, stage, rank):
    results = surface_run[0][rank]["stages"][stage]
    assert set(results) == FULL_CHECKS | {"zero3_only_rejected"}
    assert all(results.values()), {k: v for k, v in results.items() if not v}


@pytest.mark.parametrize("rank", RANKS)
def test_accessors_match_deepspeed_zero3(surface_run, rank):
    results = surface_run[0][rank]["stages"]["3"]
    assert set(results) == FULL_CHECKS | ZERO3_LOCAL_CHECKS
    assert all(results.values()), {k: v for k, v in results.items() if not v}


@pytest.mark.parametrize("rank", RANKS)
def test_groups_share_deepspeed_state(surface_run, rank):
    groups = surface_run[0][rank]["groups"]
    assert groups == {
        "data_parallel_world_size": 2,
        "data_parallel_rank": rank,
        "mpu_shared": True,
        "mesh_device_written_through": True,
        "mesh_device_read_through": True,
    }


@pytest.mark.parametrize("rank", RANKS)
def test_leaf_modules_change_zero3_fetches(surface_run, rank):
    leaf = surface_run[0][rank]["leaf"]
    # Without a leaf, the coordinator fetches each Linear inside the block on its own.
    assert {"block.0", "block.2", "block"} <= set(leaf["without"])
    # With the Sequential flagged as a leaf, its children are fetched with it, never one by one.
    assert "block" in leaf["with"] and "head" in leaf["with"]
    assert not any(name.startswith("block.") for name in leaf["with"])


def test_log_dist_prints_on_the_requested_ranks_only(surface_run):
    lines = [line for line in surface_run[1].splitlines() if "surface-check" in line]
    messages = sorted(line.split("] ", 3)[-1] for line in lines)
    assert messages == [
        "[Rank 0] surface-check all ranks",
        "[Rank 1] surface-check all ranks",
        "[Rank 1] surface-check rank one only",
    ]
    # Records point at the caller, not at ds_profutils/logging.py.
    assert all("check_utils_surface.py" in line for line in lines)
