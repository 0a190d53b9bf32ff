"""Lightning's ``DeepSpeedStrategy`` with ``ProfUtilsCallback``, in the ``lightning`` and ``pytorch_lightning``
namespaces: a real Lightning ``Trainer`` and a real ZeRO-3 engine, 2 ranks on gloo, started as two
nodes of one device each (both processes have local rank 0, global ranks 0 and 1).

The strategy refuses any accelerator but CUDA: only that check is bypassed here
(tests/dist_scripts/lightning_job.py, ``--bypass-cuda-check``); tests/gpu/test_gpu_lightning.py runs
the same job unpatched on a GPU.
"""
import json

import pytest

from ds_profutils.report import build_report
from launcher import DIST_SCRIPTS, run_ranks_as_nodes
from report_testing import read_records_file

RANKS = (0, 1)
SERIES = {"lightning": "lightning", "pytorch_lightning": "pytorch-lightning"}  # namespace -> the callback's name=
FIT = ([("eval", 0)] + [("train", step) for step in (0, 0, 1, 1)] + [("eval", 2)] +
       [("train", step) for step in (2, 2, 3, 3)] + [("eval", 4)])
"""One fit(), per rank: the sanity check's validation forward, 4 optimizer steps of 2 micro steps, a
validation forward after each 4 micro steps; the engine numbers its steps from 0."""


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    run_ranks_as_nodes(DIST_SCRIPTS / "lightning_job.py", ["--out", str(out), "--bypass-cuda-check"], out)
    return out


@pytest.mark.parametrize("namespace", list(SERIES))
@pytest.mark.parametrize("rank", RANKS)
def test_every_micro_step_and_validation_forward_in_a_file_named_by_global_rank(lightning_run, namespace, rank):
    found = json.loads((lightning_run / f"findings_rank_{rank}.json").read_text())[namespace]
    assert (found["global_rank"], found["local_rank"]) == (rank, 0)  # two nodes: local rank 0 on both
    assert found["name"] == SERIES[namespace] and found["closed_after_fit"] and found["engine_steps"] == 4
    records = read_records_file(lightning_run / "records" / f"zero_fetch_{SERIES[namespace]}_rank_{rank}.jsonl")
    # the second fit() gets a new engine, attached under the same name: its records are appended
    assert found["second_fit"] == {"new_engine": True, "closed_after_fit": True, "engine_steps": 4}
    assert [(record["mode"], record["global_step"]) for record in records] == FIT + FIT
    assert all((record["rank"], record["local_rank"]) == (rank, 0) for record in records)
    assert all(record["events"]["forward_fetch_wait"]["count"] > 0 for record in records)


def test_the_report_reads_both_series(lightning_run):
    report = build_report(lightning_run / "records")
    assert report["problems"] == [] and sorted(report["engines"]) == sorted(SERIES.values())
    assert all(engine["ranks"] == list(RANKS) for engine in report["engines"].values())
