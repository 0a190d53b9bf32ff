"""Run a script under the real ``deepspeed`` launcher, the way users run their jobs.

Tests of multi-rank behaviour use this instead of mocks.  A launcher start costs 10-20 s, so each
script checks many things in one run and writes its findings as JSON for the test to assert on.
"""
from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
DIST_SCRIPTS = Path(__file__).resolve().parent / "dist_scripts"


def free_port() -> int:
    """A TCP port nobody listens on now; the default 29500 collides with any other job here."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_deepspeed(script: os.PathLike | str,
                  args: Sequence[str] = (),
                  *,
                  num_gpus: int = 2,
                  timeout: float = 300,
                  env: Optional[Mapping[str, str]] = None,
                  cwd: Optional[os.PathLike | str] = None,
                  check: bool = True) -> subprocess.CompletedProcess:
    """Run ``deepspeed --num_gpus N --master_port P script args`` and return the finished process.

    With ``check`` a non-zero exit fails with the tail of the combined output, which is what one
    needs to see when a rank dies.
    """
    command = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus",
        str(num_gpus), "--master_port",
        str(free_port()),
        str(script), *args
    ]
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    proc = subprocess.run(command,
                          cwd=cwd or REPO,
                          env=full_env,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-60:])
        raise AssertionError(f"deepspeed launcher exited {proc.returncode}: {' '.join(command)}\n{tail}")
    return proc


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
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    nodes = []
    for node in range(2):
        runner = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
                  "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port), str(script),
                  *args]
        shell = f"hostname node-{node} && exec {shlex.join(runner)}"
        log = open(workdir / f"node_{node}.log", "w")
        nodes.append((subprocess.Popen(["unshare", "--uts", "--pid", "--fork", "--mount-proc", "sh", "-c", shell],
                                       cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    failures = []
    for node, (process, log) in enumerate(nodes):
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            code = "timeout"
        log.close()
        if code != 0:
            tail = "\n".join((workdir / f"node_{node}.log").read_text().splitlines()[-40:])
            failures.append(f"node {node} exited {code}:\n{tail}")
    if failures:
        raise AssertionError("\n\n".join(failures))
