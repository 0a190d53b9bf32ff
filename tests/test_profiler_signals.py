"""The profiler under SIGTERM, SIGINT and the program's own signals: handlers only while a window holds
unsaved steps, the window written at the next step boundary before the program's cleanup, every Python
handler held (and then delivered) while the profiler works, the signal's meaning kept afterwards, and a
hold that never outlives its deadline, even with the main thread stuck."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch

from ds_profutils import _signal_exit, profiler, step_profiler
from ds_profutils.torch_profiler import calls as profiler_calls
from ds_profutils.torch_profiler import run as profiler_run
from ds_profutils.torch_profiler import watchdog
from profiler_testing import profiler_steps, read_trace, train_step

SCHEDULE = dict(skip_first=0, wait=2, warmup=1, active=3)  # active steps 3, 4, 5
_original_export = torch.profiler.profile.export_chrome_trace


def _export_sending(monkeypatch, *signums):
    """Make every trace export send ``signums`` to this process first, as a launcher or a user would
    while the profiler writes."""

    def export(self, path, use_python_export=False):
        for signum in signums:
            os.kill(os.getpid(), signum)
        return _original_export(self, path, use_python_export)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export)


def test_handlers_are_installed_only_while_a_window_holds_unsaved_steps(tmp_path, handlers):
    """And the watchdog keeping their deadline runs only then: no thread or pipe of ours outside a window."""
    seen, watchdogs, fds = [], [], []

    def train():
        for _ in range(8):
            seen.append(signal.getsignal(signal.SIGTERM))
            watchdogs.append([thread.name for thread in threading.enumerate()].count("ds_profutils-signal-watchdog"))
            fds.append(len(os.listdir("/proc/self/fd")))
            step_profiler()

    profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
    assert seen[:3] == [signal.SIG_DFL] * 3  # wait, wait, warmup: nothing unsaved
    assert all(callable(handler) for handler in seen[3:6])  # active steps
    assert seen[6:] == [signal.SIG_DFL] * 2  # the window is on disk
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert watchdogs == [0, 0, 0, 1, 1, 1, 0, 0]
    assert fds[6:] == [fds[0]] * 2 and fds[3] == fds[0] + 2  # its pipe, closed with it


def test_a_window_armed_as_the_last_ones_watchdog_thread_ends_gets_a_thread_of_its_own(monkeypatch):
    """An uninstall waits a bounded time for the thread to end; one that ends only later (descheduled as it ends)
    must not pass for the next window's thread: a signal held then would have no deadline."""

    class SlowToEnd(watchdog.Watchdog):
        def _loop(self, *args):
            super()._loop(*args)
            time.sleep(0.3)

    monkeypatch.setattr(watchdog, "_END_WAIT_S", 0.05)
    dog, guard = SlowToEnd(), object()
    dog.install(guard)
    dog.uninstall(guard)  # gives up waiting: the thread still sleeps on its way out
    dog.install(guard)
    time.sleep(0.6)
    try:
        assert dog._thread is not None and dog._thread.is_alive()
    finally:
        dog.uninstall(guard)


def test_a_programs_own_handler_is_called_instead_and_kept(tmp_path, handlers):
    received = []

    def own(signum, frame):
        received.append(signum)

    def train():
        for step in range(8):
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            if step == 5:
                signal.signal(signal.SIGINT, own)  # replaced while the window runs: kept afterwards
            step_profiler()

    signal.signal(signal.SIGTERM, own)
    profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
    assert received == [signal.SIGTERM]
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4, 5]
    assert signal.getsignal(signal.SIGTERM) is own and signal.getsignal(signal.SIGINT) is own


