"""``ds_profutils.attach``: step boundaries and records on a stand-in engine, refusals, and one real 2-rank run.

The stand-in engine behaves as DeepSpeed's does where the recorder depends on it: a forward pre-hook
that logs and resets the coordinator's profiler (DeepSpeed's ``reset_step``), fetches that go through
the coordinator's ``__profiler``, and ``step()`` advancing ``micro_steps``/``global_steps``.
"""
import json
import types

import deepspeed
import pytest
import torch
from deepspeed.runtime.zero.partitioned_param_profiler import PartitionedParameterProfiler as DeepSpeedProfiler
from deepspeed.utils.timer import NoopTimer

import ds_profutils
from ds_profutils import nvtx
from ds_profutils.config import PartitionedParamProfilerConfig
from ds_profutils.exceptions import InvalidArgumentError
from ds_profutils.outputs import ProcessIdentity
from ds_profutils.report import build_report
from ds_profutils.engine import AttachError, Attachment, StepRecorder
from ds_profutils.engine.recorder import RECORDER_ATTR
from ds_profutils.engine.step import StepRecord
from launcher import DIST_SCRIPTS, run_deepspeed
from report_testing import read_records_file

PROFILER_ATTR = "_PartitionedParameterCoordinator__profiler"


class Coordinator:
    """Holds its profiler where DeepSpeed's coordinator does, fetches through it, and counts the gathered
    elements as DeepSpeed's does (before an all-gather's events)."""

    def __init__(self):
        self._PartitionedParameterCoordinator__profiler = DeepSpeedProfiler(None)
        self._PartitionedParameterCoordinator__n_available_params = 0

    def fetch(self, name, numel):
        profiler = self._PartitionedParameterCoordinator__profiler
        if name.endswith("all_gather"):
            self._PartitionedParameterCoordinator__n_available_params += numel
        profiler.start_event(name)
        profiler.stop_event(name, numel)

    def release(self, numel):
        self._PartitionedParameterCoordinator__n_available_params -= numel

    def _invalidate_trace(self):
        pass

    def reset_step(self, module, args):
        profiler = self._PartitionedParameterCoordinator__profiler
        profiler.log_events()
        profiler.reset_events()
        self._PartitionedParameterCoordinator__n_available_params = 0


class Model(torch.nn.Module):

    def __init__(self, coordinator):
        super().__init__()
        self.coordinator = coordinator

    def forward(self, x):
        self.coordinator.fetch("forward_fetch_wait", 5)
        self.coordinator.fetch("forward_all_gather", 10)
        return x * 2


class Engine:

    def __init__(self, config=None, stage=3):
        self.coordinator = Coordinator()
        self.module = Model(self.coordinator)
        self.module.register_forward_pre_hook(self.coordinator.reset_step)  # DeepSpeed's, registered first
        self.global_steps = self.micro_steps = 0
        self.timers = NoopTimer()
        self.config = config or {}
        self.stage = stage
        self.optimizer = object()
        self.is_compiled = False

    def zero_optimization_stage(self):
        return self.stage

    def zero_max_live_parameters(self):
        return 1_000_000_000

    def wall_clock_breakdown(self):
        return bool(self.config.get("wall_clock_breakdown"))

    def steps_per_print(self):
        return 10

    def gradient_accumulation_steps(self):
        return 1

    def forward(self, x=torch.ones(1)):
        return self.module(x)

    def backward(self):
        self.coordinator.fetch("backward_fetch_wait", 5)

    def step(self):
        self.micro_steps += 1
        self.global_steps += 1

    def train_step(self):
        self.module.train()
        self.forward()
        self.backward()
        self.step()

    def eval_forward(self):
        self.module.eval()
        self.forward()
        self.module.train()


IDENTITY = ProcessIdentity(rank=3, world_size=4, local_rank=1, host="node-a", pid=4242, source="test")


def recorder_for(engine, tmp_path, name="main", device_events=None, memory=None, append=False, **settings):
    """What ``attach`` builds on a ZeRO-3 engine, on the stand-in engine: an Attachment with a recorder."""
    settings = PartitionedParamProfilerConfig(enabled=True, output_dir=str(tmp_path), **settings)
    attachment = Attachment(engine, name, None)
    recorder = StepRecorder(engine, engine.coordinator, settings,
                                 name=name,
                                 identity=IDENTITY,
                                 dtype=torch.float16,
                                 device_events=device_events,
                                 memory=memory,
                                 append=append)
    attachment.recorder = recorder
    attachment.add(recorder, recorder.close)
    return attachment


