"""Two processes on two GPUs over NCCL: a rank slowed on the device in backward only is the one named, with
its gradient reduce-scatter on a side stream (overlap_comm) timed on that stream."""
from pathlib import Path

import pytest
import torch

from ds_profutils.report import build_report
from launcher import run_deepspeed
from report_testing import read_records_file


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL straggler run needs two GPUs (NCCL refuses two "
                    "ranks on one device)")
def test_a_rank_slowed_on_the_device_in_backward_is_named(tmp_path):
    run_deepspeed(Path(__file__).with_name("nccl_straggler.py"), ["--out", str(tmp_path)], timeout=600)
    report = build_report(tmp_path / "records")
    engine = report["engines"]["main"]
    assert engine["straggler_ranks"] == [1]
    records = read_records_file(tmp_path / "records" / "zero_fetch_rank_0.jsonl")
    assert {record["clock"] for record in records} == {"device"}
    side = [entry for record in records for op, entry in record["collectives"].items() if op.endswith("@side-stream")]
    assert side and all(entry["exposed_ms"] == 0 for entry in side)
