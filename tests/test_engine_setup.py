"""What attach sets up in an engine and its process (timers, comms logger, NVTX), and the undo that puts
everything back: on stand-ins shaped as DeepSpeed 0.19's objects, and on real ZeRO 1/2/3 engines."""
import json
import types

import deepspeed.comm as dist
import deepspeed.comm.comm as ds_comm
import deepspeed.utils.nvtx as ds_nvtx
import deepspeed.utils.timer as ds_timer
import pytest

from ds_profutils import nvtx
from ds_profutils.comms_logging import CommsLogger
from ds_profutils.config import load_config
from ds_profutils.timer import SynchronizedWallClockTimer
from ds_profutils.engine.engine_setup import apply_engine_settings, install_timers
from launcher import DIST_SCRIPTS, run_one_rank


def zero3_engine():
    """An engine whose timer group sits where DeepSpeed 0.19 keeps it with ZeRO-3 and NVMe optimizer state."""
    theirs = ds_timer.SynchronizedWallClockTimer()
    swapper = types.SimpleNamespace(timers=theirs, gradient_swapper=types.SimpleNamespace(timers=theirs))
    optimizer = types.SimpleNamespace(timers=theirs, parameter_offload=types.SimpleNamespace(timers=theirs),
                                      optimizer_swapper=swapper)
    engine = types.SimpleNamespace(timers=theirs, optimizer=optimizer, eval_timers=ds_timer.NoopTimer(),
                                   elsewhere=types.SimpleNamespace(timers=theirs))
    return engine, theirs


def holders(engine):
    optimizer = engine.optimizer
    return [engine.timers, optimizer.timers, optimizer.parameter_offload.timers, optimizer.optimizer_swapper.timers,
            optimizer.optimizer_swapper.gradient_swapper.timers]


def test_install_timers_replaces_the_group_on_every_holder_deepspeed_names_and_undo_puts_it_back():
    engine, theirs = zero3_engine()
    undo = install_timers(engine)
    ours = engine.timers
    assert isinstance(ours, SynchronizedWallClockTimer) and all(timers is ours for timers in holders(engine))
    assert isinstance(engine.eval_timers, ds_timer.NoopTimer)  # only holders of the engine's group change
    assert engine.elsewhere.timers is theirs  # holders are named, not searched for
    install_timers(engine)()  # ours already: nothing happens, nor on its undo
    assert engine.timers is ours
    undo()
    assert all(timers is theirs for timers in holders(engine))


def test_an_interval_running_at_the_swap_moves_to_the_new_group_both_ways():
    engine, theirs = zero3_engine()
    theirs("fwd").start()
    undo = install_timers(engine)
    assert not theirs("fwd").started_ and engine.timers("fwd").started_
    engine.timers("fwd").stop()  # the engine stops what it started: no error
    engine.timers("bwd").start()
    undo()
    theirs("bwd").stop()  # DeepSpeed's own assert would fire if it were not started
    assert theirs("bwd").elapsed() >= 0


def test_undo_leaves_a_holder_someone_else_changed_since():
    engine, theirs = zero3_engine()
    undo = install_timers(engine)
    later = ds_timer.SynchronizedWallClockTimer()
    engine.optimizer.timers = later
    undo()
    assert engine.timers is theirs and engine.optimizer.timers is later


@pytest.fixture
def process_state(monkeypatch, deepspeeds_logger):
    """DeepSpeed's comms logger (one call recorded) and its NVTX switches as a fresh process has them."""
    monkeypatch.setattr(ds_nvtx, "enable_nvtx", True)
    monkeypatch.setattr(ds_nvtx, "DEEPSPEED_NVTX_DOMAIN", "DeepSpeed")
    monkeypatch.setattr(nvtx, "get_accelerator", lambda: types.SimpleNamespace(supports_nvtx_domain=True))

    def now():
        return ds_comm.comms_logger, dist.comms_logger, ds_nvtx.enable_nvtx, ds_nvtx.DEEPSPEED_NVTX_DOMAIN

    return now


def test_a_config_without_our_sections_changes_nothing(process_state):
    engine, theirs = zero3_engine()
    before = process_state()
    assert apply_engine_settings(engine, load_config({"comms_logger_typo": {}})) is None  # nothing to undo
    assert process_state() == before and engine.timers is theirs
    assert ds_comm.comms_logger.get_total_operations() == 1  # DeepSpeed's logger, with what it recorded


def test_every_section_applies_and_the_undo_restores_exactly(process_state):
    engine, theirs = zero3_engine()
    before = process_state()
    config = load_config({"wall_clock_breakdown": True, "comms_logger": {"enabled": False},
                          "nvtx": {"enabled": False, "domain": "Job"}})
    undo = apply_engine_settings(engine, config)
    logger = ds_comm.comms_logger
    assert isinstance(logger, CommsLogger) and not logger.enabled and dist.comms_logger is logger
    assert logger.get_total_operations() == 1  # what DeepSpeed's had recorded
    assert (ds_nvtx.enable_nvtx, ds_nvtx.DEEPSPEED_NVTX_DOMAIN) == (False, "Job")
    assert isinstance(engine.timers, SynchronizedWallClockTimer)
    undo()
    assert process_state() == before and all(timers is theirs for timers in holders(engine))
    undo()  # twice: nothing more
    assert process_state() == before
    again = apply_engine_settings(engine, config)  # attaching again works
    assert isinstance(engine.timers, SynchronizedWallClockTimer) and ds_nvtx.DEEPSPEED_NVTX_DOMAIN == "Job"
    again()
    assert process_state() == before


def test_real_zero_engines_train_on_our_timers_and_get_their_own_back(tmp_path):
    """One gloo rank (tests/dist_scripts/engine_setup_undo.py): ZeRO 1, 2 and 3 engines built by DeepSpeed."""
    out = tmp_path / "findings.json"
    run_one_rank([str(DIST_SCRIPTS / "engine_setup_undo.py"), "--out", str(out)])
    findings = json.loads(out.read_text())
    expected_holders = {"1": ["engine", "engine.optimizer"], "2": ["engine", "engine.optimizer"],
                        "3": ["engine", "engine.optimizer", "engine.optimizer.parameter_offload"]}
    for stage, found in findings.items():
        assert sorted(found["before"]) == expected_holders[stage], stage
        assert set(found["before"].values()) == {found["theirs"]} and set(found["applied"].values()) == {found["ours"]}
        assert found["applied_is_ours"] and found["after"] == found["before"] and found["after_is_theirs"]
        assert {"fwd", "bwd", "step"} <= set(found["ours_timer_names"])  # the engine timed into ours
        assert found["timer_lines"] >= 2 and found["timer_lines_again"] >= 1  # and logged them (steps_per_print 1)
        applied = found["process_applied"]
        assert applied[0] != found["process_before"][0] and applied[2] is False  # our logger; NVTX off
        assert applied[3] == "DeepSpeed"  # the CPU accelerator takes no domain: DeepSpeed's kept
        assert found["process_after"] == found["process_after_again"] == found["process_before"], stage
