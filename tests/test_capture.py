"""Trace captures (docs/capture.md) in one process: the decision every rank takes from the exchanged rows, the
ranks that matter, the anomaly rules and their bounds, a request taken through a real LiveMetrics and traced by a
real torch.profiler, the config section, the CLI and the gzip readers.  The launcher jobs: test_capture_launcher.py."""
import gc
import gzip
import json
import socket
import time
import weakref
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from ds_profutils.cli import main as cli_main
from ds_profutils.config import ConfigError, ProfilerConfig
from ds_profutils.config.loading import config_from_raw
from ds_profutils.engine.capture import CaptureController, CaptureDecider
from ds_profutils.engine.capture.decide import ANOMALY_LATE_SHARE, late_steps, request_columns, suspects, Request
from ds_profutils.engine.capture.hosts import HOST_KEY, HostDirectory, publish_host
from ds_profutils.engine.capture.tracer import _compress
from ds_profutils.engine.live import LiveMetrics, StepFigures
from ds_profutils.engine.live.interval import interval_straggler, pack_interval
from ds_profutils.outputs import process_identity
from ds_profutils.report.captures import read_captures
from ds_profutils.report.captures.command import write_request
from ds_profutils.report.traces import iter_trace, summarize_trace

STEPS = 5


def settings(**changes):
    values = dict(enabled=True, on_request=True, on_anomaly=True, steps=2, ranks="suspects", max_captures=3,
                  cooldown_steps=100, step_jump=1.5, gzip=False, output_dir=None)
    values.update(changes)
    return config_from_raw({"trace_capture": values}).trace_capture


def step(number, step_ms=100.0, collective_ms=40.0):
    return StepFigures(global_step=number, step_ms=step_ms, iteration_ms=step_ms + 5, gap_ms=5.0, flops=None,
                       tokens=None, samples=4, exposed_wait_ms=collective_ms, collective_ms=collective_ms,
                       peak_allocated_bytes=None)


def interval(first, late=None, step_ms=100.0, ranks=4):
    """Every rank's packed row of one interval; ``late``: the rank the others wait for (it waits 1 ms, they 60)."""
    rows = []
    for rank in range(ranks):
        waited = 40.0 if late is None else (1.0 if rank == late else 60.0)
        rows.append(pack_interval([step(first + i, step_ms, waited + rank * 0.1) for i in range(STEPS)]))
    return rows


NO_COLUMNS = [request_columns(None, -1)] * 4


def test_suspects_are_the_straggler_the_rank_that_waited_most_and_a_median_rank():
    rows = interval(0, late=2)
    chosen = suspects(rows, STEPS, [0, 1, 2, 3])
    assert len(chosen) == 3 and 2 in chosen and chosen[2].startswith("straggler")
    assert chosen[3].startswith("waited most")  # 60.3 ms: the most
    assert [why.split(":")[0] for why in chosen.values()] == ["straggler", "waited most", "median"]
    even = suspects(interval(0), STEPS, [0, 1, 2, 3])
    assert even[0].startswith("slowest") and len(even) == 3  # no straggler: the least arrival figure
    assert list(suspects(interval(0, ranks=1), STEPS, [5])) == [5]


def test_a_straggler_lasting_two_intervals_fires_one_capture_on_every_rank_alike():
    deciders = [CaptureDecider(settings(), [0, 1, 2, 3]) for _ in range(2)]
    for decider in deciders:
        assert decider.decide(0, interval(0), NO_COLUMNS, STEPS, 4, 0) is None
        assert decider.decide(1, interval(5, late=2), NO_COLUMNS, STEPS, 9, 0) is None  # one interval: a hiccup
        plan = decider.decide(2, interval(10, late=2), NO_COLUMNS, STEPS, 14, 0)
        assert plan.reason == "straggler" and plan.first_step == 15 and plan.steps == 2
        assert 2 in plan.ranks and len(plan.ranks) <= 3 and plan.figures["straggler_rank"] == 2
        # the deferred path: the rows are held by every rank two intervals on, the capture starts after that
        assert decider.decide(3, interval(15, late=2), NO_COLUMNS, STEPS, 19, 0) is None  # within the cooldown
    deferred = CaptureDecider(settings(), [0, 1, 2, 3])
    for index in range(3):
        plan = deferred.decide(index, interval(5 * index, late=None if index == 0 else 2), NO_COLUMNS, STEPS,
                               5 * index + 4, 2)
    assert plan.first_step == 14 + 2 * STEPS + 1


