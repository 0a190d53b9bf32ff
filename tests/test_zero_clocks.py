"""Fetch records on the device clock, and collectives timed on their own streams, on the stand-in engine of
test_zero_attach (the real ZeRO-3 engine with the same stand-in accelerator runs in test_zero_fidelity).

Two stand-in devices: :mod:`stream_clock`'s, whose streams keep their own clocks (a misplaced event gives
a wrong figure), and :class:`FakeDevice`, whose events complete only when the test says (records wait
for their device times, pools run dry, devices hang).
"""
import time

import deepspeed
import pytest
import torch
from deepspeed.accelerator import set_accelerator

import deepspeed.accelerator.real_accelerator as installed
from ds_profutils.engine import collectives, recorder as recorder_module
from ds_profutils._device_clock import DeviceEvents
from stream_clock import StandInStream, StreamClockAccelerator, simulate_collectives
from report_testing import read_records_file
from test_zero_attach import Engine, read_records, recorder_for


class FakeDevice:
    """A device whose clock advances ``tick_ms`` at every event recorded, and whose events complete only up
    to ``completed`` (all, unless a test holds them back) -- or when synchronized."""

    def __init__(self, tick_ms=1.0):
        self.tick_ms = tick_ms
        self.now_ms = 0.0
        self.recorded = 0
        self.completed = None  # None: every event completes at once
        self.synchronized = 0

    def event(self, enable_timing=False):
        return FakeEvent(self)


class FakeEvent:

    def __init__(self, device):
        self.device = device
        self.index = None
        self.time_ms = None

    def record(self):
        device = self.device
        device.now_ms += device.tick_ms
        self.time_ms, self.index = device.now_ms, device.recorded
        device.recorded += 1

    def query(self):
        completed = self.device.completed
        return completed is None or self.index < completed

    def synchronize(self):
        self.device.synchronized += 1
        if self.device.completed is not None:
            self.device.completed = max(self.device.completed, self.index + 1)

    def elapsed_time(self, end):
        assert self.query() and end.query(), "elapsed_time read before the events completed"
        return end.time_ms - self.time_ms


@pytest.fixture
def device():
    return FakeDevice()


@pytest.fixture
def accelerator():
    """The stream-clock stand-in, installed as DeepSpeed's accelerator for the test."""
    previous = installed.ds_accelerator
    stand_in = StreamClockAccelerator()
    set_accelerator(stand_in)
    yield stand_in
    installed.ds_accelerator = previous


FORWARD_MS, WAIT_MS, STEP_MS = 2.0, 3.0, 1.0


def on_device(engine, accelerator):
    """The stand-in engine's work on the device: its forward computes FORWARD_MS, each fetch wait stalls the
    compute stream WAIT_MS (an all-gather it waits for), its optimizer step computes STEP_MS."""
    coordinator, step = engine.coordinator, engine.step

    def fetch(name, numel):
        profiler = coordinator._PartitionedParameterCoordinator__profiler
        profiler.start_event(name)
        if name.endswith("fetch_wait"):
            accelerator.advance(WAIT_MS)
        profiler.stop_event(name, numel)

    def stepped():
        accelerator.advance(STEP_MS)
        step()

    coordinator.fetch = fetch
    engine.step = stepped
    engine.module.register_forward_hook(lambda *_: accelerator.advance(FORWARD_MS))
    return engine


def test_fetch_waits_and_step_time_are_the_compute_streams_times(tmp_path, accelerator):
    engine = on_device(Engine(), accelerator)
    side = StandInStream("side")
    with recorder_for(engine, tmp_path, device_events=DeviceEvents(accelerator.Event)):
        engine.train_step()
        accelerator.advance(50.0, side)  # another stream's work is no part of this step's times
    (record, ) = read_records(tmp_path)
    assert record["clock"] == "device"
    for name in ("forward_fetch_wait", "backward_fetch_wait"):
        entry = record["events"][name]
        assert (entry["clock"], entry["time_ms"], entry["min_ms"], entry["max_ms"]) == ("device", WAIT_MS, WAIT_MS,
                                                                                         WAIT_MS)
        assert 0 <= entry["host_time_ms"] < 1.0  # the host's own measure, kept beside
    assert record["fetch_wait_ms"] == 2 * WAIT_MS == record["exposed_wait_ms"]
    gather = record["events"]["forward_all_gather"]  # a launch: host clock
    assert gather["clock"] == "host" and "host_time_ms" not in gather
    assert record["step_time_ms"] == FORWARD_MS + 2 * WAIT_MS + STEP_MS and record["device_waits"] == 0