def read_records(tmp_path, rank=3):
    return read_records_file(tmp_path / f"zero_fetch_rank_{rank}.jsonl")


def test_one_record_per_step_with_the_step_read_at_forward_start(tmp_path):
    (tmp_path / "zero_fetch_rank_3.jsonl").write_text("an earlier run\n")
    engine = Engine()
    with recorder_for(engine, tmp_path):
        for _ in range(3):
            engine.train_step()
            # flushed at step(), before close: a killed job keeps every finished step
            assert len(read_records(tmp_path)) == engine.micro_steps
    records = read_records(tmp_path)
    assert [(r["micro_step"], r["global_step"], r["mode"]) for r in records] == [(0, 0, "train"), (1, 1, "train"),
                                                                                  (2, 2, "train")]
    first = records[0]
    assert {k: first[k] for k in ("schema", "engine", "rank", "world_size", "local_rank", "host", "pid", "dtype",
                                  "clock", "comms_logger")} == {
        "schema": 3, "engine": "main", "rank": 3, "world_size": 4, "local_rank": 1, "host": "node-a", "pid": 4242,
        "dtype": "float16", "clock": "host", "comms_logger": False
    }
    # the coordinator's count of gathered elements after the forward's all-gather, beside the engine's limit
    assert (first["live_params_max"], first["max_live_parameters"]) == (10, 1_000_000_000)
    assert first["trace_cache_invalidations"] == 0 and "memory" not in first  # memory figures: see test_zero_memory
    # DeepSpeed's own reset at the next forward start did not eat the backward's events.
    assert {name: (e["count"], e["numel"], e["numel_unit"], e["bytes"])
            for name, e in first["events"].items()} == {
                "forward_fetch_wait": (1, 5, "shard", 10),
                "forward_all_gather": (1, 10, "full", 20),
                "backward_fetch_wait": (1, 5, "shard", 10),
            }
    assert first["step_time_ms"] >= first["events"]["forward_fetch_wait"]["time_ms"]
    waits = first["events"]["forward_fetch_wait"]["time_ms"] + first["events"]["backward_fetch_wait"]["time_ms"]
    assert first["fetch_wait_ms"] == pytest.approx(waits)
    assert first["collective_wait_ms"] == first["collective_ms"] == 0 and first["collectives"] == {}  # no backend here
    assert first["exposed_wait_ms"] == pytest.approx(waits)
    assert all(e["clock"] == "host" and e["dropped"] == 0 for e in first["events"].values())


def test_eval_forwards_are_labelled_and_written_at_next_forward_or_close(tmp_path):
    engine = Engine()
    recorder = recorder_for(engine, tmp_path)
    engine.train_step()
    engine.eval_forward()
    engine.train_step()
    engine.eval_forward()
    assert [r["mode"] for r in read_records(tmp_path)] == ["train", "eval", "train"]
    recorder.close()  # what runs at exit
    records = read_records(tmp_path)
    assert [(r["micro_step"], r["mode"]) for r in records] == [(0, "train"), (1, "eval"), (1, "train"), (2, "eval")]
    assert "backward_fetch_wait" not in records[-1]["events"]


def test_no_empty_record_without_a_forward(tmp_path):
    engine = Engine()
    recorder = recorder_for(engine, tmp_path)
    engine.step()
    recorder.close()
    assert read_records(tmp_path) == []


def test_a_train_step_interrupted_in_its_backward_is_absent_not_torn(tmp_path):
    engine = Engine()
    recorder = recorder_for(engine, tmp_path)
    engine.train_step()
    engine.forward()  # SIGTERM in the backward that follows: it never returns, the process exits
    recorder.close()  # what runs at exit
    text = (tmp_path / "zero_fetch_rank_3.jsonl").read_text()
    assert text.endswith("\n") and [r["micro_step"] for r in read_records(tmp_path)] == [0]


