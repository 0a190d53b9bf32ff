"""Core binding for the launcher: which cores and NUMA memory each local rank gets, as a numactl command.

Same contract as ``deepspeed.utils.numa``: ``get_numactl_cmd`` returns ``(cores_per_rank, cmd)``,
binds memory to the NUMA node holding the rank's cores (``-m``), to the paired HBM node in flat
mode (``-p``), or to a whole fake-NUMA group.  What differs:

* The topology (``get_numa_cores``) comes from ``numactl --hardware``; on a host without numactl, from
  sysfs (``/sys/devices/system/node/node*/cpulist``), where DeepSpeed gets none.  ``get_numactl_cmd``
  itself raises without numactl, as DeepSpeed's releases after 0.19.8 do: 0.19.8 returns a command that
  every rank then fails to start.
  Where numactl runs but cannot use NUMA ("No NUMA available", as in many containers), no memory
  is bound, as in DeepSpeed: ``-m`` would fail there for the same reason.
  Index i is NUMA node i, as in DeepSpeed, also when node ids have gaps (DeepSpeed then loses or
  misnumbers nodes): the missing ids hold empty lists, and the list's ``node_ids`` says which
  nodes exist, so that only a real node without cores counts as memory-only (HBM).
* Impossible input fails with ``InvalidArgumentError`` saying what is wrong: bad syntax, reversed
  ranges, cores listed twice or out of order, fewer cores than ranks, a local rank out of range.
  Core ids are not checked against this machine: a launcher may build commands for other nodes.
* ``check_for_numactl_pkg`` looks for the ``numactl`` executable on PATH (what the command needs)
  instead of querying dpkg/rpm/pacman, and warns through the logger.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .exceptions import InvalidArgumentError
from .logging import logger

__all__ = [
    "NumaCores",
    "check_for_numactl_pkg",
    "get_numa_cores",
    "get_numactl_cmd",
    "parse_numactl_hardware",
    "parse_range",
    "parse_range_list",
    "read_sysfs_numa_cores",
]

SYSFS_NODE_DIR = Path("/sys/devices/system/node")

# Spaces around ids are allowed, as DeepSpeed's int() allows them: "0-3, 8-11" is a valid list.
_RANGE = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?")
_NUMACTL_NODE_CPUS = re.compile(r"node ([0-9]+) cpus:(.*)")
_SYSFS_NODE = re.compile(r"node([0-9]+)")


def parse_range(rng: str) -> range:
    """``"4"`` -> ``range(4, 5)``, ``"0-3"`` -> ``range(0, 4)`` (both ends included)."""
    match = _RANGE.fullmatch(rng)
    if match is None:
        raise InvalidArgumentError(f"bad core range {rng!r}: expected a core id such as '4' or an inclusive "
                                   f"range such as '0-3' (non-negative integers)")
    start = int(match[1])
    end = start if match[2] is None else int(match[2])
    if end < start:
        raise InvalidArgumentError(f"bad core range {rng!r}: reversed, the end ({end}) is below the start "
                                   f"({start}); write '{end}-{start}'")
    return range(start, end + 1)


def parse_range_list(range_str: str) -> List[int]:
    """``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]``.

    Items are comma separated, in ascending order, and must not overlap: the order of the list is
    the order in which ranks receive cores, so an unsorted or repeated core would be ambiguous.
    """
    cores: List[int] = []
    for item in range_str.split(","):
        try:
            rng = parse_range(item)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"{error} (in core list {range_str!r})") from None
        if cores and rng.start <= cores[-1]:
            repeated = sorted(set(cores).intersection(rng))
            problem = f"cores {repeated} are listed twice" if repeated else "items must be in ascending order"
            raise InvalidArgumentError(f"bad core list {range_str!r}: {problem} (at {item!r})")
        cores.extend(rng)
    return cores


class NumaCores(list):
    """The cores of each NUMA node, index i for node i, and ``node_ids``: the nodes that exist.

    A list, as DeepSpeed's ``get_numa_cores`` returns.  Node ids can have gaps (nodes 0 and 3 only):
    a missing id holds an empty list, as a node without cores (HBM) does, and is told apart from one
    by not being in ``node_ids``.
    """

    def __init__(self, cores_by_node: Optional[Dict[int, List[int]]] = None) -> None:
        cores_by_node = cores_by_node or {}
        super().__init__(cores_by_node.get(node, []) for node in range(max(cores_by_node, default=-1) + 1))
        self.node_ids = frozenset(cores_by_node)


def _node_ids(numa_cores: Sequence[List[int]]) -> List[int]:
    """The nodes that exist, ascending: ``node_ids`` of a ``NumaCores``, every index of a plain list."""
    node_ids = getattr(numa_cores, "node_ids", None)
    return list(range(len(numa_cores))) if node_ids is None else sorted(node_ids)


def parse_numactl_hardware(text: str) -> NumaCores:
    """The cores of each NUMA node, from the output of ``numactl --hardware``."""
    cores_by_node = {}
    for line in text.splitlines():
        match = _NUMACTL_NODE_CPUS.fullmatch(line.strip())
        if match is not None:
            cores_by_node[int(match[1])] = [int(core) for core in match[2].split()]
    return NumaCores(cores_by_node)


def read_sysfs_numa_cores(node_dir: Path = SYSFS_NODE_DIR) -> NumaCores:
    """The cores of each NUMA node, from ``node_dir/node<N>/cpulist`` (empty if there is no such dir)."""
    cores_by_node = {}
    for path in Path(node_dir).glob("node*"):
        match = _SYSFS_NODE.fullmatch(path.name)
        if match is not None:
            cpulist = (path / "cpulist").read_text().strip()
            cores_by_node[int(match[1])] = parse_range_list(cpulist) if cpulist else []
    return NumaCores(cores_by_node)


def get_numa_cores() -> NumaCores:
    """This machine's cores per NUMA node (empty if unknown); nodes without cores (HBM) are empty lists.

    Empty when numactl is here but fails: the commands it is asked for could not bind memory either.
    """
    numactl = shutil.which("numactl")
    if numactl is None:
        return read_sysfs_numa_cores(SYSFS_NODE_DIR)
    try:
        output = subprocess.run([numactl, "--hardware"], capture_output=True, text=True, check=True,
                                timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("numactl --hardware failed (%s); cores are bound without a NUMA memory binding",
                       getattr(exc, "stderr", None) or exc)
        return NumaCores()
    return parse_numactl_hardware(output)


def check_for_numactl_pkg() -> bool:
    """Whether the ``numactl`` executable is on PATH; if not, log how to install it."""
    if shutil.which("numactl") is not None:
        return True
    logger.warning("numactl is not on PATH, and core binding runs it: install the numactl package "
                   "(apt install numactl, yum install numactl or pacman -S numactl)")
    return False


def _fake_numa_groups(numa_cores: Sequence[List[int]], node_ids: Sequence[int]) -> List[List[int]]:
    """Runs of adjacent nodes with the same non-empty cores: one physical node split into fake nodes."""
    groups = []
    for cores, run in itertools.groupby(node_ids, key=lambda node: numa_cores[node]):
        nodes = list(run)
        if cores and len(nodes) > 1:
            groups.append(nodes)
    return groups


def _memory_binding(numa_cores: Sequence[List[int]], rank_cores: Sequence[int]) -> List[str]:
    """numactl's memory option for a rank on ``rank_cores``: ``-m``/``-p`` and the node(s), or nothing.

    * Flat-mode HBM (as many core-less nodes as nodes with cores, paired in order): prefer the HBM
      node paired with the rank's node (``-p``).
    * Fake NUMA: bind to every node of the group holding the rank's cores (``-m a,b``).
    * Otherwise bind to the node holding all of the rank's cores (``-m n``).
    A rank whose cores span nodes gets no memory binding.
    """
    wanted = set(rank_cores)
    node_ids = _node_ids(numa_cores)
    homes = [node for node in node_ids if wanted <= set(numa_cores[node])]
    with_cores = [node for node in node_ids if numa_cores[node]]
    # Existing nodes only: an id the system lacks is no memory-only node to bind memory to.
    without_cores = [node for node in node_ids if not numa_cores[node]]
    if without_cores and len(without_cores) == len(with_cores):
        hbm_of = dict(zip(with_cores, without_cores))
        return ["-p", str(hbm_of[homes[0]])] if homes else []
    groups = _fake_numa_groups(numa_cores, node_ids)
    if groups:
        return next((["-m", ",".join(map(str, group))] for group in groups if group[0] in homes), [])
    return ["-m", str(homes[0])] if homes else []


def _format_range_list(cores: Sequence[int]) -> str:
    """The inverse of ``parse_range_list`` for ascending cores: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    items = []
    for _, run in itertools.groupby(enumerate(cores), key=lambda pair: pair[1] - pair[0]):
        run_cores = [core for _, core in run]
        items.append(str(run_cores[0]) if len(run_cores) == 1 else f"{run_cores[0]}-{run_cores[-1]}")
    return ",".join(items)