class FakeBackend:
    """deepspeed.comm's backend as DeepSpeed 0.19's TorchBackend calls it (async_op positional)."""

    def __init__(self):
        self.calls = []

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self.calls.append(("all_reduce", async_op))
        return _Done() if async_op else None

    def reduce_scatter_tensor(self, output_tensor, input_tensor, op=None, group=None, async_op=False):
        self.calls.append(("reduce_scatter_tensor", async_op))

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        self.calls.append(("all_gather_into_tensor", async_op))
        return _Done() if async_op else None


class _Done:

    def wait(self):
        return True


@pytest.fixture
def backend(monkeypatch):
    backend = FakeBackend()
    monkeypatch.setattr(deepspeed.comm.comm, "cdb", backend)
    return backend


ALL_REDUCE_MS, REDUCE_SCATTER_MS, ALL_GATHER_MS, BETWEEN_MS = 5.0, 7.0, 4.0, 2.5


def one_step_of_collectives(engine, accelerator, backend):
    """A train step whose forward makes: a blocking all-reduce on the compute stream, a reduce-scatter on a
    side stream (overlap_comm), and an async all-gather launched on the compute stream and waited for after
    BETWEEN_MS of compute (so the compute stream stalls ALL_GATHER_MS - BETWEEN_MS)."""
    tensor, side = torch.ones(2), StandInStream("reduce_and_partition_stream")
    engine.module.train()
    engine.forward()
    backend.all_reduce(tensor, None, None, False)  # positional, as DeepSpeed passes it
    with accelerator.stream(side):
        backend.reduce_scatter_tensor(tensor, tensor, None, None, False)
    handle = backend.all_gather_into_tensor(tensor, tensor, None, True)
    accelerator.advance(BETWEEN_MS)
    handle.wait()
    engine.backward()
    engine.step()
    backend.all_reduce(tensor)  # between steps: no record is open


def simulated(accelerator, backend):
    simulate_collectives(accelerator, backend, {"all_reduce": ALL_REDUCE_MS, "reduce_scatter_tensor": REDUCE_SCATTER_MS,
                                                "all_gather_into_tensor": ALL_GATHER_MS},
                         collectives.ASYNC_OP_POSITION)


def test_every_collective_is_timed_on_its_own_stream(tmp_path, accelerator, backend):
    simulated(accelerator, backend)
    engine = on_device(Engine(), accelerator)
    with recorder_for(engine, tmp_path, device_events=DeviceEvents(accelerator.Event)):
        one_step_of_collectives(engine, accelerator, backend)
    (record, ) = read_records(tmp_path)
    assert record["collectives"] == {
        "all_reduce": {"count": 1, "async": 0, "time_ms": ALL_REDUCE_MS, "exposed_ms": ALL_REDUCE_MS,
                       "stream": "compute", "clock": "device"},
        "reduce_scatter_tensor@side-stream": {"count": 1, "async": 0, "time_ms": REDUCE_SCATTER_MS, "exposed_ms": 0.0,
                                              "stream": "side", "clock": "device"},
        "all_gather_into_tensor": {"count": 1, "async": 1, "time_ms": ALL_GATHER_MS, "exposed_ms": 0.0,
                                   "stream": "compute", "clock": "device"},
    }
    # Time inside collectives, waiting for late peers included, against what stalled the compute stream; on the
    # step's axis the side stream's reduce-scatter (0-7 ms) overlaps the all-reduce (5-10 ms, after the forward
    # and its fetch wait) and their 2 ms in common count once, then the all-gather (10-14 ms).
    assert record["collective_ms"] == 14.0 <= record["step_time_ms"]
    assert record["collective_wait_ms"] == ALL_REDUCE_MS
    assert record["exposed_wait_ms"] == record["fetch_wait_ms"] + ALL_REDUCE_MS
    assert "all_reduce" not in vars(backend) or vars(backend)["all_reduce"].__name__ == "call"  # the simulation's


def test_a_misplaced_event_gives_a_wrong_figure(tmp_path, accelerator, backend, monkeypatch):
    """The stand-in can tell: with every event recorded on the compute stream (not the collective's own),
    the side stream's reduce-scatter comes out wrong."""
    simulated(accelerator, backend)
    events = DeviceEvents(accelerator.Event)
    mark = events.mark

    def on_the_compute_stream():
        with accelerator.stream(accelerator.compute):
            return mark()

    monkeypatch.setattr(events, "mark", on_the_compute_stream)
    engine = on_device(Engine(), accelerator)
    with recorder_for(engine, tmp_path, device_events=events):
        one_step_of_collectives(engine, accelerator, backend)
    (record, ) = read_records(tmp_path)
    assert record["collectives"]["reduce_scatter_tensor@side-stream"]["time_ms"] != REDUCE_SCATTER_MS