@pytest.mark.parametrize("boundary", [None, False], ids=["engine cannot say", "before the boundary"])
def test_at_close_a_micro_step_whose_backward_returned_is_whole_unless_a_step_began(tmp_path, boundary):
    """Accelerate calls step() only at the accumulation boundary: a backward that returned ends its micro step.
    One whose step() began and did not return (an exception in the optimizer) is not whole."""
    engine = Engine()
    if boundary is not None:
        engine.is_gradient_accumulation_boundary = lambda: boundary  # Accelerate sets it before each backward
    recorder = recorder_for(engine, tmp_path)
    engine.forward()
    engine.backward()
    recorder.close()
    (record, ) = read_records(tmp_path)
    assert (record["micro_step"], record["mode"]) == (0, "train")
    engine = Engine()

    def failing_step():
        raise RuntimeError("optimizer failed")

    engine.step = failing_step
    recorder = recorder_for(engine, tmp_path / "raising")
    engine.forward()
    engine.backward()
    with pytest.raises(RuntimeError):
        engine.step()
    recorder.close()
    assert read_records(tmp_path / "raising") == []


def test_at_close_a_step_cut_short_between_its_backward_and_its_optimizer_step_is_not_whole(tmp_path):
    """A hang or a signal after engine.backward() at the accumulation boundary, before engine.step(): that step did
    not finish, as on the ranks the collectives inside their step() held (a report would take those for the ones
    that ended early)."""
    engine = Engine()
    engine.is_gradient_accumulation_boundary = lambda: True
    recorder = recorder_for(engine, tmp_path)
    engine.train_step()
    engine.forward()
    engine.backward()
    recorder.close()
    assert [record["global_step"] for record in read_records(tmp_path)] == [0]


def test_a_no_grad_forward_inside_a_micro_step_keeps_the_micro_steps_fetches(tmp_path):
    """DPO's reference logits after the policy's forward, on ZeRO-3: DeepSpeed resets the fetch counters at every
    forward's start; the step's record still holds the policy forward's fetches, with the reference's and the
    backward's."""
    engine = Engine()
    with recorder_for(engine, tmp_path):
        engine.module.train()
        engine.forward()
        with torch.no_grad():
            engine.forward()
        engine.backward()
        engine.step()
        engine.train_step()  # a plain step after it: counted from its own forward's start again
    first, second = read_records(tmp_path)
    assert first["mode"] == "train" and first["events"]["forward_fetch_wait"]["count"] == 2
    assert first["events"]["backward_fetch_wait"]["count"] == 1
    assert second["events"]["forward_fetch_wait"]["count"] == 1


def test_a_step_that_raises_is_not_recorded(tmp_path):
    engine = Engine()

    def failing_step():
        raise RuntimeError("optimizer failed")

    engine.step = failing_step
    with recorder_for(engine, tmp_path):
        engine.forward()
        with pytest.raises(RuntimeError):
            engine.step()
    assert read_records(tmp_path) == []


def test_log_interval_skips_steps_with_the_profiler_not_recording(tmp_path):
    engine = Engine()
    deepspeeds = getattr(engine.coordinator, PROFILER_ATTR)
    with recorder_for(engine, tmp_path, log_interval=2) as attached:
        profiler = attached.recorder.fetches.profiler
        recording = []
        for _ in range(5):
            engine.forward()
            assert getattr(engine.coordinator, PROFILER_ATTR) is profiler  # installed once, at attach
            recording.append(profiler.recording)
            engine.backward()
            engine.step()
            assert not profiler.recording  # between steps nothing is counted
    assert [r["global_step"] for r in read_records(tmp_path)] == [0, 2, 4]
    assert recording == [True, False, True, False, True]
    assert [r["events"]["backward_fetch_wait"]["count"] for r in read_records(tmp_path)] == [1, 1, 1]
    assert getattr(engine.coordinator, PROFILER_ATTR) is deepspeeds  # given back at close


def test_a_full_disk_pauses_the_records_until_space_returns(tmp_path, ds_caplog):
    engine = Engine()
    with recorder_for(engine, tmp_path) as attached:
        recorder = attached.recorder
        engine.train_step()
        records = recorder.records_file
        kept, records._file = records._file, open("/dev/full", "wb", buffering=0)  # ENOSPC on every write
        engine.train_step()
        engine.train_step()
        records._file.close()
        records._file = kept
        engine.train_step()
    assert ds_caplog.text.count(f"ds_profutils: {tmp_path} is full (No space left on device): step and ZeRO-3 "
                                "fetch records of rank 3 paused until space returns; training goes on") == 1
    assert f"ds_profutils: {tmp_path} has space again" in ds_caplog.text
    assert [r["global_step"] for r in read_records(tmp_path)] == [0, 3]
    assert recorder.closed and "step" not in vars(engine)