@pytest.mark.parametrize("while_torch", ["stops", "exports"])
def test_a_sigterm_the_program_handles_while_writing_stops_nothing(tmp_path, handlers, monkeypatch, ds_caplog,
                                                                    while_torch):
    """Graceful preemption (SLURM's --signal, a handler that sets a flag and checkpoints): a SIGTERM that
    arrives while a cycle is written reaches the program's handler once the files are on disk; the run,
    its later cycles, their operator summary and the other writers (the ZeRO-3 recorders) go on."""
    if while_torch == "exports":
        _export_sending(monkeypatch, signal.SIGTERM)
    else:
        stop = torch.profiler.profile.stop_trace

        def stop_sending(self):
            os.kill(os.getpid(), signal.SIGTERM)
            return stop(self)

        monkeypatch.setattr(torch.profiler.profile, "stop_trace", stop_sending)
    received, other_writer_closed, summaries = [], [], []
    _signal_exit.call_before_signal_exit(lambda: other_writer_closed.append(True))
    monkeypatch.setattr(profiler_run, "show_comms_summary", lambda *args: summaries.append(args))
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))

    def train():
        for _ in range(6):
            step_profiler()

    try:
        profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=1, active=2, repeat=2)(train)()
        assert received == [signal.SIGTERM, signal.SIGTERM]  # one per cycle written
        assert other_writer_closed == [] and len(summaries) == 1  # a normal end: the comms summary is shown
        assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [1, 2, 4, 5]
        assert "interrupted" not in ds_caplog.text and "leaves out" not in ds_caplog.text
    finally:
        _signal_exit._callbacks.clear()


def test_ctrl_c_writes_the_window_before_the_programs_cleanup_runs(tmp_path, handlers):
    """Ctrl-C mid-step: the step goes on to its step_profiler(), which writes the window (that step its last)
    and only then raises KeyboardInterrupt; the program's finally (a checkpoint save, a barrier) finds the
    window on disk."""
    seen_by_cleanup = []

    def train():
        try:
            for step in range(20):
                train_step()
                if step == 4:
                    os.kill(os.getpid(), signal.SIGINT)
                    train_step()  # the rest of the step runs
                step_profiler()
        finally:
            path = tmp_path / "trace_rank_0.json"
            seen_by_cleanup.append(profiler_steps(read_trace(path)) if path.exists() else None)

    with pytest.raises(KeyboardInterrupt):
        profiler(output_dir=str(tmp_path), skip_first=0, wait=2, warmup=1, active=10)(train)()
    assert seen_by_cleanup == [[3, 4]]  # step 4 finished: it is in the window


def test_after_a_noted_ctrl_c_other_handlers_wait_for_the_window_too(tmp_path, handlers):
    """Ctrl-C kills the DataLoader workers with the rank: their SIGCHLD must not reach torch's handler (which
    raises) before the window is written; it is delivered after it, not dropped."""
    seen = []
    previous_sigchld = signal.signal(signal.SIGCHLD,
                                     lambda signum, frame: seen.append((tmp_path / "trace_rank_0.json").exists()))

    def train():
        for step in range(20):
            if step == 4:
                os.kill(os.getpid(), signal.SIGINT)
                signal.raise_signal(signal.SIGCHLD)
                assert seen == []
            step_profiler()

    try:
        with pytest.raises(KeyboardInterrupt):
            profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
        _run_pending_handlers()
        assert seen == [True]
    finally:
        signal.signal(signal.SIGCHLD, previous_sigchld)


def _run_pending_handlers():
    """A Python call: handlers of signals tripped while another handler raised run as it begins."""


def test_a_step_that_does_not_end_in_the_grace_period_is_unwound(tmp_path, handlers, monkeypatch):
    """No step boundary within GRACE_S (a long step, a hung collective): the main thread is interrupted where it
    waits, KeyboardInterrupt unwinds to the profiled block, and the window is written there."""
    monkeypatch.setattr(watchdog, "GRACE_S", 0.5)
    began = []

    def train():
        for step in range(20):
            if step == 4:
                os.kill(os.getpid(), signal.SIGINT)
                began.append(time.monotonic())
                time.sleep(60)  # a step that does not end in time
            step_profiler()

    with pytest.raises(KeyboardInterrupt):
        profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
    assert 0.5 <= time.monotonic() - began[0] < 10
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4]  # step 4 cut where it stopped
    assert profiler_calls._current is None and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_run_that_returns_after_a_users_except_keyboardinterrupt_shows_no_comms_summary(tmp_path, handlers,
                                                                                      monkeypatch):
    """The comms logger's summary has barriers: never after Ctrl-C, even when the function catches it."""
    summaries = []
    monkeypatch.setattr(profiler_run, "show_comms_summary", lambda *args: summaries.append(args))

    def train():
        try:
            for step in range(8):
                if step == 4:
                    os.kill(os.getpid(), signal.SIGINT)
                step_profiler()
        except KeyboardInterrupt:
            return "saved"

    assert profiler(output_dir=str(tmp_path), **SCHEDULE)(train)() == "saved"
    assert summaries == []
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4]


