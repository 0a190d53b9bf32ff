"""``attach`` leaves the user's objects as they were (issue 32 item 2) on real engines of ZeRO stages 0-2,
one gloo rank (tests/dist_scripts/user_objects.py): copies of the attached module do what they do without
``attach`` and are not recorded, and ``close()`` is idempotent.  On the same job: an eval forward and a
checkpoint save between steps are named parts of the next step's gap (issue 32 item 8).
A dropped engine: test_isolation.py."""
import json

import pytest

from launcher import DIST_SCRIPTS, run_one_rank

FETCHES_NEED_STAGE_3 = ("ds_profutils: partitioned_param_profiler is on, but ZeRO stage 2 does not partition parameters: "
                        "fetch records need zero_optimization.stage 3; the step records of step_metrics go on")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("user_objects") / "found.json"
    done = run_one_rank([str(DIST_SCRIPTS / "user_objects.py"), "--out", str(out)])
    return json.loads(out.read_text()), done.stdout + done.stderr


@pytest.fixture(scope="module")
def found(job):
    return job[0]


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("kind", ["deepcopy", "pickle", "averaged"])
def test_copies_of_the_attached_module_do_as_without_attach_and_are_not_the_engines_steps(found, stage, kind):
    without = found[f"stage{stage}"]["without_attach"][kind]
    assert found[f"stage{stage}"][kind] == without
    if kind != "pickle":  # DeepSpeed's own hooks are local functions: pickling fails without ds_profutils too
        assert without == {"ok": True, "records_added_by_the_copy": 0}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_the_engine_goes_on_recording_and_close_twice_is_one_close(found, stage):
    assert found[f"stage{stage}"]["records_after"] == 1 and found[f"stage{stage}"]["closed_twice"]


def test_both_record_sections_below_stage_3_keep_the_step_records_and_say_so_once(job):
    found, output = job
    both = found["both_sections"]
    assert (both["records"], both["fetches"]) == (2, False)
    assert len(both["config_hash"]) == 16  # the real engine's resolved config, which tells another job's file apart
    assert output.count(FETCHES_NEED_STAGE_3) == 1


def test_an_eval_forward_and_a_checkpoint_save_on_a_real_engine_are_named_parts_of_the_next_gap(found):
    """A ZeRO-2 engine: train, an eval forward whose eval-only branch sleeps 80 ms, save_checkpoint, train twice."""
    done = found["eval_and_save"]
    assert done["saved"] is True and done["checkpoint"]  # DeepSpeed's save, through our wrapper
    assert done["wrapped"] and done["given_back"]  # on the instance while attached, the engine's own after close
    first, after, quiet = done["train"]
    assert [step["global_step"] for step in done["train"]] == [0, 1, 2]
    assert (first["eval_ms"], first["save_ms"]) == (0.0, 0.0) and (quiet["eval_ms"], quiet["save_ms"]) == (0.0, 0.0)
    assert after["eval_ms"] >= 80.0 and after["save_ms"] > 0.0
    assert after["eval_ms"] + after["save_ms"] <= after["gap_ms"]
