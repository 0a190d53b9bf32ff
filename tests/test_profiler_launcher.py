"""The profiler's "done when": a 2-rank job under the deepspeed launcher writes one trace per global
rank, each with the right ``distributedInfo.rank`` and exactly ``active * repeat`` profiler steps
under the engine's global step numbers (gradient accumulation 2), rank 0's summary has a FLOPs
column, rank 0 prints where the files went, and the comms logger's summary is shown at the end.  A
second profiled call continues the step numbers, with rank 1 left out and never waited for."""
import pytest

from profiler_testing import PROFILED_JOB_ACTIVE as ACTIVE
from profiler_testing import PROFILED_JOB_REPEAT as REPEAT
from profiler_testing import profiler_steps, read_trace

RANKS = (0, 1)


@pytest.mark.parametrize("rank", RANKS)
def test_each_rank_writes_its_trace(profiled_job, rank):
    profiles, _, _ = profiled_job
    trace = read_trace(profiles / f"trace_rank_{rank}.json")
    assert trace["distributedInfo"]["rank"] == rank
    assert trace["distributedInfo"]["world_size"] == len(RANKS)
    assert trace["ds_profutils"]["host"]
    assert (trace["ds_profutils"]["step_numbering"], trace["ds_profutils"]["profiled_ranks"]) == ("global", None)
    # optimizer steps: skip 0, wait 1, warmup 2, active 3-4; wait 5, warmup 6, active 7-8
    assert profiler_steps(trace) == [3, 4, 7, 8]
    assert len(profiler_steps(trace)) == ACTIVE * REPEAT
    assert len(list((profiles / f"rank_{rank}").glob("*.pt.trace.json"))) == REPEAT


def test_summary_shows_flops_on_rank_0_only(profiled_job):
    profiles, _, _ = profiled_job
    table = (profiles / "summary_rank_0.txt").read_text().splitlines()
    header = table[0].split()
    assert header[0] == "Name" and header[-1] == "FLOPs"
    mm = next(row.split() for row in table if row.startswith("aten::addmm") or row.startswith("aten::mm"))
    assert mm[-1] != "-"  # torch counted the matmuls' FLOPs
    assert not (profiles / "summary_rank_1.txt").exists()


def test_rank_0_prints_the_files_and_every_rank_reaches_the_comms_summary(profiled_job):
    profiles, _, output = profiled_job
    assert output.count("ds_profutils profiler: rank 0 recorded steps 3-4, 7-8 (2 cycle(s))") == 1
    assert f"{profiles / 'trace_rank_0.json'}" in output and "counted-operator FLOP/s" in output
    assert output.count("Comm. Op") == 1  # deepspeed.comm.log_summary: both ranks in its barriers, rank 0 prints


def test_a_second_call_continues_the_numbers_and_leaves_rank_1_out(profiled_job):
    _, second, output = profiled_job
    trace = read_trace(second / "trace_rank_0.json")
    # the engine is at global step 10: skip 10, wait 11, warmup 12, active 13-14
    assert profiler_steps(trace) == [13, 14]
    assert trace["ds_profutils"]["profiled_ranks"] == [0]
    assert sorted(path.name for path in second.iterdir()) == ["rank_0", "summary_rank_0.txt", "trace_rank_0.json"]
    assert output.count("comms_logger summary not shown") == 1
