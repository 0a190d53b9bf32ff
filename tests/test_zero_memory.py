"""Memory in the fetch records (per phase, from the accelerator's peak statistics) and the allocator-history
snapshot written where memory runs out, on the stand-in engine of test_zero_attach."""
import os
import pickle

import psutil
import pytest
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

from ds_profutils.config import MemorySnapshotConfig
from ds_profutils.outputs import ProcessIdentity
from ds_profutils.engine import snapshot
from ds_profutils.engine.snapshot import StepSnapshots
from ds_profutils.engine.hooks import EngineHooks
from ds_profutils.engine import memory
from ds_profutils.engine.memory import StepMemory
from test_zero_attach import Engine, read_records, recorder_for


class Allocator:
    """An accelerator's allocator the test moves: current and peak bytes, reserved a fixed 1 MiB above."""

    def __init__(self):
        self.allocated = self.peak = 0
        self.resets = 0

    def device_name(self):
        return "stand-in"

    def allocate(self, size):
        self.allocated += size
        self.peak = max(self.peak, self.allocated)

    def reset_peak_memory_stats(self):
        self.resets += 1
        self.peak = self.allocated

    def max_memory_allocated(self):
        return self.peak

    def max_memory_reserved(self):
        return self.peak + 2**20


def using_memory(engine, allocator):
    """The stand-in engine's memory: its forward keeps 100 bytes of activations (peak 300 within), its
    backward frees them (peak 250 within), its optimizer step peaks 50 bytes above what is kept."""
    backward, step = engine.backward, engine.step

    def forward_using(module, args):
        allocator.allocate(300)
        allocator.allocate(-200)

    def backward_using():
        allocator.allocate(150)
        allocator.allocate(-250)
        backward()

    def step_using():
        allocator.allocate(50)
        allocator.allocate(-50)
        step()

    engine.module.register_forward_pre_hook(forward_using)  # inside the module's forward, after the hooks of attach
    engine.backward, engine.step = backward_using, step_using
    return engine


def test_each_record_holds_the_peaks_of_its_phases(tmp_path):
    allocator = Allocator()
    allocator.allocate(1000)  # the model
    engine = using_memory(Engine(), allocator)
    with recorder_for(engine, tmp_path, memory=StepMemory(allocator)):
        engine.train_step()
        engine.eval_forward()
    train, evaluated = read_records(tmp_path)
    assert train["memory"] == {"source": "allocator", "peak_allocated_bytes": 1300,
                               "peak_reserved_bytes": 1300 + 2**20,
                               "phases": {"forward": 1300, "backward": 1250, "step": 1050}}
    assert evaluated["memory"]["phases"] == {"forward": 1300}  # the backward freed the activations
    assert allocator.resets == 4  # a reset per phase, nothing between steps


def test_on_deepspeeds_cpu_accelerator_the_figures_are_the_process_rss(tmp_path):
    engine = Engine()
    with recorder_for(engine, tmp_path, memory=StepMemory(CPU_Accelerator())):
        engine.train_step()
    (record, ) = read_records(tmp_path)
    assert record["memory"]["source"] == "rss" and record["memory"]["peak_allocated_bytes"] > 10 * 2**20