def test_an_exception_from_a_programs_handler_while_writing_reaches_the_program(tmp_path, handlers, monkeypatch,
                                                                              ds_caplog):
    """A program's handler runs after the files are written, and what it raises comes out of step_profiler():
    it is not taken for a write failure and logged away while training goes on."""
    _export_sending(monkeypatch, signal.SIGUSR1)
    steps_run = []

    def preempted(signum, frame):
        raise RuntimeError("preempted")

    previous = signal.signal(signal.SIGUSR1, preempted)
    try:

        def train():
            for step in range(20):
                steps_run.append(step)
                step_profiler()

        with pytest.raises(RuntimeError, match="preempted"):
            profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert steps_run[-1] == 5  # raised by the step_profiler() that ended the window, once it was written
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4, 5]
    assert "was not written" not in ds_caplog.text and "failed" not in ds_caplog.text


def test_a_sigchld_while_writing_is_delivered_afterwards_not_dropped(tmp_path, handlers, monkeypatch):
    """torch's DataLoader's SIGCHLD handler raises "DataLoader worker ... is killed" into whatever runs: not into
    the write, but after it, into the program, which would have seen it without the profiler."""
    calls = []

    def torch_like_handler(signum, frame):
        calls.append(signum)
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated.")

    _export_sending(monkeypatch, signal.SIGCHLD)
    previous_sigchld = signal.getsignal(signal.SIGCHLD)

    def train():
        for step in range(6):
            if step == 3:  # a DataLoader iterator made while the window records
                signal.signal(signal.SIGCHLD, torch_like_handler)
            step_profiler()

    try:
        with pytest.raises(RuntimeError, match="DataLoader worker"):
            profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
        assert calls == [signal.SIGCHLD]
        assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4, 5]
        assert signal.getsignal(signal.SIGCHLD) is torch_like_handler  # given back
    finally:
        signal.signal(signal.SIGCHLD, previous_sigchld)


def test_sigchld_handlers_that_call_the_one_they_found_run_once_each(tmp_path, handlers):
    """torch's SIGCHLD handler calls the handler it found: one DataLoader before the window, another made inside
    it; the chain runs as it would without the profiler, in both windows."""
    calls = []
    previous_sigchld = signal.getsignal(signal.SIGCHLD)

    def torch_like(name):
        found = signal.getsignal(signal.SIGCHLD)

        def handler(signum, frame):
            calls.append(name)
            if callable(found):
                found(signum, frame)

        signal.signal(signal.SIGCHLD, handler)

    def train():
        for step in range(10):
            if step == 3:
                torch_like("later loader")
            if step in (4, 8):
                calls.clear()
                signal.raise_signal(signal.SIGCHLD)
                assert calls == ["later loader", "first loader"], (step, calls)
            step_profiler()

    try:
        torch_like("first loader")
        profiler(output_dir=str(tmp_path), skip_first=0, wait=2, warmup=1, active=2, repeat=2)(train)()
        assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4, 8, 9]
    finally:
        signal.signal(signal.SIGCHLD, previous_sigchld)


