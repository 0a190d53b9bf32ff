"""A profiler must never hurt the job (issue 32 item 1, issue 37 item 1), in one process: the records file's
one behaviour for every output failure, and the live exchange's rows when a rank has no figures or asks every
rank to stop.  Across ranks under the launcher: test_isolation_launcher.py."""
import errno
import math
import os
from types import SimpleNamespace

import pytest
import torch

from ds_profutils.engine.live import LiveMetrics, StepFigures
from ds_profutils.engine.live.decisions import STOP, decide, empty_row, known_rows, split_flags, with_flags
from ds_profutils.engine.records_file import RecordsFile


def test_a_directory_under_a_file_is_one_line_and_recording_off(tmp_path, ds_caplog):
    (tmp_path / "plain").write_text("a file")
    records = RecordsFile(tmp_path / "plain" / "out" / "zero_fetch_rank_1.jsonl", "step records", 1)
    records.make_directory()
    records.open(append=False)
    records.write(b"{}\n")
    records.close()
    assert records.failed and records.opened
    lines = [record.getMessage() for record in ds_caplog.records]
    assert lines == [f"ds_profutils: output_dir {tmp_path / 'plain' / 'out'} cannot be created (Not a directory): "
                     "step records are off on rank 1, training goes on; no step records of rank 1 are on disk"]
    assert "Traceback" not in ds_caplog.text


def test_a_records_path_that_is_a_directory_says_what_is_on_disk(tmp_path, ds_caplog):
    (tmp_path / "zero_fetch_rank_0.jsonl").mkdir()
    records = RecordsFile(tmp_path / "zero_fetch_rank_0.jsonl", "step records", 0)
    records.make_directory()
    records.open(append=True)
    assert records.failed
    assert f"output_dir {tmp_path} cannot be written (Is a directory): step records are off on rank 0" in \
        ds_caplog.text


def test_a_write_error_keeps_what_was_written_and_names_it(tmp_path, ds_caplog):
    path = tmp_path / "zero_fetch_rank_0.jsonl"
    records = RecordsFile(path, "step records", 0)
    records.open(append=False)
    records.write(b'{"step": 0}\n')
    records._file.close()  # the next write fails as on a revoked mount: ValueError is no OSError, EBADF is
    records._file = open(path, "rb", buffering=0)  # read-only handle: write raises OSError (EBADF)
    records.write(b'{"step": 1}\n')
    records.write(b'{"step": 2}\n')
    assert records.failed and path.read_bytes() == b'{"step": 0}\n'
    assert ds_caplog.text.count("cannot be written") == 1
    assert f"{path} keeps the 12 bytes of step records written before" in ds_caplog.text


class FillingDisk:
    """A records file on a disk with ``room`` bytes left: a write past it is cut short (as the kernel does, with
    no error), the next one raises ENOSPC; ``room`` may grow again (space returns)."""

    def __init__(self, file, room):
        self.file, self.room = file, room

    def write(self, data):
        if self.room == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = self.file.write(data[:self.room])
        self.room -= written
        return written

    def fileno(self):
        return self.file.fileno()

    def close(self):
        self.file.close()


def test_a_record_the_disk_fills_inside_is_cut_off_and_the_next_starts_a_whole_line(tmp_path, ds_caplog):
    path = tmp_path / "zero_fetch_rank_0.jsonl"
    records = RecordsFile(path, "step records", 0)
    records.open(append=False)
    records.write(b'{"step": 0}\n')
    disk = records._file = FillingDisk(records._file, room=5)
    records.write(b'{"step": 1}\n')  # 5 bytes of it fit
    records.write(b'{"step": 2}\n')
    disk.room = 100  # space returns
    records.write(b'{"step": 3}\n')
    records.close()
    assert path.read_bytes() == b'{"step": 0}\n{"step": 3}\n'
    assert ds_caplog.text.count("is full (No space left on device)") == 1 and "has space again" in ds_caplog.text


@pytest.mark.parametrize("tail", [b'{"step": 1, "ti', b'x' * 70_000], ids=["part of a record", "longer than a read"])
def test_a_file_resumed_after_a_cut_record_starts_on_a_whole_line(tmp_path, ds_caplog, tail):
    path = tmp_path / "zero_fetch_rank_0.jsonl"
    path.write_bytes(b'{"step": 0}\n' + tail)  # a job stopped while its disk was full
    records = RecordsFile(path, "step records", 0)
    records.open(append=True)
    records.write(b'{"step": 2}\n')
    records.close()
    assert path.read_bytes() == b'{"step": 0}\n{"step": 2}\n'
    assert f"{path} ended in {len(tail)} bytes of a record cut short (a full disk); they are cut off" in ds_caplog.text


def test_a_file_resumed_on_a_whole_line_is_left_as_it_was(tmp_path, ds_caplog):
    path = tmp_path / "zero_fetch_rank_0.jsonl"
    path.write_bytes(b'{"step": 0}\n')
    records = RecordsFile(path, "step records", 0)
    records.open(append=True)
    records.write(b'{"step": 1}\n')
    records.close()
    assert path.read_bytes() == b'{"step": 0}\n{"step": 1}\n' and "cut short" not in ds_caplog.text


