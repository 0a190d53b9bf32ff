"""Issue 35's "done when": a 2-stage PipelineModule on 2 ranks (gloo) under the deepspeed launcher, 30
``train_batch()`` calls with ``step_metrics`` on, once with a balanced split and once with a layer sleeping 10 ms
per micro batch on stage 1.  Each variant launches once (module-scoped fixtures) and everything is checked on it:
the records, ``report --json``'s pipeline section, and the live console line while it trains."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
from launcher import DIST_SCRIPTS, REPO, ended_as_documented, run_deepspeed
from report_testing import read_records_file, records_file

STEPS = 30
MARKER = "PIPELINE JOB DONE"


def _launch(out: Path, *args: str) -> Dict[str, Any]:
    """The job's output and ``report --json``; a non-zero exit is accepted only as gloo's teardown abort: every
    rank printed the last-line marker and no traceback came before it."""
    proc = run_deepspeed(DIST_SCRIPTS / "pipeline_job.py", ["--out", str(out), *args], timeout=900, check=False)
    output = proc.stdout
    assert ended_as_documented(output, proc.returncode, rf"{MARKER} rank \d") and "Traceback" not in output, \
        output[-6000:]
    report = subprocess.run([sys.executable, "-m", "ds_profutils", "report", "--json", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=300, check=True)
    return {"out": out, "output": output, "report": json.loads(report.stdout)}


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    return _launch(tmp_path_factory.mktemp("pipeline_slow"), "--slow")


@pytest.fixture(scope="module")
def balanced(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    return _launch(tmp_path_factory.mktemp("pipeline_balanced"))


@pytest.mark.parametrize("variant", ["slow", "balanced"])
def test_records_cover_every_train_batch_with_the_stage(variant: str, request: pytest.FixtureRequest) -> None:
    job = request.getfixturevalue(variant)
    for rank in range(2):
        records = read_records_file(records_file(job["out"], rank))
        train = [r for r in records if r["mode"] == "train"]
        assert [r["global_step"] for r in train] == list(range(STEPS))
        assert {(r["pipe_stage"], r["pipe_stages"], r["micro_batches"]) for r in train} == {(rank, 2, 8)}
        sent, received = (("SendActivation", "RecvGrad") if rank == 0 else ("SendGrad", "RecvActivation"))
        for r in train:
            assert {sent, received, "ForwardPass", "BackwardPass", "OptimizerStep"} <= set(r["instructions_ms"])
            assert r["p2p_ms"] > 0 and r["bubble_ms"] == pytest.approx(r["p2p_ms"] + r["other_ms"])
        assert [r["global_step"] for r in records if r["mode"] == "eval"] == [STEPS]
        found = json.loads((job["out"] / f"found_rank_{rank}.json").read_text())
        assert found["held_step_records"] <= 1 and found["instance_attributes_left"] == []
        assert {r["flops"] for r in train} == {8 * found["reference_flops_per_micro_batch"]}  # its stage's layers


@pytest.mark.parametrize("variant", ["slow", "balanced"])
def test_report_has_the_stage_table(variant: str, request: pytest.FixtureRequest) -> None:
    pipeline = request.getfixturevalue(variant)["report"]["engines"]["main"]["pipeline"]
    assert set(pipeline["stages"]) == {"0", "1"}
    for stage, row in pipeline["stages"].items():
        assert row["ranks"] == [int(stage)]
        for key in ("compute_ms_median", "p2p_ms_median", "bubble_ms_median", "bubble_share_median"):
            assert row[key] is not None and row[key] > 0
    assert pipeline["ideal_bubble_share"] == pytest.approx(1 / 9)
    # 5 Linear layers on stage 0, 3 on stage 1 (and the one that sleeps): per-stage model TFLOP/s
    assert all(row["tflops_median"] > 0 for row in pipeline["stages"].values())


def test_slow_stage_is_named(slow: Dict[str, Any]) -> None:
    pipeline = slow["report"]["engines"]["main"]["pipeline"]
    assert pipeline["slowest_stage"] == 1
    assert pipeline["stage_imbalance"] >= 1.3
    stages = pipeline["stages"]
    assert stages["0"]["p2p_ms_median"] > stages["1"]["p2p_ms_median"]  # stage 0 waits for stage 1
    engine = slow["report"]["engines"]["main"]
    assert engine["straggler_ranks"] == []  # a slower stage is no straggler: stages do different work


def test_balanced_pipeline_names_no_stage(balanced: Dict[str, Any]) -> None:
    assert balanced["report"]["engines"]["main"]["pipeline"]["slowest_stage"] is None


@pytest.mark.parametrize("variant", ["slow", "balanced"])
def test_live_line_while_training(variant: str, request: pytest.FixtureRequest) -> None:
    output = request.getfixturevalue(variant)["output"]
    lines = [line for line in output.splitlines() if line.startswith("ds_profutils step ")]
    assert [line.split()[2] for line in lines] == ["9:", "19:", "29:"]  # monitor_interval 10, from global rank 0
    assert output.index(lines[-1]) < output.index(MARKER)
    assert all(" bubble " in line and "FLOP/s" in line for line in lines)  # the stage figures, the stages' FLOPs
    assert lines[-1].endswith("slowest stage 1" if variant == "slow" else "no slow stage")
