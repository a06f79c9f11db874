"""SLURM's environment, read without ``scontrol``: the node list, the job's layout and whether it was requeued.

Under ``srun``, every task's environment says which job it belongs to (``SLURM_JOB_ID``), how many nodes the
step has (``SLURM_STEP_NUM_NODES``, else ``SLURM_NNODES``), which of them this is (``SLURM_NODEID``, else
``SLURM_PROCID``), how many tasks were started (``SLURM_STEP_NUM_TASKS``, else ``SLURM_NTASKS``), the GPUs of
the node (``SLURM_GPUS_ON_NODE``, else ``SLURM_GPUS_PER_NODE``) and the nodes themselves, in SLURM's
compressed host-list syntax (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST`` or ``SLURM_NODELIST``):
``gpu[01-04,07]``, ``a[1-2],b3``, ``n[001-003]-ib``, ``rack[1-2]-n[1-2]``. :func:`expand_hostlist` expands
that syntax; the first host is the rendezvous host, as it is the node that SLURM numbers 0.

``finetune run`` starts its own processes on each node (torchrun's agent), so it expects one task per node; a
requeued job (``SLURM_RESTART_COUNT`` above 0) resumes from its newest checkpoint.

Pure Python: the launcher reads this before torch is imported.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from finetune.errors import UserError

#: The rendezvous port is derived from the job id into this range (below Linux's ephemeral ports, 32768 on),
#: so that every node of a job names the same one and jobs sharing a node rarely collide.
PORT_BASE, PORT_SPAN = 15000, 15000


def expand_hostlist(text: str, name: str = "SLURM_JOB_NODELIST") -> list[str]:
    """The host names of a SLURM host list, in order: ``gpu[01-03,07]`` -> gpu01, gpu02, gpu03, gpu07.

    Commas outside brackets separate names; each bracket is a comma-separated list of numbers and ranges
    ``lo-hi`` whose zero padding is the lower bound's width (``[08-10]`` -> 08, 09, 10); several brackets in one
    name expand as a product (``r[1-2]-n[1-2]`` -> r1-n1, r1-n2, r2-n1, r2-n2). A malformed list is one
    sentence naming ``name`` (the variable it came from).
    """
    hosts: list[str] = []
    for item in _split_outside_brackets(text.strip(), name, text):
        if item:
            hosts.extend(_expand_name(item, name, text))
    if not hosts:
        raise UserError(f"{name}: `{text}` names no host; it should hold the job's nodes, e.g. gpu[01-04]")
    return hosts


def _split_outside_brackets(text: str, name: str, whole: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise UserError(f"{name}: `{whole}` opens a bracket inside a bracket; SLURM writes e.g. gpu[01-04,07]")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UserError(f"{name}: `{whole}` closes a bracket it never opened")
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise UserError(f"{name}: `{whole}` leaves a bracket open")
    parts.append(text[start:].strip())
    return parts


_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def _expand_name(item: str, name: str, whole: str) -> list[str]:
    """Every host one comma-free item stands for (its brackets expanded left to right)."""
    match = _BRACKET.search(item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    rests = _expand_name(tail, name, whole)
    return [head + number + rest for number in _numbers(match.group(1), name, whole) for rest in rests]


def _numbers(spec: str, name: str, whole: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise UserError(
                f"{name}: `{whole}` has `[{spec}]`, whose `{part}` is neither a number nor a range lo-hi of numbers"
            )
        if not dash:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise UserError(f"{name}: `{whole}` has the range {part}, which runs backwards")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _int(env: Mapping[str, str], *names: str) -> tuple[int, str] | None:
    """The first of ``names`` set in ``env``, as an integer, and its name (a value that is not one: an error)."""
    for n in names:
        value = env.get(n, "").strip()
        if value:
            if not value.isdigit():
                raise UserError(f"{n}: `{value}` is not a whole number; SLURM sets it to one (is it set by hand?)")
            return int(value), n
    return None


def gpus_on_node(env: Mapping[str, str]) -> int | None:
    """The node's GPUs SLURM allocated: ``SLURM_GPUS_ON_NODE`` (a count), else ``SLURM_GPUS_PER_NODE``
    (``4``, ``a100:4`` or ``gpu:a100:4``); None when neither is set."""
    found = _int(env, "SLURM_GPUS_ON_NODE")
    if found is not None:
        return found[0]
    per_node = env.get("SLURM_GPUS_PER_NODE", "").strip()
    if not per_node:
        return None
    count = per_node.split("(")[0].split(":")[-1]
    if not count.isdigit():
        raise UserError(f"SLURM_GPUS_PER_NODE: `{per_node}` holds no GPU count (e.g. 4 or a100:4)")
    return int(count)


@dataclass(frozen=True)
class SlurmJob:
    """What ``finetune run`` takes from the environment of one SLURM task."""

    job_id: int
    nnodes: int
    node_rank: int
    ntasks: int | None  # tasks the step started (one per node is what finetune expects)
    hosts: tuple[str, ...]
    gpus: int | None  # GPUs SLURM gave this node
    restart_count: int  # how often the job was requeued

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlurmJob | None:
        """The job this process runs in, or None outside SLURM (no ``SLURM_JOB_ID``)."""
        env = os.environ if env is None else env
        job = _int(env, "SLURM_JOB_ID", "SLURM_JOBID")
        if job is None:
            return None
        nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
        rank = _int(env, "SLURM_NODEID", "SLURM_PROCID")
        tasks = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        lists = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        listed = next(((n, env[n]) for n in lists if env.get(n, "").strip()), None)
        hosts = tuple(expand_hostlist(listed[1], listed[0])) if listed else ()
        nnodes = nodes[0] if nodes else max(1, len(hosts))  # only the first host is used: the rendezvous
        node_rank = rank[0] if rank else 0
        if not 0 <= node_rank < nnodes:
            raise UserError(f"{rank[1] if rank else 'SLURM_NODEID'}: {node_rank} is not one of the job's {nnodes} node(s)")
        restarts = _int(env, "SLURM_RESTART_COUNT")
        return cls(
            job_id=job[0], nnodes=nnodes, node_rank=node_rank, ntasks=tasks[0] if tasks else None, hosts=hosts,
            gpus=gpus_on_node(env), restart_count=restarts[0] if restarts else 0,
        )

    def check_one_task_per_node(self) -> None:
        """Refuse, in one sentence, a step that started several tasks per node (one per GPU, as for scripts
        that start their own process per GPU): ``finetune run`` starts each node's processes itself."""
        if self.ntasks is not None and self.ntasks != self.nnodes:
            raise UserError(
                f"SLURM_NTASKS: SLURM started {self.ntasks} tasks on {self.nnodes} node(s), but finetune run starts "
                "each node's processes itself: run one task per node (srun --ntasks-per-node=1, as the script "
                "`finetune slurm` writes does)"
            )

    def rendezvous_endpoint(self, env: Mapping[str, str] | None = None) -> str:
        """``host:port`` every node of the job names alike: ``MASTER_ADDR`` or the node list's first host, and
        ``MASTER_PORT`` or a port derived from the job id (:func:`job_port`)."""
        env = os.environ if env is None else env
        host = env.get("MASTER_ADDR", "").strip() or (self.hosts[0] if self.hosts else "")
        if not host:
            raise UserError(
                "SLURM_JOB_NODELIST: not set, so the rendezvous host is unknown; run under srun, or pass "
                "--rdzv-endpoint HOST:PORT"
            )
        port = _int(env, "MASTER_PORT")
        return f"{host}:{port[0] if port else job_port(self.job_id)}"


def job_port(job_id: int) -> int:
    """The rendezvous port of SLURM job ``job_id``: the same on every node, different for neighbouring jobs."""
    return PORT_BASE + job_id % PORT_SPAN


def requeued(env: Mapping[str, str] | None = None) -> bool:
    """Whether this is a requeued SLURM job (``SLURM_RESTART_COUNT`` above 0): it continues its run."""
    env = os.environ if env is None else env
    value = env.get("SLURM_RESTART_COUNT", "").strip()
    return value.isdigit() and int(value) > 0