def test_on_cpu_rss_is_read_once_per_step_boundary_and_deepspeeds_peaks_are_left_alone(tmp_path, monkeypatch):
    """DeepSpeed's CPU accelerator reads RSS afresh for its reset and each of its two peaks (nine reads a
    step); the same figures come from one read per boundary of the step's phases, a phase's peak the larger
    of its ends.  A phase begins where the one before it ended: the optimizer step where the backward ended
    (nothing of the engine runs between ``engine.backward()`` returning and ``engine.step()``), the next
    step's forward where the step ended; three reads a step once the first has begun."""
    mib = 2**20
    accelerator = CPU_Accelerator()
    accelerator.max_mem = 7  # another reader's peak: not reset by the records
    reads = iter([100 * mib, 300 * mib, 400 * mib, 250 * mib, 120 * mib, 130 * mib, 110 * mib])
    monkeypatch.setattr(memory, "_rss", lambda: next(reads))
    engine = Engine()
    with recorder_for(engine, tmp_path, memory=StepMemory(accelerator)):
        engine.train_step()
        engine.train_step()
    first, second = read_records(tmp_path)
    # Reads: forward begins (100: the first step after attach), forward ends = backward begins (300), backward
    # returns = the optimizer step begins (400), the step ends (250) = the next forward begins.
    assert first["memory"] == {"source": "rss", "peak_allocated_bytes": 400 * mib, "peak_reserved_bytes": 400 * mib,
                               "phases": {"forward": 300 * mib, "backward": 400 * mib, "step": 400 * mib}}
    assert second["memory"]["phases"] == {"forward": 250 * mib, "backward": 130 * mib, "step": 130 * mib}
    assert next(reads, None) is None and accelerator.max_mem == 7


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc")
def test_rss_is_what_psutil_reads_and_a_forked_child_reads_its_own():
    """The kept /proc/self/statm descriptor gives psutil's figure; after a fork it is the child's process."""
    read = memory.rss_reader()
    assert isinstance(read, memory._StatmRss)
    before, ours, after = psutil.Process().memory_info().rss, read(), psutil.Process().memory_info().rss
    assert min(before, after) - 2**20 <= ours <= max(before, after) + 2**20
    ballast = bytearray(b"\x01") * (64 * 2**20)  # the parent grows; the child frees its copy, so their RSS part
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        del ballast[:]
        os.write(writer, f"{read()} {psutil.Process().memory_info().rss}".encode())
        os._exit(0)
    os.close(writer)
    os.waitpid(child, 0)
    child_ours, child_psutil = map(int, os.read(reader, 100).split())
    assert abs(child_ours - child_psutil) <= 2**20
    assert read() - child_ours > 32 * 2**20  # the parent's own, not the child's
    del ballast


def test_steps_left_out_by_log_interval_do_not_touch_the_allocator(tmp_path):
    allocator = Allocator()
    engine = Engine()
    with recorder_for(engine, tmp_path, memory=StepMemory(allocator), log_interval=3):
        for _ in range(3):
            engine.train_step()
    assert allocator.resets == 3 and len(read_records(tmp_path)) == 1


class History:
    """The allocator history of a stand-in accelerator: what was asked of it, and what it wrote."""

    def __init__(self):
        self.started, self.stopped, self.dumps = [], 0, []

    def start(self, max_entries):
        self.started.append(max_entries)

    def dump(self, path):
        self.dumps.append(path.name)
        path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))

    def stop(self):
        self.stopped += 1


IDENTITY = ProcessIdentity(rank=1, world_size=2, local_rank=1, host="node-a", pid=7, source="test")


def snapshotting(engine, tmp_path, history, **settings):
    settings = MemorySnapshotConfig(enabled=True, output_dir=str(tmp_path), **settings)
    snapshots = snapshot.MemorySnapshots(settings, IDENTITY, history)
    hooks = EngineHooks(engine)
    hooks.add(StepSnapshots(snapshots))
    return hooks, snapshots


@pytest.mark.parametrize("where", ["backward", "save_checkpoint", "save_16bit_model"])
def test_an_out_of_memory_error_in_the_engine_writes_the_history_and_goes_on_unchanged(tmp_path, where):
    """In a step (its backward) or in the engine's own work between steps (a checkpoint save, where ZeRO-3 gathers
    its partitions; ``save_16bit_model`` gathers them through ``_zero3_consolidated_16bit_state_dict``, which is
    wrapped too): written once."""
    import torch

    engine, history = Engine(), History()
    hooks, snapshots = snapshotting(engine, tmp_path, history, max_entries=500)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB")

    def out_of_memory(*args, **kwargs):
        raise error

    if where == "backward":
        engine.forward()
    else:
        engine.train_step()
    if where == "save_16bit_model":  # DeepSpeed's: the gather inside it runs out of memory
        engine._zero3_consolidated_16bit_state_dict = out_of_memory
        engine.save_16bit_model = lambda *args: engine._zero3_consolidated_16bit_state_dict()
    else:
        setattr(engine, where, out_of_memory)
    hooks.remove()  # the hooks wrap what the engine holds when a listener watching errors is added
    hooks = EngineHooks(engine)
    hooks.add(StepSnapshots(snapshots))
    with pytest.raises(torch.OutOfMemoryError) as raised:
        getattr(engine, where)()
    assert raised.value is error and history.started == [500]
    assert len(history.dumps) == 1 and history.dumps[0].startswith(".memory_snapshot_rank_1.pickle")  # a temporary
    # name, then renamed
    assert pickle.loads((tmp_path / "memory_snapshot_rank_1.pickle").read_bytes())["segments"] == []
    snapshots.close()
    snapshots.close()
    assert history.stopped == 1