def test_an_error_of_the_recorder_stops_recording_never_the_training(tmp_path, monkeypatch, ds_caplog):
    """An accelerator event that misbehaves (or any bug of ours) inside DeepSpeed's forward hooks."""
    engine = Engine()
    recorder = recorder_for(engine, tmp_path).recorder
    engine.train_step()

    def broken(*args, **kwargs):
        raise RuntimeError("event recorded on another stream")

    monkeypatch.setattr(recorder.fetches.profiler, "host_statistics", broken)  # read when engine.step() returns
    engine.train_step()  # the hooks and step() of this step meet the error: training goes on
    engine.train_step()
    assert engine.global_steps == 3 and recorder.closed
    assert "ds_profutils: the ZeRO-3 fetch recorder of engine 'main' failed (RuntimeError: event recorded on " \
           "another stream); it stops recording and training goes on" in ds_caplog.text
    assert [r["global_step"] for r in read_records(tmp_path)] == [0]  # what was recorded stays
    assert "step" not in vars(engine) and RECORDER_ATTR not in vars(engine)  # DeepSpeed's engine again
    assert vars(engine.coordinator)[PROFILER_ATTR].__class__ is DeepSpeedProfiler


def test_an_interruption_while_a_record_is_built_leaves_it_for_close(tmp_path, monkeypatch):
    engine = Engine()
    recorder = recorder_for(engine, tmp_path).recorder
    build = StepRecord.line

    def interrupted_once(*args):
        monkeypatch.setattr(StepRecord, "line", build)
        raise SystemExit(143)  # the profiler's SIGTERM handler, while the record is built

    monkeypatch.setattr(StepRecord, "line", interrupted_once)
    with pytest.raises(SystemExit):
        engine.train_step()
    recorder.close()  # as run_before_signal_exit does before the process ends
    assert [r["global_step"] for r in read_records(tmp_path)] == [0]


def test_an_interruption_inside_the_lines_encoding_leaves_the_whole_record_for_close(tmp_path, monkeypatch):
    import orjson

    engine = Engine()
    recorder = recorder_for(engine, tmp_path).recorder
    encode = orjson.dumps

    def interrupted_once(*args, **kwargs):
        monkeypatch.setattr(orjson, "dumps", encode)
        raise SystemExit(143)  # the SIGTERM handler, after the line took the step's timing

    monkeypatch.setattr(orjson, "dumps", interrupted_once)
    with pytest.raises(SystemExit):
        engine.train_step()
    recorder.close()
    (record, ) = read_records(tmp_path)
    assert record["global_step"] == 0 and record["step_time_ms"] > 0
    # the whole record: the step's timing, its fetch events and the waits they add up to
    assert {"collectives", "collective_ms", "collective_wait_ms", "collective_seq", "fetch_wait_ms",
            "events"} <= set(record)
    assert record["exposed_wait_ms"] == record["fetch_wait_ms"] + record["collective_wait_ms"] > 0


def test_a_recorder_does_not_keep_a_dropped_engine_alive(tmp_path):
    import gc
    import weakref

    engine = Engine()
    recorder_for(engine, tmp_path)  # attached, never closed
    engine.train_step()
    alive = weakref.ref(engine)
    del engine
    gc.collect()
    assert alive() is None
    assert [r["global_step"] for r in read_records(tmp_path)] == [0]


def test_collective_timing_is_removed_with_the_last_recorder_closed_or_collected(tmp_path, monkeypatch):
    import gc

    original = lambda *args, **kwargs: None  # noqa: E731
    backend = types.SimpleNamespace(all_reduce=original)
    monkeypatch.setattr(deepspeed.comm.comm, "cdb", backend)
    closed, dropped = Engine(), Engine()
    first = recorder_for(closed, tmp_path)
    recorder_for(dropped, tmp_path, name="engine1")
    assert vars(backend)["all_reduce"] is not original  # timed while a recorder listens
    first.close()
    first.close()  # twice: counted once
    assert vars(backend)["all_reduce"] is not original
    del dropped
    gc.collect()
    assert vars(backend)["all_reduce"] is original  # the backend as it was


