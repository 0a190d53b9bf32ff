"""Fetch records on the device clock and the exposed wait in blocking collectives, on the stand-in engine
of test_zero_attach (the real ZeRO-3 engine with a stand-in accelerator runs in test_zero_fidelity)."""
import time
import types

import pytest
import torch

from ds_profutils.zero3 import collectives, recorder as recorder_module
from ds_profutils.zero3.device_clock import DeviceEvents
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


def test_fetch_waits_and_step_time_are_device_times_and_host_times_are_kept(tmp_path, device):
    engine = Engine()
    with recorder_for(engine, tmp_path, device_events=DeviceEvents(device.event)):
        engine.train_step()
    (record, ) = read_records(tmp_path)
    assert record["clock"] == "device"
    waits = {name: record["events"][name] for name in ("forward_fetch_wait", "backward_fetch_wait")}
    for entry in waits.values():  # start and stop mark adjacent events: one tick apart on the device
        assert (entry["clock"], entry["time_ms"], entry["min_ms"], entry["max_ms"]) == ("device", 1.0, 1.0, 1.0)
        assert 0 <= entry["host_time_ms"] < 1.0  # the host's own measure, kept beside
    assert record["fetch_wait_ms"] == 2.0 == record["exposed_wait_ms"]
    gather = record["events"]["forward_all_gather"]  # a launch: host clock
    assert gather["clock"] == "host" and "host_time_ms" not in gather
    # After the step's start mark: two fetch waits of two marks each, the forward's end (a mark the step's
    # end replaces) and the step's end.
    assert record["step_time_ms"] == 6.0 and record["device_waits"] == 0


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


class FakeBackend:
    """deepspeed.comm's backend as DeepSpeed 0.19's TorchBackend calls it (async_op positional)."""

    def __init__(self):
        self.calls = []

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self.calls.append(("all_reduce", async_op))
        if not async_op:
            time.sleep(0.02)  # a peer arrives late

    def reduce_scatter_tensor(self, output_tensor, input_tensor, op=None, group=None, async_op=False):
        self.calls.append(("reduce_scatter_tensor", async_op))


@pytest.fixture
def backend(monkeypatch):
    backend = FakeBackend()
    monkeypatch.setattr(collectives, "_backend", lambda: backend)
    return backend


def test_blocking_collectives_are_exposed_wait_and_async_ones_are_not(tmp_path, backend):
    engine = Engine()
    tensor = torch.ones(2)
    with recorder_for(engine, tmp_path):
        engine.forward()
        backend.all_reduce(tensor, None, None, False)  # blocking, positional as DeepSpeed passes it
        backend.all_reduce(tensor, None, None, True)  # overlaps compute: not a wait
        backend.reduce_scatter_tensor(output_tensor=tensor, input_tensor=tensor, async_op=False)
        engine.step()
        backend.all_reduce(tensor)  # between steps: no record is open
    (record, ) = read_records(tmp_path)
    assert set(record["collectives"]) == {"all_reduce", "reduce_scatter_tensor"}
    assert record["collectives"]["all_reduce"]["count"] == 1
    assert record["collectives"]["all_reduce"]["time_ms"] >= 20
    assert record["collective_wait_ms"] == pytest.approx(sum(c["time_ms"] for c in record["collectives"].values()))
    assert record["exposed_wait_ms"] == pytest.approx(record["fetch_wait_ms"] + record["collective_wait_ms"])
    assert record["step_time_ms"] >= record["exposed_wait_ms"]
    assert len(backend.calls) == 4 and "all_reduce" not in vars(backend)  # closed: the backend is DeepSpeed's again


def test_an_eval_record_holds_its_own_forwards_collectives_not_what_follows(tmp_path, backend):
    """RLHF: a reference model's eval forward, then the actor trains; the actor's gradient collectives are
    not the reference's waits (the eval record stays open until its engine's next forward)."""
    reference, tensor = Engine(), torch.ones(2)
    with recorder_for(reference, tmp_path):
        reference.module.eval()
        reference.forward()
        backend.all_reduce(tensor, None, None, False)  # after the forward: another engine's step
        reference.forward()
    (first, second) = read_records(tmp_path)
    assert first["mode"] == "eval" and first["collectives"] == {} and first["collective_wait_ms"] == 0


def test_on_the_device_clock_a_side_stream_collective_is_timed_on_the_host_and_kept_apart(tmp_path, device,
                                                                                         backend, monkeypatch):
    """ZeRO-3's overlap_comm reduce-scatter runs on its own stream: events there would time the collective,
    not a stall of the compute stream."""
    on_side_stream = []
    monkeypatch.setattr(collectives, "_on_side_stream", lambda: bool(on_side_stream))
    engine, tensor = Engine(), torch.ones(2)
    with recorder_for(engine, tmp_path, device_events=DeviceEvents(device.event)):
        engine.forward()
        backend.all_reduce(tensor, None, None, False)  # the compute stream: device events, one tick
        on_side_stream.append(True)
        backend.reduce_scatter_tensor(tensor, tensor, None, None, False)
        backend.all_reduce(tensor, None, None, False)  # 20 ms on the host
        engine.step()
    (record, ) = read_records(tmp_path)
    found = record["collectives"]
    assert found["all_reduce"] == {"count": 1, "time_ms": 1.0, "clock": "device"}
    assert found["all_reduce@side-stream"]["clock"] == "host" and found["all_reduce@side-stream"]["time_ms"] >= 20
    assert found["reduce_scatter_tensor@side-stream"]["clock"] == "host"
    assert record["collective_wait_ms"] == pytest.approx(sum(entry["time_ms"] for entry in found.values()))


def test_the_compute_stream_is_the_one_the_forward_started_on(monkeypatch):
    """A job that runs its steps in a stream of its own: its collectives are on the compute stream."""
    import deepspeed.accelerator

    current = ["the job's stream"]
    accelerator = types.SimpleNamespace(current_stream=lambda: current[0], default_stream=lambda: "default")
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: accelerator)
    collectives.note_compute_stream()
    assert not collectives._on_side_stream()
    current[0] = "reduce_and_partition_stream"
    assert collectives._on_side_stream()


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
import ds_profutils.zero3.recorder as recorder_module
from ds_profutils import profiler, step_profiler
from ds_profutils.zero3.device_clock import DeviceEvents
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
