"""Waits the frameworks add between steps (issue 32, finding 6): the transformers Trainer all-gathers its token
count through ``torch.distributed`` after loading a step's batches, so the ranks that loaded early wait there,
inside their gap.  Those calls are timed (``gap_collective_ms``), the straggler test counts them as time inside
collectives, and the late rank is named with its own gap (``gap_ms`` less ``gap_collective_ms``)."""
from ds_profutils.report import build_report
from launcher import DIST_SCRIPTS, ended_as_documented, run_deepspeed

from report_testing import read_records_file


def test_a_trainer_rank_sleeping_in_its_collator_is_the_straggler_by_its_own_gap(tmp_path):
    job = run_deepspeed(DIST_SCRIPTS / "trainer_slow_collator_job.py", ["--out", str(tmp_path)], timeout=600,
                        env={"HF_HUB_OFFLINE": "1"}, check=False)
    assert ended_as_documented(job.stdout, job.returncode, r"trainer_slow_collator done rank \d"), job.stdout[-4000:]
    waits = [record.get("gap_collective_ms") for record in read_records_file(tmp_path / "zero_fetch_rank_0.jsonl")
             if record.get("iteration_ms") is not None]
    assert len(waits) >= 14 and sorted(waits)[len(waits) // 2] > 50  # rank 0 waits in the gather for rank 1
    engine = build_report(tmp_path)["engines"]["main"]
    late, early = engine["ranks_summary"][1], engine["ranks_summary"][0]
    assert engine["straggler_ranks"] == [1] and late["late_by_gap"] is True
    assert late["own_gap_ms_median"] - early["own_gap_ms_median"] > 50
    assert early["gap_collective_ms_median"] > late["gap_collective_ms_median"] + 50
