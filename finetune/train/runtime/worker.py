"""The entry point of each process torch.distributed.run starts: ``python -m finetune.train.runtime.worker SPEC``.

SPEC is the :class:`RunRequest` the launcher wrote as JSON: the resolved recipe, the Plan and the run
options, so that every rank executes exactly what the launcher planned. The worker sets its torch
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
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.plan.types import Plan
from finetune.recipe.schema import LoadedRecipe, recipe_from_dict


@dataclass
class RunRequest:
    """Everything a rank needs to train exactly the run the launcher planned (written as JSON for workers)."""

    recipe: dict[str, Any]  # the resolved recipe (absolute paths)
    plan: dict[str, Any]  # Plan.to_dict()
    base_dir: str  # where the recipe's relative paths were resolved
    recipe_path: str | None = None  # the user's file, for the resume command rank 0 prints
    overrides: list[str] = field(default_factory=list)
    resume: str | None = None  # a checkpoint directory
    measure_memory: bool = False
    debug_memory: bool = False

    @classmethod
    def of(
        cls, loaded: LoadedRecipe, plan: Plan, *, resume: str | None, measure_memory: bool, debug_memory: bool = False
    ) -> RunRequest:
        """The request for a loaded recipe and its plan."""
        return cls(
            recipe=loaded.recipe.model_dump(mode="json"), plan=plan.to_dict(), base_dir=str(loaded.base_dir),
            recipe_path=str(loaded.path) if loaded.path else None, overrides=list(loaded.overrides),
            resume=resume, measure_memory=measure_memory, debug_memory=debug_memory,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunRequest:
        """Inverse of :meth:`to_dict`."""
        return cls(**d)

    def write(self, path: Path) -> Path:
        """Save as JSON (the file ``python -m finetune.train.runtime.worker`` reads)."""
        path.write_text(json.dumps(self.to_dict()))
        return path

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> RunRequest:
        """Load what :meth:`write` saved."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def loaded_recipe(self) -> LoadedRecipe:
        """The recipe as the launcher loaded it (paths already absolute)."""
        loaded = recipe_from_dict(self.recipe, Path(self.base_dir))
        if self.recipe_path:
            loaded.path = Path(self.recipe_path)  # the user's file (same directory as base_dir)
        loaded.overrides = list(self.overrides)
        return loaded


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

    from finetune.train.parallel.distributed import threads_per_process

    n = os.environ.get("OMP_NUM_THREADS")
    threads = int(n) if n and n.isdigit() else threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    torch.set_num_threads(threads)


def run_worker(request_path: str) -> None:
    """Train this rank as the request says; global rank 0 writes recipe.yaml, plan.json and every output."""
    from finetune.train.runtime import allocator

    allocator.configure()  # inherited from the launcher; before CUDA initialises in any case
    from finetune.versions import quiet_library_notes

    quiet_library_notes()
    _quiet_if_not_main(int(os.environ.get("RANK", 0)))
    _set_threads()
    from finetune.train.checkpoint.save import write_run_files
    from finetune.train.parallel.distributed import DistContext
    from finetune.train.parallel.nodes import (
        agree_with_node0,
        check_shared_output,
        input_fingerprints,
        several_nodes,
    )
    from finetune.train.trainer import train_rank

    request = RunRequest.read(request_path)
    loaded = request.loaded_recipe()
    d = loaded.recipe.distributed
    ctx = DistContext.from_env(timeout=d.timeout, wait_timeout=d.wait_timeout, offload=offloads(request))
    try:
        # Every node planned on its own hardware; all of them run node 0's plan (and the same recipe, package
        # versions, model config and data files: one rank per node reads them), and see one output.dir.
        reads = several_nodes() and ctx.local_rank == 0
        plan_dict = agree_with_node0(request.recipe, request.plan, ctx, input_fingerprints(loaded) if reads else None)
        check_shared_output(loaded.recipe.output.dir, ctx)
        if ctx.is_main:  # c10d may put global rank 0 on any node: it writes the run files there
            write_run_files(loaded, plan_dict)
        train_rank(
            loaded, Plan.from_dict(plan_dict), measure_memory=request.measure_memory, ctx=ctx,
            resume=request.resume, debug_memory=request.debug_memory,
        )
    finally:
        ctx.close()


def offloads(request: RunRequest) -> bool:
    """Whether this run may keep state in host memory (``train.offload``), which its process group must know
    before it exists (finetune/train/parallel/distributed.py: gloo beside NCCL): this node's plan offloads, or on several
    nodes the recipe leaves it to the planner, since every node runs node 0's plan, which may."""
    planned = (request.plan.get("execution") or {}).get("offload", "none") != "none"
    several_nodes = int(os.environ.get("WORLD_SIZE", 1)) > int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return planned or (several_nodes and request.recipe.get("train", {}).get("offload") == "auto")


def main(argv: list[str] | None = None) -> None:
    """Run one rank; record any exception in torchelastic's error file for the launcher to report."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m finetune.train.runtime.worker SPEC.json (started by `finetune run`)\n")
        sys.exit(2)
    handler = get_error_handler()
    handler.initialize()
    code = 0
    try:
        run_worker(args[0])
    except UserError as err:
        handler.record_exception(err)  # the launcher prints it, once, naming the rank
        code = getattr(err, "exit_code", 2)
    except Exception as err:
        if _peer_failed(err):
            # A consequence, not a cause: another rank died and took the connection with it. Record nothing
            # (the launcher reports the rank that did record its error) and skip the traceback.
            sys.stderr.write(f"rank {os.environ.get('RANK', '?')}: stopped, another rank failed\n")
            code = PEER_FAILED_EXIT
        else:
            handler.record_exception(err)
            traceback.print_exc()
            code = 1
    _leave(code)


def _leave(code: int) -> None:
    """Exit with ``code`` once the logs are flushed, without the interpreter's teardown.

    The outputs are written and closed and the process group left by then. A native thread still joinable
    when C++ static objects are destroyed aborted ranks at teardown now and then ("terminate called without an
    active exception", SIGABRT), after a finished run or after a rank had recorded its error, which turned a
    complete run into a failed one and an exit status 2 into a signal.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