def test_an_even_run_fires_nothing_and_anomaly_captures_are_bounded():
    decider = CaptureDecider(settings(), [0, 1, 2, 3])
    assert all(decider.decide(i, interval(5 * i), NO_COLUMNS, STEPS, 5 * i + 4, 0) is None for i in range(30))
    bounded = CaptureDecider(settings(max_captures=1, cooldown_steps=0), [0, 1, 2, 3])
    plans = [bounded.decide(i, interval(5 * i, late=1), NO_COLUMNS, STEPS, 5 * i + 4, 0) for i in range(20)]
    assert [plan.reason for plan in plans if plan] == ["straggler"]
    off = CaptureDecider(settings(on_anomaly=False), [0, 1, 2, 3])
    assert all(off.decide(i, interval(5 * i, late=1), NO_COLUMNS, STEPS, 5 * i + 4, 0) is None for i in range(5))


def measured(first, figures):
    """Every rank's packed row of one interval from ``(step_ms by rank, collective_ms by rank)`` per step."""
    ranks = len(figures[0][0])
    return [pack_interval([step(first + i, times[rank], waits[rank]) for i, (times, waits) in enumerate(figures)])
            for rank in range(ranks)]


# Intervals measured on loaded 4-rank jobs (8 and 12 gloo ranks on 2 cores, test_capture_launcher's capture_job):
# per step each rank's step time and time inside collectives.  Even jobs: the live rule names rank 0 (3 of 5
# steps) and rank 2 (4 of 5), ahead of the next-latest rank by 0-5.1 ms.
EVEN_RANK_0 = [([41.5, 42.4, 41.2, 41.3], [13.4, 18.0, 16.3, 15.6]),
               ([39.3, 40.3, 42.1, 41.2], [10.4, 15.5, 18.4, 17.0]),
               ([42.9, 43.2, 41.9, 43.2], [9.0, 14.3, 13.1, 18.4]), ([35.5, 33.7, 34.7, 34.7], [8.8, 9.1, 11.1, 7.1]),
               ([42.8, 42.2, 42.3, 42.0], [19.2, 13.8, 13.6, 12.3])]
EVEN_RANK_2 = [([43.7, 42.4, 44.2, 44.7], [17.1, 17.1, 21.0, 20.4]),
               ([53.2, 53.0, 52.7, 52.3], [24.0, 24.6, 9.6, 13.3]),
               ([33.6, 34.2, 34.7, 34.7], [9.0, 11.3, 7.7, 7.7]), ([37.1, 37.0, 37.1, 37.1], [12.9, 13.5, 7.9, 8.2]),
               ([34.8, 36.7, 35.0, 35.0], [11.6, 8.6, 5.8, 10.0])]
# The job whose rank 2 sleeps 60 ms more from step 40: two of its intervals, the first with the host's hiccups.
SLOWED_RANK_2 = [
    [([95.5, 99.5, 98.0, 96.8], [70.1, 71.4, 9.5, 68.1]), ([93.0, 93.6, 93.7, 99.4], [67.6, 69.4, 8.4, 70.8]),
     ([152.0, 105.6, 93.8, 120.2], [125.7, 78.6, 9.4, 95.0]),
     ([125.0, 142.1, 145.3, 144.8], [96.3, 113.8, 39.6, 117.6]),
     ([110.9, 112.4, 110.4, 109.2], [75.0, 84.9, 15.5, 73.8])],
    [([93.3, 92.3, 94.3, 95.3], [69.0, 66.6, 9.6, 68.0]), ([99.5, 100.9, 98.6, 99.0], [75.3, 75.7, 14.8, 73.2]),
     ([98.4, 96.4, 98.4, 98.5], [70.9, 73.0, 14.7, 68.8]), ([93.0, 95.5, 94.0, 93.4], [69.3, 68.4, 10.6, 67.3]),
     ([95.9, 96.3, 96.0, 95.6], [68.4, 72.3, 12.3, 70.1])]]