def test_close_gives_the_engine_back(tmp_path):
    engine = Engine()
    original = getattr(engine.coordinator, PROFILER_ATTR)
    recorder = recorder_for(engine, tmp_path)
    assert "step" in vars(engine)
    engine.train_step()
    recorder.close()
    recorder.close()  # twice is fine
    assert getattr(engine.coordinator, PROFILER_ATTR) is original
    assert "step" not in vars(engine) and not hasattr(engine, "_ds_profutils_fetch_recorder")
    engine.train_step()
    assert len(read_records(tmp_path)) == 1


@pytest.mark.parametrize("trace_ranges", [True, False])
def test_trace_ranges_follow_the_torch_profiler_at_forward_start(tmp_path, trace_ranges):
    engine = Engine()
    with recorder_for(engine, tmp_path, trace_ranges=trace_ranges) as attached:
        recorder = attached.recorder
        engine.forward()
        assert not recorder.fetches.profiler.trace_ranges
        nvtx.set_torch_profiler_recording(True)
        try:
            engine.forward()
            assert recorder.fetches.profiler.trace_ranges is trace_ranges
        finally:
            nvtx.set_torch_profiler_recording(False)
        engine.forward()
        assert not recorder.fetches.profiler.trace_ranges


def fetch_config(**section):
    return {"zero_optimization": {"stage": 3}, "partitioned_param_profiler": {"enabled": True, **section}}


def assert_untouched(engine):
    assert "step" not in vars(engine)
    assert not hasattr(engine, "_ds_profutils_fetch_recorder")
    assert isinstance(getattr(engine.coordinator, PROFILER_ATTR), DeepSpeedProfiler)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda engine, mp: setattr(engine, "stage", 2), "ZeRO stage 2 does not partition parameters"),
        (lambda engine, mp: setattr(engine, "is_compiled", True), "torch.compile"),
        (lambda engine, mp: mp.setattr(deepspeed, "__version__", "0.20.1"), "DeepSpeed 0.20.1 is not a version"),
        (lambda engine, mp: None, "no ZeRO-3 parameter coordinator found behind the engine's object"),
    ],
    ids=["zero2", "compiled", "unknown-deepspeed", "no-coordinator"],
)
def test_attach_refuses_what_it_does_not_know(tmp_path, monkeypatch, change, message):
    engine = Engine(fetch_config(output_dir=str(tmp_path)))
    change(engine, monkeypatch)
    with pytest.raises(AttachError, match=message) as refused:
        ds_profutils.attach(engine)
    assert "the engine was left untouched" in str(refused.value)
    assert_untouched(engine)
    assert list(tmp_path.iterdir()) == []


class Reached(Exception):
    """Raised where attach starts changing the engine: every check that may refuse came before."""


def test_with_step_metrics_on_the_fetch_sections_own_ranks_are_not_checked(monkeypatch, fresh_names):
    """Both record sections on: the records go to step_metrics' ranks, so the fetch section's (not used, as
    check-config says) may name a rank the job does not have."""
    from ds_profutils.engine import attaching

    monkeypatch.setattr(attaching, "_coordinator", lambda engine: engine.coordinator)
    monkeypatch.setattr(attaching, "apply_engine_settings", lambda engine, config: (_ for _ in ()).throw(Reached()))
    engine = Engine(fetch_config(ranks=[4]))
    with pytest.raises(ds_profutils.config.ConfigError, match=r"partitioned_param_profiler\.ranks"):
        ds_profutils.attach(engine, name="alone")  # the fetch section alone: its ranks are used, and checked
    engine = Engine({**fetch_config(ranks=[4]), "step_metrics": {"enabled": True}})
    with pytest.raises(Reached):
        ds_profutils.attach(engine, name="both")


@pytest.mark.parametrize("config, section", [({"step_metrics": {"enabled": True}}, "step_metrics"),
                                             (fetch_config(), "partitioned_param_profiler"),
                                             ({}, "partitioned_param_profiler")])