class Kept:
    def __init__(self):
        self.writes = []

    def write(self, events):
        self.writes.append(events)


def step(global_step, step_ms=100.0):
    return StepFigures(global_step, step_ms, 120.0, 20.0, 10**12, 100, 4, 5.0, 10.0, None)


def test_a_step_whose_figures_never_came_counts_empty_and_keeps_the_exchange():
    """The recorder failed: the engine's boundaries still count (one exchange per interval), rows empty."""
    kept = Kept()
    live = LiveMetrics(SimpleNamespace(monitor_interval=2, console=False), None, [kept])
    live.step_finished(step(0))
    live.optimizer_step_ended(0)  # told after the recorder: figures came, nothing more counts
    live.optimizer_step_ended(1)  # the recorder failed in step 1: an empty step ends the interval
    live.optimizer_step_ended(2)
    live.optimizer_step_ended(3)
    assert live._gather.launched == 2 and kept.writes == []  # two exchanges, nothing known to write


def test_rows_with_flags_decide_alike_and_empty_rows_are_unknown():
    rows = [with_flags([1.0, 2.0], 0), with_flags(empty_row(2), STOP)]
    assert math.isnan(rows[1][0]) and known_rows(split_flags(rows)[0]) == [0]
    assert decide(split_flags(rows)[1]).stop and not decide([0, 0]).stop


def test_a_rank_whose_live_figures_fail_asks_every_rank_to_stop(ds_caplog):
    kept = Kept()
    live = LiveMetrics(SimpleNamespace(monitor_interval=1, console=False), None, [kept])
    live.step_finished(step(0))
    bad = StepFigures(1, 100.0, 120.0, 20.0, 10**12, 100, 4, None, 10.0, None)  # exposed_wait_ms None: no sum
    live.step_finished(bad)
    assert live.stopped and len(kept.writes) == 1
    live.step_finished(step(2))
    assert live._gather.launched == 2  # stopped: no exchange after the one that carried the flag
    assert "every rank stops sending live figures at the same interval" in ds_caplog.text


@pytest.mark.parametrize("failing, exchanges", [
    ("due", 2),  # reading the last exchange's rows: this interval's row says stop
    ("_row", 2),  # making this rank's row (its rider's columns, say): an empty row says stop
    ("exchange", 3),  # reading the new exchange's rows: the next interval's row says stop
])
def test_an_error_anywhere_at_an_intervals_end_keeps_the_rank_in_that_exchange(monkeypatch, ds_caplog, failing,
                                                                                 exchanges):
    """One rank's error as an interval ends must not leave it out of that interval's all-gather, where every other
    rank waits for it (until the process group's timeout): it takes part, and every rank stops at the same interval."""
    kept = Kept()
    live = LiveMetrics(SimpleNamespace(monitor_interval=1, console=False), None, [kept])
    owner = live if failing == "_row" else live._gather
    original = getattr(owner, failing)
    failed = []

    def once(*args):
        launched = live._gather.launched
        result = original(*args) if failing == "exchange" else None  # launched first: reading its rows fails
        if launched == 1 and not failed:
            failed.append(True)
            raise RuntimeError("an allocation of ours")
        return result if failing == "exchange" else original(*args)

    monkeypatch.setattr(owner, failing, once)
    for global_step in range(5):
        live.step_finished(step(global_step))
    assert live._gather.launched == exchanges and live.stopped
    assert ds_caplog.text.count("live metrics failed on this rank (RuntimeError: an allocation of ours)") == 1


@pytest.mark.parametrize("known", [[0, 1], [1]])
def test_the_straggler_is_named_by_its_rank_among_rows_with_figures(known):
    from ds_profutils.engine.live.interval import pack_interval

    live = LiveMetrics(SimpleNamespace(monitor_interval=1, console=False), None, [])
    live._gather.ranks = [0, 1, 2]
    fast = pack_interval([StepFigures(0, 100.0, 200.0, 20.0, None, 100, 1, 90.0, 90.0, None)])
    slow = pack_interval([StepFigures(0, 100.0, 200.0, 20.0, None, 100, 1, 0.0, 0.0, None)])
    rows = [fast if index in known else empty_row(len(fast)) for index in range(2)] + [slow]
    events = dict((name, value) for name, value, _ in live._events(rows, 1, 0))
    assert events["ds_profutils/straggler_rank"] == 2
    assert ("ds_profutils/tokens_per_s" in events) == (len(known) == 2)


