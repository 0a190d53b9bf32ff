"""Device clocks on a real GPU: fetch waits, collectives on their own streams and step times, held against
CUDA events the test records itself, and a side-stream delay that must move its figure by its size."""
import deepspeed
import pytest
import torch
from deepspeed.utils.timer import NoopTimer

from ds_profutils._device_clock import DeviceEvents
from ds_profutils.timer import SynchronizedWallClockTimer
from ds_profutils.zero3.fetch_profiler import PartitionedParameterProfiler
from test_zero_attach import Engine, read_records, recorder_for

REL = 0.05  # device times agree with the test's own events to within 5% (and 0.05 ms)


def own_events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def test_the_engines_timers_time_device_work_step_after_step_on_recorded_again_events(cuda_accelerator, gpu_sleep):
    """As the engine uses its timers with ``wall_clock_breakdown``: started, the step's device work queued,
    stopped, read with reset, step after step; from the second step on, the events of the pair read are
    recorded again (none made), on the current stream."""
    timer = SynchronizedWallClockTimer()("fwd")
    side = torch.cuda.Stream()
    for step, ms in enumerate((5.0, 2.0, 8.0)):
        stream = side if step == 2 else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            start, end = own_events()
            timer.start()
            start.record()
            gpu_sleep(ms)
            end.record()
            timer.stop()
        assert timer.elapsed(reset=True) == pytest.approx(start.elapsed_time(end), rel=REL, abs=0.05)
        assert len(timer._free) == 2  # the pair just read, to be recorded again by the next step


def test_a_profiler_built_directly_times_fetch_waits_on_the_device(cuda_accelerator, gpu_sleep):
    profiler = PartitionedParameterProfiler(NoopTimer())
    assert profiler.device_events is not None  # CUDA: DeepSpeed's timers use device events, so do we
    start, end = own_events()
    profiler.start_event("forward_fetch_wait")
    start.record()
    gpu_sleep(20)
    end.record()
    profiler.stop_event("forward_fetch_wait", 1)
    end.synchronize()
    entry = profiler.statistics()["forward_fetch_wait"]
    assert entry["clock"] == "device"
    assert entry["time_ms"] == pytest.approx(start.elapsed_time(end), rel=REL, abs=0.05)
    assert entry["host_time_ms"] < entry["time_ms"] / 4  # the host saw the launch only


class SleepingBackend:
    """deepspeed.comm's backend whose collectives are device work on the stream they are issued on."""

    def __init__(self, sleep, all_reduce_ms, reduce_scatter_ms):
        self.sleep, self.all_reduce_ms, self.reduce_scatter_ms = sleep, all_reduce_ms, reduce_scatter_ms

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self.sleep(self.all_reduce_ms)

    def reduce_scatter_tensor(self, output_tensor, input_tensor, op=None, group=None, async_op=False):
        self.sleep(self.reduce_scatter_ms)


def one_step(tmp_path, monkeypatch, gpu_sleep, side_ms):
    """A stand-in engine's step with a 10 ms all-reduce on the compute stream and a ``side_ms`` reduce-scatter
    on a side stream (overlap_comm); returns its record."""
    backend = SleepingBackend(gpu_sleep, 10.0, side_ms)
    monkeypatch.setattr(deepspeed.comm.comm, "cdb", backend)
    from deepspeed.accelerator import get_accelerator

    engine, tensor, side = Engine(), torch.ones(2, device="cuda"), torch.cuda.Stream()
    out = tmp_path / f"side_{side_ms}"
    with recorder_for(engine, out, device_events=DeviceEvents(get_accelerator().Event)):
        engine.forward()
        backend.all_reduce(tensor, None, None, False)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            backend.reduce_scatter_tensor(tensor, tensor, None, None, False)
        torch.cuda.current_stream().wait_stream(side)
        engine.backward()
        engine.step()
    (record, ) = read_records(out)
    return record


