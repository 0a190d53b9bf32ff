"""Fixtures every test file shares."""
import logging
import os

import pytest

import ds_profutils

# Set by the README's commands for tox itself, not a setting of ours.
_NOT_A_SETTING = "DS_PROFUTILS_TOX_DIR"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Tests decide rank and overrides themselves; nothing leaks in from the shell or tox."""
    for name in list(os.environ):
        if (name.startswith("DS_PROFUTILS_") and name != _NOT_A_SETTING) or name in ("RANK", "WORLD_SIZE",
                                                                                    "LOCAL_RANK"):
            monkeypatch.delenv(name)


@pytest.fixture
def ds_caplog(caplog):
    """Capture the DeepSpeed logger's records (it does not propagate to root, so attach directly)."""
    ds_profutils.logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="DeepSpeed")
    yield caplog
    ds_profutils.logger.removeHandler(caplog.handler)
