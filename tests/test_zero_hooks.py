"""The hooks ``attach`` puts on an engine: restored exactly, never raising into training, and not mistaking
an exception raised by a signal handler for their own."""
import os
from pathlib import Path
import signal
import time

import pytest
import torch

from ds_profutils.engine.hooks import BETWEEN_STEPS, EngineHooks, Listener, running
from test_zero_attach import Engine, read_records, recorder_for


def test_close_restores_a_wrapper_put_on_the_engine_before_attach(tmp_path):
    engine = Engine()
    step = engine.step
    calls = []

    def theirs():  # e.g. a framework that wraps engine.step on the instance
        calls.append("theirs")
        step()

    engine.step = theirs
    with recorder_for(engine, tmp_path):
        engine.train_step()
        assert vars(engine)["step"] is not theirs
    assert vars(engine)["step"] is theirs and "forward" not in vars(engine) and "backward" not in vars(engine)
    engine.train_step()
    assert calls == ["theirs", "theirs"] and len(read_records(tmp_path)) == 1


def test_a_wrapper_put_over_ours_after_attach_keeps_working_after_close(tmp_path):
    engine = Engine()
    attached = recorder_for(engine, tmp_path)
    ours = engine.step

    def theirs():
        ours()

    engine.step = theirs
    engine.train_step()
    attached.close()
    assert vars(engine)["step"] is theirs  # not taken out from under their wrapper
    engine.train_step()  # ours passes through, recording nothing
    assert engine.global_steps == 2 and len(read_records(tmp_path)) == 1


def test_a_recorder_started_afresh_replaces_the_file_and_one_appending_adds_to_it(tmp_path, ds_caplog):
    engine = Engine()
    with recorder_for(engine, tmp_path):
        engine.train_step()
    with recorder_for(engine, tmp_path, append=True):  # attached again: an RLHF phase, a resumed train()
        engine.train_step()
        engine.train_step()
    assert [(r["global_step"], r["segment"]) for r in read_records(tmp_path)] == [(0, 0), (1, 0), (2, 0)]
    with recorder_for(engine, Path(tmp_path)):  # a new process resuming at step 3: appends, a new segment
        engine.train_step()
    assert [(r["global_step"], r["segment"]) for r in read_records(tmp_path)] == [(0, 0), (1, 0), (2, 0), (3, 1)]
    engine.global_steps = 0
    with recorder_for(engine, tmp_path):  # a new process starting at step 0: replaces the file, and says so
        engine.train_step()
    assert [(r["global_step"], r["segment"]) for r in read_records(tmp_path)] == [(0, 0)]
    assert "held records of an earlier run" in ds_caplog.text


def test_a_step_that_comes_again_starts_a_segment_and_the_report_takes_the_latest(tmp_path):
    """A process that trains steps 0-3, then resumes from its checkpoint at step 1 (a second train())."""
    engine = Engine()
    with recorder_for(engine, tmp_path):
        for _ in range(4):
            engine.train_step()
        engine.global_steps = 1
        for _ in range(3):
            engine.train_step()
    records = read_records(tmp_path)
    assert [(r["global_step"], r["segment"]) for r in records] == [(0, 0), (1, 0), (2, 0), (3, 0), (1, 1), (2, 1),
                                                                   (3, 1)]
    from ds_profutils.report.records import read_records as read_file_records
    steps = read_file_records(tmp_path / "zero_fetch_rank_3.jsonl", "main", 3)
    assert steps.superseded == 3 and list(steps.global_steps) == [0, 1, 2, 3]


class Failing(Listener):

    def __init__(self, error):
        self.error = error
        self.stopped = None

    def forward_started(self, module, args, kwargs):
        raise self.error

    def stop_after_error(self, exc):
        self.stopped = exc


def test_a_listeners_own_error_stops_it_and_training_goes_on():
    engine = Engine()
    hooks = EngineHooks(engine)
    failing = Failing(RuntimeError("ours"))
    hooks.add(failing)
    engine.train_step()
    engine.train_step()
    assert engine.global_steps == 2 and str(failing.stopped) == "ours"
    assert "step" not in vars(engine)  # the last listener gone: the engine is as DeepSpeed made it