def test_an_even_run_on_a_loaded_host_fires_no_capture_though_the_live_figure_names_a_straggler():
    for figures, named in ((EVEN_RANK_0, 0), (EVEN_RANK_2, 2)):
        assert interval_straggler(measured(0, figures), STEPS) == named  # the live figure: unchanged
        decider = CaptureDecider(settings(), [0, 1, 2, 3])
        assert all(decider.decide(i, measured(5 * i, figures), NO_COLUMNS, STEPS, 5 * i + 4, 0) is None
                   for i in range(10))
    slowed = CaptureDecider(settings(), [0, 1, 2, 3])
    assert slowed.decide(0, measured(40, SLOWED_RANK_2[0]), NO_COLUMNS, STEPS, 44, 0) is None
    plan = slowed.decide(1, measured(45, SLOWED_RANK_2[1]), NO_COLUMNS, STEPS, 49, 0)
    assert plan.reason == "straggler" and plan.figures["straggler_rank"] == 2 and 2 in plan.ranks
    assert plan.figures["late_steps"] == 5 and 52 < plan.figures["late_ms_median"] < 60


def test_a_straggler_fires_only_a_quarter_of_a_step_ahead_of_the_next_rank_in_most_steps():
    def ahead(leads):
        """Rank 1 ahead of the others by ``leads[i]`` ms in step i of 100 ms (they wait 40 ms more than it)."""
        return [([100.0] * 4, [40.0 + (0.0 if rank == 1 else lead + rank * 0.1) for rank in range(4)])
                for lead in leads]

    def fires(leads):
        decider = CaptureDecider(settings(), [0, 1, 2, 3])
        decider.decide(0, measured(0, ahead(leads)), NO_COLUMNS, STEPS, 4, 0)
        return decider.decide(1, measured(5, ahead(leads)), NO_COLUMNS, STEPS, 9, 0) is not None

    share = ANOMALY_LATE_SHARE * 100.0
    assert fires([share + 1] * 3 + [0.0] * 2) and not fires([share - 1] * 3 + [0.0] * 2)
    # named by the live rule in every step (over 10% of the step), a quarter of a step ahead in only two
    assert interval_straggler(measured(0, ahead([share + 1] * 2 + [15.0] * 3)), STEPS) == 1
    assert not fires([share + 1] * 2 + [15.0] * 3) and fires([share + 1] * 3 + [15.0] * 2)
    rows = measured(0, ahead([share + 1] * STEPS))
    rows[3][STEPS] = float("nan")  # rank 3 without the first step's figure: left out, as the step rule leaves it
    assert len(late_steps(rows, STEPS, 1)) == STEPS
    rows[1][STEPS] = float("nan")  # the straggler without it: that step is not late
    assert late_steps(rows, STEPS, 1) == [share + 1] * (STEPS - 1)


def pipeline_interval(first, stages, waited):
    """Pipeline ranks' rows of one interval: rank r in stage ``stages[r]``, ``waited[r]`` ms a step inside collectives
    (a stage waits for the others in p2p, which is not in that figure)."""
    return [pack_interval([StepFigures(global_step=first + i, step_ms=100.0, iteration_ms=105.0, gap_ms=5.0, flops=None,
                                       tokens=None, samples=4, exposed_wait_ms=wait, collective_ms=wait,
                                       peak_allocated_bytes=None, pipe_stage=stage, compute_ms=50.0, bubble_ms=40.0)
                           for i in range(STEPS)]) for stage, wait in zip(stages, waited)]


def test_a_pipeline_ranks_are_compared_within_their_stage_for_anomaly_captures_and_suspects():
    def fired(stages, waited):
        decider = CaptureDecider(settings(), list(range(len(stages))))
        decider.decide(0, pipeline_interval(0, stages, waited), NO_COLUMNS, STEPS, 4, 0)
        return decider.decide(1, pipeline_interval(5, stages, waited), NO_COLUMNS, STEPS, 9, 0)

    # 3 stages of one rank: the middle one issues no collective (tied embeddings' all-reduce is the first and last
    # stage's); across stages it would be a straggler a step after step, within its stage there is none
    assert fired([0, 1, 2], [40.0, 0.0, 40.1]) is None
    # 2 stages of 2 ranks: rank 0 makes its stage peer wait 60 ms; the other stage waits in p2p, not in collectives
    plan = fired([0, 0, 1, 1], [1.0, 61.0, 0.5, 0.6])
    assert plan.reason == "straggler" and plan.figures["straggler_rank"] == 0
    chosen = suspects(pipeline_interval(0, [0, 0, 1, 1], [1.0, 61.0, 0.5, 0.6]), STEPS, [0, 1, 2, 3])
    assert chosen[0].startswith("straggler")


