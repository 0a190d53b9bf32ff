"""Fixtures every test file shares."""
import logging
import os

import pytest

import ds_profutils
from ds_profutils.outputs import LAUNCHER_VARIABLES

# Set by the README's commands for tox itself, not a setting of ours.
_NOT_A_SETTING = "DS_PROFUTILS_TOX_DIR"
_LAUNCHER_NAMES = {name for names in LAUNCHER_VARIABLES for name in names if name}


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