def test_sigint_while_writing_is_held_until_the_window_is_on_disk(tmp_path, handlers, monkeypatch):
    _export_sending(monkeypatch, signal.SIGINT)
    steps_run = []

    def train():
        for step in range(20):
            steps_run.append(step)
            step_profiler()

    with pytest.raises(KeyboardInterrupt):
        profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
    assert steps_run[-1] == 5  # raised in the step_profiler() that ended the window, once it was written
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [3, 4, 5]
    assert profiler_calls._current is None and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_while_the_first_window_starts_is_acted_on_at_the_first_boundary(tmp_path, handlers, monkeypatch):
    enter = torch.autograd.profiler.record_function.__enter__

    def ctrl_c_then_enter(self):  # the step range opens with the handlers in place
        if self.name == "ProfilerStep#0":
            os.kill(os.getpid(), signal.SIGINT)  # held until the transition is done, then noted
        return enter(self)

    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__", ctrl_c_then_enter)
    ran = []

    def train():
        for step in range(5):
            ran.append(step)
            step_profiler()

    with pytest.raises(KeyboardInterrupt):
        profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=0, active=3)(train)()
    assert ran == [0]  # the first step ran, and its step_profiler() wrote it and raised
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [0]
    assert profiler_calls._current is None and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not torch.autograd.profiler._is_profiler_enabled


@pytest.mark.parametrize("failure", [KeyboardInterrupt, SystemExit, OSError])
def test_a_failed_write_is_one_error_line_naming_the_file_whatever_the_exception(tmp_path, handlers, monkeypatch,
                                                                                 ds_caplog, failure):

    def export(self, path, use_python_export=False):
        raise failure("disk says no")

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export)
    decorated = profiler(output_dir=str(tmp_path), **SCHEDULE)(lambda: [step_profiler() for _ in range(8)] and "done")
    if issubclass(failure, Exception):
        assert decorated() == "done"  # training goes on
    else:
        with pytest.raises(failure):  # an interruption from elsewhere is not swallowed
            decorated()
    errors = [r.getMessage() for r in ds_caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and str(tmp_path / "rank_0") in errors[0]
    assert f"({failure.__name__}: disk says no)" in errors[0]
    assert profiler_calls._current is None


def test_outside_the_main_thread_no_handlers_and_one_line_says_so(tmp_path, handlers, ds_caplog):

    def train():
        for _ in range(12):
            train_step()
            step_profiler()

    thread = threading.Thread(target=profiler(output_dir=str(tmp_path), skip_first=0, wait=0, warmup=1, active=2,
                                              repeat=3)(train))
    thread.start()
    thread.join()
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [1, 2, 4, 5, 7, 8]
    assert ds_caplog.text.count("outside the main thread") == 1
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_process_forked_while_a_window_records_gets_the_programs_handlers(tmp_path, handlers):
    """A DataLoader worker forked mid-window must not inherit the guard: SIGTERM from the launcher would only be
    noted there (no step_profiler() ever comes), and its signals would reach the parent's watchdog."""
    seen = []

    def train():
        for step in range(6):
            if step == 4:
                read, write = os.pipe()
                pid = os.fork()
                if pid == 0:
                    report = (signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                              signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                              signal.set_wakeup_fd(-1) == -1)
                    os.write(write, repr(report).encode())
                    os._exit(0)
                os.close(write)
                seen.append(os.read(read, 100).decode())
                os.waitpid(pid, 0)
                os.close(read)
            step_profiler()

    profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
    assert seen == ["(True, True, True)"]


def test_the_programs_wakeup_fd_gets_every_byte_and_is_given_back(tmp_path, handlers):
    """asyncio and others read the signal wakeup fd: while the guard routes it to its watchdog, their bytes are
    passed on, and their fd is theirs again after the window."""
    theirs, ours = socket.socketpair()
    theirs.setblocking(False)
    ours.setblocking(False)  # a byte that never comes fails the test at its deadline, not hangs it
    previous_usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    previous_fd = signal.set_wakeup_fd(theirs.fileno())
    try:

        def train():
            for step in range(6):
                if step == 4:
                    signal.raise_signal(signal.SIGUSR1)
                step_profiler()

        profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
        assert signal.set_wakeup_fd(-1) == theirs.fileno()
        deadline, received = time.monotonic() + 5, None
        while time.monotonic() < deadline:
            try:
                received = ours.recv(16)
                break
            except BlockingIOError:
                time.sleep(0.01)
        assert received == bytes([signal.SIGUSR1])  # the watchdog's thread ending as the window ends passed it on
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGUSR1, previous_usr1)
        theirs.close()
        ours.close()


