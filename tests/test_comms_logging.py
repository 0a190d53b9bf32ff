"""ds_profutils.comms_logging: DeepSpeed's numbers and output, ``enabled: false`` honoured, clear errors."""
import builtins
import inspect
import random
import re
import socket
import subprocess
import sys

import deepspeed.comm as dist
import deepspeed.utils.comms_logging as ds_comms
import pytest
import torch
from deepspeed.comm.config import CommsLoggerConfig, DeepSpeedCommsConfig

import ds_profutils.comms_logging as comms
from ds_profutils.comms_logging import CommsLogger, calc_bw_log, convert_size, get_caller_func
from ds_profutils.config import CommsLoggerSettings
from ds_profutils.exceptions import InvalidArgumentError

# The ops DeepSpeed 0.19.8's calc_bw_log knows.
DEEPSPEED_OPS = [
    "all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_reduce", "all_reduce_coalesced", "inference_all_reduce", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "broadcast", "broadcast_object_list", "reduce", "gather", "scatter", "barrier"
]


def assert_close(ours, theirs, path="result"):
    """Nested dicts equal, numbers to 1e-12 relative (numpy's mean and ours sum in different orders)."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), path
        for key in theirs:
            assert_close(ours[key], theirs[key], f"{path}[{key!r}]")
    elif isinstance(theirs, str) or theirs is None:
        assert ours == theirs, path
    else:
        assert ours == pytest.approx(float(theirs), rel=1e-12), path


def fill(logger, seed=0):
    """The same recorded calls for any logger: several ops, sizes and latencies."""
    rng = random.Random(seed)
    for _ in range(60):
        op = rng.choice(["all_reduce", "all_gather_into_tensor", "broadcast", "barrier"])
        size = 0 if op == "barrier" else rng.choice([1024, 4 * 1024**2, 3 * 10**8])
        logger.append(op, f"{op}_name" if op == "broadcast" else op, rng.uniform(0.05, 40.0), size)


def test_public_surface_matches_deepspeed():
    ours, theirs = CommsLogger(), ds_comms.CommsLogger()
    assert vars(ours) == vars(theirs)
    public = [name for name, _ in inspect.getmembers(ds_comms.CommsLogger, inspect.isfunction)
              if not name.startswith("_")]
    for name in public + ["__init__"]:
        ours_sig = inspect.signature(getattr(CommsLogger, name))
        theirs_sig = inspect.signature(getattr(ds_comms.CommsLogger, name))
        assert [(p.name, p.default) for p in ours_sig.parameters.values()] == \
            [(p.name, p.default) for p in theirs_sig.parameters.values()], name
    for function in ("get_caller_func", "convert_size", "calc_bw_log", "print_rank_0"):
        assert function in comms.__all__
        assert list(inspect.signature(getattr(comms, function)).parameters) == \
            list(inspect.signature(getattr(ds_comms, function)).parameters)


def test_print_rank_0_prints_on_rank_0_as_deepspeeds_does(monkeypatch, capsys):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for rank, expected in ((0, "hello\n"), (1, "")):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        comms.print_rank_0("hello")
        ours = capsys.readouterr().out
        ds_comms.print_rank_0("hello")
        assert ours == capsys.readouterr().out == expected


def test_print_rank_0_prints_before_deepspeed_comm_is_initialized(monkeypatch, capsys):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    comms.print_rank_0("hello")  # DeepSpeed's: AssertionError, no backend to ask for the rank
    assert capsys.readouterr().out == "hello\n"


@pytest.mark.parametrize("op", DEEPSPEED_OPS)
def test_calc_bw_log_equals_deepspeeds(world, op):
    for size, duration in ((1024, 0.5), (3 * 10**8, 12.25), (0, 1.0)):
        assert calc_bw_log(op, size, duration) == ds_comms.calc_bw_log(op, size, duration)


def test_calc_bw_log_unknown_op_raises_naming_known_ops(world):
    with pytest.raises(InvalidArgumentError, match=r"unknown comm_op 'all_reduse'; known ops: all_gather, .*barrier"):
        calc_bw_log("all_reduse", 1024, 1.0)
    with pytest.raises(InvalidArgumentError, match=r"duration of 'all_reduce' must be > 0 ms, got 0"):
        calc_bw_log("all_reduce", 1024, 0)


def test_calc_bw_log_knows_the_other_ops_deepspeed_comm_times(world):
    # deepspeed.comm times these too; DeepSpeed's calc_bw_log exit(0)s on them.
    assert calc_bw_log("all_gather_object", 1024, 1.0) == calc_bw_log("all_gather", 1024, 1.0)
    assert calc_bw_log("monitored_barrier", 0, 1.0) == (0.0, 0.0)


def test_calc_bw_log_before_deepspeed_comm_is_initialized_uses_one_rank(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert calc_bw_log("all_gather", 1000, 1.0) == (8000 / 1e6, 0.0)


def test_convert_size_equals_deepspeeds_and_takes_exact_powers_to_the_right_unit():
    rng = random.Random(3)
    sizes = [0, 1, 1023, 1024, 1536, 10**9] + [1024**k for k in range(9)]
    sizes += [rng.randrange(1, 2**48) for _ in range(500)]
    for size in sizes:
        assert convert_size(size) == ds_comms.convert_size(size), size
    assert convert_size(1024**9) == "1024.0 YB"  # DeepSpeed: IndexError
    assert convert_size(0.5) == "0.5 B"  # DeepSpeed: "512.0 YB"
    with pytest.raises(InvalidArgumentError, match="size_bytes must be >= 0, got -1"):
        convert_size(-1)


def test_get_caller_func_counts_frames_as_deepspeed_does():

    def outer():
        return middle()

    def middle():
        return inner()

    def inner():
        return get_caller_func(), get_caller_func(frame=1), ds_comms.get_caller_func(), ds_comms.get_caller_func(1)

    assert outer() == ("outer", "inner", "outer", "inner")


def test_append_and_queries_equal_deepspeeds(world):
    ours, theirs = CommsLogger(), ds_comms.CommsLogger()
    assert not ours.has_data()
    fill(ours)
    fill(theirs)
    assert ours.comms_dict == theirs.comms_dict
    assert ours.get_raw_data() == theirs.get_raw_data() and ours.get_raw_data() is not ours.comms_dict
    assert ours.has_data()
    assert ours.get_operation_names() == theirs.get_operation_names()
    assert ours.get_total_operations() == theirs.get_total_operations() == 60
    for name in ours.get_operation_names() + ["never_seen"]:
        assert_close(ours.get_operation_summary(name), theirs.get_operation_summary(name))
    ours.reset_data()
    assert not ours.has_data() and ours.get_total_operations() == 0


def test_append_imports_nothing(world, monkeypatch):
    # append() runs on every timed collective; deepspeed.comm is imported once, with the module.
    imported = []
    real_import = builtins.__import__

    def recording_import(name, *args, **kwargs):
        imported.append(name)
        return real_import(name, *args, **kwargs)

    logger = CommsLogger()
    monkeypatch.setattr(builtins, "__import__", recording_import)
    for _ in range(3):
        logger.append("all_reduce", "all_reduce", 2.0, 1024)
    monkeypatch.undo()
    assert imported == []
    assert logger.get_total_operations() == 3


def strip_timestamp(result):
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+", result["metadata"].pop("timestamp"))
    return result


def test_log_all_prints_and_returns_what_deepspeed_does(world, capsys):
    ours, theirs = CommsLogger(), ds_comms.CommsLogger()
    fill(ours)
    fill(theirs)
    ours_result = ours.log_all(return_dict=True)
    ours_out = capsys.readouterr().out
    theirs_result = theirs.log_all(return_dict=True)
    assert ours_out == capsys.readouterr().out
    assert "all_reduce" in ours_out and "Avg Latency(ms)" in ours_out
    assert_close(strip_timestamp(ours_result), strip_timestamp(theirs_result))
    assert ours_result["metadata"] == {"world_size": 4, "rank": 0}
    assert ours.log_all(print_log=False) is None
    assert capsys.readouterr().out == ""


def test_log_all_with_stragglers_matches_deepspeed(world, monkeypatch, capsys):

    def all_reduce_min(tensor, op=None, **kwargs):
        # Another rank that was 0.5 ms faster on every call.
        tensor.copy_(torch.minimum(tensor, tensor - 0.5))

    monkeypatch.setattr(dist, "all_reduce", all_reduce_min)
    ours, theirs = CommsLogger(), ds_comms.CommsLogger()
    fill(ours)
    fill(theirs)
    ours_result = ours.log_all(show_straggler=True, return_dict=True)
    ours_out = capsys.readouterr().out
    theirs_result = theirs.log_all(show_straggler=True, return_dict=True)
    assert ours_out == capsys.readouterr().out
    assert "Breakdown with straggler effect" in ours_out
    assert_close(strip_timestamp(ours_result), strip_timestamp(theirs_result))
    analysis = ours_result["straggler_analysis"]["all_reduce"]
    assert all(row["avg_straggler_ms"] == pytest.approx(0.5) for row in analysis.values())


@pytest.mark.parametrize("section, enabled", [
    (None, False),
    ({}, False),
    ({"verbose": True, "prof_ops": ["broadcast"]}, False),
    ({"enabled": False, "verbose": True, "prof_ops": ["broadcast"]}, False),
    ({"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"], "debug": True}, True),
])
def test_configure_reads_enabled_as_written(section, enabled):
    config = DeepSpeedCommsConfig({} if section is None else {"comms_logger": section})
    ours, theirs = CommsLogger(), ds_comms.CommsLogger()
    ours.configure(config)
    theirs.configure(config)
    assert ours.enabled is enabled
    # DeepSpeed switches on whenever the section exists; both apply the section's other settings.
    assert theirs.enabled is (section is not None)
    assert vars(ours) == {**vars(theirs), "enabled": enabled}


def test_configure_accepts_the_section_itself():
    logger = CommsLogger()
    logger.configure(CommsLoggerConfig(enabled=False, prof_all=False))
    assert (logger.enabled, logger.prof_all) == (False, False)
    logger.configure(CommsLoggerSettings(enabled=True, verbose=True))
    assert (logger.enabled, logger.verbose) == (True, True)


def test_profiling_switches():
    logger = CommsLogger()
    logger.stop_profiling_comms()
    assert logger.prof_all is False
    logger.start_profiling_op(["all_reduce", "broadcast"])
    logger.start_profiling_op(["broadcast", "barrier"])
    assert logger.prof_ops == ["all_reduce", "broadcast", "barrier"]
    logger.stop_profiling_op(["broadcast"])
    assert logger.prof_ops == ["all_reduce", "barrier"]
    logger.start_profiling_comms()
    assert logger.prof_all is True


def test_verbose_append_logs_each_call_on_rank_0(world, monkeypatch):
    logged = []
    monkeypatch.setattr(comms, "log_dist", lambda message, ranks=None: logged.append((message, ranks)))
    logger = CommsLogger()
    logger.verbose = True
    logger.append("all_reduce", "all_reduce", 2.0, 1024**2)
    assert logged == [("comm op: all_reduce | time (ms): 2.00 | msg size: 1.0 MB | algbw (Gbps): 8.39 | "
                       "busbw (Gbps): 6.29", [0])]


INTEGRATION = """
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, deepspeed
import deepspeed.comm as dist
import deepspeed.comm.comm as ds_comm
from ds_profutils.comms_logging import CommsLogger
from ds_profutils.timer import SynchronizedWallClockTimer
ds_comm.comms_logger, ds_comm.timers = CommsLogger(), SynchronizedWallClockTimer()
deepspeed.init_distributed(dist_backend="gloo")
dist.configure(enabled=True, prof_all=True)
tensor = torch.ones(1024)
for _ in range(3):
    dist.all_reduce(tensor)
