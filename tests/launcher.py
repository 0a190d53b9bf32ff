"""Run a script under the real ``deepspeed`` launcher, the way users run their jobs.

Tests of multi-rank behaviour use this instead of mocks.  A launcher start costs 10-20 s, so each
script checks many things in one run and writes its findings as JSON for the test to assert on.
"""
from __future__ import annotations

import contextlib
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
DIST_SCRIPTS = Path(__file__).resolve().parent / "dist_scripts"
_PORTS = random.SystemRandom()  # free_port's draws (see there)


def free_port() -> int:
    """A TCP port nobody listens on now, below the kernel's ephemeral range (the default 29500 collides with any
    other job here).  A port the kernel hands out (binding port 0) is free again once checked, and until the job's
    rendezvous binds it any outgoing connection may take it -- the gloo pairs and store clients of a job the other
    test worker runs -- which failed a launch with EADDRINUSE; ports below the range are never given to those.  The
    draws come from the system's entropy: the module ``random`` follows the seed a test set in its worker (a Trainer
    built in-process seeds it with 42), and two workers seeded alike drew the same ports in the same order."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default start
    while True:
        port = _PORTS.randint(max(low // 2, 1024), low - 1)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # listened on, or lingering: another
                continue
            return port


def _command(script: os.PathLike | str, args: Sequence[str], num_gpus: int, port: int) -> List[str]:
    return [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus",
        str(num_gpus), "--master_port",
        str(port),
        str(script), *args
    ]


def accelerate_launch(deepspeed_config: os.PathLike | str) -> Callable[[os.PathLike | str, Sequence[str], int, int],
                                                                      List[str]]:
    """The command ``accelerate launch --use_deepspeed --deepspeed_config_file CONFIG`` as a user types it
    (no accelerate config file: every choice on the command line), for :class:`LauncherJob`."""

    def command(script: os.PathLike | str, args: Sequence[str], num_processes: int, port: int) -> List[str]:
        return [
            sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--deepspeed_config_file",
            str(deepspeed_config), "--num_processes", str(num_processes), "--num_machines", "1", "--mixed_precision",
            "no", "--dynamo_backend", "no", "--main_process_port", str(port), str(script), *args
        ]

    return command


def _remove_shared_memory(port: int) -> None:
    """Remove the /dev/shm buffers DeepSpeed's CPU comm op made for the job on ``port``.

    DeepSpeed 0.19 creates one per rank (``deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}``, 69 MB)
    and never unlinks it, even when the job ends normally: a suite of ~35 launcher runs would leave
    ~5 GB of RAM behind, and repeated runs exhaust the machine.
    """
    for buffer in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        with contextlib.suppress(OSError):
            buffer.unlink()


def _environment(env: Optional[Mapping[str, str]]) -> Dict[str, str]:
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    return full_env


def run_deepspeed(script: os.PathLike | str,
                  args: Sequence[str] = (),
                  *,
                  num_gpus: int = 2,
                  timeout: float = 300,
                  env: Optional[Mapping[str, str]] = None,
                  cwd: Optional[os.PathLike | str] = None,
                  check: bool = True,
                  prefix: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run ``deepspeed --num_gpus N --master_port P script args`` and return the finished process.

    With ``check`` a non-zero exit fails with the tail of the combined output, which is what one
    needs to see when a rank dies -- except gloo's teardown abort after every rank printed the job scripts'
    ``job end: rank R`` line with no traceback before (DESIGN: that abort happens with or without us).
    ``prefix`` goes before the command (``unshare --mount ...``).
    """
    port = free_port()
    command = [*prefix, *_command(script, args, num_gpus, port)]
    try:
        proc = subprocess.run(command,
                              cwd=cwd or REPO,
                              env=_environment(env),
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              text=True,
                              timeout=timeout)
    finally:
        _remove_shared_memory(port)
    if check and proc.returncode != 0 and not ended_as_documented(proc.stdout, proc.returncode, JOB_END, num_gpus):
        tail = "\n".join(proc.stdout.splitlines()[-60:])
        raise AssertionError(f"deepspeed launcher exited {proc.returncode}: {' '.join(command)}\n{tail}")
    return proc


def run_one_rank(args: Sequence[str], *, timeout: float = 600,
                 cwd: Optional[os.PathLike | str] = None) -> subprocess.CompletedProcess:
    """Run ``python args`` as rank 0 of a world of one (the variables the launcher would set, a free port)
    and return it finished; a non-zero exit fails with the tails of its output.  A real engine on one gloo
    rank, without a launcher start's cost."""
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    try:
        done = subprocess.run([sys.executable, *args], env=_environment(env), capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)
    finally:
        _remove_shared_memory(port)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