def test_a_window_a_signal_handler_opens_while_the_last_one_ends_gets_the_watchdog_whole():
    """A handler (a program's that starts a profiled call) installs the watchdog again while an uninstall closes its
    pipe: the install waits for the uninstall's end, so the new window has a pipe, a thread and the wakeup fd."""

    class SignalWhileDraining(watchdog.Watchdog):
        fire = False

        def _drain(self):
            if self.fire:
                self.fire = False
                signal.raise_signal(signal.SIGUSR1)  # its handler runs right here
            super()._drain()

    dog, guard = SignalWhileDraining(), object()
    previous_usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: dog.install(guard))
    try:
        dog.install(guard)
        dog.fire = True
        dog.uninstall(guard)
        assert dog._installed and dog._thread.is_alive() and signal.set_wakeup_fd(-1) == dog._write >= 0
        signal.set_wakeup_fd(dog._write)
        dog.uninstall(guard)
        assert dog._read == dog._write == -1 and dog._thread is None
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)


def test_a_whole_window_a_signal_handler_runs_while_the_last_one_ends_breaks_nothing():
    """A handler that opens and closes a window (installs, uninstalls) inside an uninstall: both return, and nothing
    of the watchdog is left afterwards."""

    class SlowToEnd(watchdog.Watchdog):
        def _loop(self, *args):
            super()._loop(*args)
            time.sleep(0.3)  # the uninstall waits in its join: the signal's handler runs there

    dog, outer, inner = SlowToEnd(), object(), object()

    def whole_window(signum, frame):
        dog.install(inner)
        dog.uninstall(inner)

    previous_usr1 = signal.signal(signal.SIGUSR1, whole_window)
    previous_fd = signal.set_wakeup_fd(-1)
    try:
        dog.install(outer)
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        dog.uninstall(outer)
        assert not dog._installed and dog.guard is None and dog._read == dog._write == -1 and dog._thread is None
        assert signal.set_wakeup_fd(-1) == -1
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)
        signal.set_wakeup_fd(previous_fd)


def test_a_signal_just_before_a_window_ends_still_reaches_the_programs_wakeup_fd():
    """The watchdog's thread ends with the window: a signal's byte it had not read yet is passed on all the same."""
    theirs, ours = socket.socketpair()
    theirs.setblocking(False)
    ours.setblocking(False)
    previous_usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    previous_fd = signal.set_wakeup_fd(theirs.fileno())
    dog, guard, received = watchdog.Watchdog(), object(), []
    try:
        for _ in range(50):
            dog.install(guard)
            signal.raise_signal(signal.SIGUSR1)
            dog.uninstall(guard)
            try:
                received.append(ours.recv(16))
            except BlockingIOError:
                received.append(b"")
        assert received == [bytes([signal.SIGUSR1])] * 50
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGUSR1, previous_usr1)
        theirs.close()
        ours.close()


# ---- real processes: SIGTERM's default action, the deadline, exits ---------------------------------------

_JOB = textwrap.dedent("""
    import signal, sys, time, torch
    from ds_profutils import profiler, step_profiler

    if sys.argv[2] == "slow-export":  # a large window's export, so signals arrive while it runs
        export = torch.profiler.profile.export_chrome_trace
        def slow_export(self, path, use_python_export=False):
            time.sleep(3)
            return export(self, path, use_python_export)
        torch.profiler.profile.export_chrome_trace = slow_export

    @profiler(output_dir=sys.argv[1], skip_first=0, wait=0, warmup=1, active=1000)
    def train():
        model = torch.nn.Linear(8, 8)
        data = torch.utils.data.TensorDataset(torch.randn(100000, 8))
        loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=1, persistent_workers=True)
        try:
            for step, (batch,) in enumerate(loader):
                model(batch).sum().backward()
                if step == 3:
                    print("recording", flush=True)
                step_profiler()
                time.sleep(0.001)
        finally:
            steps = [e["name"] for e in __import__("json").load(open(sys.argv[1] + "/trace_rank_0.json"))["traceEvents"]
                     if e["name"].startswith("ProfilerStep#")]
            print(f"cleanup found {len(steps)} steps on disk", flush=True)

    train()
""")