def test_other_errors_write_nothing_and_at_steps_write_after_those_global_steps(tmp_path):
    engine, history = Engine(), History()
    hooks, snapshots = snapshotting(engine, tmp_path, history, at_steps=[1, 3])
    for _ in range(4):
        engine.train_step()

    def step():
        raise ValueError("not memory")

    engine.forward()
    engine.step = step
    with pytest.raises(ValueError):
        engine.step()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["memory_snapshot_rank_1_step_1.pickle",
                                                               "memory_snapshot_rank_1_step_3.pickle"]
    snapshots.close()


def test_the_history_is_the_processs_started_by_the_first_engine_and_stopped_by_the_last(tmp_path):
    history = History()
    first = snapshot.MemorySnapshots(MemorySnapshotConfig(enabled=True), IDENTITY, history)
    second = snapshot.MemorySnapshots(MemorySnapshotConfig(enabled=True), IDENTITY, history)
    first.close()
    assert len(history.started) == 1 and history.stopped == 0
    second.close()
    assert history.stopped == 1


def test_an_accelerator_without_allocator_history_says_so_once(ds_caplog):
    snapshot.warning_once.cache_clear() if hasattr(snapshot.warning_once, "cache_clear") else None
    assert snapshot.cuda_allocator_history(CPU_Accelerator()) is None
    assert snapshot.cuda_allocator_history(CPU_Accelerator()) is None
    lines = [r.getMessage() for r in ds_caplog.records if "memory_snapshot" in r.getMessage()]
    assert lines == ["memory_snapshot: the 'cpu' accelerator keeps no allocator history (CUDA's does); no memory "
                     "snapshot is written"]


def test_peaks_reset_by_deepspeeds_memory_breakdown_mark_the_records_disturbed(tmp_path):
    """A real ZeRO-3 engine on one gloo rank (tests/dist_scripts/memory_breakdown.py): with ``memory_breakdown``
    DeepSpeed's see_memory_usage resets the stand-in allocator's peaks inside forward, backward and step, and
    every record of that engine says so; the engine without it is not marked."""
    import json

    from launcher import DIST_SCRIPTS, run_one_rank
    from report_testing import read_records_file

    run_one_rank([str(DIST_SCRIPTS / "memory_breakdown.py"), "--out", str(tmp_path)])
    resets = json.loads((tmp_path / "resets.json").read_text())
    records = {name: read_records_file(next(tmp_path.glob(f"*{name}*.jsonl"))) for name in resets}
    assert resets["breakdown"] > resets["plain"] and len(records["breakdown"]) == 3  # DeepSpeed's, beside ours
    for record in records["breakdown"]:
        assert record["memory"]["source"] == "allocator" and record["memory"]["disturbed"] is True
    for record in records["plain"]:
        assert record["memory"]["source"] == "allocator" and "disturbed" not in record["memory"]


def test_on_cpu_a_forward_reads_its_start_afresh_after_an_unmeasured_step_or_another_engines_reading(tmp_path,
                                                                                                      monkeypatch):
    """The forward starts from the last step's end reading only where nothing came between: after a step
    ``log_interval`` left unmeasured, or another engine's step (RSS is the process's), it reads its own start.
    RSS falls at every read here, so a phase's peak is its start: the figure says which reading began it."""
    reads = iter(range(200, 100, -1))
    monkeypatch.setattr(memory, "_rss", lambda: next(reads))
    engine = Engine()
    with recorder_for(engine, tmp_path, memory=StepMemory(CPU_Accelerator()), log_interval=2):
        for _ in range(3):
            engine.train_step()
    first, second = read_records(tmp_path)  # global steps 0 and 2; step 1 unmeasured
    assert first["memory"]["phases"] == {"forward": 200, "backward": 199, "step": 198}  # reads 200-197
    assert second["memory"]["phases"] == {"forward": 196, "backward": 195, "step": 194}  # 196 afresh, not 197
    actor, critic = StepMemory(CPU_Accelerator()), StepMemory(CPU_Accelerator())
    figures = []
    for step_memory in (actor, critic, actor):
        step_memory.begin("forward")
        step_memory.begin("backward")
        step_memory.end()
        step_memory.begin("step")
        figures.append(step_memory.record()["phases"])
    # the actor 192-189, the critic 188-185, then the actor's forward reads its start afresh (184), not 189
    assert [phases["forward"] for phases in figures] == [192, 188, 184]
    assert next(reads) == 180