def test_a_step_jump_fires_against_the_run_median_so_far():
    decider = CaptureDecider(settings(), [0, 1])
    # 1.4x: below step_jump; one interval at 2x: a hiccup; then two in a row
    for index, step_ms in enumerate([100.0, 104.0, 98.0, 140.0, 200.0, 100.0, 102.0, 160.0]):
        assert decider.decide(index, interval(5 * index, step_ms=step_ms, ranks=2), NO_COLUMNS[:2], STEPS,
                              5 * index + 4, 0) is None
    plan = decider.decide(8, interval(40, step_ms=170.0, ranks=2), NO_COLUMNS[:2], STEPS, 44, 0)
    assert plan.reason == "step_jump" and plan.figures["slowest_median_step_ms"] == 170.0
    assert plan.figures["run_median_step_ms"] == 103.0


def test_requests_name_their_ranks_and_are_refused_with_the_reason_while_a_capture_runs():
    decider = CaptureDecider(settings(max_captures=2), [0, 1, 2, 3])
    listed = [request_columns(Request(1, 3, [1, 3]), -1)] + NO_COLUMNS[1:]
    plan = decider.decide(0, interval(0), listed, STEPS, 4, 0)
    assert (plan.reason, plan.ranks, plan.steps, plan.first_step, plan.request_number) == ("request", [1, 3], 3, 5, 1)
    every = [request_columns(Request(2, 2, None), -1)] + NO_COLUMNS[1:]
    assert "capture is running" in decider.decide(1, interval(5), every, STEPS, 6, 0)
    assert decider.decide(2, interval(10), every, STEPS, 14, 0).ranks == [0, 1, 2, 3]
    assert "max_captures" in decider.decide(3, interval(15), every, STEPS, 19, 0)


class Engine:
    """What the controller reads of an engine: its global step count (held weakly, as the hooks hold it)."""

    global_steps = 0


def run_steps(live, controller, engine, count):
    for _ in range(count):
        controller.forward_started(None, (), {})
        torch.ones(8, 8).matmul(torch.ones(8, 8))
        number = engine.global_steps
        engine.global_steps += 1
        live.step_finished(step(number))
        controller.optimizer_step_ended(number)


def armed(out, name="main", defer=None, **changes):
    """(engine, live metrics, capture controller) riding on them, capturing into ``out``, as attach puts them."""
    engine = Engine()
    live = LiveMetrics(SimpleNamespace(monitor_interval=STEPS, console=False), None, [], defer=defer)
    controller = CaptureController(engine, name, settings(output_dir=str(out), **changes),
                                   ProfilerConfig(with_flops=False), process_identity(), live.group_rank,
                                   live.group_ranks)
    live.rider = controller
    return engine, live, controller


def test_an_empty_row_saying_stop_leaves_the_capture_rider_working(tmp_path, ds_caplog):
    """A rank whose live figures fail sends an empty row (NaN capture columns too) saying stop: the captures read
    it as saying nothing, and fail not."""
    engine, live, controller = armed(tmp_path, ranks="all")
    run_steps(live, controller, engine, 4)

    def failing_row(steps):
        raise RuntimeError("an allocation of ours")

    live._row = failing_row
    run_steps(live, controller, engine, 1)  # the interval's end: the empty row
    assert live.stopped and not controller._failed
    assert "trace capture failed" not in ds_caplog.text


@pytest.mark.parametrize("compressed", [False, True])
def test_a_request_is_taken_once_decided_through_the_exchange_and_traced_exactly(tmp_path, compressed):
    engine, live, controller = armed(tmp_path, gzip=compressed, ranks="all")
    run_steps(live, controller, engine, 7)
    request = write_request(tmp_path, 2, "all")
    run_steps(live, controller, engine, 3)  # the interval ends after step 9: taken, decided, S = 10
    assert not (tmp_path / "capture_request.json").exists() and (tmp_path / "capture_request.taken.1.json").exists()
    folder = tmp_path / "capture_10"
    announced = json.loads((folder / "manifest.json").read_text())
    assert announced["done"] is False and announced["hosts"] == {"0": socket.gethostname()}
    run_steps(live, controller, engine, 10)  # 10, 11 traced; the next exchange says rank 0 wrote
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (manifest["reason"], manifest["first_step"], manifest["ranks"], manifest["done"]) == ("request", 10,
                                                                                                [0], True)
    assert manifest["hosts"] == {"0": socket.gethostname()}  # no torch.distributed: rank 0 knows its own
    assert manifest["request_id"] == request["id"]
    trace = folder / ("trace_rank_0.json.gz" if compressed else "trace_rank_0.json")
    assert [entry["step"] for entry in summarize_trace(trace)["steps"]] == [10, 11]
    assert [path.name for path in tmp_path.iterdir() if "trace" in path.name] == []
    assert [capture["folder"].name for capture in read_captures(tmp_path)] == ["capture_10"]
    engine_ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert engine_ref() is None  # the controller and the live figures, still open, hold the engine weakly
    live.close()
    controller.close()