def _start_job(tmp_path, mode):
    job = subprocess.Popen([sys.executable, "-c", _JOB, str(tmp_path), mode],
                           stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT,
                           text=True)
    for line in job.stdout:
        if line.strip() == "recording":
            return job
    raise AssertionError(f"the job ended before recording: {job.wait()}")


def _assert_complete_trace(tmp_path):
    steps = profiler_steps(read_trace(tmp_path / "trace_rank_0.json"))
    assert steps[0] == 1 and steps == list(range(1, steps[-1] + 1)) and len(steps) >= 3
    cycle_file, = (tmp_path / "rank_0").iterdir()
    assert profiler_steps(read_trace(cycle_file)) == steps
    assert not [p for p in tmp_path.rglob(".*")], "temporary files left behind"


def test_sigterm_writes_the_window_then_ends_the_process_as_sigterm_would(tmp_path):
    job = _start_job(tmp_path, "plain")
    try:
        job.send_signal(signal.SIGTERM)  # what the launcher sends, 30 s before SIGKILL
        output, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == -signal.SIGTERM, output  # "killed by SIGTERM", as without the profiler
    assert "rank 0 interrupted at step" in output and "was not written" not in output
    assert "cleanup found" not in output  # the default action: no finally runs, as without the profiler
    _assert_complete_trace(tmp_path)


def test_a_second_sigterm_and_a_dying_dataloader_worker_do_not_cut_the_write(tmp_path):
    """The launcher's order: SIGTERM reaches the rank, its DataLoader workers die (torch's SIGCHLD handler
    would raise into the write), and a second SIGTERM comes while the rank writes."""
    job = _start_job(tmp_path, "slow-export")
    try:
        worker, = psutil.Process(job.pid).children()
        job.send_signal(signal.SIGTERM)
        for line in job.stdout:
            if "rank 0 interrupted at step" in line:
                break
        worker.terminate()
        worker.wait(timeout=30)
        job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == -signal.SIGTERM, output
    assert "was not written" not in output and "DataLoader worker" not in output, output
    _assert_complete_trace(tmp_path)


_HUNG_STOP = textwrap.dedent("""
    import ctypes, signal, sys, time, torch
    from ds_profutils import profiler, step_profiler
    from ds_profutils.torch_profiler import watchdog

    watchdog.DEADLINE_S = 2.0
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def hang_in_c():  # blocked in C with the GIL released, where no Python handler ever runs (a device sync)
        mutex = ctypes.create_string_buffer(64)  # zeroed: an initialised default mutex
        libc = ctypes.CDLL(None)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)

    def hang_in_sleep():  # handlers run (and hold the signals) but the call never returns
        while True:
            time.sleep(3600)

    hang = hang_in_c if sys.argv[2] == "c-call" else hang_in_sleep
    def stop_trace(self):
        print("stopping", flush=True)
        hang()
    torch.profiler.profile.stop_trace = stop_trace

    @profiler(output_dir=sys.argv[1], skip_first=0, wait=0, warmup=0, active=3)
    def train():
        for _ in range(10):
            step_profiler()

    train()
""")