COMPUTE_MS = 10.0


def record_of_a_step_doing(between_forward_and_backward, tmp_path, accelerator, backend):
    """The record of one simulated device step that runs ``between_forward_and_backward(gather)`` after its
    forward, ``gather()`` launching a 4 ms async all-gather and returning its handle."""
    simulated(accelerator, backend)
    engine = on_device(Engine(), accelerator)
    tensor = torch.ones(2)
    with recorder_for(engine, tmp_path, device_events=DeviceEvents(accelerator.Event)):
        engine.module.train()
        engine.forward()
        between_forward_and_backward(lambda: backend.all_gather_into_tensor(tensor, tensor, None, True))
        engine.backward()
        engine.step()
    (record, ) = read_records(tmp_path)
    return record


def test_an_async_collective_is_its_own_time_however_late_it_is_waited_for(tmp_path, accelerator, backend):
    """A 4 ms gather launched, 10 ms of compute, then the wait: the gather took 4 ms, not the 10 ms between."""

    def gather_compute_wait(gather):
        handle = gather()
        accelerator.advance(COMPUTE_MS)
        handle.wait()

    record = record_of_a_step_doing(gather_compute_wait, tmp_path, accelerator, backend)
    gather = record["collectives"]["all_gather_into_tensor"]
    assert gather == {"count": 1, "async": 1, "time_ms": ALL_GATHER_MS, "exposed_ms": 0.0, "stream": "compute",
                      "clock": "device"}
    assert record["collective_ms"] == ALL_GATHER_MS


def test_overlapping_collectives_count_once_on_the_steps_time_axis(tmp_path, accelerator, backend):
    """Two 4 ms gathers launched 1 ms apart cover 5 ms of the step, not 8: ``collective_ms`` stays within it."""

    def two_gathers_1_ms_apart(gather):
        first = gather()
        accelerator.advance(1.0)
        second = gather()
        first.wait()
        second.wait()

    record = record_of_a_step_doing(two_gathers_1_ms_apart, tmp_path, accelerator, backend)
    assert record["collectives"]["all_gather_into_tensor"]["time_ms"] == 2 * ALL_GATHER_MS  # each its own 4 ms
    assert record["collective_ms"] == ALL_GATHER_MS + 1.0 <= record["step_time_ms"]


def test_on_the_host_clock_async_collectives_count_their_wait(tmp_path, backend, monkeypatch):
    """CPU: blocking calls are timed around the call, async ones by the time blocked in wait()."""
    import types

    tensor = torch.ones(2)
    handle = types.SimpleNamespace(wait=lambda: time.sleep(0.03))
    monkeypatch.setattr(backend, "all_gather_into_tensor", lambda *args, **kwargs: handle, raising=False)
    monkeypatch.setattr(backend, "all_reduce", lambda *args, **kwargs: time.sleep(0.02), raising=False)
    engine = Engine()
    with recorder_for(engine, tmp_path):
        engine.forward()
        launched = backend.all_gather_into_tensor(tensor, tensor, None, True)
        time.sleep(0.05)  # compute between launch and wait is not inside the collective
        waiting = time.perf_counter()
        launched.wait()
        waited_ms = (time.perf_counter() - waiting) * 1e3  # what load stretches the 30 ms sleep to
        backend.all_reduce(tensor, None, None, False)
        engine.backward()
        engine.step()
    (record, ) = read_records(tmp_path)
    gather, reduce = record["collectives"]["all_gather_into_tensor"], record["collectives"]["all_reduce"]
    assert gather["clock"] == reduce["clock"] == "host" and gather["async"] == 1
    # The time blocked in wait(), measured around it here (launch to wait would hold the 50 ms between too).
    assert 30 <= gather["time_ms"] <= waited_ms and gather["exposed_ms"] == 0  # its stall is a fetch wait in ZeRO-3
    assert 20 <= reduce["time_ms"] == reduce["exposed_ms"]
    assert record["collective_ms"] == pytest.approx(gather["time_ms"] + reduce["time_ms"])
    assert record["collective_wait_ms"] == reduce["time_ms"]