@pytest.mark.parametrize("compressed", [False, True])
def test_a_capture_the_disk_had_no_room_for_says_so_leaves_no_file_and_is_this_ranks_last(tmp_path, monkeypatch,
                                                                                          ds_caplog, compressed):
    """Kineto on a full disk says so on stderr only and leaves its own temporary file: the ERROR line names the full
    disk, nothing is left using the space, and the rank takes no further capture (docs/capture.md)."""
    from ds_profutils.torch_profiler import writer

    exports = []

    def full_disk(self, path, use_python_export=False):
        exports.append(path)
        open(f"{path}.tmp", "wb").close()

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", full_disk)
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda path: SimpleNamespace(total=10, used=10, free=0))
    engine, live, controller = armed(tmp_path, gzip=compressed, ranks="all")
    run_steps(live, controller, engine, 7)
    write_request(tmp_path, 2, "all")
    run_steps(live, controller, engine, 8)  # captured 10-11, its write failed
    assert ds_caplog.text.count("ERROR") == 1, ds_caplog.text
    assert "the trace exporter wrote no file (No space left on device)); no further captures here" in ds_caplog.text
    assert sorted(path.name for path in (tmp_path / "capture_10").iterdir()) == ["manifest.json"]
    write_request(tmp_path, 2, "all")
    run_steps(live, controller, engine, 10)  # taken and decided (rank 0 takes requests for every rank); not traced here
    assert not (tmp_path / "capture_request.json").exists() and (tmp_path / "capture_request.taken.2.json").exists()
    assert len(exports) == 1 and not controller.capturing
    assert ds_caplog.text.count("ERROR") == 1, ds_caplog.text
    live.close()
    controller.close()


def test_a_capture_running_at_the_end_is_written_with_its_steps_so_far(tmp_path):
    engine, live, controller = armed(tmp_path, "critic", steps=50)
    write_request(tmp_path, 50, "suspects")
    run_steps(live, controller, engine, 8)
    assert controller.capturing
    controller.close()
    assert [entry["step"] for entry in summarize_trace(tmp_path / "capture_critic_5" / "trace_rank_0.json")["steps"]] == [
        5, 6, 7]


def test_the_config_section_its_defaults_its_environment_and_its_checks(monkeypatch):
    capture = config_from_raw({}).trace_capture
    assert (capture.enabled, capture.output_dir, capture.on_request, capture.on_anomaly, capture.steps, capture.ranks,
            capture.max_captures, capture.cooldown_steps, capture.step_jump, capture.gzip) == (
        False, None, True, False, 2, "suspects", 3, 100, 1.5, False)
    assert config_from_raw({"trace_capture": {"ranks": "all"}}).trace_capture.ranks is None
    monkeypatch.setenv("DS_PROFUTILS_TRACE_CAPTURE_RANKS", "3,0")
    monkeypatch.setenv("DS_PROFUTILS_TRACE_CAPTURE_STEP_JUMP", "2.5")
    capture = config_from_raw({"trace_capture": {"enabled": True}}).trace_capture
    assert (capture.ranks, capture.step_jump) == ([0, 3], 2.5)
    monkeypatch.delenv("DS_PROFUTILS_TRACE_CAPTURE_RANKS")
    monkeypatch.delenv("DS_PROFUTILS_TRACE_CAPTURE_STEP_JUMP")
    for bad in ({"ranks": "some"}, {"ranks": [60]}, {"steps": 0}, {"step_jump": 1.0}, {"gzip": "yes"}, {"every": 1}):
        with pytest.raises(ConfigError):
            config_from_raw({"trace_capture": bad})


def test_check_config_names_a_capture_rank_outside_the_world_and_what_runs_without_step_metrics(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"trace_capture": {"enabled": True, "ranks": [0, 5]}}))
    assert cli_main(["check-config", "--world-size", "4", str(path)]) != 0
    assert "trace_capture.ranks: ranks [5] are outside the world size 4" in capsys.readouterr().err
    assert cli_main(["check-config", "--world-size", "8", str(path)]) == 0
    assert "note: trace_capture runs the live exchange every 10 steps" in capsys.readouterr().out


