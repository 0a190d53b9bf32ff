"""log_dist and friends: DeepSpeed's rank semantics, caller-pointing records, lazy and handler-free."""
import logging

import pytest

import ds_profutils
from ds_profutils import logging as ds_logging


def test_before_dist_init_every_process_logs_as_rank_minus_one(ds_caplog):
    ds_profutils.log_dist("hello", ranks=[0], level=logging.WARNING)
    assert [r.getMessage() for r in ds_caplog.records] == ["[Rank -1] hello"]


def test_records_carry_the_formatted_message_as_deepspeeds_do(ds_caplog):
    """Filters and handlers that read ``record.msg`` see DeepSpeed's string: prefix applied, no args."""
    import deepspeed.utils.logging as ds_logging_module

    message = "loss 100% done (%s kept)"  # a % in a message must not be taken for a format
    ds_profutils.log_dist(message, ranks=[0], level=logging.WARNING)
    ds_logging_module.log_dist(message, ranks=[0], level=logging.WARNING)
    ours, theirs = ds_caplog.records
    assert ours.msg == theirs.msg == "[Rank -1] loss 100% done (%s kept)"
    assert ours.args == theirs.args == ()
    assert ours.getMessage() == theirs.getMessage()


def test_print_configuration_logs_deepspeeds_records(ds_caplog):
    """The same lines as DeepSpeed's, formatted into ``record.msg`` as its are (a filter reading it sees the line)."""
    import argparse

    import deepspeed.utils.logging as ds_logging_module

    args = argparse.Namespace(lr=0.1, name="100% run")
    with ds_caplog.at_level(logging.INFO, logger="DeepSpeed"):
        ds_profutils.logging.print_configuration(args, "Cfg")
        count = len(ds_caplog.records)
        ds_logging_module.print_configuration(args, "Cfg")
    ours, theirs = ds_caplog.records[:count], ds_caplog.records[count:]
    assert [(r.msg, r.args) for r in ours] == [(r.msg, r.args) for r in theirs]
    assert [r.msg for r in ours][0] == "Cfg:"


def test_a_filter_on_record_msg_drops_our_records_as_deepspeeds(ds_caplog):
    dropped = logging.Filter()
    dropped.filter = lambda record: not record.msg.startswith("[Rank -1] noisy")
    ds_caplog.handler.addFilter(dropped)
    try:
        ds_profutils.log_dist("noisy line", level=logging.WARNING)
        ds_profutils.log_dist("kept line", level=logging.WARNING)
    finally:
        ds_caplog.handler.removeFilter(dropped)
    assert [r.msg for r in ds_caplog.records] == ["[Rank -1] kept line"]


def test_record_points_at_the_caller(ds_caplog):
    ds_profutils.log_dist("where", level=logging.WARNING)
    (record, ) = ds_caplog.records
    assert record.filename == "test_logging.py" and record.funcName == "test_record_points_at_the_caller"


def test_log_dist_once_emits_once_and_points_at_caller(ds_caplog):
    for _ in range(3):
        ds_profutils.log_dist_once("only once please", ranks=[-1], level=logging.WARNING)
    assert [r.getMessage() for r in ds_caplog.records] == ["[Rank -1] only once please"]
    assert ds_caplog.records[0].funcName == "test_log_dist_once_emits_once_and_points_at_caller"


def test_below_level_is_not_formatted(ds_caplog):
    ds_profutils.set_log_level_from_string("warning")

    class Exploding:

        def __str__(self):
            raise AssertionError("formatted although filtered out")

    ds_profutils.log_dist(Exploding(), level=logging.INFO)
    assert ds_caplog.records == []


def test_ranks_semantics_after_init(monkeypatch, ds_caplog):
    from deepspeed import comm as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    for ranks in (None, [], [0], [1], [-1], [0, 1]):
        ds_profutils.log_dist(f"to {ranks}", ranks=ranks, level=logging.WARNING)
    assert [r.getMessage() for r in ds_caplog.records] == ["[Rank 1] to [1]", "[Rank 1] to [-1]", "[Rank 1] to [0, 1]"]
    assert ds_logging.get_dist_msg("m", ranks=[0]) is None
    assert ds_logging.get_dist_msg("m", ranks=[1]) == "[Rank 1] m"


def test_set_log_level_from_string_sets_logger_and_handlers():
    logger = logging.getLogger("ds_profutils-test-level")
    handler = logging.StreamHandler()
    logger.addHandler(handler)
    ds_profutils.set_log_level_from_string("ERROR", custom_logger=logger)
    assert logger.level == logging.ERROR and handler.level == logging.ERROR


@pytest.mark.parametrize("bad", ["loud", "", 3])
def test_unknown_level_names_the_allowed_ones(bad):
    with pytest.raises(ValueError, match="debug"):
        ds_profutils.set_log_level_from_string(bad)


def test_should_log_le():
    ds_profutils.set_log_level_from_string("info")
    try:
        assert ds_logging.should_log_le("info") and not ds_logging.should_log_le("debug")
    finally:
        ds_profutils.set_log_level_from_string("warning")