dist.broadcast(tensor, 0)
result = dist.log_summary(return_dict=True)
print("COUNTS", {name: sum(row["count"] for row in sizes.values()) for name, sizes in result["summary"].items()})
"""


def test_deepspeed_comm_runs_on_our_logger_and_timers():
    """deepspeed.comm's timed ops drive our CommsLogger and timer group (one gloo rank, own process)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run = subprocess.run([sys.executable, "-c", INTEGRATION, str(port)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "COUNTS {'all_reduce': 3, 'broadcast': 1, 'log_summary_barrier': 1}" in run.stdout
    assert "Avg Latency(ms)" in run.stdout


def test_installed_logger_honours_enabled_false_and_keeps_what_deepspeeds_recorded(deepspeeds_logger):
    from deepspeed.comm import comm as ds_comm

    undo = comms.install_comms_logger(CommsLoggerSettings(enabled=False, verbose=True))
    ours = ds_comm.comms_logger
    assert isinstance(ours, CommsLogger) and dist.comms_logger is ours  # the alias users read, too
    assert not ours.enabled and ours.verbose  # DeepSpeed's would be on: the section exists
    # deepspeed.initialize configures the logger it finds; ours keeps "enabled": false meaning off.
    ours.configure(DeepSpeedCommsConfig({"comms_logger": {"enabled": False}}))
    assert not ours.enabled
    assert ours.get_total_operations() == 1  # DeepSpeed's record is there
    ours.append("broadcast", "broadcast", 1.0, 2048)
    undo()
    assert ds_comm.comms_logger is deepspeeds_logger and dist.comms_logger is deepspeeds_logger
    assert deepspeeds_logger.get_operation_names() == ["all_reduce", "broadcast"]  # nothing recorded is lost
    undo()  # twice: nothing more
    assert ds_comm.comms_logger is deepspeeds_logger


def test_loggers_installed_by_several_engines_come_out_in_any_order(deepspeeds_logger):
    from deepspeed.comm import comm as ds_comm

    undo_actor = comms.install_comms_logger(CommsLoggerSettings(enabled=True))
    actor = ds_comm.comms_logger
    undo_critic = comms.install_comms_logger(CommsLoggerSettings(enabled=False))
    undo_critic()
    assert ds_comm.comms_logger is actor and dist.comms_logger is actor
    undo_actor()
    assert ds_comm.comms_logger is deepspeeds_logger and dist.comms_logger is deepspeeds_logger
    undo_actor = comms.install_comms_logger(CommsLoggerSettings(enabled=True))
    undo_critic = comms.install_comms_logger(CommsLoggerSettings(enabled=False))
    undo_actor()
    assert not ds_comm.comms_logger.enabled  # the critic's, still in force
    undo_critic()
    assert ds_comm.comms_logger is deepspeeds_logger and dist.comms_logger is deepspeeds_logger