def test_a_bad_shared_keyword_is_named_under_the_section_it_applies_to(fresh_names, config, section):
    """output_dir, ranks, log_interval and memory apply to the records: step_metrics' where it is on."""
    with pytest.raises(ds_profutils.config.ConfigError) as refused:
        ds_profutils.attach(Engine(config, stage=2), log_interval=0)
    assert str(refused.value) == f"{section}.log_interval: 0 is not allowed; expected an integer >= 1"


@pytest.mark.parametrize(
    "config, kwargs, env",
    [
        ({}, {}, None),  # no section: off, whatever the engine
        (fetch_config(), {"enabled": False}, None),  # keyword over config
        (fetch_config(), {"enabled": True}, "0"),  # environment over keyword
    ],
    ids=["no-section", "keyword-off", "env-off"],
)
def test_attach_off_returns_none_and_checks_nothing(monkeypatch, config, kwargs, env):
    if env is not None:
        monkeypatch.setenv("DS_PROFUTILS_PARTITIONED_PARAM_PROFILER_ENABLED", env)
    engine = Engine(config, stage=1)
    assert ds_profutils.attach(engine, **kwargs) is None
    assert_untouched(engine)


# --------------------------------------------------------------------------------------------------
# A real ZeRO-3 engine, 2 ranks under the deepspeed launcher
# --------------------------------------------------------------------------------------------------

RANKS = (0, 1)


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_fetch")
    run_deepspeed(DIST_SCRIPTS / "zero_fetch_records.py", ["--out", str(out)])
    expected = {rank: json.loads((out / f"expected_rank_{rank}.json").read_text()) for rank in RANKS}
    records = {rank: read_records(out / "records", rank) for rank in RANKS}
    return types.SimpleNamespace(out=out, expected=expected, records=records)


@pytest.mark.parametrize("rank", RANKS)
def test_real_engine_records_match_the_coordinators_fetches(zero3_run, rank):
    expected, records = zero3_run.expected[rank], zero3_run.records[rank]
    counted = expected["counted"]
    assert [f"{r['micro_step']}/{r['mode']}" for r in records] == list(counted)  # fresh file, no empty record
    assert [r["mode"] for r in records].count("eval") == 2  # the last one written at exit
    for record in records:
        events, count = record["events"], counted[f"{record['micro_step']}/{record['mode']}"]
        assert record["rank"] == rank and record["world_size"] == 2 and record["host"]
        for direction in ("forward", "backward"):
            assert events.get(f"{direction}_fetch_wait", {}).get("count", 0) == count.get(f"{direction}_fetches", 0)
            gather = events.get(f"{direction}_all_gather", {"count": 0, "numel": 0})
            assert (gather["count"], gather["numel"]) == (count.get(f"{direction}_all_gather_count", 0),
                                                          count.get(f"{direction}_all_gather_numel", 0))
        for name, event in events.items():
            assert event["bytes"] == 4 * event["numel"]
            assert event["numel_unit"] == ("full" if "all_gather" in name or "prefetch" in name else "shard")


@pytest.mark.parametrize("rank", RANKS)
def test_real_engine_every_train_forward_gathers_the_whole_model(zero3_run, rank):
    records = zero3_run.records[rank]
    total = zero3_run.expected[rank]["total_numel"]
    # DeepSpeed leaves the parameters gathered after a no_grad eval forward, so the train forward
    # right after one has nothing to fetch; every other train forward gathers each parameter once.
    after_eval = {r["micro_step"] for r in records if r["mode"] == "eval"}
    train = [r for r in records if r["mode"] == "train" and r["micro_step"] not in after_eval]
    assert len(train) == 3
    for record in train:
        assert record["events"]["forward_all_gather"]["numel"] == total


@pytest.mark.parametrize("rank", RANKS)
def test_real_engine_live_parameters_prefetch_and_memory(zero3_run, rank):
    """The most elements gathered at once lies within the model and falls with stage3_max_live_parameters;
    every train record says what prefetch gathered against on demand, and the process's RSS."""
    records = [r for r in zero3_run.records[rank] if r["mode"] == "train"]
    total = zero3_run.expected[rank]["total_numel"]
    assert all(0 < r["live_params_max"] <= total for r in records if "forward_all_gather" in r["events"])
    limited = read_records_file(zero3_run.out / "records" / f"zero_fetch_limited_rank_{rank}.jsonl")
    assert {r["max_live_parameters"] for r in limited} == {zero3_run.expected[rank]["limited_max_live"]}
    assert max(r["live_params_max"] for r in limited) < max(r["live_params_max"] for r in records)
    for record in records:
        gathered = record["prefetch"]["hits"] + record["prefetch"]["waited"]
        gathers = sum(record["events"].get(f"{d}_all_gather", {"numel": 0})["numel"] for d in ("forward", "backward"))
        assert gathered == gathers  # every all-gather was either prefetched or fetched on demand
        assert record["memory"]["source"] == "rss" and record["memory"]["peak_allocated_bytes"] > 0
        assert set(record["memory"]["phases"]) == {"forward", "backward", "step"}
    assert sum(r["prefetch"]["hits"] for r in records) > 0  # stage3_prefetch_bucket_size: 600


