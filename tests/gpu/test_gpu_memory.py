"""Memory on a real GPU: the allocator's peaks in the records, and the allocator history written where
memory runs out, the error going on unchanged."""
import pickle

import pytest
import torch

from ds_profutils.config import MemorySnapshotConfig
from ds_profutils.outputs import ProcessIdentity
from ds_profutils.engine import snapshot
from ds_profutils.engine.snapshot import StepSnapshots
from ds_profutils.engine.hooks import EngineHooks
from ds_profutils.engine.memory import StepMemory
from test_zero_attach import Engine, read_records, recorder_for

MB = 2**20


def test_records_hold_the_allocators_peaks(cuda_accelerator, tmp_path):
    engine, kept = Engine(), []

    def activations(module, args):
        kept.append(torch.empty(256 * MB, dtype=torch.uint8, device="cuda"))
        torch.empty(64 * MB, dtype=torch.uint8, device="cuda")  # freed at once: in the peak, not kept

    engine.module.register_forward_pre_hook(activations)
    with recorder_for(engine, tmp_path, memory=StepMemory(cuda_accelerator)):
        before = torch.cuda.memory_allocated()
        engine.train_step()
    (record, ) = read_records(tmp_path)
    memory = record["memory"]
    assert memory["source"] == "allocator"
    assert memory["phases"]["forward"] >= before + 320 * MB
    assert memory["peak_reserved_bytes"] >= memory["peak_allocated_bytes"]


def test_a_peak_reset_inside_a_phase_as_see_memory_usage_makes_marks_the_record(cuda_accelerator, tmp_path):
    """DeepSpeed's see_memory_usage (memory_breakdown) resets the peaks through the accelerator mid-forward:
    the forward's 320 MiB peak is gone from the allocator, and the record says its figures are disturbed; a
    step without the reset is not marked, and the accelerator's method is given back at close."""
    from deepspeed.runtime.utils import see_memory_usage

    engine, kept = Engine(), []

    def activations(module, args):
        torch.empty(320 * MB, dtype=torch.uint8, device="cuda")  # the peak, freed at once
        if kept:
            see_memory_usage("inside forward", force=True)
        kept.append(True)

    engine.module.register_forward_pre_hook(activations)
    with recorder_for(engine, tmp_path, memory=StepMemory(cuda_accelerator)):
        engine.train_step()
        engine.train_step()
    assert "reset_peak_memory_stats" not in vars(cuda_accelerator)
    calm, reset = read_records(tmp_path)
    assert "disturbed" not in calm["memory"] and reset["memory"]["disturbed"] is True
    assert reset["memory"]["phases"]["forward"] < calm["memory"]["phases"]["forward"]


def test_an_out_of_memory_error_writes_the_allocator_history(cuda_accelerator, tmp_path):
    engine = Engine()
    settings = MemorySnapshotConfig(enabled=True, output_dir=str(tmp_path), max_entries=10_000)
    identity = ProcessIdentity(rank=0, world_size=1, local_rank=0, host="gpu", pid=1, source="test")
    snapshots = snapshot.MemorySnapshots(settings, identity, snapshot.cuda_allocator_history(cuda_accelerator))
    hooks = EngineHooks(engine)
    hooks.add(StepSnapshots(snapshots))
    total = torch.cuda.get_device_properties(0).total_memory

    def too_much(module, args):
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")

    engine.module.register_forward_pre_hook(too_much)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            engine.forward()
    finally:
        hooks.remove()
        snapshots.close()
    dumped = pickle.loads((tmp_path / "memory_snapshot_rank_0.pickle").read_bytes())
    assert "segments" in dumped and "device_traces" in dumped
