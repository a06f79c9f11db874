"""Start a run: validate the recipe, make the Plan, then train in this process or launch N of them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.recipe import LoadedRecipe, RecipeError, check_files, load_recipe, recipe_to_yaml


def prepare(recipe: str, overrides: list[str]) -> LoadedRecipe:
    """Load and check the recipe; make its input paths absolute so the saved copy is self-describing."""
    loaded = load_recipe(recipe, overrides)
    problems = check_files(loaded)
    if problems:
        raise RecipeError(problems)
    from finetune.train.model import resolve_model_path

    resolve_model_path(loaded)  # a planning-only catalog name or an uncached hub id fails here, before planning
    r = loaded.recipe
    mp = loaded.resolve_input(r.model.path)
    if mp.exists():
        r.model.path = str(mp.resolve())
    if isinstance(r.data.train, list):
        r.data.train = [_abs_data(loaded, t) for t in r.data.train]
    else:
        r.data.train = _abs_data(loaded, r.data.train)
    if r.data.eval:
        r.data.eval = _abs_data(loaded, r.data.eval)
    return loaded


def _abs_data(loaded: LoadedRecipe, spec: str) -> str:
    if any(ch in spec for ch in "*?["):
        return str(loaded.base_dir / spec) if not Path(spec).is_absolute() else spec
    p = loaded.resolve_input(spec)
    return str(p.resolve()) if p.exists() else spec


def write_run_files(loaded: LoadedRecipe, plan_dict: dict) -> Path:
    """Save the resolved recipe and the plan in the output directory (rank 0, before training)."""
    out = Path(loaded.recipe.output.dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"output.dir: cannot create {out} ({exc.strerror}); choose a writable directory") from None
    if not os.access(out, os.W_OK):
        raise UserError(f"output.dir: {out} is not writable; choose a writable directory")
    (out / "recipe.yaml").write_text(recipe_to_yaml(loaded.recipe))
    (out / "plan.json").write_text(json.dumps(plan_dict, indent=2) + "\n")
    return out


def launch(
    recipe: str,
    *,
    overrides: list[str],
    nproc: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    resume: str | None = None,
    measure_memory: bool = False,
) -> int:
    """Run ``recipe``: plan, then train in-process (1 process) or through torch.distributed.run (N)."""
    import torch

    from finetune.plan.flowchart import plan_for_run

    loaded = prepare(recipe, overrides)
    r = loaded.recipe
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if nproc is None:
        nproc = r.distributed.nproc if r.distributed.nproc != "auto" else max(1, torch.cuda.device_count())
    plan = plan_for_run(loaded, nproc=nproc, nnodes=nnodes, device=device)
    if device == "cuda" and nproc > torch.cuda.device_count():
        raise UserError(
            f"--nproc: {nproc} processes but this node has {torch.cuda.device_count()} GPU(s); one process per GPU"
        )
    if plan.chosen.strategy in ("zero1", "zero2", "fsdp") and nproc * nnodes == 1:
        # torch's sharding needs a process group: on one process it would silently run without the plan's
        # mixed-precision policy and checkpointing (zero2/fsdp) or fail (zero1).
        raise UserError(
            f"distributed.strategy: `{plan.chosen.strategy}` shards over several processes but this run has one; "
            "use --nproc N (N >= 2), or strategy single or auto"
        )
    if plan.chosen.strategy == "single" and nproc * nnodes > 1:
        raise UserError(
            f"distributed.strategy: `single` trains one process but {nproc * nnodes} were asked for "
            "(--nproc/--nnodes or distributed.nproc); choose ddp, zero1, zero2, fsdp or auto, or run 1 process"
        )
    if node_rank == 0:
        from finetune.train.resume import preflight_resume

        resume = preflight_resume(loaded, plan, resume)  # the checkpoint path; a mismatch is a UserError
        write_run_files(loaded, plan.to_dict())
    if nproc * nnodes == 1:
        from finetune.train.loop import train_rank

        return train_rank(loaded, plan, measure_memory=measure_memory, resume=resume).exit_code
    return launch_workers(
        loaded, plan.to_dict(), nproc=nproc, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
        max_restarts=max_restarts, resume=resume, measure_memory=measure_memory,
    )


class WorkerFailed(UserError):
    """A worker process of a multi-process run failed; the message names the rank and its error.

    The exit code is the worker's: 2 for a user's mistake (as a single-process run), 1 for a crash.
    """


def write_spec(
    loaded: LoadedRecipe, plan_dict: dict, path: Path, *, resume: str | None, measure_memory: bool
) -> Path:
    """Write what every worker needs to train exactly this run (finetune.train.worker reads it)."""
    spec = {
        "recipe": loaded.recipe.model_dump(mode="json"),
        "plan": plan_dict,
        "base_dir": str(loaded.base_dir),
        "recipe_path": str(loaded.path) if loaded.path else None,  # for the resume command rank 0 prints
        "overrides": list(loaded.overrides),
        "resume": resume,
        "measure_memory": measure_memory,
    }
    path.write_text(json.dumps(spec))
    return path


def torchrun_args(
    spec_path: Path, *, nproc: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None, max_restarts: int,
    run_id: str,
) -> list[str]:
    """The ``torch.distributed.run`` command line that starts this node's workers (c10d rendezvous)."""
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
    return [*args, "-m", "finetune.train.worker", str(spec_path)]


