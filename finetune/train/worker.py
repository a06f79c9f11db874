"""The entry point of each process torch.distributed.run starts: ``python -m finetune.train.worker SPEC``.

SPEC is a JSON file the launcher wrote (see finetune.launch.write_spec): the resolved recipe, the Plan and
the run options, so that every rank executes exactly what the launcher planned. The worker sets its torch
threads, silences everything but errors on ranks other than 0, joins the process group and trains.

Any exception is recorded in torchelastic's error file (the launcher reads it back and reports
"rank N failed: <message>"); a user's mistake (UserError) exits with its exit code (2 unless it says otherwise)
and no traceback, like the CLI; a rank that only lost its peers exits 75 and records nothing.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from finetune.errors import UserError


def read_spec(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The launcher's run description: ``recipe`` (dict), ``plan`` (dict), ``base_dir``, options."""
    return json.loads(Path(path).read_text())


def _quiet_if_not_main(rank: int) -> None:
    """Ranks other than 0 print nothing but errors: no progress bars, no library chatter, no stdout."""
    if rank == 0:
        return
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    # Library warnings are the same on every rank: rank 0 shows them once. Errors still reach stderr.
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def _set_threads() -> None:
    """Torch threads = this node's cores / its processes (OMP_NUM_THREADS, when set, wins)."""
    import torch

    from finetune.train.distributed import threads_per_process

    n = os.environ.get("OMP_NUM_THREADS")
    threads = int(n) if n and n.isdigit() else threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    torch.set_num_threads(threads)


def run_worker(spec_path: str) -> None:
    """Train this rank as the spec says; rank 0 writes recipe.yaml, plan.json and every output."""
    _quiet_if_not_main(int(os.environ.get("RANK", 0)))
    _set_threads()
    from finetune.launch import write_run_files
    from finetune.plan.types import Plan
    from finetune.recipe import recipe_from_dict
    from finetune.train.distributed import DistContext
    from finetune.train.loop import train_rank

    spec = read_spec(spec_path)
    loaded = recipe_from_dict(spec["recipe"], Path(spec["base_dir"]))
    if spec.get("recipe_path"):
        loaded.path = Path(spec["recipe_path"])  # the user's file (same directory as base_dir)
    loaded.overrides = list(spec.get("overrides", []))
    plan = Plan.from_dict(spec["plan"])
    ctx = DistContext.from_env()
    try:
        if ctx.is_main:
            write_run_files(loaded, spec["plan"])
        kwargs: dict[str, Any] = {"measure_memory": bool(spec.get("measure_memory")), "ctx": ctx}
        if spec.get("resume"):
            kwargs["resume"] = spec["resume"]
        train_rank(loaded, plan, **kwargs)
    finally:
        ctx.close()


def main(argv: list[str] | None = None) -> None:
    """Run one rank; record any exception in torchelastic's error file for the launcher to report."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m finetune.train.worker SPEC.json (started by `finetune run`)\n")
        sys.exit(2)
    handler = get_error_handler()
    handler.initialize()
    try:
        run_worker(args[0])
    except UserError as err:
        handler.record_exception(err)  # the launcher prints it, once, naming the rank
        sys.exit(getattr(err, "exit_code", 2))
    except Exception as err:
        if _peer_failed(err):
            # A consequence, not a cause: another rank died and took the connection with it. Record nothing
            # (the launcher reports the rank that did record its error) and skip the traceback.
            sys.stderr.write(f"rank {os.environ.get('RANK', '?')}: stopped, another rank failed\n")
            sys.exit(PEER_FAILED_EXIT)
        handler.record_exception(err)
        raise


#: Exit status of a rank that stopped because another rank's process died (not a cause: never reported).
PEER_FAILED_EXIT = 75


def _peer_failed(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because a peer process went away (gloo / nccl / store)."""
    text = str(err)
    return any(
        s in text
        for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")
    )


if __name__ == "__main__":
    main()
