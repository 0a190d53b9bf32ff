"""Lightning's ``DeepSpeedStrategy`` on a GPU, unpatched (the CPU test bypasses the strategy's CUDA check):
``ProfUtilsCallback`` in both namespaces records every micro step and validation forward, on the
device clock."""
from launcher import DIST_SCRIPTS, run_ranks_as_nodes
from report_testing import read_records_file
from test_integrations_lightning import FIT, SERIES


def test_the_callback_records_a_real_deepspeed_strategy_run(tmp_path):
    run_ranks_as_nodes(DIST_SCRIPTS / "lightning_job.py", ["--out", str(tmp_path)], tmp_path, nodes=1, timeout=600)
    for series in SERIES.values():
        records = read_records_file(tmp_path / "records" / f"zero_fetch_{series}_rank_0.jsonl")
        assert [(record["mode"], record["global_step"]) for record in records] == FIT + FIT
        assert {record["clock"] for record in records} == {"device"}
        assert all(record["memory"]["source"] == "allocator" for record in records)