def test_an_attached_engine_dropped_without_close_is_freed_and_leaves_inert_hooks(tmp_path):
    """A retry loop or a sweep drops engines without close(): nothing of ours keeps one alive, and a module
    kept beyond its engine (an EMA copy's source) runs its forwards as without ds_profutils."""
    import copy
    import gc
    import pickle
    import weakref

    from test_zero_attach import Engine, read_records, recorder_for

    engine = Engine()
    recorder_for(engine, tmp_path)
    engine.train_step()
    copied = pickle.loads(pickle.dumps(copy.deepcopy(engine.module).__dict__["_forward_hooks"]))
    assert all(hook._hooks is None for hook in copied.values())  # copies hold nothing of the engine
    module, ref = engine.module, weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None
    module.train()
    module(torch.ones(1))
    assert len(read_records(tmp_path)) == 1


def test_a_resume_that_trains_longer_or_profiles_otherwise_is_the_same_job():
    """The Trainer fills the LR schedule's length from max_steps (raised to train on after a resume), and a resume
    may switch logging or profiling on: the same job's records go on; a change of what a step does is another."""
    from ds_profutils.engine.records_file import config_hash

    def engine(**changes):
        resolved = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}, "steps_per_print": 10,
                    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 1}}}
        return SimpleNamespace(_config=SimpleNamespace(_param_dict={**resolved, **changes}))

    first = config_hash(engine())
    assert config_hash(engine(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 14}})) == first
    assert config_hash(engine(steps_per_print=1, wall_clock_breakdown=True, step_metrics={"enabled": True})) == first
    assert config_hash(engine(zero_optimization={"stage": 2})) != first
    assert config_hash(engine(train_micro_batch_size_per_gpu=8)) != first


@pytest.mark.parametrize("earlier, moved", [({"model_numel": 999, "world_size": 4}, True),
                                            ({"model_numel": 123, "world_size": 8}, True),
                                            ({"model_numel": 123, "world_size": 4, "job_config_hash": "x"}, True),
                                            # an earlier version's hash of the whole config: no evidence either way
                                            ({"model_numel": 123, "world_size": 4, "engine_config_hash": "x"}, False),
                                            ({"model_numel": 123, "world_size": 4}, False)])
def test_a_resume_into_another_jobs_records_moves_them_aside_once(tmp_path, ds_caplog, earlier, moved):
    """Another job = a different model_numel, world_size or job config hash in the last record (a key either side
    lacks decides nothing); the readers skip the moved file."""
    import json

    from ds_profutils.outputs import fetch_records_files
    from test_step_records import attach_recorder
    from test_zero_attach import Engine, read_records

    path = tmp_path / "zero_fetch_rank_3.jsonl"
    earlier_text = json.dumps({"global_step": 9, "segment": 0, **earlier}) + "\n"
    path.write_text(earlier_text)
    engine = Engine(stage=2)
    engine.global_steps = 5  # a resume
    with attach_recorder(engine, tmp_path, model_numel=123, config_hash="h"):
        engine.train_step()
    aside = tmp_path / "zero_fetch_rank_3.prev-1.jsonl"
    assert aside.exists() == moved
    steps = [(record["global_step"], record["segment"]) for record in read_records(tmp_path)]
    if moved:
        assert aside.read_text() == earlier_text and steps == [(5, 0)]
        assert ds_caplog.text.count(f"ds_profutils: {path} held another job's records") == 1
        assert fetch_records_files(tmp_path) == {"main": {3: path}}  # the readers' pattern skips it
    else:
        assert path.read_text().startswith(earlier_text) and steps == [(9, 0), (5, 1)]


def test_an_error_making_rank_0s_events_never_skips_its_next_exchange(monkeypatch, ds_caplog):
    """Rank 0 alone makes the events: an error there must leave its exchanges in step with the other ranks'."""
    live = LiveMetrics(SimpleNamespace(monitor_interval=1, console=False), None, [Kept()])

    def broken(*_args):
        raise ZeroDivisionError("a figure of ours")

    monkeypatch.setattr(live, "_events", broken)
    for global_step in range(3):
        live.step_finished(step(global_step))
    assert live._gather.launched == 3 and not live.stopped
    assert "live events of an interval could not be made" in ds_caplog.text


def test_a_failed_recorder_keeps_the_collective_wrappers_until_close(tmp_path):
    """The hang watchdog lines ranks up by the sequence numbers the collective wrappers keep: a recorder that
    failed on one rank must not take them off that rank only; close() does."""
    from test_flops_windows import Blocks, TorchEngine, attached

    attachment = attached(TorchEngine(Blocks()), tmp_path)
    recorder = attachment.recorder
    recorder.stop_after_error(RuntimeError("a write of ours"))
    assert recorder.closed and recorder._detach_collectives.alive
    attachment.close()
    assert not recorder._detach_collectives.alive


def test_a_memory_snapshot_stopped_after_an_error_ends_the_allocator_history():
    from ds_profutils.engine.snapshot import StepSnapshots

    class Snapshots:
        settings = SimpleNamespace(on_oom=True)
        closed = False

        def close(self):
            self.closed = True

    class Engine:
        global_steps = 0

    snapshots, engine = Snapshots(), Engine()
    StepSnapshots(snapshots).stop_after_error(RuntimeError("a dump of ours"))
    assert snapshots.closed