@pytest.mark.parametrize("ranks", ["x", 3, ["a", 1]])
def test_a_capture_ranks_value_of_no_allowed_shape_is_one_line_naming_the_key(tmp_path, capsys, ranks):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"trace_capture": {"enabled": True, "ranks": ranks}}))
    assert cli_main(["check-config", str(path)]) != 0
    assert capsys.readouterr().err == (f"{path}: trace_capture.ranks: {json.dumps(ranks)} is not allowed; expected "
                                       '"suspects", "all" or null (every rank), or global ranks: a list of integers '
                                       'or "0,3"\n')


def test_check_config_checks_the_step_metrics_output_dir_a_capture_writes_to(tmp_path, capsys):
    """A capture with its output_dir null writes to step_metrics' output_dir, checked even with step_metrics off."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"trace_capture": {"enabled": True}, "step_metrics": {"output_dir": str(blocker)}}))
    assert cli_main(["check-config", str(path)]) != 0
    assert capsys.readouterr().err.startswith(f"{path}: trace_capture.output_dir (null: step_metrics.output_dir): ")


def test_capture_says_plainly_when_no_job_took_the_request_and_withdraws_it(tmp_path, capsys):
    assert cli_main(["capture", str(tmp_path), "--steps", "2", "--ranks", "0,3", "--wait", "1"]) == 1
    assert "no job took the request within 1 s" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert cli_main(["capture", str(tmp_path / "missing")]) == 1


def test_a_gzip_trace_cut_short_reads_up_to_the_cut(tmp_path):
    events = [{"ph": "X", "name": f"ProfilerStep#{n}", "ts": n * 10, "dur": 5, "pid": 1, "tid": 1}
              for n in range(20000)]
    plain = tmp_path / "plain.json"
    plain.write_text('{"baseTimeNanoseconds": 1,\n"traceEvents": [\n' +
                     ",\n".join(json.dumps(event) for event in events) + "\n]}\n")
    packed = tmp_path / "trace_rank_0.json.gz"
    _compress(plain, packed)
    assert sum(kind == "event" for kind, _ in iter_trace(packed)) == 20000
    whole = packed.read_bytes()
    packed.write_bytes(whole[:len(whole) * 2 // 3])
    read = 0
    with pytest.raises(ValueError, match="truncated"):
        for kind, _ in iter_trace(packed):
            read += kind == "event"
    assert 1000 < read < 20000
    assert gzip.decompress(whole).startswith(b'{"baseTimeNanoseconds"')


def test_a_profiler_window_starting_inside_a_capture_is_skipped_and_a_capture_waits_for_no_window(tmp_path, caplog):
    """One torch profiler at a time: the fixed window whose start falls inside a capture is skipped with one line;
    a capture whose first step comes while a window is open is skipped on that rank, the window going first."""
    from ds_profutils.torch_profiler.calls import advance, finish_run, start_run
    from ds_profutils.torch_profiler.recording import set_capture_recording

    window = ProfilerConfig(output_dir=str(tmp_path / "window"), skip_first=0, wait=1, warmup=1, active=1,
                            with_flops=False)
    set_capture_recording(True)
    try:
        run = start_run(window)
        for _ in range(4):
            advance(run)
        finish_run(run, None, summary=False)
    finally:
        set_capture_recording(False)
    assert "the window of cycle 0, beginning at step 1, is skipped: a trace capture is recording" in caplog.text
    assert not list((tmp_path / "window").glob("trace_rank_*"))

    engine, live, controller = armed(tmp_path)
    write_request(tmp_path, 2, "all")
    run_steps(live, controller, engine, 5)  # S = 5
    run = start_run(window.model_copy(update=dict(wait=4)))  # its warmup at step 4, active at 5
    for _ in range(5):
        advance(run)
    assert run.window_open
    run_steps(live, controller, engine, 3)
    finish_run(run, None, summary=False)
    assert "capture at step 5 skipped on this rank: a \"profiler\" window is open" in caplog.text
    assert not list((tmp_path / "capture_5").glob("trace_rank_*"))
    assert list((tmp_path / "window").glob("trace_rank_*"))


EXIT_SCRIPT = """
import sys
from types import SimpleNamespace
sys.path.insert(0, {tests!r})
from test_capture import armed, run_steps
from ds_profutils.report.captures.command import write_request
engine, live, controller = armed({out!r}, steps=50)
write_request(__import__("pathlib").Path({out!r}), 50, "all")
run_steps(live, controller, engine, 7)
print("exiting without close", flush=True)
"""


def test_a_capture_recording_when_the_process_exits_without_close_is_written(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = EXIT_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "exiting without close" in done.stdout, done.stderr[-2000:]
    assert "cut short: 50 asked" in done.stdout
    summary = summarize_trace(tmp_path / "capture_5" / "trace_rank_0.json")
    assert [entry["step"] for entry in summary["steps"]] == [5, 6]


def test_on_the_deferred_path_a_request_starts_two_intervals_on_and_rows_read_at_close_start_nothing(tmp_path):
    """A one-rank gloo group read the deferred way (as on an accelerator): interval k's rows are held by every rank
    at the boundary of k + 2, so the capture starts at the step after it; one decided but not begun when the job
    ends leaves no folder."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        engine, live, controller = armed(tmp_path, defer=True, ranks="all")
        write_request(tmp_path, 2, "all")
        run_steps(live, controller, engine, 5)  # taken into the row of the interval ending after step 4
        run_steps(live, controller, engine, 17)
        assert [entry["step"] for entry in summarize_trace(tmp_path / "capture_15" / "trace_rank_0.json")["steps"]] == [
            15, 16]
        write_request(tmp_path, 2, "all")
        run_steps(live, controller, engine, 3)  # the interval ending after step 24 takes it: S = 35, never reached
        # taken now; decided once that exchange's rows are read (at once if the all-gather is already complete,
        # else at a later boundary or at close: on the deferred path either may come first, so only the taking is
        # certain here)
        assert (tmp_path / "capture_request.taken.2.json").exists()
        controller.close()
        live.close()
        assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith("capture_")) == [
            "capture_15", "capture_request.taken.1.json", "capture_request.taken.2.json"]
    finally:
        dist.destroy_process_group()