@pytest.mark.parametrize("rank", RANKS)
def test_real_engine_memory_held_from_a_step_on_shows_in_that_steps_peaks(zero3_run, rank):
    found = zero3_run.expected[rank]["memory"]
    records = read_records_file(zero3_run.out / "records" / f"zero_fetch_memory_rank_{rank}.jsonl")
    peaks = {r["global_step"]: r["memory"]["peak_allocated_bytes"] for r in records}
    before = max(peaks[step] for step in range(found["from_step"]))
    after = min(peaks[step] for step in range(found["from_step"], 6))
    assert after - before >= 0.9 * found["bytes"]
    assert after - before < 0.9 * 256 * 2**20 or rank == 1


def test_real_engine_report_names_the_rank_that_keeps_more_memory(zero3_run):
    """Issue 19: rank 1 keeps 256 MB from global step 3 on: the report's highest peak, an imbalance above 1,
    and a jump on rank 1 at step 3; live parameters within the model, lower with the smaller limit."""
    report = build_report(zero3_run.out / "records")
    memory = report["engines"]["memory"]["memory"]
    assert memory["highest_rank"] == 1 and memory["imbalance"] > 1
    assert {(jump["rank"], jump["global_step"]) for jump in memory["jumps"]} == {(1, 3)}
    total = zero3_run.expected[0]["total_numel"]
    main, limited = report["engines"]["main"]["memory"], report["engines"]["limited"]["memory"]
    for rank in RANKS:
        assert 0 < limited["ranks"][rank]["live_params_max"] < main["ranks"][rank]["live_params_max"] <= total


@pytest.mark.parametrize("rank", RANKS)
def test_real_engine_attached_again_appends_and_close_gives_everything_back(zero3_run, rank):
    expected = zero3_run.expected[rank]["phases"]
    assert expected["given_back"] and expected["name_kept"]
    records = read_records_file(zero3_run.out / "records" / f"zero_fetch_phases_rank_{rank}.jsonl")
    assert [r["global_step"] for r in records] == [0, 1, 2, 3, 0]  # two attaches of one engine, then a new one


@pytest.mark.parametrize("rank", RANKS)
def test_real_engine_attach_is_idempotent_and_refuses_zero1(zero3_run, rank):
    expected = zero3_run.expected[rank]
    assert expected["second_attach_same"]
    assert "ZeRO stage 1 does not partition parameters" in expected["zero1_refusal"]
    assert expected["zero1_untouched"]


def test_real_engine_report(zero3_run):
    report = build_report(zero3_run.out / "records")
    engine = report["engines"]["main"]
    assert engine["ranks"] == [0, 1] and report["incomplete"] == [] and report["problems"] == []
    assert engine["steps"].global_steps == [0, 1, 2, 3]
    assert set(engine["events"]) == {"train", "eval"}
    gather = engine["events"]["train"]["forward_all_gather"]
    assert gather["per_rank"][0]["numel"] == sum(r["events"].get("forward_all_gather", {}).get("numel", 0)
                                                 for r in zero3_run.records[0] if r["mode"] == "train")


