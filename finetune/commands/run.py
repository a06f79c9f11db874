"""Start a run: validate the recipe, make the Plan, then train in this process or launch N of them."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.errors import UserError
from finetune.recipe.schema import LoadedRecipe, RecipeError, check_files, load_recipe

if TYPE_CHECKING:
    from finetune.plan.types import Plan
    from finetune.train.runtime.slurm import SlurmJob
    from finetune.train.runtime.worker import RunRequest


@dataclass(frozen=True)
class LaunchOptions:
    """How ``finetune run`` starts a recipe: processes, nodes, rendezvous, restarts, resume, measurement."""

    nproc: int | None = None  # processes per node (None: distributed.nproc, else SLURM's GPUs of the node, else
    # one per visible GPU, 1 on CPU)
    nnodes: int | None = None  # None: SLURM's nodes under srun, else 1
    node_rank: int | None = None  # None: SLURM's node id under srun, else 0
    rdzv_endpoint: str | None = None  # host:port of node 0 (several nodes; under srun: SLURM's first host)
    max_restarts: int = 0
    resume: str | None = None  # ``latest``, ``auto`` (the newest checkpoint if there is one) or a checkpoint directory
    measure_memory: bool = False  # measure the peak on CPU too (MemTracker)
    overwrite: bool = False  # replace an earlier run in output.dir (without it or resume, such a run is refused)
    debug_memory: bool = False  # CUDA: record allocations, write a snapshot when out of memory
    host_memory: str | None = None  # this node's host memory, e.g. 512GiB (None: its MemAvailable)
    ignore_host_memory: bool = False  # run even when the plan needs more host memory than the node has


def prepare(recipe: str, overrides: list[str]) -> LoadedRecipe:
    """Load the recipe (its inputs resolved once, made absolute) and refuse missing or planning-only inputs."""
    loaded = load_recipe(recipe, overrides, fetch=True)  # hub ids neither local nor cached: downloaded, before planning
    problems = check_files(loaded)
    if problems:
        raise RecipeError(problems)
    assert loaded.inputs is not None
    loaded.inputs.model.weights_dir()  # a planning-only catalog name fails here, before planning
    from finetune.storage.publish import check_push

    check_push("output.push_to_hub", loaded.recipe.output.push_to_hub)
    if loaded.recipe.output.trackers:
        from finetune.train.metrics.trackers import check_installed

        check_installed(list(loaded.recipe.output.trackers))  # before any weights load, not after
    return loaded


def with_slurm(options: LaunchOptions, env: Mapping[str, str] | None = None) -> tuple[LaunchOptions, SlurmJob | None]:
    """``options`` with the nodes, this node's rank and the rendezvous endpoint that no flag gave taken from
    SLURM's environment under ``srun`` (:class:`~finetune.train.runtime.slurm.SlurmJob`), else one node; and the job.
    Explicit flags win; a step that started several tasks per node is refused in one sentence."""
    from finetune.train.runtime.slurm import SlurmJob

    job = SlurmJob.from_env(env)
    given = (options.nnodes, options.node_rank, options.rdzv_endpoint)
    if job is None or None not in given:
        return replace(options, nnodes=options.nnodes or 1, node_rank=options.node_rank or 0), job
    job.check_one_task_per_node()
    nnodes = options.nnodes or job.nnodes
    endpoint = options.rdzv_endpoint or (job.rendezvous_endpoint(env) if nnodes > 1 else None)
    rank = options.node_rank if options.node_rank is not None else job.node_rank
    return replace(options, nnodes=nnodes, node_rank=rank, rdzv_endpoint=endpoint), job


def launch(recipe: str, overrides: list[str], options: LaunchOptions = LaunchOptions()) -> int:
    """Run ``recipe``: plan, then train in-process (1 process) or through torch.distributed.run (N)."""
    options, job = with_slurm(options)
    from finetune.train.runtime import allocator

    allocator.configure()  # before CUDA initialises here; the workers inherit it (finetune/train/runtime/allocator.py)
    import torch

    from finetune.plan.flowchart import plan_for_run

    loaded = prepare(recipe, overrides)
    r = loaded.recipe
    device = "cuda" if torch.cuda.is_available() else "cpu"
    nproc = options.nproc
    if nproc is None and r.distributed.nproc != "auto":
        nproc = r.distributed.nproc
    if nproc is None:
        nproc = job.gpus if job is not None and job.gpus else max(1, torch.cuda.device_count())
    options = replace(options, nproc=nproc)
    nnodes = options.nnodes or 1
    plan = plan_for_run(loaded, nproc=nproc, nnodes=nnodes, device=device)
    if device == "cuda" and nproc > torch.cuda.device_count():
        raise UserError(
            f"--nproc: {nproc} processes but this node has {torch.cuda.device_count()} GPU(s); one process per GPU"
        )
    # what the recipe and the process count cannot do together was refused by the planner (capability table)
    check_host_memory(plan, options)
    resume = options.resume
    if resume is None and job is not None and job.restart_count > 0:
        # A requeued job continues from its newest checkpoint, or starts again without one; an --overwrite in
        # its command line was done by its first attempt.
        resume, options = "auto", replace(options, overwrite=False)
    from finetune.train.checkpoint.lock import OutputLock

    # node 0's launcher prepares output.dir (clears, resumes, writes the run files): it holds the directory from
    # here to its exit, so a second run into it is refused before it touches anything there
    with OutputLock(r.output.dir) if options.node_rank == 0 else contextlib.nullcontext():
        if options.node_rank == 0:
            from finetune.train.checkpoint.resume import preflight_resume
            from finetune.train.checkpoint.save import write_run_files

            resume = preflight_resume(loaded, plan, resume, options.overwrite)  # the checkpoint path; a mismatch is a UserError
            write_run_files(loaded, plan.to_dict())
        if nproc * nnodes == 1:
            from finetune.train.trainer import train_rank

            return train_rank(
                loaded, plan, measure_memory=options.measure_memory, resume=resume, debug_memory=options.debug_memory
            ).exit_code
        from finetune.train.runtime.worker import RunRequest

        request = RunRequest.of(
            loaded, plan, resume=resume, measure_memory=options.measure_memory, debug_memory=options.debug_memory
        )
        return launch_workers(request, options)


def check_host_memory(plan: Plan, options: LaunchOptions) -> None:
    """Refuse (one sentence) a run whose plan needs more host memory per node, in its largest phase (loading,
    checkpoint save, final save), than this node has: ``--host-memory`` or MemAvailable. Every node's
    launcher checks its own, before any weights load or any process group starts."""
    from finetune.plan.job import available_host_memory, host_memory_problem
    from finetune.units import parse_bytes

    if options.ignore_host_memory or not plan.job or plan.execution is None:
        return
    if options.host_memory is not None:
        limit, source = parse_bytes(options.host_memory), "--host-memory"
        if limit <= 0:
            raise UserError(f"--host-memory: {options.host_memory} is no memory; write e.g. 512GiB")
    else:
        limit, source = available_host_memory(), "MemAvailable in /proc/meminfo"
    nproc = options.nproc or 1
    problem = host_memory_problem(plan.job, limit, source=source, spec=plan.execution, processes=nproc)
    if problem is not None:
        raise UserError(problem)


#: The signals the launcher's agent forwards to its workers (each a graceful stop: finetune.train.runtime.signals).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


class WorkerFailed(UserError):
    """A worker process of a multi-process run failed; the message names the rank and its error.

    The exit code is the worker's: 2 for a user's mistake (as a single-process run), 1 for a crash.
    """


def torchrun_args(request_path: Path, options: LaunchOptions, run_id: str) -> list[str]:
    """The ``torch.distributed.run`` command line that starts this node's workers (c10d rendezvous)."""
    nproc, nnodes, node_rank = options.nproc, options.nnodes or 1, options.node_rank or 0
    rdzv_endpoint, max_restarts = options.rdzv_endpoint, options.max_restarts
    if nnodes > 1 and not rdzv_endpoint:
        raise UserError(
            "--rdzv-endpoint: a run on several nodes needs the host:port of the rendezvous, e.g. "
            "--rdzv-endpoint node0:29500, given identically on every node"
        )
    if not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank: {node_rank} is not in 0..{nnodes - 1} (--nnodes {nnodes})")
    if max_restarts < 0:
        raise UserError(f"--max-restarts: {max_restarts} is negative; give 0 or more")
    args = [
        f"--nproc-per-node={nproc}",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint or '127.0.0.1:0'}",
        f"--rdzv-id={run_id}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.2",
    ]
    if nnodes > 1:
        # Node 0 hosts the rendezvous store: said explicitly, so that several nodes on one host (or an
        # endpoint written as an IP) never both try to host it.
        args.append(f"--rdzv-conf=is_host={'true' if node_rank == 0 else 'false'},join_timeout=300")
    return [*args, "-m", "finetune.train.runtime.worker", str(request_path)]


