"""Under SLURM's ``srun`` without torchrun: the process group from SLURM's own variables.

:func:`export_torch_env` writes torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` from ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``
and ``SLURM_JOB_NODELIST``, so everything downstream is as under torchrun (under torchrun inside
srun nothing is touched). The master is the node list's first host, parsed here because
``scontrol`` is missing from most containers; the port comes from the job id, so every task
computes the same one alone.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import MutableMapping

from trainkit.core.errors import TrainkitError

# Ports 20000-39999: above the usual services, below Linux's ephemeral range (32768+ overlaps a
# little; a job id whose port is taken fails at once with "address already in use").
_PORT_BASE, _PORT_SPAN = 20000, 20000
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def under_srun(environ: MutableMapping[str, str] | None = None) -> bool:
    """True in a task that ``srun`` started and torchrun did not (no ``RANK`` of torchrun's)."""
    env = os.environ if environ is None else environ
    return "SLURM_PROCID" in env and "SLURM_JOB_ID" in env and "RANK" not in env


def export_torch_env(environ: MutableMapping[str, str] | None = None) -> bool:
    """Under ``srun`` (or a submitit job) without torchrun, set torchrun's variables from
    SLURM's (submitit's); True when set.

    Variables already set are kept; a no-op outside SLURM and under torchrun. Call it before
    :meth:`Runtime.from_env` (the entry point does). Under Hydra's submitit launcher the ranks are
    submitit's ``JobEnvironment``'s.

    Raises:
        TrainkitError: a node list or task count that cannot be read.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env:
        return False  # torchrun's worker (under srun or not): its variables are the truth
    if env.get("SUBMITIT_EXECUTOR"):
        values = _from_submitit()
    elif under_srun(env):
        values = _from_slurm(env)
    else:
        return False
    for name, value in values.items():
        env.setdefault(name, value)
    return True


def _from_slurm(env: MutableMapping[str, str]) -> dict[str, str]:
    world = _count(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", default="1")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost"
    return {
        "RANK": str(_count(env, "SLURM_PROCID")),
        "LOCAL_RANK": str(_count(env, "SLURM_LOCALID", default="0")),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(_tasks_on_this_node(env, world)),
        "MASTER_ADDR": expand_nodelist(nodes)[0],
        "MASTER_PORT": str(port_for_job(env["SLURM_JOB_ID"])),
    }


def _from_submitit() -> dict[str, str]:
    import submitit  # only in its jobs, where it is installed (trainkit[slurm])

    job = submitit.JobEnvironment()
    digits = "".join(c for c in str(job.job_id) if c.isdigit()) or "0"
    return {
        "RANK": str(job.global_rank),
        "LOCAL_RANK": str(job.local_rank),
        "WORLD_SIZE": str(job.num_tasks),
        "LOCAL_WORLD_SIZE": str(job.num_tasks // max(job.num_nodes, 1)),
        "MASTER_ADDR": job.hostnames[0],
        "MASTER_PORT": str(port_for_job(digits)),
    }


def port_for_job(job_id: str) -> int:
    """The rendezvous port of a SLURM job: the same on every task, differing between jobs.

    Example:
        >>> port_for_job("4242")
        24242
    """
    if not job_id.isdigit():
        raise TrainkitError(f"SLURM_JOB_ID={job_id!r} is not a job number: run under sbatch or "
                            "srun, or unset SLURM_JOB_ID")
    return _PORT_BASE + int(job_id) % _PORT_SPAN


def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a SLURM node list, in order (what ``scontrol show hostnames`` prints).

    Example:
        >>> expand_nodelist("node[01-03,07],gpu-a1")
        ['node01', 'node02', 'node03', 'node07', 'gpu-a1']

    Raises:
        TrainkitError: the list does not parse (unbalanced brackets, a range like ``3-1``).
    """
    hosts: list[str] = []
    for name in _split_top_level(nodelist):
        hosts.extend(_expand_host(name, nodelist))
    if not hosts:
        raise _bad_nodelist(nodelist, "it names no host")
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """``nodelist`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise _bad_nodelist(nodelist, "brackets do not match")
        if char == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise _bad_nodelist(nodelist, "brackets do not match")
    parts.append(nodelist[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_host(name: str, nodelist: str) -> list[str]:
    """``gpu[1-2]-r[01,03]`` -> every combination, brackets left to right."""
    pieces = re.split(r"\[([^\]]*)\]", name)  # text, ranges, text, ranges, ..., text
    choices: list[list[str]] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            choices.append([piece])
            continue
        numbers: list[str] = []
        for item in piece.split(","):
            match = _RANGE.match(item.strip())
            if not match:
                raise _bad_nodelist(nodelist, f"[{piece}] is not a list of numbers and ranges")
            low, high = match.group(1), match.group(2) or match.group(1)
            if int(high) < int(low):
                raise _bad_nodelist(nodelist, f"range {item} runs backwards")
            width = len(low)  # node[01-10]: node01 ... node10, padding kept
            numbers += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
        choices.append(numbers)
    return ["".join(parts) for parts in itertools.product(*choices)]


def _bad_nodelist(nodelist: str, why: str) -> TrainkitError:
    return TrainkitError(f"cannot read the SLURM node list {nodelist!r}: {why}; set MASTER_ADDR "
                         "to the first node's host name (scontrol show hostnames | head -1)")


def _count(env: MutableMapping[str, str], *names: str, default: str | None = None) -> int:
    """The first of ``names`` that is set, as a number."""
    name = next((n for n in names if n in env), names[0])
    value = env.get(name, default)
    if value is None or not value.isdigit():
        raise TrainkitError(f"{name}={value!r} is not a number: start the tasks with srun, "
                            "which sets it")
    return int(value)


def _tasks_on_this_node(env: MutableMapping[str, str], world: int) -> int:
    """Tasks on this node, from ``SLURM_STEP_TASKS_PER_NODE`` (e.g. ``2(x3),1``) or its
    job-wide twin, at this node's index ``SLURM_NODEID``; ``world`` on one node."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return world
    per_node: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise TrainkitError(f"SLURM_TASKS_PER_NODE={spec!r} cannot be read: start the tasks "
                                "with srun, which sets it, or set LOCAL_WORLD_SIZE")
        per_node += [int(match.group(1))] * int(match.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return per_node[node] if node < len(per_node) else per_node[-1]
