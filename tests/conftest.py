"""Fixtures every test file shares."""
import json
import logging
import os
import signal

import pytest

import ds_profutils
from ds_profutils.outputs import LAUNCHER_VARIABLES
from launcher import DIST_SCRIPTS, run_deepspeed
from profiler_testing import PROFILED_JOB_ACTIVE, PROFILED_JOB_REPEAT

# Set by the README's commands for tox itself, not a setting of ours.
_NOT_A_SETTING = "DS_PROFUTILS_TOX_DIR"
_LAUNCHER_NAMES = {name for names in LAUNCHER_VARIABLES for name in names if name}


# What a test file imports from tests/launcher.py to start real multi-process jobs (10-60 s each).
_JOB_STARTERS = ("DIST_SCRIPTS", "run_deepspeed", "LauncherJob", "run_ranks_as_nodes", "run_two_nodes")


def pytest_collection_modifyitems(items):
    """The files that start real jobs first, each file's tests in their order.  tox runs two workers that
    take whole files in collection order: started early, the long files are shared out between them
    instead of one worker running the last of them alone while the other waits."""
    items.sort(key=lambda item: not any(hasattr(item.module, name) for name in _JOB_STARTERS))


@pytest.fixture
def handlers():
    """SIGTERM and SIGINT as a program run from a terminal has them, whatever the suite started with
    (``nohup ... &`` starts Python with SIGINT ignored)."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL), signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGTERM, previous[0])
    signal.signal(signal.SIGINT, previous[1])


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Tests decide rank and overrides themselves; nothing leaks in from the shell, tox or a launcher."""
    for name in list(os.environ):
        if (name.startswith("DS_PROFUTILS_") and name != _NOT_A_SETTING) or name in _LAUNCHER_NAMES:
            monkeypatch.delenv(name)


@pytest.fixture
def ds_caplog(caplog):
    """Capture the DeepSpeed logger's records (it does not propagate to root, so attach directly)."""
    ds_profutils.logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="DeepSpeed")
    yield caplog
    ds_profutils.logger.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def profiled_job(tmp_path_factory):
    """One 2-rank job under the launcher (tests/dist_scripts/profiler_two_ranks.py), read by the profiler's and
    the timeline's tests: (traces of the first call, outputs of the second, the job's output)."""
    out = tmp_path_factory.mktemp("profiled_job")
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "comms_logger": {"enabled": True},
        "profiler": {"output_dir": str(out / "profiles"), "skip_first": 1, "wait": 1, "warmup": 1,
                     "active": PROFILED_JOB_ACTIVE, "repeat": PROFILED_JOB_REPEAT, "with_flops": True,
                     "summary_ranks": [0]},
    }
    config_path = out / "ds_config.json"
    config_path.write_text(json.dumps(config))
    job = run_deepspeed(DIST_SCRIPTS / "profiler_two_ranks.py",
                        ["--deepspeed_config", str(config_path), "--second_output_dir", str(out / "second")])
    return out / "profiles", out / "second", job.stdout


@pytest.fixture
def world(monkeypatch):
    """deepspeed.comm reporting an initialized 4-rank world, rank 0 (no process group needed)."""
    from deepspeed import comm as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)


@pytest.fixture
def deepspeeds_logger(monkeypatch, world):
    """DeepSpeed's own CommsLogger in deepspeed.comm (both names), with one recorded all_reduce; put back after."""
    from deepspeed import comm as dist
    from deepspeed.comm import comm as ds_comm
    from deepspeed.utils.comms_logging import CommsLogger

    theirs = CommsLogger()
    theirs.append("all_reduce", "all_reduce", 2.0, 1024)
    monkeypatch.setattr(ds_comm, "comms_logger", theirs)
    monkeypatch.setattr(dist, "comms_logger", theirs)
    return theirs
