"""The torch profiler driven by an attached engine: a config with an enabled ``"profiler"`` section and
``attach(engine)``, no decorator and no ``step_profiler()`` in the loop.

In-process tests use the stand-in engine of test_zero_attach.py with gradient accumulation as
DeepSpeed counts it (``global_steps`` moves at every second ``step()``); the interruption tests run it
in a process of its own, as the launcher's SIGTERM finds it.  The real engines under the launcher,
through a transformers Trainer and Accelerate, are in test_integrations_jobs.py.
"""
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from deepspeed.comm import comm as deepspeed_comm

import ds_profutils
from ds_profutils import profiler, step_profiler
from ds_profutils.engine import engine_driven
from ds_profutils.engine.hooks import EngineHooks, Listener
from ds_profutils.engine.collectives import attach_engine
from ds_profutils.engine.step import EngineCollectives, StepRecord
from ds_profutils.engine.torch_collectives import TorchCollectives, inside_ours
from ds_profutils.torch_profiler import calls as profiler_calls
from ds_profutils.torch_profiler import watchdog
from ds_profutils.torch_profiler.run import TAIL_RANGE
from profiler_testing import cycle_steps, profiler_steps, read_trace
from test_zero_attach import Engine

TESTS = Path(__file__).resolve().parent
SCHEDULE = {"skip_first": 0, "wait": 1, "warmup": 1, "active": 2, "repeat": 0}


class AccumulatingEngine(Engine):
    """The stand-in engine, counting steps as DeepSpeed does with gradient accumulation: ``step()`` at every
    micro step, an optimizer step (``global_steps`` + 1) at every ``accumulation``-th."""

    def __init__(self, config, accumulation=2, global_steps=0, stage=3):
        super().__init__(config, stage)
        self.accumulation = accumulation
        self.global_steps = global_steps

    def gradient_accumulation_steps(self):
        return self.accumulation

    def was_step_applied(self):
        return self.micro_steps % self.accumulation == 0

    def step(self):
        self.micro_steps += 1
        if self.micro_steps % self.accumulation == 0:
            self.global_steps += 1

    def train(self, optimizer_steps):
        for _ in range(optimizer_steps * self.accumulation):
            self.train_step()


def profiler_config(out, **schedule):
    return {"profiler": {"output_dir": str(out), **SCHEDULE, **schedule}}


def forwards_per_step(trace):
    """How many forwards (the stand-in model's ``aten::mul``) fall inside each ``ProfilerStep#N`` range."""
    events = trace["traceEvents"]
    steps = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("ProfilerStep#")}
    muls = [e["ts"] for e in events if e.get("name") == "aten::mul" and e.get("ph") == "X"]
    return {int(name.split("#")[1]): sum(start <= ts < end for ts in muls) for name, (start, end) in steps.items()}


@pytest.fixture(autouse=True)
def no_run_left():
    yield
    assert profiler_calls._current is None, "a test left the process's profiler running"


def test_steps_follow_optimizer_steps_named_by_global_step(tmp_path):
    """A resumed engine (global step 5), gradient accumulation 2: each ProfilerStep holds both micro steps'
    forwards, is named by the engine's global step, and the schedule counts from the first forward."""
    engine = AccumulatingEngine(profiler_config(tmp_path), global_steps=5)
    attachment = ds_profutils.attach(engine, config=engine.config)
    assert attachment is not None and attachment.recorder is None  # the profiler only: no fetch records asked
    engine.train(9)  # global steps 5-13: wait 5, warmup 6, active 7-8, wait 9, warmup 10, active 11-12, wait 13
    attachment.close()
    trace = read_trace(tmp_path / "trace_rank_0.json")
    assert profiler_steps(trace) == [7, 8, 11, 12]
    assert cycle_steps(tmp_path) == [[7, 8], [11, 12]]
    assert forwards_per_step(trace) == {7: 2, 8: 2, 11: 2, 12: 2}
    assert trace["ds_profutils"]["step_numbering"] == "global"
    assert "step" not in vars(engine)  # the engine is DeepSpeed's again