def test_collectives_are_timed_on_their_own_streams(cuda_accelerator, gpu_sleep, tmp_path, monkeypatch):
    record = one_step(tmp_path, monkeypatch, gpu_sleep, side_ms=15.0)
    compute, side = record["collectives"]["all_reduce"], record["collectives"]["reduce_scatter_tensor@side-stream"]
    assert compute["clock"] == side["clock"] == "device"
    assert compute["time_ms"] == pytest.approx(10.0, rel=REL) and compute["exposed_ms"] == compute["time_ms"]
    assert side["time_ms"] == pytest.approx(15.0, rel=REL) and side["exposed_ms"] == 0
    assert record["collective_ms"] == pytest.approx(25.0, rel=REL)


def test_a_side_stream_delay_moves_its_figure_by_its_size(cuda_accelerator, gpu_sleep, tmp_path, monkeypatch):
    quick = one_step(tmp_path, monkeypatch, gpu_sleep, side_ms=1.0)
    slow = one_step(tmp_path, monkeypatch, gpu_sleep, side_ms=31.0)
    moved = (slow["collectives"]["reduce_scatter_tensor@side-stream"]["time_ms"]
             - quick["collectives"]["reduce_scatter_tensor@side-stream"]["time_ms"])
    assert moved == pytest.approx(30.0, rel=REL)
    assert slow["collective_wait_ms"] == pytest.approx(quick["collective_wait_ms"], rel=REL)  # not a compute stall


def test_step_time_is_the_compute_streams(cuda_accelerator, gpu_sleep, tmp_path):
    from deepspeed.accelerator import get_accelerator

    engine = Engine()
    engine.module.register_forward_hook(lambda *_: gpu_sleep(12))
    start, end = own_events()
    with recorder_for(engine, tmp_path, device_events=DeviceEvents(get_accelerator().Event)):
        start.record()
        engine.train_step()
        end.record()
    (record, ) = read_records(tmp_path)
    assert record["clock"] == "device"
    assert record["step_time_ms"] == pytest.approx(start.elapsed_time(end), rel=REL, abs=0.1)


class NcclGatherBackend:
    """deepspeed.comm's backend over a real single-rank NCCL group: each all-gather is ``gather_ms`` of device
    work on a stream of its own, then NCCL's all-gather after it (the gather's time as a slow peer makes it)."""

    def __init__(self, sleep, gather_ms):
        self.sleep, self.gather_ms = sleep, gather_ms

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        own = torch.cuda.Stream()
        own.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(own):
            self.sleep(self.gather_ms)
            return torch.distributed.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


@pytest.fixture
def nccl_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    # NCCL makes a group's communicator inside its first collective (290 ms on an H200, the first in a process):
    # a recorded step's first collective counts that as its own time.  Made here, before the test times any.
    tensor = torch.ones(2, device="cuda")
    dist.all_gather_into_tensor(torch.empty_like(tensor), tensor)
    torch.cuda.synchronize()
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("gathers", [1, 2])
def test_async_gathers_are_their_own_time_and_overlap_once(cuda_accelerator, gpu_sleep, nccl_group, tmp_path,
                                                           monkeypatch, gathers):
    """4 ms gathers launched, 10 ms of compute, then waited: each is 4 ms (not the 14 ms to its wait); two
    launched together cover 4 ms of the step and the launch between them (0.35 ms on an H200), not 8."""
    from deepspeed.accelerator import get_accelerator

    backend = NcclGatherBackend(gpu_sleep, 4.0)
    monkeypatch.setattr(deepspeed.comm.comm, "cdb", backend)
    engine, tensor = Engine(), torch.ones(2, device="cuda")
    with recorder_for(engine, tmp_path, device_events=DeviceEvents(get_accelerator().Event)):
        engine.forward()
        handles = [backend.all_gather_into_tensor(torch.empty_like(tensor), tensor, None, True)
                   for _ in range(gathers)]
        gpu_sleep(10)
        for handle in handles:
            handle.wait()
        engine.backward()
        engine.step()
    (record, ) = read_records(tmp_path)
    gather = record["collectives"]["all_gather_into_tensor"]
    assert gather["clock"] == "device" and gather["async"] == gathers
    assert gather["time_ms"] == pytest.approx(4.0 * gathers, rel=REL, abs=0.3)
    assert 4.0 * (1 - REL) <= record["collective_ms"] <= 4.0 * (1 + REL) + (gathers - 1) * 1.0
    assert record["collective_ms"] < record["step_time_ms"]