def test_a_request_while_a_capture_runs_is_refused_with_the_reason_that_capture_wait_prints(tmp_path, capsys):
    from ds_profutils.report.captures.command import _wait

    engine, live, controller = armed(tmp_path, steps=8)
    write_request(tmp_path, 8, "all")
    run_steps(live, controller, engine, 7)  # S = 5, tracing 5..12
    second = write_request(tmp_path, 2, "all")
    run_steps(live, controller, engine, 3)  # taken after step 9: the capture runs
    assert _wait(tmp_path, second, 5) == 1
    assert "the job refused the request: a capture is running (steps up to 12)" in capsys.readouterr().err
    controller.close()


def test_report_lists_the_captures_with_their_reasons_and_why_each_rank(tmp_path, capsys):
    folder = tmp_path / "capture_critic_40"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({
        "reason": "straggler", "first_step": 40, "steps": 2, "ranks": [2, 3], "done": False,
        "why_these_ranks": {"2": "straggler: the others waited for it", "3": "waited most"},
        "figures": {"straggler_rank": 2}}))
    (folder / "trace_rank_2.json.gz").write_bytes(gzip.compress(b'{"traceEvents": []}'))
    (tmp_path / "capture_7").mkdir()  # no manifest (yet)
    assert cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "capture_7: no manifest, steps ?" in out
    assert ("capture_critic_40: straggler, steps 40-41, ranks [2, 3], traces of ranks [2] (not confirmed by every "
            "chosen rank)") in out
    assert "rank 2: straggler: the others waited for it" in out and 'fired by: {"straggler_rank": 2}' in out
    assert cli_main(["report", "--json", str(tmp_path)]) == 0
    listed = json.loads(capsys.readouterr().out)["captures"]
    assert [(capture.get("reason"), capture["traces"]) for capture in listed] == [(None, []), ("straggler", [2])]


def test_report_says_which_host_holds_which_ranks_trace_only_when_the_ranks_span_hosts(tmp_path, capsys):
    for step, hosts in ((4, {"0": "node-a", "1": "node-a", "2": "node-b", "3": None}), (9, {"0": "node-a", "2": "node-a"})):
        (tmp_path / f"capture_{step}").mkdir()
        (tmp_path / f"capture_{step}" / "manifest.json").write_text(json.dumps({
            "reason": "request", "first_step": step, "steps": 1, "ranks": [int(rank) for rank in hosts],
            "hosts": hosts, "done": True}))
    assert cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("    traces on hosts: node-a ranks [0, 1]; node-b ranks [2]; host unknown ranks [3] (each host writes its "
            "ranks' traces into its own capture_4/)") in out
    assert out.count("traces on hosts") == 1  # capture_9: one host
    assert cli_main(["report", "--json", str(tmp_path)]) == 0
    assert [capture["hosts"] for capture in json.loads(capsys.readouterr().out)["captures"]][0]["2"] == "node-b"