def test_the_last_listener_failing_as_a_forward_ends_leaves_no_hook_on_its_output():
    """The hooks are removed as their last listener fails inside ``forward_ended``: the forward's output gets no
    backward watch then, which would keep the removed hooks alive for as long as the program keeps its graph."""
    import gc
    import weakref

    class FailingAtForwardEnd(Listener):
        def forward_ended(self, module, output):
            raise RuntimeError("ours")

    engine = Engine()
    engine.module.train()
    hooks = EngineHooks(engine)
    hooks.add(FailingAtForwardEnd())
    output = engine.forward(torch.ones(1, requires_grad=True))
    assert output.requires_grad and not hooks.listeners and "forward" not in vars(engine)
    removed = weakref.ref(hooks)
    del hooks
    gc.collect()
    assert removed() is None


def test_an_exception_from_a_signal_handler_inside_a_hook_reaches_the_training_loop():
    """torch's DataLoader SIGCHLD handler raises RuntimeError when a worker dies, from whatever code runs;
    inside one of our hooks that is the program's error, not ours to swallow."""

    class Signalled(Listener):

        def forward_started(self, module, args, kwargs):
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs before the next bytecode here

    def handler(signum, frame):
        raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed.")

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        engine = Engine()
        hooks = EngineHooks(engine)
        hooks.add(Signalled())
        with pytest.raises(RuntimeError, match="DataLoader worker"):
            engine.train_step()
        assert len(hooks.listeners) == 1  # and the listener was not taken for a failed one
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_each_listener_hears_a_steps_end_and_its_optimizer_step_before_the_next_listener_does():
    """A listener acts on what those before it did with the step (the engine-driven profiler's window starts only once
    a trace capture before it ended); an interruption a later listener re-raises (Ctrl-C out of a profiler window,
    which a program may catch and go on) leaves every listener before it told of the optimizer step."""
    heard = []

    class Hearing(Listener):
        def __init__(self, name, interrupts_at=None):
            self.name, self.interrupts_at = name, interrupts_at

        def step_ended(self):
            heard.append((self.name, "step_ended"))
            if self.interrupts_at == engine.global_steps:
                os.kill(os.getpid(), signal.SIGUSR1)  # its handler raises before the next bytecode here

        def optimizer_step_ended(self, global_step):
            heard.append((self.name, global_step))

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        engine = Engine()
        hooks = EngineHooks(engine)
        for listener in (Hearing("capture"), Hearing("profiler", interrupts_at=2), Hearing("snapshots")):
            hooks.add(listener)
        engine.train_step()
        assert heard == [("capture", "step_ended"), ("capture", 0), ("profiler", "step_ended"), ("profiler", 0),
                         ("snapshots", "step_ended"), ("snapshots", 0)]
        heard.clear()
        with pytest.raises(KeyboardInterrupt):
            engine.train_step()  # global step 1 ends: the profiler's step_ended is interrupted
        assert heard == [("capture", "step_ended"), ("capture", 1), ("profiler", "step_ended")]
        assert len(hooks.listeners) == 3  # nobody's error: every listener goes on
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_listener_failing_after_another_removed_the_hooks_does_not_reach_the_training_loop():
    """Removing the hooks inside a listener (closing the attachment from a callback) empties the listeners; one
    after it in the same step's end that then fails is stopped as ever, and its error stays ours."""

    class Closing(Listener):
        def step_ended(self):
            hooks.remove()

    class FailingAtStepEnd(Failing):
        def forward_started(self, module, args, kwargs):
            pass

        def step_ended(self):
            raise self.error

    engine = Engine()
    hooks = EngineHooks(engine)
    failing = FailingAtStepEnd(RuntimeError("ours"))
    hooks.add(Closing())
    hooks.add(failing)
    engine.train_step()
    assert str(failing.stopped) == "ours" and hooks.listeners == [] and "step" not in vars(engine)