def test_an_eval_record_holds_its_own_forwards_collectives_not_what_follows(tmp_path, backend):
    """RLHF: a reference model's eval forward, then the actor trains; the actor's gradient collectives are
    not the reference's (the eval record stays open until its engine's next forward)."""
    reference, tensor = Engine(), torch.ones(2)
    with recorder_for(reference, tmp_path):
        reference.module.eval()
        reference.forward()
        backend.all_reduce(tensor, None, None, False)  # after the forward: another engine's step
        reference.forward()
    (first, second) = read_records(tmp_path)
    assert first["mode"] == "eval" and first["collectives"] == {} and first["collective_ms"] == 0


def test_the_compute_stream_is_the_one_the_forward_started_on(tmp_path, accelerator, backend):
    """A job that runs its steps in a stream of its own: its collectives are on the compute stream."""
    simulated(accelerator, backend)
    engine, tensor = on_device(Engine(), accelerator), torch.ones(2)
    job_stream = StandInStream("the job's stream")
    with recorder_for(engine, tmp_path, device_events=DeviceEvents(accelerator.Event)):
        with accelerator.stream(job_stream):
            engine.forward()
            backend.all_reduce(tensor, None, None, False)
            engine.backward()
            engine.step()
    (record, ) = read_records(tmp_path)
    assert record["collectives"]["all_reduce"]["stream"] == "compute"
    assert record["collective_wait_ms"] == ALL_REDUCE_MS


def test_a_collective_belongs_to_the_engine_whose_forward_backward_or_step_runs(tmp_path, backend):
    """Actor and critic steps interleave (RLHF): each engine's record holds its own forward's all-gather and
    its own backward's all-reduce, as when the two train one after the other; a collective of the program's
    own loop, outside both engines' calls, belongs to both."""
    tensor = torch.ones(2)

    def with_collectives(engine):
        engine.module.register_forward_hook(lambda *_: backend.all_gather_into_tensor(tensor, tensor, None, False))
        backward = engine.backward

        def reducing_backward():
            backend.all_reduce(tensor, None, None, False)
            backward()

        engine.backward = reducing_backward
        return engine

    actor, critic = with_collectives(Engine()), with_collectives(Engine())
    with recorder_for(actor, tmp_path, name="actor"), recorder_for(critic, tmp_path, name="critic"):
        for _ in range(2):
            actor.forward()
            critic.forward()
            backend.reduce_scatter_tensor(tensor, tensor, None, None, False)  # the loop's own, between calls
            actor.backward()
            critic.backward()
            actor.step()
            critic.step()
    for name in ("actor", "critic"):
        records = read_records_file(tmp_path / f"zero_fetch_{name}_rank_3.jsonl")
        assert [{op: entry["count"] for op, entry in record["collectives"].items()} for record in records] == [
            {"all_gather_into_tensor": 1, "all_reduce": 1, "reduce_scatter_tensor": 1}] * 2, name


def test_a_collective_of_the_programs_loop_between_steps_is_a_wait_of_the_gap(tmp_path, backend, monkeypatch):
    """A loss all-reduce through deepspeed.comm after engine.step() (as DeepSpeed's examples log): a rank that
    arrives early waits there, in its gap, as in a framework's torch.distributed call; a checkpoint save's own
    collectives are the save's time, no wait of the gap."""
    tensor, wait_s = torch.ones(2), 0.03

    def waiting(*args, **kwargs):
        time.sleep(wait_s)  # for a late peer

    monkeypatch.setattr(backend, "all_reduce", waiting)  # before attach: what the wrapper calls
    engine = Engine()
    own_work = ("save_checkpoint", "load_checkpoint", "_zero3_consolidated_16bit_state_dict")  # the Trainer's save
    for name in own_work:  # each with a collective of its own (a barrier, ZeRO's all-gathers)
        setattr(engine, name, lambda *args: backend.all_reduce(tensor, None, None, False))
    with recorder_for(engine, tmp_path):
        for step in range(5):
            engine.train_step()
            if step < 2:
                backend.all_reduce(tensor, None, None, False)
            elif step < 4:
                getattr(engine, own_work[0] if step == 2 else own_work[1])("checkpoint")
                if step == 3:
                    getattr(engine, own_work[2])()
    records = read_records(tmp_path)
    waits = [record["gap_collective_ms"] for record in records]
    assert waits[0] == waits[3] == waits[4] == 0 and all(wait >= wait_s * 1e3 for wait in waits[1:3]), waits
    assert records[3]["save_ms"] >= wait_s * 1e3 and all(record["collectives"] == {} for record in records)