def test_rank_0_reads_the_hosts_from_the_store_a_missing_key_is_null_at_once_and_a_failure_is_said_once(
        tmp_path, caplog, monkeypatch):
    """No collective: each rank sets its host in the default store at attach, rank 0 reads the chosen ranks' keys;
    a rank whose key is missing reads as null without waiting the store's timeout (60 s here)."""
    import torch.distributed as dist
    from ds_profutils.engine.capture import hosts as hosts_module

    identity = process_identity()
    assert HostDirectory(identity).hosts([identity.rank, 1]) == {"0": identity.host, "1": None}  # no store
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        identity = process_identity()
        publish_host(identity)
        store = dist.distributed_c10d._get_default_store()
        assert store.get(HOST_KEY.format(rank=0)).decode() == socket.gethostname()
        store.set(HOST_KEY.format(rank=2), "node-b")
        directory = HostDirectory(identity)
        began = time.monotonic()
        assert directory.hosts([0, 2, 3]) == {"0": socket.gethostname(), "2": "node-b", "3": None}
        assert time.monotonic() - began < 5
        store.set(HOST_KEY.format(rank=3), "node-c")  # published late: read at the next manifest
        assert directory.hosts([2, 3]) == {"2": "node-b", "3": "node-c"}
        assert HostDirectory(identity).hosts([0, 2, 3]) == {"0": socket.gethostname(), "2": "node-b", "3": "node-c"}

        def broken():
            raise RuntimeError("the store's server is gone")

        monkeypatch.setattr(hosts_module, "_default_store", broken)
        publish_host(identity)
        failing = HostDirectory(identity)
        assert failing.hosts([0, 5]) == {"0": socket.gethostname(), "5": None}
        assert failing.hosts([6]) == {"6": None}  # not tried again
        assert caplog.text.count("host could not be set in torch.distributed's store (RuntimeError") == 1
        assert caplog.text.count("the hosts of ranks [5] could not be read") == 1
        assert "ranks [6]" not in caplog.text
    finally:
        dist.destroy_process_group()


ATTACH_SCRIPT = """
import json, sys
import deepspeed, torch
import ds_profutils
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Linear(8, 1)
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
          "zero_optimization": {"stage": 2}, "step_metrics": {"monitor_interval": 3, "output_dir": sys.argv[1]},
          "trace_capture": {"enabled": True}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
attachment = ds_profutils.attach(engine)
found = {"interval": attachment.live.interval, "sinks": len(attachment.live.sinks), "rider": type(attachment.live.rider).__name__,
         "memory": attachment.recorder.memory is None, "flops": attachment.recorder.flops is None,
         "writes": attachment.recorder.writes,
         "host": torch.distributed.distributed_c10d._get_default_store().get("ds_profutils/host/0").decode()}
attachment.close()
print("FOUND " + json.dumps(found), flush=True)
torch.distributed.destroy_process_group()
"""


def test_trace_capture_alone_runs_the_exchange_at_monitor_interval_with_no_records_sinks_flops_or_peak_resets(
        tmp_path):
    from launcher import run_one_rank

    done = run_one_rank(["-c", ATTACH_SCRIPT, str(tmp_path)])
    found = json.loads(done.stdout.split("FOUND ")[1].splitlines()[0])
    assert found == {"interval": 3, "sinks": 0, "rider": "CaptureController", "memory": True, "flops": True,
                     "writes": False, "host": socket.gethostname()}  # set at attach for rank 0's manifests
    assert not list(tmp_path.glob("zero_fetch_*"))


def test_a_capture_that_cannot_start_is_one_error_and_holds_no_profiler_window_back(tmp_path, caplog, monkeypatch):
    from ds_profutils.torch_profiler import recording

    def refuse(self, identity):
        raise RuntimeError("the profiler is busy elsewhere")

    monkeypatch.setattr(recording.WindowRecording, "start", refuse)
    engine, live, controller = armed(tmp_path)
    write_request(tmp_path, 2, "all")
    run_steps(live, controller, engine, 8)
    assert "trace capture failed on this rank (RuntimeError: the profiler is busy elsewhere)" in caplog.text
    assert not recording.capture_recording() and not controller.capturing
    controller.close()