def test_close_inside_a_window_writes_it_and_a_later_attach_continues_the_files(tmp_path, ds_caplog):
    """Trainer.train() ending inside a window (close at on_train_end), then a resumed train() in the same
    process: the first window is cut where it stopped and the second run's cycles join the same run trace."""
    engine = AccumulatingEngine(profiler_config(tmp_path, active=4))
    attachment = ds_profutils.attach(engine, config=engine.config)
    engine.train(4)  # wait 0, warmup 1, active 2-3, and the range of step 4 opened when step 3 ended
    attachment.close()
    trace = read_trace(tmp_path / "trace_rank_0.json")
    assert profiler_steps(trace) == [2, 3]
    assert [e["name"] for e in trace["traceEvents"] if e.get("name") == TAIL_RANGE] == [TAIL_RANGE]

    resumed = AccumulatingEngine(profiler_config(tmp_path, active=4), global_steps=engine.global_steps)
    with ds_profutils.attach(resumed, config=resumed.config):
        resumed.train(6)  # global steps 4-9: wait 4, warmup 5, active 6-9
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [2, 3, 6, 7, 8, 9]
    assert cycle_steps(tmp_path) == [[2, 3], [6, 9]]


def test_a_fresh_engine_counting_from_0_again_starts_the_files_afresh(tmp_path):
    """No step number twice in one trace (the report would add two runs' times up under one step)."""
    for _ in range(2):
        engine = AccumulatingEngine(profiler_config(tmp_path))
        with ds_profutils.attach(engine, config=engine.config):
            engine.train(4)
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [2, 3]