def test_collective_timing_gives_back_a_wrapper_that_was_there_before(tmp_path, backend):
    def theirs(*args, **kwargs):
        return None

    backend.all_reduce = theirs  # some other tool's wrapper, on the instance
    with recorder_for(Engine(), tmp_path):
        assert vars(backend)["all_reduce"] is not theirs
    assert vars(backend)["all_reduce"] is theirs and "reduce_scatter_tensor" not in vars(backend)


def test_a_full_pool_first_looks_whether_its_oldest_pair_completed(device):
    """Forced waits count only when the oldest pair has not completed (it is resolved otherwise)."""
    events = DeviceEvents(device.event, capacity=2)
    events.pair(events.mark(), events.mark(), 0)
    events.mark()  # the pool is exhausted; the oldest pair has completed on this device
    assert events.waits == 0 and device.synchronized == 0


def test_a_signal_handler_may_close_a_recorder_while_the_pool_is_in_use(tmp_path, device):
    """A program's signal handler runs between two bytecodes of the main thread, which may be inside the
    pool; closing a recorder there takes the pool again (a plain lock would deadlock)."""
    import threading

    engine = Engine()
    events = DeviceEvents(device.event)
    attached = recorder_for(engine, tmp_path, device_events=events)
    engine.train_step()
    record = FakeEvent.record

    def interrupted(event):  # the handler runs while mark() holds the pool
        record(event)
        FakeEvent.record = record
        attached.close()

    FakeEvent.record = interrupted
    done = threading.Event()
    worker = threading.Thread(target=lambda: (engine.train_step(), done.set()), daemon=True)
    worker.start()
    worker.join(5)
    FakeEvent.record = record
    assert done.is_set(), "closing the recorder inside the pool deadlocked"
    assert attached.closed and [r["global_step"] for r in read_records(tmp_path)] == [0]


def test_records_wait_for_their_device_times_without_synchronizing(tmp_path, device):
    device.completed = 0  # the device is behind: nothing has completed
    engine = Engine()
    recorder = recorder_for(engine, tmp_path, device_events=DeviceEvents(device.event))
    engine.train_step()
    assert read_records(tmp_path) == [] and device.synchronized == 0
    device.completed = None  # the device caught up; the next step end writes both, in order
    engine.train_step()
    assert [r["micro_step"] for r in read_records(tmp_path)] == [0, 1]
    assert all(r["clock"] == "device" for r in read_records(tmp_path))
    recorder.close()


def test_close_never_blocks_on_a_hung_device_and_writes_host_times(tmp_path, device, monkeypatch):
    monkeypatch.setattr(recorder_module, "SETTLE_SECONDS", 0.05)
    device.completed = 0
    engine = Engine()
    recorder = recorder_for(engine, tmp_path, device_events=DeviceEvents(device.event))
    engine.train_step()
    began = time.monotonic()
    recorder.close()
    assert time.monotonic() - began < 1.0 and device.synchronized == 0
    (record, ) = read_records(tmp_path)
    assert record["clock"] == "host-fallback"
    wait = record["events"]["forward_fetch_wait"]
    assert wait["clock"] == "host-fallback" and wait["time_ms"] == wait["host_time_ms"]


def test_a_full_pool_waits_for_its_oldest_pair_and_counts_it(tmp_path, device):
    device.completed = 0
    events = DeviceEvents(device.event, capacity=4)
    engine = Engine()
    with recorder_for(engine, tmp_path, device_events=events):
        for _ in range(3):
            engine.train_step()
    # A pool of 4 events on a device that completes nothing by itself: the oldest pair is waited for each
    # time the pool is exhausted, and only then.
    assert events.waits == device.synchronized == 7  # only the waits the pool had to make, each counted
    records = read_records(tmp_path)
    assert [record["device_waits"] for record in records] == [1, 3, 3]
    assert [record["clock"] for record in records] == ["device", "device", "host-fallback"]


def test_events_go_back_to_the_pool_however_many_steps_and_evals_run(tmp_path, device):
    """A device that keeps up never makes the pool wait, however long the run: every mark is paired and
    resolved, or given back (a forward's end replaced by its step's, a step that did not finish)."""
    events = DeviceEvents(device.event, capacity=32)
    engine = Engine()
    with recorder_for(engine, tmp_path, device_events=events):
        for step in range(200):
            engine.train_step()
            if step % 10 == 0:
                engine.eval_forward()
        engine.forward()  # a train step cut short: its marks go back too
    assert events.waits == 0 and device.synchronized == 0 and events._made <= 32
    assert len(read_records(tmp_path)) == 220


