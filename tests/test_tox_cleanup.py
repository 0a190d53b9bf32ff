"""The demos' clean-up (tox.ini ``commands_post``) removes the /dev/shm buffers of the demo's own ranks only:
this user's, on the demo's port, ranks 0 and 1; another user's buffers on the same port stay."""
import configparser
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("env, port", [("demo", 29611), ("demo-hf", 29612)])
def test_the_demo_removes_only_the_buffers_its_own_ranks_made(tmp_path, env, port):
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    command = tox[f"testenv:{env}"]["commands_post"].strip()
    code = re.fullmatch(r'python -c "(.*)"', command).group(1)
    code = code.replace(f"{{env:DEMO_MASTER_PORT:{port}}}", str(port)).replace("/dev/shm/", f"{tmp_path}/")
    uid = os.getuid()
    ours = [f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_{rank}" for rank in (0, 1)]
    theirs = [f"deepspeed_allreduce_buffer_{uid + 1}_127.0.0.1_{port}_0",  # another user, same port
              f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port + 1}_0",  # this user's other job
              f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}0_1"]  # a port that only starts with the demo's
    for name in ours + theirs:
        (tmp_path / name).touch()
    subprocess.run([sys.executable, "-c", code], check=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(theirs)