@pytest.mark.parametrize("new_process", [False, True])
def test_a_run_resumed_from_an_earlier_checkpoint_continues_the_trace_latest_wins(tmp_path, new_process):
    """Steps 0-7 profiled (cycles 2-3 and 6-7), then a restart from the checkpoint at step 4 (in the same
    process, or in a new one: the process's writers forgotten): the run trace keeps steps 2-3, and steps 6-7
    are the new run's, once each -- as the records keep the latest record of each step."""
    from ds_profutils.torch_profiler import writer as writer_module

    engine = AccumulatingEngine(profiler_config(tmp_path))
    with ds_profutils.attach(engine, config=engine.config):
        engine.train(8)
    first = {e["name"]: e["ts"] for e in read_trace(tmp_path / "trace_rank_0.json")["traceEvents"]
             if e.get("name", "").startswith("ProfilerStep#")}
    if new_process:
        writer_module._writers.clear()
    resumed = AccumulatingEngine(profiler_config(tmp_path), global_steps=4)
    with ds_profutils.attach(resumed, config=resumed.config):
        resumed.train(4)  # global steps 4-7: wait 4, warmup 5, active 6-7
    trace = read_trace(tmp_path / "trace_rank_0.json")
    assert profiler_steps(trace) == [2, 3, 6, 7]
    later = {e["name"]: e["ts"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert later["ProfilerStep#2"] == first["ProfilerStep#2"] and later["ProfilerStep#6"] > first["ProfilerStep#7"]


@pytest.mark.parametrize("new_process", [False, True])
def test_a_resume_leaves_out_the_earlier_cycles_from_its_first_step_not_from_its_first_warmup(tmp_path, new_process):
    """Steps 0-11 profiled (cycles 2-3, 6-7, 10-11), then a restart from the checkpoint at step 7: its first warmup
    is step 8, but step 7 is trained again too, so the cycle 6-7 is the earlier run's no more."""
    from ds_profutils.torch_profiler import writer as writer_module

    engine = AccumulatingEngine(profiler_config(tmp_path))
    with ds_profutils.attach(engine, config=engine.config):
        engine.train(12)
    if new_process:
        writer_module._writers.clear()
    resumed = AccumulatingEngine(profiler_config(tmp_path), global_steps=7)
    with ds_profutils.attach(resumed, config=resumed.config):
        resumed.train(4)  # global steps 7-10: wait 7, warmup 8, active 9-10
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [2, 3, 9, 10]


@pytest.mark.parametrize("new_process", [False, True])
def test_a_job_from_step_0_starts_afresh_however_late_its_first_window(tmp_path, new_process):
    from ds_profutils.torch_profiler import writer as writer_module

    engine = AccumulatingEngine(profiler_config(tmp_path))
    with ds_profutils.attach(engine, config=engine.config):
        engine.train(8)  # cycles 2-3 and 6-7
    if new_process:
        writer_module._writers.clear()
    again = AccumulatingEngine(profiler_config(tmp_path, skip_first=4))
    with ds_profutils.attach(again, config=again.config):
        again.train(8)  # skip 0-3, wait 4, warmup 5, active 6-7
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [6, 7]


def test_a_restart_takes_up_the_cycles_of_the_run_it_resumes_not_an_earlier_jobs(tmp_path):
    """A job, the same job again from step 0 in the same output_dir (its first cycle's files stay there), then a
    restart of the second from its checkpoint at step 4, each in a new process."""
    from ds_profutils.torch_profiler import writer as writer_module

    for _ in range(2):
        writer_module._writers.clear()
        engine = AccumulatingEngine(profiler_config(tmp_path))
        with ds_profutils.attach(engine, config=engine.config):
            engine.train(4)  # cycle 2-3
    second = {e["name"]: e["ts"] for e in read_trace(tmp_path / "trace_rank_0.json")["traceEvents"]
              if e.get("name", "").startswith("ProfilerStep#")}
    writer_module._writers.clear()
    resumed = AccumulatingEngine(profiler_config(tmp_path), global_steps=4)
    with ds_profutils.attach(resumed, config=resumed.config):
        resumed.train(4)  # global steps 4-7: active 6-7
    trace = read_trace(tmp_path / "trace_rank_0.json")
    assert profiler_steps(trace) == [2, 3, 6, 7]
    assert {e["name"]: e["ts"] for e in trace["traceEvents"] if e.get("name") == "ProfilerStep#2"} == {
        "ProfilerStep#2": second["ProfilerStep#2"]}  # the second job's, the one resumed


def test_an_engine_dropped_without_close_gives_the_profiler_to_the_next(tmp_path, ds_caplog):
    engine = AccumulatingEngine(profiler_config(tmp_path / "first", active=4))
    ds_profutils.attach(engine, config=engine.config)
    engine.train(4)  # steps 2-3 recorded, step 4's range open
    del engine
    gc.collect()
    second = AccumulatingEngine(profiler_config(tmp_path / "second"))
    with ds_profutils.attach(second, config=second.config):
        second.train(4)
    assert profiler_steps(read_trace(tmp_path / "first" / "trace_rank_0.json")) == [2, 3]
    assert profiler_steps(read_trace(tmp_path / "second" / "trace_rank_0.json")) == [2, 3]
    assert any("dropped without close()" in r.message for r in ds_caplog.records)


def test_a_decorated_call_in_another_thread_runs_beside_the_engines(tmp_path):
    engine = AccumulatingEngine(profiler_config(tmp_path, active=4))
    attachment = ds_profutils.attach(engine, config=engine.config)
    engine.train(2)

    ran = []

    @profiler(output_dir=str(tmp_path / "thread"), skip_first=0, wait=0, warmup=0, active=2)
    def elsewhere():
        step_profiler()
        step_profiler()
        ran.append(True)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert ran == [True]  # the call ran to its end (unprofiled), and took nothing from the engine's run
    engine.train(4)
    attachment.close()
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [2, 3, 4, 5]
    assert not (tmp_path / "thread").exists()


def test_step_profiler_in_the_loop_does_not_count_twice(tmp_path):
    engine = AccumulatingEngine(profiler_config(tmp_path))
    with ds_profutils.attach(engine, config=engine.config):
        for _ in range(16):
            engine.train_step()
            step_profiler(engine)
            step_profiler()
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [2, 3, 6, 7]


def test_a_decorated_call_already_running_keeps_the_profiler(tmp_path, ds_caplog):
    engine = AccumulatingEngine(profiler_config(tmp_path / "engine"))
    attachment = ds_profutils.attach(engine, config=engine.config)

    @profiler(output_dir=str(tmp_path / "decorated"), skip_first=0, wait=0, warmup=0, active=3, repeat=1)
    def train():
        for _ in range(6):
            engine.train_step()
            step_profiler(engine)

    train()
    engine.train(4)  # after the call: the engine's profiler stays idle for the rest of its attachment
    attachment.close()
    assert profiler_steps(read_trace(tmp_path / "decorated" / "trace_rank_0.json")) == [0, 1, 2]
    assert not (tmp_path / "engine").exists()
    assert len([r for r in ds_caplog.records if "stays idle" in r.message]) == 1


def test_a_decorated_call_begun_while_the_engine_profiles_takes_over(tmp_path, ds_caplog):
    """Explicit beats implicit: the engine's window is written where the call began, and the call profiles."""
    engine = AccumulatingEngine(profiler_config(tmp_path, wait=0, active=4))
    attachment = ds_profutils.attach(engine, config=engine.config)
    engine.train(3)  # warmup 0, active 1-2, and step 3's range open

    @profiler(output_dir=str(tmp_path / "decorated"), skip_first=0, wait=0, warmup=1, active=1, repeat=1)
    def evaluate():
        for _ in range(2):
            engine.train(1)
            step_profiler(engine)

    evaluate()
    engine.train(3)
    attachment.close()
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [1, 2]
    assert profiler_steps(read_trace(tmp_path / "decorated" / "trace_rank_0.json")) == [4]  # warmup 3, active 4
    assert any("takes over" in r.message for r in ds_caplog.records)


def test_ranks_left_out_and_an_absent_section_attach_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # rank 0 of 2, as the launcher says
    left_out = AccumulatingEngine({"profiler": {"output_dir": str(tmp_path), "ranks": [1]}})
    assert ds_profutils.attach(left_out, config=left_out.config) is None  # this is rank 0
    absent = AccumulatingEngine({"train_batch_size": 2})
    assert ds_profutils.attach(absent, config=absent.config) is None
    assert "step" not in vars(left_out) and "step" not in vars(absent)
    assert not list(tmp_path.iterdir())


def test_by_default_the_lowest_profiled_rank_writes_and_prints_the_operator_summary(tmp_path, monkeypatch, capsys):
    """profiler.ranks [1] of 2, summary_ranks left out: rank 1 (the lowest profiled rank, which prints the end-of-run
    lines) writes summary_rank_1.txt and prints its table, as docs/configuration.md says."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    engine = AccumulatingEngine(profiler_config(tmp_path, ranks=[1], repeat=1))
    with ds_profutils.attach(engine, config=engine.config):
        engine.train(4)
    assert "aten::mul" in (tmp_path / "summary_rank_1.txt").read_text()
    assert not (tmp_path / "summary_rank_0.txt").exists()
    out = capsys.readouterr().out
    assert f"operator summary  {tmp_path / 'summary_rank_1.txt'}" in out and "aten::mul" in out
    assert ds_profutils.config.load_config(engine.config).profiler.summary_ranks == [1]
    explicit = {"profiler": {**engine.config["profiler"], "summary_ranks": [0]}}  # as written: rank 0 (not profiled)
    assert ds_profutils.config.load_config(explicit).profiler.summary_ranks == [0]


def test_a_rank_outside_the_world_fails_at_attach_naming_the_key(tmp_path):
    engine = AccumulatingEngine({"profiler": {"output_dir": str(tmp_path), "summary_ranks": [7]}})
    with pytest.raises(ds_profutils.config.ConfigError, match="profiler.summary_ranks"):
        ds_profutils.attach(engine, config=engine.config)
    assert "step" not in vars(engine)


# ---- a process of its own: exit without close, SIGTERM at a boundary, SIGTERM in a hung step ---------------

_JOB = textwrap.dedent("""
    import os, signal, sys, threading, time
    import torch
    sys.path.insert(0, sys.argv[3])
    import ds_profutils
    from ds_profutils.torch_profiler import watchdog
    from test_profiler_engine_driven import AccumulatingEngine

    out, mode = sys.argv[1], sys.argv[2]
    hangs = mode in ("hung", "taken-elsewhere", "between-steps", "saving", "other-engine")
    # hung: the step never reaches its boundary, so the grace runs out; boundary: it does, in 0.5 s, and a grace load
    # cannot eat keeps it so (on a busy machine 1 s was not: the unwind came first, outside the forward)
    watchdog.GRACE_S = 1.0 if hangs else 20.0
    engine = AccumulatingEngine({"profiler": {"output_dir": out, "skip_first": 0, "wait": 0, "warmup": 1,
                                              "active": 1000}})
    engine.save_checkpoint = lambda save_dir: time.sleep(60)  # a save that does not end in time
    ds_profutils.attach(engine, config=engine.config)
    def slowed(forward):
        def slow_forward(x):
            if engine.global_steps == 6:
                print("recording", flush=True)
                if mode == "taken-elsewhere":  # a thread of the process takes the SIGTERM while this one sleeps
                    threading.Timer(1.0, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGTERM)).start()
                time.sleep(60 if hangs else 0.5)
            return forward(x)
        return slow_forward

    train_mode = engine.module.train

    def slow_batch(training=True):  # train_step's first call: the program's loop, outside the engine's calls
        if engine.global_steps == 6 and engine.micro_steps % 2 == 0:
            print("recording", flush=True)
            if mode == "saving":  # the engine's own work between steps
                engine.save_checkpoint(out)
            time.sleep(60)  # a batch that never comes
        return train_mode(training)

    if mode in ("between-steps", "saving"):
        engine.module.train = slow_batch
    elif mode == "other-engine":  # RLHF: a second engine, its steps recorded but not profiled, hangs in its forward
        other = AccumulatingEngine({"step_metrics": {"enabled": True, "output_dir": out + "/records"}})
        other.get_data_types = lambda: (torch.float32, torch.float32)  # what the recorder asks of a DeepSpeed engine
        ds_profutils.attach(other, config=other.config)
        other.module.forward = slowed(other.module.forward)
    else:
        engine.module.forward = slowed(engine.module.forward)
    try:
        for _ in range(16 if mode == "exit" else 200):
            engine.train_step()
            if mode == "other-engine":
                other.train_step()
    finally:
        print("cleanup found the trace on disk" if os.path.exists(out + "/trace_rank_0.json")
              else "cleanup found no trace", flush=True)
""")


def _run(tmp_path, mode, send_sigterm):
    job = subprocess.Popen([sys.executable, "-c", _JOB, str(tmp_path), mode, str(TESTS)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        if send_sigterm:
            for line in job.stdout:
                if line.strip() == "recording":
                    job.send_signal(signal.SIGTERM)  # what the launcher sends, 30 s before SIGKILL
                    break
        output, _ = job.communicate(timeout=90)
    finally:
        job.kill()
    return job.returncode, output


def test_a_process_that_exits_without_close_writes_the_window_in_flight(tmp_path):
    status, output = _run(tmp_path, "exit", send_sigterm=False)
    assert status == 0, output
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == list(range(1, 8))
    assert "was not written" not in output


@pytest.mark.parametrize("mode", ["boundary", "hung", "taken-elsewhere", "between-steps", "saving",
                                  "other-engine"])
def test_sigterm_writes_the_window_then_ends_the_process_as_sigterm_would(tmp_path, mode):
    """``boundary``: the step in flight ends within the grace period, and the window is written at its
    ``engine.step()``; ``hung``: it does not, the SystemExit raised for the SIGTERM is caught leaving the
    engine's forward and the window written there; ``taken-elsewhere``: as ``hung``, but another thread took
    the SIGTERM (the kernel gives a process's signal to any thread that does not block it), so the sleeping
    main thread ran no handler until the watchdog sent it the signal; ``between-steps``: the program's loop waits
    for a batch that does not come, outside the engine's calls, and the window is written right there; ``saving``:
    a checkpoint save there does not end, and the window is written as the exception leaves it; ``other-engine``:
    a second attached engine's forward hangs (no profiler there), and its hooks end the first one's run.  Each time
    the process then ends killed by SIGTERM, as without the profiler: no ``finally`` of the program runs (its
    barriers would meet dead peers)."""
    status, output = _run(tmp_path, mode, send_sigterm=mode != "taken-elsewhere")
    assert status == -signal.SIGTERM, output
    assert "rank 0 interrupted at step" in output and "cleanup found" not in output
    trace = read_trace(tmp_path / "trace_rank_0.json")
    waited = mode == "between-steps"  # for step 6's batch: the range open then is no step, and is named so
    assert profiler_steps(trace) == list(range(1, 6 if waited else 7)), output  # hung: step 6 cut where it stopped
    assert [e["name"] for e in trace["traceEvents"] if e.get("name") == TAIL_RANGE] == [TAIL_RANGE] * waited
    assert not [p for p in tmp_path.rglob(".*")], "temporary files left behind"


def test_our_own_work_keeps_the_run_going_where_our_wrapper_waiting_on_the_programs_collective_does_not(monkeypatch):
    """What the signal guard asks before ending an engine's run where the main thread is: a listener of ours on the
    stack (its update half done) and code our collective wrapper calls for its own bookkeeping are our work; the
    program's collective our wrappers wait on (``torch.distributed``'s, and ``deepspeed.comm``'s backend's between
    steps and in a recorded step) is not."""
    seen = {}
    engine = Engine()
    recorded = EngineCollectives(engine)

    class Backend:  # deepspeed.comm's backend object, its all_reduce the program's
        @staticmethod
        def all_reduce(*args, **kwargs):
            where = "between steps" if recorded.step is None else "in a recorded step"
            seen.setdefault(f"in deepspeed.comm's, {where}", inside_ours(sys._getframe()))

    class Asking(Listener):
        def step_ended(self):
            seen.setdefault("in a listener", inside_ours(sys._getframe()))

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *args, **kwargs: seen.setdefault(
        "in torch.distributed's", inside_ours(sys._getframe())))
    monkeypatch.setattr(deepspeed_comm, "cdb", Backend())
    wrappers = detach = hooks = None
    try:
        wrappers = TorchCollectives(lambda op, host_ns: seen.setdefault(  # called by the wrapper, after the wait
            "in the wrapper's bookkeeping", inside_ours(sys._getframe())))
        torch.distributed.all_reduce(torch.ones(1))
        detach = attach_engine(recorded, None)
        deepspeed_comm.cdb.all_reduce(torch.ones(1))
        recorded.step = StepRecord({"mode": "train"}, None, None)
        deepspeed_comm.cdb.all_reduce(torch.ones(1))
        hooks = EngineHooks(engine)
        hooks.add(Asking())
        engine.train_step()
    finally:
        for undo in (detach, wrappers and wrappers.remove, hooks and hooks.remove):
            if undo:
                undo()
    assert seen == {"in torch.distributed's": False, "in the wrapper's bookkeeping": True,
                    "in deepspeed.comm's, between steps": False, "in deepspeed.comm's, in a recorded step": False,
                    "in a listener": True}
    assert not inside_ours(sys._getframe())


@pytest.mark.parametrize("waits_in", ["sleep", "collective"])
def test_ctrl_c_while_the_loop_waits_for_a_batch_writes_the_window_before_the_keyboardinterrupt(tmp_path, monkeypatch,
                                                                                               handlers, waits_in):
    """No optimizer step comes in the grace period and the loop is outside the engine's calls: the window is written
    there, and the KeyboardInterrupt comes out where the loop waited, finding the trace on disk.  ``collective``: the
    loop waits in a ``torch.distributed`` collective of its own (a peer late), timed by our wrapper around it, which
    is no work of ours to finish first (before, the window was left to the exit)."""
    monkeypatch.setattr(watchdog, "GRACE_S", 0.5)
    summaries = []  # DeepSpeed's comms summary has barriers: never after a signal stopped the run
    monkeypatch.setattr(engine_driven, "show_comms_summary", lambda *args: summaries.append(args))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None, group=None, async_op=False:
                        time.sleep(60))  # the peer that never comes, wrapped by ours below as the real one is
    timed_calls = []
    engine = AccumulatingEngine(profiler_config(tmp_path, wait=0, warmup=1, active=1000))
    found = []
    train_mode = engine.module.train

    def slow_batch(training=True):
        if engine.global_steps == 6 and engine.micro_steps % 2 == 0:
            os.kill(os.getpid(), signal.SIGINT)
            try:
                torch.distributed.all_reduce(torch.ones(1)) if waits_in == "collective" else time.sleep(60)
            except KeyboardInterrupt:
                found.append(profiler_steps(read_trace(tmp_path / "trace_rank_0.json")))
                raise
        return train_mode(training)

    wrappers = TorchCollectives(lambda op, host_ns: timed_calls.append(op))
    try:
        with ds_profutils.attach(engine, config=engine.config):
            engine.module.train = slow_batch
            with pytest.raises(KeyboardInterrupt):
                engine.train(100)
    finally:
        wrappers.remove()
    assert found == [[1, 2, 3, 4, 5]]
    assert timed_calls == (["torch.distributed.all_reduce"] if waits_in == "collective" else [])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert summaries == []  # at close(), after the program caught the KeyboardInterrupt
