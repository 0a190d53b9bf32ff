"""The profiler's "done when": a 2-rank job under the deepspeed launcher writes one trace per global
rank, each with the right ``distributedInfo.rank`` and exactly ``active * repeat`` profiler steps
under their training step numbers, and rank 0's summary has a FLOPs column."""
import json

import pytest

from launcher import DIST_SCRIPTS, run_deepspeed
from profiler_testing import profiler_steps, read_trace

ACTIVE, REPEAT = 2, 2
RANKS = (0, 1)


@pytest.fixture(scope="module")
def profiled_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiled_job")
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "profiler": {"output_dir": str(out / "profiles"), "skip_first": 1, "wait": 1, "warmup": 1,
                     "active": ACTIVE, "repeat": REPEAT, "with_flops": True, "summary_ranks": [0]},
    }
    config_path = out / "ds_config.json"
    config_path.write_text(json.dumps(config))
    run_deepspeed(DIST_SCRIPTS / "profiler_two_ranks.py", ["--deepspeed_config", str(config_path)])
    return out / "profiles"


@pytest.mark.parametrize("rank", RANKS)
def test_each_rank_writes_its_trace(profiled_job, rank):
    trace = read_trace(profiled_job / f"trace_rank_{rank}.json")
    assert trace["distributedInfo"]["rank"] == rank
    assert trace["distributedInfo"]["world_size"] == len(RANKS)
    assert trace["ds_profutils"]["host"]
    # optimizer steps: skip 0, wait 1, warmup 2, active 3-4; wait 5, warmup 6, active 7-8
    assert profiler_steps(trace) == [3, 4, 7, 8]
    assert len(profiler_steps(trace)) == ACTIVE * REPEAT
    assert len(list((profiled_job / f"rank_{rank}").glob("*.pt.trace.json"))) == REPEAT


def test_summary_shows_flops_on_rank_0_only(profiled_job):
    table = (profiled_job / "summary_rank_0.txt").read_text().splitlines()
    header = table[0].split()
    assert header[0] == "Name" and header[-1] == "FLOPs"
    mm = next(row.split() for row in table if row.startswith("aten::addmm") or row.startswith("aten::mm"))
    assert mm[-1] != "-"  # torch counted the matmuls' FLOPs
    assert not (profiled_job / "summary_rank_1.txt").exists()