def test_eval_records_reach_the_disk_at_the_next_forward_not_at_the_next_step(tmp_path):
    engine = Engine()
    with recorder_for(engine, tmp_path):
        engine.train_step()
        for _ in range(50):
            engine.eval_forward()
        assert [r["mode"] for r in read_records(tmp_path)] == ["train"] + ["eval"] * 49  # the last at close


def test_async_op_positions_are_deepspeeds():
    """The table of where async_op sits in each backend method, checked against DeepSpeed's own source (its
    methods are wrapped by decorators that hide their signatures from inspect)."""
    import ast
    import inspect

    from deepspeed.comm.torch import TorchBackend

    tree = ast.parse(inspect.getsource(inspect.getmodule(TorchBackend)))
    backend = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "TorchBackend")
    methods = {node.name: [arg.arg for arg in node.args.args[1:]] for node in backend.body
               if isinstance(node, ast.FunctionDef)}
    for op, position in collectives.ASYNC_OP_POSITION.items():
        assert methods[op].index("async_op") == position, op
    for op in collectives.ALWAYS_BLOCKING:
        assert "async_op" not in methods[op], op
    takes_async_op = {name for name, args in methods.items() if "async_op" in args}
    assert takes_async_op == set(collectives.ASYNC_OP_POSITION)  # no blocking-capable collective left out


_KILLED_WHILE_DEVICE_TIMES_ARE_PENDING = """
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import ds_profutils.engine.recorder as recorder_module
from ds_profutils import profiler, step_profiler
from ds_profutils._device_clock import DeviceEvents
from test_zero_attach import Engine, recorder_for
from test_zero_clocks import FakeDevice

recorder_module.SETTLE_SECONDS = 0.1
device = FakeDevice()
device.completed = 0  # the device is behind: no record can be written at its step's end
engine = Engine()
recorder = recorder_for(engine, Path(sys.argv[1]), device_events=DeviceEvents(device.event))
signal.signal(signal.SIGINT, signal.default_int_handler)

@profiler(output_dir=sys.argv[1], skip_first=0, wait=0, warmup=0, active=100)
def train():
    for _ in range(3):
        engine.train_step()
        step_profiler()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)

train()
"""


def test_records_waiting_for_device_times_are_written_when_a_sigterm_ends_the_process(tmp_path):
    """The profiler re-raises SIGTERM with its default action after writing its traces, which skips atexit:
    the recorder writes its pending records first (on host times, the device never caught up)."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", _KILLED_WHILE_DEVICE_TIMES_ARE_PENDING, str(tmp_path),
                           str(Path(__file__).parent)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -15, done.stderr  # killed by SIGTERM, as the launcher expects
    records = read_records(tmp_path)
    assert [r["micro_step"] for r in records] == [0, 1, 2]
    assert {r["clock"] for r in records} == {"host-fallback"}
    assert (tmp_path / "trace_rank_0.json").exists()


def test_a_collective_that_raises_ends_its_marker_and_the_next_takes_the_next_sequence_number(tmp_path, backend,
                                                                                              monkeypatch):
    """A gloo timeout inside a recorded step: the rank is inside that collective no more (a marker left open would
    make every later torch.distributed call look like that collective's own, and the rank's sequence numbers
    drift from its peers'), and the error reaches the program unchanged."""
    from ds_profutils.engine.hangs import sequence

    def timed_out(self, tensor, op=None, group=None, async_op=False):
        raise RuntimeError("Timed out waiting for peers")

    monkeypatch.setattr(FakeBackend, "all_reduce", timed_out)
    engine = Engine()
    with recorder_for(engine, tmp_path):
        engine.module.train()
        engine.forward()
        with pytest.raises(RuntimeError, match="Timed out"):
            backend.all_reduce(torch.ones(2), None, (0, 1), False)
        group = next(group for group in sequence.progress() if group.ranks == (0, 1))
        assert group.current is None and group.last.ended_ns is not None
        backend.reduce_scatter_tensor(torch.ones(2), torch.ones(2), None, (0, 1), False)
        assert group.last.seq == group.seq and group.last.name == "reduce_scatter_tensor"
        engine.backward()
        engine.step()
    (record, ) = read_records(tmp_path)
    assert list(record["collectives"]) == ["reduce_scatter_tensor"]  # the raised call took no time of the step's