@pytest.mark.parametrize("hang", ["c-call", "sleep"])
@pytest.mark.parametrize("signals, deadline, status", [
    ((signal.SIGTERM, ), 2.0, 128 + signal.SIGTERM),
    ((signal.SIGINT, ) * 3, 0.0, 128 + signal.SIGINT),
])
def test_a_rank_whose_stop_trace_never_returns_is_still_ended(tmp_path, hang, signals, deadline, status):
    """torch.profiler's stop synchronizes the device, which a hung collective never lets finish.  SIGTERM ends
    the process within its deadline (here 2 s) + 5 s, a third Ctrl-C at once, each with a line saying why."""
    job = subprocess.Popen([sys.executable, "-c", _HUNG_STOP, str(tmp_path), hang], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        for line in job.stdout:
            if line.strip() == "stopping":
                break
        time.sleep(0.5)  # well inside the stuck call
        began = time.monotonic()
        for signum in signals:
            job.send_signal(signum)
            time.sleep(0.1)
        output, _ = job.communicate(timeout=60)
        took = time.monotonic() - began
    finally:
        job.kill()
    assert job.returncode == status, output
    assert took <= deadline + 5, took
    name = signal.Signals(signals[0]).name
    reason = "SIGINT received 3 times" if len(signals) == 3 else f"{name} arrived 2 s ago and the profiler still holds it"
    assert f"ds_profutils: rank 0 (pid {job.pid}): {reason}" in output, output
    assert f"ending the process now with exit status {status}" in output


_CAUGHT_SYSTEMEXIT = textwrap.dedent("""
    import os, signal, sys, time
    from ds_profutils import profiler, step_profiler
    from ds_profutils.torch_profiler import watchdog

    watchdog.GRACE_S, watchdog.DEADLINE_S = 0.3, 2.0

    @profiler(output_dir=sys.argv[1], skip_first=0, wait=1, warmup=0, active=3, repeat=3)
    def train():
        for step in range(12):
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
                try:
                    time.sleep(30)  # no boundary in the grace period: unwound here
                except SystemExit as exc:
                    print(f"caught SystemExit {exc.code}", flush=True)
            time.sleep(0.4)  # 12 steps take longer than the deadline
            step_profiler()

    train()
    print("ended normally", flush=True)
""")


def test_a_program_that_catches_the_systemexit_and_goes_on_is_not_killed_later(tmp_path):
    job = subprocess.run([sys.executable, "-c", _CAUGHT_SYSTEMEXIT, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
    assert "caught SystemExit 143" in job.stdout and "ended normally" in job.stdout
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [1, 2, 3, 5, 6, 7, 9, 10, 11]


_HANDLER_STARTS_A_PROFILED_CALL = textwrap.dedent("""
    import os, signal, sys
    from ds_profutils import profiler, step_profiler
    from ds_profutils.torch_profiler import run

    evaluate = profiler(output_dir=sys.argv[1] + "/eval", skip_first=0, wait=0, warmup=0, active=1)(
        lambda: step_profiler() or "evaluated")
    signal.signal(signal.SIGUSR1, lambda signum, frame: print(evaluate(), flush=True))

    init = run.ProfilerRun.__init__
    def init_then_signal(self, *args, **kwargs):  # a signal while the run is being made
        os.kill(os.getpid(), signal.SIGUSR1)
        init(self, *args, **kwargs)
    run.ProfilerRun.__init__ = init_then_signal

    profiler(output_dir=sys.argv[1], skip_first=0, wait=0, warmup=0, active=1)(lambda: step_profiler())()
    print("done", flush=True)
""")


def test_a_signal_handler_starting_a_profiled_call_mid_claim_does_not_deadlock(tmp_path):
    """No lock a signal path can take twice: the handler runs on the main thread, inside whatever it was doing."""
    job = subprocess.run([sys.executable, "-c", _HANDLER_STARTS_A_PROFILED_CALL, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert job.returncode == 0, job.stdout + job.stderr
    assert [line for line in job.stdout.splitlines() if line in ("evaluated", "done")] == ["evaluated", "done"]
    assert profiler_steps(read_trace(tmp_path / "trace_rank_0.json")) == [0]


_HANDLER_PUT_OVER_THE_GUARDS = textwrap.dedent("""
    import os, signal, sys, time
    from ds_profutils import profiler, step_profiler
    from ds_profutils.torch_profiler import watchdog

    watchdog.DEADLINE_S = 1.0

    @profiler(output_dir=sys.argv[1], skip_first=0, wait=0, warmup=0, active=12)
    def train():
        for step in range(10):
            if step == 2:  # a library installs its own handler while the window records
                signal.signal(signal.SIGTERM, lambda signum, frame: print("graceful", flush=True))
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)  # ten steps outlast the deadline
            step_profiler()

    train()
    print("ended normally", flush=True)
""")


def test_a_signal_the_programs_later_handler_takes_starts_no_deadline(tmp_path):
    """The watchdog sees every SIGTERM byte; one that went to a handler put over the guard's is not held."""
    job = subprocess.run([sys.executable, "-c", _HANDLER_PUT_OVER_THE_GUARDS, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
    assert "graceful" in job.stdout and "ended normally" in job.stdout


_PROGRAMS_HANDLER_TAKEN_ELSEWHERE = textwrap.dedent("""
    import ctypes, signal, sys, threading, time
    from ds_profutils import profiler, step_profiler
    from ds_profutils.torch_profiler import watchdog

    watchdog.GRACE_S, watchdog.DEADLINE_S = 0.5, 2.0
    calls = []
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))  # graceful preemption: it goes on

    def blocked_in_c(seconds):  # a wait no signal ends (a device sync, a collective), the GIL released
        class Timespec(ctypes.Structure):
            _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]
        libc = ctypes.CDLL(None)
        mutex = ctypes.create_string_buffer(64)  # zeroed: an initialised default mutex
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_timedlock(mutex, ctypes.byref(Timespec(int(time.time() + seconds), 0)))

    @profiler(output_dir=sys.argv[1], skip_first=0, wait=0, warmup=0, active=12)
    def train():
        for step in range(6):
            if step == 3:  # another thread takes the SIGTERM while this one waits, past the deadline
                threading.Timer(0.3, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGTERM)).start()
                began = time.monotonic()
                blocked_in_c(4)
                print(f"blocked {time.monotonic() - began:.1f} s", flush=True)
            step_profiler()

    train()
    print(f"ended normally, the program's handler called {len(calls)} time(s)", flush=True)
""")


def test_a_signal_the_programs_own_handler_takes_has_no_deadline_whichever_thread_took_it(tmp_path):
    """The guard calls a handler of the program's at once and holds nothing: the profiler keeps no deadline for
    it, even while the main thread, blocked in C past the deadline, has not run it yet (another thread took the
    signal).  The handler then runs once, when the wait returns, as without the profiler."""
    job = subprocess.run([sys.executable, "-c", _PROGRAMS_HANDLER_TAKEN_ELSEWHERE, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
    assert "ended normally, the program's handler called 1 time(s)" in job.stdout
    assert float(job.stdout.split("blocked ")[1].split(" s")[0]) >= 3.0  # the premise: blocked past the deadline


def test_a_signal_arriving_while_the_programs_handlers_are_given_back_is_delivered_once(tmp_path, handlers,
                                                                                         monkeypatch):
    """The race of the give-back: a signal that comes while the profiler puts the program's handlers back finds
    the profiler's handler still installed and is held; it reaches the program's handler in that same
    ``step_profiler()``, exactly once (not lost, not left for a later boundary, not twice)."""
    steps_begun, received, raised_at = [], [], []

    def own(signum, frame):
        received.append(len(steps_begun))

    previous = signal.signal(signal.SIGUSR1, own)
    real_signal = signal.signal

    def signal_raising_first(signum, handler):
        if signum == signal.SIGUSR1 and handler is own and not raised_at:  # the first give-back of the handler
            raised_at.append(len(steps_begun))
            signal.raise_signal(signal.SIGUSR1)  # Python runs the installed (profiler's) handler before returning
        return real_signal(signum, handler)

    def train():
        for _ in range(8):
            steps_begun.append(True)
            step_profiler()

    monkeypatch.setattr(signal, "signal", signal_raising_first)
    try:
        profiler(output_dir=str(tmp_path), **SCHEDULE)(train)()
        assert raised_at == [2]  # the step_profiler() that ended step 1 prepares the window's warmup
        assert received == raised_at
        assert signal.getsignal(signal.SIGUSR1) is own
    finally:
        monkeypatch.undo()
        real_signal(signal.SIGUSR1, previous)