def rendezvous_id(rdzv_endpoint: str | None) -> str:
    """The rendezvous id every node of a job derives alike: from the endpoint they all name, not from the
    recipe (nodes whose recipes differ must meet, so that the workers can say how they differ)."""
    import hashlib

    return "finetune-" + hashlib.sha1(str(rdzv_endpoint or "local").encode()).hexdigest()[:12]


def launch_workers(request: RunRequest, options: LaunchOptions) -> int:
    """Start this node's ``nproc`` workers through torch.distributed.run (its elastic agent, in this process).

    Returns 0 when every worker succeeded; a failed worker raises :class:`WorkerFailed` with the rank and its
    message, after the agent has stopped every other worker of the node.
    """
    import logging
    import tempfile

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    from finetune.train.parallel.distributed import threads_per_process

    nproc, nnodes = options.nproc or 1, options.nnodes or 1
    run_id = rendezvous_id(options.rdzv_endpoint)
    # torchrun would set one thread per process; a CPU run wants this node's cores shared out instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(nproc)))
    # The agent's own INFO/WARNING chatter (and its failure tables) would bury the one line we print.
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="finetune-launch-") as tmp:
        argv = torchrun_args(request.write(Path(tmp) / "request.json"), options, run_id)
        # On SIGTERM/Ctrl-C, and SLURM's warning signals USR1/USR2 (sbatch --signal), the agent forwards the
        # signal to the workers, which finish the step and save a checkpoint (finetune.train.runtime.signals.StopRequest);
        # it waits this long before SIGKILL (torch's default: 30 s).
        os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")
        config, cmd, cmd_args = config_from_args(get_args_parser().parse_args(argv))
        config.signals_to_handle = ",".join(STOP_SIGNALS)  # the agent installs its handlers for these
        try:
            elastic_launch(config, cmd)(*cmd_args)
        except SignalException as err:
            return 128 + int(err.sigval)  # rank 0 printed where the checkpoint is and how to resume
        except RendezvousError as err:
            raise UserError(
                f"--rdzv-endpoint: the {nnodes} node(s) did not meet at {options.rdzv_endpoint or 'localhost'} ({err}); "
                "start every node with the same --nnodes and --rdzv-endpoint (node 0's host:port)"
            ) from None
        except ChildFailedError as err:
            rank, failure = first_cause(err.failures)
            code = failure_exit_code(failure, err.failures)
            raise WorkerFailed(f"rank {rank} failed: {failure_message(failure)}", exit_code=code) from None
    return 0