def test_no_engine_runs_after_its_steps_whatever_left_a_forward():
    """A forward inside a forward of the module (Lightning's training_step), and a forward a KeyboardInterrupt
    left (torch calls always-call hooks on an Exception only; the program caught it): no engine runs after
    either, so a collective between steps is the gap's."""
    engine = Engine()
    hooks = EngineHooks(engine)
    hooks.add(Listener())
    inner = engine.module.forward
    engine.module.forward = lambda x: inner(x) if x.numel() > 1 else engine.module(torch.ones(2))  # nested
    engine.train_step()
    assert running.engine_id is None
    engine.module.forward = inner

    def interrupt(*_):
        raise KeyboardInterrupt

    handle = engine.module.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.forward()
    assert running.engine_id is None and hooks.phase == BETWEEN_STEPS
    handle.remove()
    engine.train_step()
    assert running.engine_id is None


def test_errors_leaving_the_engine_reach_listeners_that_watch_them_and_go_on_unchanged():

    class Watching(Listener):
        def __init__(self):
            self.seen = []

        def failed(self, exc):
            self.seen.append(exc)

    engine = Engine()
    error = MemoryError("out of memory")

    def backward():
        raise error

    engine.backward = backward
    watching = Watching()
    hooks = EngineHooks(engine)
    hooks.add(watching)
    engine.forward()
    with pytest.raises(MemoryError) as raised:
        engine.backward()
    assert raised.value is error and watching.seen == [error]
    hooks.remove()
    assert vars(engine)["backward"] is backward and "forward" not in vars(engine)


def test_a_micro_step_without_a_step_ends_when_its_backward_returns(tmp_path):
    """Accelerate (and so the Trainer) calls engine.step() only at the accumulation boundary: the micro step
    before it ends when engine.backward() returns, its backward's time included."""
    engine = Engine()
    backward = engine.backward

    def slow_backward():
        backward()
        time.sleep(0.05)

    engine.backward = slow_backward  # in place before attach, as the engine's method is
    with recorder_for(engine, tmp_path):
        engine.forward()
        engine.backward()  # micro step 0: no step()
        engine.forward()
        engine.backward()
        engine.step()  # the boundary
    first, second = read_records(tmp_path)
    assert (first["micro_step"], second["micro_step"]) == (0, 1) and first["global_step"] == second["global_step"]
    assert first["step_time_ms"] >= 50 and second["step_time_ms"] >= 50
    assert first["events"]["backward_fetch_wait"]["count"] == 1
    assert vars(engine)["backward"] is slow_backward


def test_a_forward_under_no_grad_in_train_mode_is_no_train_micro_step(tmp_path):
    """DPO or PEFT reference logits: a forward under torch.no_grad() while the model trains is recorded as what
    it is, and the micro steps around it keep their numbers."""
    engine = Engine()
    with recorder_for(engine, tmp_path):
        engine.module.train()
        with torch.no_grad():
            engine.forward()
        engine.forward()
        engine.backward()
        engine.step()
        engine.train_step()
    reference, first, second = read_records(tmp_path)
    assert reference["mode"] == "no_grad" and (first["mode"], second["mode"]) == ("train", "train")
    assert (reference["micro_step"], first["micro_step"], second["micro_step"]) == (0, 0, 1)


def test_a_torch_style_backward_ends_its_micro_step_where_the_backward_ends(tmp_path):
    """``loss.backward()`` instead of engine.backward(), two micro steps before the boundary: each record holds
    its backward (50 ms, with its fetch wait), so its step time covers its waits (busy time >= 0)."""
    engine = Engine()

    def slow_backward(grad):
        engine.coordinator.fetch("backward_fetch_wait", 5)
        time.sleep(0.05)

    with recorder_for(engine, tmp_path):
        engine.module.train()
        for _ in range(2):
            output = engine.forward(torch.ones(1, requires_grad=True))
            output.register_hook(slow_backward)
            output.sum().backward()
        engine.step()
    first, second = read_records(tmp_path)
    assert (first["micro_step"], second["micro_step"]) == (0, 1)
    for record in (first, second):
        assert record["events"]["backward_fetch_wait"]["count"] == 1
        assert record["step_time_ms"] >= 50 and record["step_time_ms"] >= record["exposed_wait_ms"]