class LauncherJob:
    """A ``deepspeed`` job started in its own session (as a terminal or a batch system starts it), so a
    test can signal the whole process group, the launcher or one rank while it runs.  ``launcher``
    builds the command (default: the ``deepspeed`` runner; :func:`accelerate_launch` for Accelerate's).

    Its output is read as it comes; :meth:`wait_for` waits for lines a script prints, :meth:`finish`
    for every process of the job to end (they all hold the output pipe).  Leaving the ``with`` block
    kills whatever is left.
    """

    def __init__(self, script: os.PathLike | str, args: Sequence[str] = (), *, num_gpus: int = 2,
                 env: Optional[Mapping[str, str]] = None,
                 launcher: Callable[[os.PathLike | str, Sequence[str], int, int], List[str]] = _command) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(launcher(script, args, num_gpus, self.port),
                                        cwd=REPO,
                                        env=_environment(env),
                                        stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT,
                                        text=True,
                                        start_new_session=True)
        self._lines: List[str] = []
        self._ended = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "".join(self._lines)

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 180) -> List["re.Match[str]"]:
        """The first ``count`` matches of ``pattern`` in the output, waiting for them to be printed.

        Processes share the output pipe, and Python unbuffered writes a line's text and its newline
        apart, so two processes' lines may share one: matches are counted in the text, not per line.
        """
        regex, deadline = re.compile(pattern), time.monotonic() + timeout
        with self._changed:
            while True:
                matches = list(regex.finditer("".join(self._lines)))
                if len(matches) >= count:
                    return matches[:count]
                remaining = deadline - time.monotonic()
                if self._ended or remaining <= 0:
                    raise AssertionError(f"{count} line(s) matching {pattern!r} never came:\n{self._tail()}")
                self._changed.wait(remaining)

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to every process of the job (a terminal's Ctrl-C, ``timeout``, a batch system)."""
        os.killpg(self.process.pid, signum)

    def finish(self, timeout: float = 180) -> int:
        """Wait for every process of the job to end; return the exit status of the ``deepspeed`` runner."""
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise AssertionError(f"the job did not end within {timeout} s:\n{self._tail()}")
        return self.process.wait(timeout)

    def _tail(self) -> str:
        return "".join(self._lines[-80:])

    def __enter__(self) -> "LauncherJob":
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process.stdout.close()
        _remove_shared_memory(self.port)


def namespaces_permitted() -> Optional[str]:
    """None when this process may give a child its own hostname and pids (unshare), else why not."""
    try:
        subprocess.run(["unshare", "--uts", "--pid", "--fork", "--mount-proc", "true"], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unshare --uts --pid --fork --mount-proc is not permitted here ({exc})"
    return None


def run_two_nodes(script: os.PathLike | str,
                  args: Sequence[str],
                  workdir: Path,
                  *,
                  slots: int = 2,
                  timeout: float = 400) -> None:
    """Run ``script`` as a 2-node job on this machine: each node is the deepspeed runner with
    ``--no_ssh --node_rank i`` in its own UTS and pid namespaces with hostname ``node-i`` (pids repeat
    across nodes, as on real hosts).  Fails with each node's output tail if a node exits non-zero."""
    hostfile = workdir / "hostfile"
    hostfile.write_text("".join(f"node-{i} slots={slots}\n" for i in range(2)))
    port = free_port()
    env = _environment(None)
    nodes = []
    for node in range(2):
        runner = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
                  "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port), str(script),
                  *args]
        shell = f"hostname node-{node} && exec {shlex.join(runner)}"
        log = open(workdir / f"node_{node}.log", "w")
        nodes.append((subprocess.Popen(["unshare", "--uts", "--pid", "--fork", "--mount-proc", "sh", "-c", shell],
                                       cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    _finish_nodes(nodes, workdir, timeout, port, ranks_per_node=slots)


def _finish_nodes(nodes: List, workdir: Path, timeout: float, port: int, ranks_per_node: int) -> None:
    """Wait for every node's process, remove the job's shared memory, and fail with the output tail of
    each node that did not end as documented (:func:`ended_as_documented`, its ``ranks_per_node`` ranks)."""
    try:
        failures = _wait_for_nodes(nodes, workdir, timeout, ranks_per_node)
    finally:
        _remove_shared_memory(port)
    if failures:
        raise AssertionError("\n\n".join(failures))


def _wait_for_nodes(nodes: List, workdir: Path, timeout: float, ranks_per_node: int) -> List[str]:
    """Wait for each node's runner; return what each one that failed printed last."""
    failures = []
    for node, (process, log) in enumerate(nodes):
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            code = "timeout"
        log.close()
        output = (workdir / f"node_{node}.log").read_text()
        if code != 0 and (code == "timeout" or not ended_as_documented(output, code, JOB_END, ranks_per_node)):
            tail = "\n".join(output.splitlines()[-40:])
            failures.append(f"node {node} exited {code}:\n{tail}")
    return failures


def run_ranks_as_nodes(script: os.PathLike | str, args: Sequence[str], workdir: Path, *, nodes: int = 2,
                       timeout: float = 300) -> None:
    """Run ``script`` as ``nodes`` processes started the way a batch system starts one process per node:
    the rank in the environment (``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_*``), ``LOCAL_RANK`` 0 on every
    one.  Fails with each process's output tail if one exits non-zero (their logs: ``workdir/node_{i}.log``)."""
    port = free_port()
    processes = []
    for node in range(nodes):
        env = _environment({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nodes),
                            "NODE_RANK": str(node), "LOCAL_RANK": "0"})
        log = open(workdir / f"node_{node}.log", "w")
        processes.append((subprocess.Popen([sys.executable, str(script), *args], cwd=REPO, env=env, stdout=log,
                                           stderr=subprocess.STDOUT), log))
    _finish_nodes(processes, workdir, timeout, port, ranks_per_node=1)


TEARDOWN_ABORT = "terminate called without an active exception"
"""gloo's abort at process exit, with or without ds_profutils (README, "On CPU")."""


JOB_END = r"job end: rank \d+"
"""The last line every job script prints before its documented shutdown (``run_deepspeed``'s check reads it)."""


def ended_as_documented(output: str, code: int, last_line: str, ranks: int = 2) -> bool:
    """Whether a job ended well: every rank printed the script's last line (``last_line``, a regex), and the exit
    status is 0 or gloo's teardown abort with no traceback before it."""
    if len(re.findall(last_line, output)) != ranks:
        return False
    return code == 0 or (TEARDOWN_ABORT in output and "Traceback" not in output.split(TEARDOWN_ABORT)[0])
