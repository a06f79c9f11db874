"""SLURM's environment: the compressed node list, the job's layout, the launcher's options, the stop signals."""

from __future__ import annotations

import signal

import pytest

from finetune.commands.run import LaunchOptions, with_slurm
from finetune.errors import UserError
from finetune.train.runtime.signals import StopRequest
from finetune.train.runtime.slurm import SlurmJob, expand_hostlist, gpus_on_node, job_port, requeued


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("gpu01", ["gpu01"]),
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("n[001-003]-ib", ["n001-ib", "n002-ib", "n003-ib"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("node[08-10]", ["node08", "node09", "node10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("x[3],y[5-6],z", ["x3", "y5", "y6", "z"]),
        ("gpu[1-2]a,cpu[10-11]", ["gpu1a", "gpu2a", "cpu10", "cpu11"]),
        ("  h1 , h2 ", ["h1", "h2"]),
    ],
)
def test_node_lists_expand_as_slurm_writes_them(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("text", "sentence"),
    [
        ("gpu[01-04", "SLURM_JOB_NODELIST: `gpu[01-04` leaves a bracket open"),
        ("gpu01]", "SLURM_JOB_NODELIST: `gpu01]` closes a bracket it never opened"),
        ("g[1-[2]]", "SLURM_JOB_NODELIST: `g[1-[2]]` opens a bracket inside a bracket; SLURM writes e.g. gpu[01-04,07]"),
        ("g[4-2]", "SLURM_JOB_NODELIST: `g[4-2]` has the range 4-2, which runs backwards"),
        ("g[a-b]", "SLURM_JOB_NODELIST: `g[a-b]` has `[a-b]`, whose `a-b` is neither a number nor a range lo-hi of "
         "numbers"),
        (" , ", "SLURM_JOB_NODELIST: ` , ` names no host; it should hold the job's nodes, e.g. gpu[01-04]"),
    ],
)
def test_a_malformed_node_list_is_one_sentence(text: str, sentence: str) -> None:
    with pytest.raises(UserError) as err:
        expand_hostlist(text)
    assert str(err.value) == sentence


def _env(**extra: str) -> dict[str, str]:
    env = {"SLURM_JOB_ID": "777", "SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_PROCID": "2",
           "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "gpu[07-09],gpu12", "SLURM_GPUS_ON_NODE": "8"}
    env.update(extra)
    return {k: v for k, v in env.items() if v != ""}


def test_the_job_comes_from_srun_environment() -> None:
    job = SlurmJob.from_env(_env())
    assert job == SlurmJob(job_id=777, nnodes=4, node_rank=2, ntasks=4, hosts=("gpu07", "gpu08", "gpu09", "gpu12"),
                           gpus=8, restart_count=0)
    assert job.rendezvous_endpoint(_env()) == f"gpu07:{job_port(777)}"
    assert job.rendezvous_endpoint(_env(MASTER_ADDR="head", MASTER_PORT="29400")) == "head:29400"
    # the step's own figures win over the job's (a step on part of the allocation)
    step = SlurmJob.from_env(_env(SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="2", SLURM_NODEID="1",
                                  SLURM_STEP_NODELIST="gpu[08-09]"))
    assert (step.nnodes, step.node_rank, step.ntasks, step.hosts) == (2, 1, 2, ("gpu08", "gpu09"))
    assert SlurmJob.from_env({"PATH": "/bin"}) is None


def test_gpus_per_node_and_restarts() -> None:
    assert gpus_on_node({"SLURM_GPUS_PER_NODE": "a100:4"}) == 4
    assert gpus_on_node({"SLURM_GPUS_PER_NODE": "gpu:h100:8(IDX:0-7)"}) == 8
    assert gpus_on_node({}) is None
    assert requeued({"SLURM_RESTART_COUNT": "2"}) and not requeued({"SLURM_RESTART_COUNT": "0"}) and not requeued({})
    assert SlurmJob.from_env(_env(SLURM_RESTART_COUNT="3")).restart_count == 3
    # neighbouring jobs get neighbouring ports, below Linux's ephemeral range
    assert job_port(777) + 1 == job_port(778) and 15000 <= job_port(10**9 + 7) < 30000


@pytest.mark.parametrize(
    ("env", "sentence"),
    [
        (_env(SLURM_NNODES="four"), "SLURM_NNODES: `four` is not a whole number; SLURM sets it to one (is it set by "
         "hand?)"),
        (_env(SLURM_NODEID="4"), "SLURM_NODEID: 4 is not one of the job's 4 node(s)"),
        (_env(SLURM_GPUS_ON_NODE="", SLURM_GPUS_PER_NODE="a100"), "SLURM_GPUS_PER_NODE: `a100` holds no GPU count "
         "(e.g. 4 or a100:4)"),
    ],
)
def test_a_wrong_slurm_variable_is_one_sentence(env: dict[str, str], sentence: str) -> None:
    with pytest.raises(UserError) as err:
        SlurmJob.from_env(env)
    assert str(err.value) == sentence


def test_the_launcher_takes_slurms_layout_and_flags_win() -> None:
    options, job = with_slurm(LaunchOptions(), _env())
    assert (options.nnodes, options.node_rank, options.rdzv_endpoint) == (4, 2, f"gpu07:{job_port(777)}")
    assert job is not None and job.gpus == 8
    flags = LaunchOptions(nnodes=2, node_rank=0, rdzv_endpoint="login:29500")
    assert with_slurm(flags, _env())[0] == flags  # every node flag given: SLURM's environment is not read for them
    partly, _ = with_slurm(LaunchOptions(rdzv_endpoint="head:1234"), _env())
    assert (partly.nnodes, partly.node_rank, partly.rdzv_endpoint) == (4, 2, "head:1234")
    single, _ = with_slurm(LaunchOptions(), _env(SLURM_NNODES="1", SLURM_NODEID="0", SLURM_NTASKS="1",
                                                 SLURM_JOB_NODELIST="gpu07"))
    assert (single.nnodes, single.node_rank, single.rdzv_endpoint) == (1, 0, None)
    outside, none = with_slurm(LaunchOptions(), {})
    assert (outside.nnodes, outside.node_rank, none) == (1, 0, None)


def test_one_task_per_gpu_is_refused_in_one_sentence() -> None:
    with pytest.raises(UserError) as err:
        with_slurm(LaunchOptions(), _env(SLURM_NTASKS="32"))
    assert str(err.value) == (
        "SLURM_NTASKS: SLURM started 32 tasks on 4 node(s), but finetune run starts each node's processes itself: "
        "run one task per node (srun --ntasks-per-node=1, as the script `finetune slurm` writes does)"
    )


def test_every_rank_stops_as_for_the_same_signal() -> None:
    """Rank 0 got SIGTERM, rank 1 SIGUSR1 (the flags of both summed, as the all-reduce does): both exit 143."""
    ranks = [StopRequest(), StopRequest()]
    ranks[0].signum, ranks[1].signum = signal.SIGUSR1, signal.SIGTERM
    flags = [[1.0 if r.signum == s else 0.0 for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)]
             for r in ranks]
    total = [a + b for a, b in zip(*flags, strict=True)]
    assert all(r.agreed(lambda _: total) for r in ranks)
    assert [r.exit_code for r in ranks] == [143, 143]
    alone = StopRequest()
    alone.signum = signal.SIGUSR1
    assert alone.agreed(lambda mine: mine) and alone.exit_code == 138
    assert not StopRequest().agreed(lambda mine: mine)