@pytest.mark.parametrize("rank", RANKS)
def test_real_engine_rank_subset_and_our_timers(zero3_run, rank):
    found = zero3_run.expected[rank]["rank0_only"]
    assert found["recorder"] is (rank == 0)
    # The earlier run's file: replaced on the recording rank, removed on the other.
    assert not found["stale_file_left"]
    assert (zero3_run.out / "rank0_only" / f"zero_fetch_engine1_rank_{rank}.jsonl").exists() is (rank == 0)
    # wall_clock_breakdown: one group of ours, shared by the engine, its ZeRO-3 optimizer and offload,
    # in which the engine and the optimizer created their timers by using them (DeepSpeed's own group
    # saw nothing after attach).
    assert found["timers_ours"] and found["optimizer_and_offload_share_them"]
    assert found["deepspeeds_timers_untouched_since"] and found["timers_given_back"]
    assert {"fwd", "bwd", "step", "optimizer_step"} <= set(found["timer_names"])
    # the fetch profiler drives the engine's timers, as DeepSpeed's does when switched on in source
    assert ({"forward_fetch_wait", "backward_fetch_wait"} <= set(found["timer_names"])) is (rank == 0)
    # and only with wall_clock_breakdown, where DeepSpeed gives them to its coordinator (else a NoopTimer)
    without_breakdown = zero3_run.expected[rank]["timer_names_without_breakdown"]
    assert not {"forward_fetch_wait", "backward_fetch_wait"} & set(without_breakdown), without_breakdown


def test_real_engine_report_of_a_rank_subset(zero3_run):
    report = build_report(zero3_run.out / "rank0_only")
    engine = report["engines"]["engine1"]  # the second engine this process attached without a name
    assert engine["ranks"] == [0] and report["incomplete"] == [] and report["problems"] == []
    assert len(engine["steps"].global_steps) == 2


# --------------------------------------------------------------------------------------------------
# Engine names: one file per engine, the same names on every rank
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_names(monkeypatch):
    """A process that has attached no engine yet."""
    from ds_profutils.engine import attaching as attach_module

    monkeypatch.setattr(attach_module, "_attached_names", {})
    monkeypatch.setattr(attach_module, "_unnamed_attached", 0)
    return attach_module._engine_name


def test_unnamed_engines_are_main_then_engine1_in_attach_order(fresh_names):
    actor, critic, reward, reference = Engine(), Engine(), Engine(), Engine()
    assert [fresh_names(actor, None), fresh_names(critic, None), fresh_names(reward, "reward"),
            fresh_names(reference, None)] == ["main", "engine1", "reward", "engine2"]
    assert fresh_names(actor, None) == "main"  # attaching the same engine again keeps its name


@pytest.mark.parametrize("name", ["main", "has_underscore", "-dash-first", "", 3])
def test_a_bad_or_reserved_name_is_refused(fresh_names, name):
    with pytest.raises(InvalidArgumentError, match="attach: name must match"):
        fresh_names(Engine(), name)


def test_a_name_in_use_by_another_attached_engine_is_refused(fresh_names):
    critic = Attachment(Engine(), "critic", None)
    with pytest.raises(InvalidArgumentError, match="an engine named 'critic' is already attached"):
        fresh_names(Engine(), "critic")
    critic.close()  # a closed attachment frees its name: a new engine may record under it (and append)
    assert fresh_names(Engine(), "critic") == "critic"


def test_close_leaves_nothing_on_the_engine_and_attaching_again_keeps_its_name(fresh_names, tmp_path):
    """The engine's name is remembered beside it, not on it: after close() the engine holds no attribute of
    ours, a second attach of it records under the same name (its file appended to), and remembering the
    name keeps no dropped engine alive."""
    import gc
    import weakref

    engine = Engine()
    before = set(vars(engine))
    with recorder_for(engine, tmp_path, name=fresh_names(engine, "actor")):
        engine.train_step()
    assert set(vars(engine)) == before
    assert fresh_names(engine, None) == "actor"  # attached again without a name: the same file, appended
    dropped = weakref.ref(engine)
    del engine
    gc.collect()
    assert dropped() is None


def test_two_recorders_in_one_process_write_their_own_files(tmp_path):
    small, large = Engine(), Engine()
    with recorder_for(small, tmp_path) as main, recorder_for(large, tmp_path, name="critic") as critic:
        small.train_step()
        large.train_step()
        large.train_step()
    first, second = main.recorder, critic.recorder
    assert (first.path.name, second.path.name) == ("zero_fetch_rank_3.jsonl", "zero_fetch_critic_rank_3.jsonl")
    assert [r["engine"] for r in read_records(tmp_path)] == ["main"]
    critic = read_records_file(second.path)
    assert [(r["engine"], r["micro_step"]) for r in critic] == [("critic", 0), ("critic", 1)]
