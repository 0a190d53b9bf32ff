"""close_at_exit: an object's close() run as the process ends (atexit, and before a SIGTERM the profiler re-raises),
held weakly, its registration gone with it, and never run by a forked child on the parent's object."""
import gc
import subprocess
import sys
from pathlib import Path

from ds_profutils import _signal_exit
from ds_profutils._signal_exit import close_at_exit

REPO = Path(__file__).resolve().parent.parent


class Closable:
    def close(self) -> None:
        pass


def test_a_registration_goes_with_its_object():
    """Engines attached in a loop and dropped without close() (a sweep, an RLHF reload): no exit callback is left
    behind for each (the signal path's list says so; atexit's own count keeps unregistered slots)."""
    before = len(_signal_exit._callbacks)
    for _ in range(200):
        close_at_exit(Closable().close)
    gc.collect()
    assert len(_signal_exit._callbacks) == before


def test_a_forked_child_ending_normally_does_not_close_its_parents_object(tmp_path):
    """A raw os.fork child that exits through the interpreter inherits the registration: its parent's object (files
    to write, locks another thread of the parent's held at the fork) is not its to close."""
    marker = tmp_path / "closed_by"
    script = f"""
import os, sys
sys.path.insert(0, {str(REPO)!r})
from ds_profutils._signal_exit import close_at_exit

class Writer:
    def close(self):
        with open({str(marker)!r}, "a") as file:
            file.write(f"{{os.getpid()}}\\n")

writer = Writer()
close_at_exit(writer.close)
child = os.fork()
if child == 0:
    sys.exit(0)
os.waitpid(child, 0)
print(os.getpid())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert marker.read_text().split() == [done.stdout.strip()]  # the parent's close, once; none of the child's