def _physical_core_count() -> int:
    import psutil

    # psutil cannot always tell physical cores (some containers); logical ones are the next best guess.
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def get_numactl_cmd(bind_core_list: Optional[str], num_local_procs: int, local_rank: int) -> Tuple[int, List[str]]:
    """``(cores_per_rank, ["numactl", <memory binding>, "-C", <cores>])`` for one local rank.

    The cores of ``bind_core_list`` (default: cores 0..physical cores - 1) are split into equal,
    consecutive shares, one per local rank; leftover cores stay unused.
    """
    if "KMP_AFFINITY" in os.environ:
        raise InvalidArgumentError("Environment variable KMP_AFFINITY conflicts with numactl because it "
                                   "interferes with how many CPU cores numactl can set. Unset KMP_AFFINITY "
                                   "before launching deepspeed.\n\n\t$ unset KMP_AFFINITY\n"
                                   "\t$ deepspeed <deepspeed command parameters>")
    if num_local_procs < 1:
        raise InvalidArgumentError(f"get_numactl_cmd: num_local_procs must be >= 1, got {num_local_procs!r}")
    if not 0 <= local_rank < num_local_procs:
        raise InvalidArgumentError(f"get_numactl_cmd: local_rank must be within 0..{num_local_procs - 1} "
                                   f"for {num_local_procs} local processes, got {local_rank!r}")
    if not check_for_numactl_pkg():
        raise InvalidArgumentError("get_numactl_cmd: numactl is not on PATH, and the command it builds runs it "
                                   "(each rank would fail to start with 'file not found'): install numactl or "
                                   "launch without --bind_cores_to_rank")
    if bind_core_list is None:
        cores = list(range(_physical_core_count()))
        source = "physical cores on this machine"
    else:
        cores = parse_range_list(bind_core_list)
        source = f"cores in bind_core_list {bind_core_list!r}"
    cores_per_rank = len(cores) // num_local_procs
    if cores_per_rank < 1:
        raise InvalidArgumentError(f"get_numactl_cmd: {len(cores)} {source}, fewer than the {num_local_procs} "
                                   f"local processes; at least one core needs to be assigned to each rank")
    rank_cores = cores[cores_per_rank * local_rank:cores_per_rank * (local_rank + 1)]
    binding = _memory_binding(get_numa_cores(), rank_cores)
    return cores_per_rank, ["numactl", *binding, "-C", _format_range_list(rank_cores)]