def launch_workers(
    loaded: LoadedRecipe, plan_dict: dict, *, nproc: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None,
    max_restarts: int, resume: str | None, measure_memory: bool,
) -> int:
    """Start this node's ``nproc`` workers through torch.distributed.run (its elastic agent, in this process).

    Returns 0 when every worker succeeded; a failed worker raises :class:`WorkerFailed` with the rank and its
    message, after the agent has stopped every other worker of the node.
    """
    import hashlib
    import logging
    import tempfile

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    from finetune.train.distributed import threads_per_process

    # Every node of a job derives the same rendezvous id from the same recipe.
    run_id = "finetune-" + hashlib.sha1(str(loaded.recipe.output.dir).encode()).hexdigest()[:12]
    # torchrun would set one thread per process; a CPU run wants this node's cores shared out instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(nproc)))
    # The agent's own INFO/WARNING chatter (and its failure tables) would bury the one line we print.
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="finetune-launch-") as tmp:
        spec = write_spec(loaded, plan_dict, Path(tmp) / "spec.json", resume=resume, measure_memory=measure_memory)
        argv = torchrun_args(
            spec, nproc=nproc, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
            max_restarts=max_restarts, run_id=run_id,
        )
        # On SIGTERM/Ctrl-C the agent forwards the signal to the workers, which finish the step and save a
        # checkpoint (finetune.train.resume.StopRequest); it waits this long before SIGKILL (torch's default: 30 s).
        os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")
        config, cmd, cmd_args = config_from_args(get_args_parser().parse_args(argv))
        try:
            elastic_launch(config, cmd)(*cmd_args)
        except SignalException as err:
            return 128 + int(err.sigval)  # rank 0 printed where the checkpoint is and how to resume
        except RendezvousError as err:
            raise UserError(
                f"--rdzv-endpoint: the {nnodes} node(s) did not meet at {rdzv_endpoint or 'localhost'} ({err}); "
                "start every node with the same --nnodes and --rdzv-endpoint (node 0's host:port)"
            ) from None
        except ChildFailedError as err:
            rank, failure = first_cause(err.failures)
            code = getattr(failure, "exitcode", 1)
            raise WorkerFailed(
                f"rank {rank} failed: {failure_message(failure)}", exit_code=code if code and code > 0 else 1
            ) from None
    return 0


def first_cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failure to report: the earliest that recorded an exception, before ranks that only lost a peer."""

    def key(item: tuple[int, Any]) -> tuple[int, int, int]:
        rank, f = item
        recorded = isinstance(getattr(f, "message", None), dict)
        return (0 if recorded else 1, int(getattr(f, "timestamp", 0)), rank)

    return min(failures.items(), key=key)


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