def first_cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failure to report: the earliest that recorded an exception, before ranks that only lost a peer."""

    def key(item: tuple[int, Any]) -> tuple[int, int, int]:
        rank, f = item
        recorded = isinstance(getattr(f, "message", None), dict)
        return (0 if recorded else 1, int(getattr(f, "timestamp", 0)), rank)

    return min(failures.items(), key=key)


def failure_exit_code(failure: Any, failures: dict[int, Any]) -> int:
    """The exit status ``finetune run`` returns for ``failure``: the worker's own, or, when the agent killed it
    after it recorded its error (it stops every worker once one has failed), that of a rank that recorded the
    same message and exited by itself (every rank raises an agreed error, such as a failed checkpoint save); 1
    when none did."""
    for f in (failure, *failures.values()):
        code = getattr(f, "exitcode", None)
        if code is not None and code > 0 and (f is failure or failure_message(f) == failure_message(failure)):
            return int(code)
    return 1


def failure_message(failure: object) -> str:
    """The worker's own exception message from torchelastic's ProcessFailure, or how it died."""
    msg = getattr(failure, "message", "")
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    msg = str(msg or "").strip()
    if msg.startswith("UserError: "):
        msg = msg[len("UserError: ") :]
    if not msg or msg.startswith("To enable traceback"):
        code = getattr(failure, "exitcode", None)
        if code is not None and code < 0:
            return f"killed by signal {failure.signal_name()}"  # type: ignore[attr-defined]
        return f"exited with code {code} (its output above has the details)"
    return msg
