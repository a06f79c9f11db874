"""``finetune slurm RECIPE --nodes N --gpus-per-node G``: an sbatch script that trains the recipe on a SLURM cluster.

The script asks for N nodes with one task each (``finetune run`` starts a node's G processes itself, through
torchrun's agent) and runs ``srun finetune run RECIPE --resume auto``, which takes the nodes, this node's rank
and the rendezvous host from SLURM's environment (finetune/train/runtime/slurm.py). It is written for a job that
outlives its time limit: ``--signal=USR1@M`` warns the job M seconds before the limit, every rank finishes its
step and saves a checkpoint and the run exits with 138; the script then requeues the job (``--requeue``,
``scontrol requeue``), whose next attempt (``SLURM_RESTART_COUNT`` above 0) resumes from that checkpoint. M is
at least :data:`MIN_MARGIN_S`, more when the plan's step and the checkpoint's write need it.

The recipe is planned for N x G GPUs first (no GPU needed), so a configuration that cannot fit is refused here,
on the login node, and the plan's host memory per node sets ``--mem``.
"""

from __future__ import annotations

import math
import re
import shlex
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.errors import UserError
from finetune.recipe.schema import RecipeError, check_files, load_recipe
from finetune.train.runtime.signals import exit_code

if TYPE_CHECKING:
    from finetune.plan.types import Plan

#: The first line after the shebang of every script this command writes (an existing file without it is
#: never replaced).
HEADER = "# finetune slurm:"
#: Seconds between SLURM's warning signal and the time limit, at the least.
MIN_MARGIN_S = 120
#: The write rate a checkpoint's time is estimated at, per node (bytes/s): a parallel filesystem's share.
CHECKPOINT_WRITE_BYTES_PER_S = 2**30
#: Extra host memory asked beyond the plan's figure per node (a fraction of it).
MEM_HEADROOM = 0.10
#: The exit status of a run stopped by SIGUSR1: the script requeues the job on it.
REQUEUE_STATUS = exit_code(signal.SIGUSR1)


@dataclass
class SlurmOptions:
    """``finetune slurm``'s arguments."""

    recipe: str
    overrides: list[str]
    nodes: int
    gpus_per_node: int
    time: str | None = None  # SLURM's --time, e.g. 1-00:00:00
    partition: str | None = None
    account: str | None = None
    output: Path | None = None  # the script's path (default: output.dir/slurm.sbatch)
    cpus_per_gpu: int = 8


@dataclass
class SlurmScript:
    """A written script: where, its text, and the figures it asks for."""

    path: Path
    text: str
    mem_bytes: int | None
    margin_s: int


def time_seconds(value: str) -> int:
    """Seconds of a SLURM time limit: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M`` or ``D-H:M:S``; one sentence
    naming ``--time`` otherwise."""
    text = value.strip()
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if match is None or text in ("0", ""):
        raise UserError(
            f"--time: `{value}` is not a SLURM time limit; write minutes, HH:MM:SS or D-HH:MM:SS, e.g. 1-00:00:00"
        )
    days, a, b, c = match.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, m, s = [*parts, 0, 0][:3]
        seconds = int(days) * 86400 + h * 3600 + m * 60 + s
    elif len(parts) == 1:  # minutes
        seconds = parts[0] * 60
    elif len(parts) == 2:  # M:S
        seconds = parts[0] * 60 + parts[1]
    else:  # H:M:S
        seconds = parts[0] * 3600 + parts[1] * 60 + parts[2]
    if seconds <= 0:
        raise UserError(f"--time: `{value}` is no time; write e.g. 1-00:00:00 or 12:00:00")
    return seconds


def signal_margin(plan: Plan, nodes: int) -> int:
    """Seconds before the time limit for SLURM's warning: the step running when it arrives, plus writing the
    checkpoint (its bytes at :data:`CHECKPOINT_WRITE_BYTES_PER_S` per node), plus a minute for the rest; at least
    :data:`MIN_MARGIN_S`."""
    step = plan.chosen.time.step if plan.chosen.time is not None else 0.0
    write = int(plan.job.get("checkpoint_bytes", 0)) / (CHECKPOINT_WRITE_BYTES_PER_S * max(1, nodes))
    return max(MIN_MARGIN_S, math.ceil(step + write + 60))


def finetune_command() -> list[str]:
    """How the job starts finetune: this environment's ``finetune`` script, else its Python with ``-m finetune``."""
    beside = Path(sys.executable).with_name("finetune")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("finetune")
    return [found] if found else [sys.executable, "-m", "finetune"]


def render_script(
    opts: SlurmOptions, recipe_path: Path, plan: Plan, workdir: Path, log_dir: Path, name: str
) -> tuple[str, int | None, int]:
    """The sbatch script's text, the memory per node it asks for (None: no figure) and the signal margin."""
    c = plan.chosen
    host = int(plan.job.get("host_peak_per_node", 0))
    mem = math.ceil(host * (1 + MEM_HEADROOM) / 2**30) * 2**30 if host else None
    margin = signal_margin(plan, opts.nodes)
    if opts.time is not None:
        limit = time_seconds(opts.time)
        if margin * 2 > limit:
            raise UserError(
                f"--time: {opts.time} leaves no room to train: the checkpoint before the limit needs about "
                f"{margin} s (SLURM's warning comes then); ask for at least {2 * margin // 60 + 1} minutes"
            )
    q = shlex.quote
    sets = "".join(f" --set {q(o)}" for o in opts.overrides)
    run = " ".join(q(part) for part in finetune_command())
    from finetune.units import fmt_bytes

    planned = (
        f"{c.method} / {c.strategy} / {c.precision}, micro-batch {c.micro_batch_size} x accumulation "
        f"{c.grad_accum_steps}, {fmt_bytes(c.memory.total)} per GPU"
    )
    lines = [
        "#!/bin/bash",
        f"{HEADER} {recipe_path.name} on {opts.nodes} node(s) x {opts.gpus_per_node} GPU(s); submit with: sbatch <this file>",
        f"# plan: {planned}",
    ]
    if any(note.startswith("No GPU is visible") for note in plan.walk[:1]):  # the planner's assumption, said
        lines.append(
            f"# planned for {fmt_bytes(int(plan.hardware.get('memory_bytes', 0)))} GPUs (none is visible here): set "
            "hardware.gpu_type or hardware.gpu_memory in the recipe to the nodes' GPUs"
        )
    lines += [
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={opts.nodes}",
        "#SBATCH --ntasks-per-node=1",  # finetune run starts the node's processes itself
        f"#SBATCH --gpus-per-node={opts.gpus_per_node}",
        f"#SBATCH --cpus-per-task={opts.cpus_per_gpu * opts.gpus_per_node}",
    ]
    if mem is not None:
        lines.append(f"#SBATCH --mem={mem // 2**30}G")
    if opts.time is not None:
        lines.append(f"#SBATCH --time={opts.time.strip()}")
    if opts.partition:
        lines.append(f"#SBATCH --partition={opts.partition}")
    if opts.account:
        lines.append(f"#SBATCH --account={opts.account}")
    lines += [
        f"#SBATCH --chdir={workdir}",
        f"#SBATCH --output={log_dir / 'slurm-%j.out'}",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        f"#SBATCH --signal=USR1@{margin}",
        "",
        f"# One task per node: `finetune run` starts the node's {opts.gpus_per_node} processes (torchrun's agent) and takes",
        "# the nodes, its node's rank and the rendezvous host (the first node) from SLURM's environment.",
        f"# --mem: the plan's host memory per node ({fmt_bytes(host)}) and {round(100 * MEM_HEADROOM)}% more."
        if mem is not None else "# --mem: the plan has no host figure; set it for your nodes.",
        f"# USR1 {margin} s before the time limit: every rank finishes its step, saves a checkpoint and the run exits",
        f"# with {REQUEUE_STATUS}; the job is then requeued and its next attempt resumes from that checkpoint.",
        "",
        "# Your cluster's network settings for NCCL go here, for example:",
        "#   export NCCL_SOCKET_IFNAME=ib0      # the interface the nodes reach each other on",
        "#   export NCCL_IB_HCA=mlx5            # InfiniBand adapters",
        "#   export NCCL_DEBUG=WARN",
        "# Compute nodes without internet: download the model and data on the login node first (finetune run",
        "# fetches Hub inputs once), and add --offline below.",
        "export PYTHONUNBUFFERED=1",
        "",
        f"srun --ntasks-per-node=1 {run} run {q(str(recipe_path))}{sets} --resume auto",
        "status=$?",
        f'if [ "$status" -eq {REQUEUE_STATUS} ]; then',
        '    scontrol requeue "$SLURM_JOB_ID"  # the checkpoint is saved; the next attempt resumes from it',
        "    exit 0",
        "fi",
        'exit "$status"',
        "",
    ]
    return "\n".join(lines), mem, margin


def plan_for_cluster(opts: SlurmOptions) -> Plan:
    """The recipe's plan for ``opts.nodes`` x ``opts.gpus_per_node`` GPUs (its hardware section for the rest)."""
    from finetune.plan.command import PlanOptions, build_plan, without_bitsandbytes

    with without_bitsandbytes():
        return build_plan(
            PlanOptions(
                recipe=opts.recipe, overrides=tuple(opts.overrides), gpus=opts.gpus_per_node, nodes=opts.nodes
            )
        )


def write_slurm_script(opts: SlurmOptions) -> SlurmScript:
    """Check the recipe, plan it for the cluster and write the script (see the module docstring)."""
    loaded = load_recipe(opts.recipe, opts.overrides)
    problems = check_files(loaded)
    if problems:
        raise RecipeError(problems)
    assert loaded.inputs is not None
    if loaded.inputs.model.kind == "catalog":
        loaded.inputs.model.weights_dir()  # a planning-only catalog name cannot train: its one sentence
    r = loaded.recipe
    if r.distributed.nproc != "auto" and int(r.distributed.nproc) != opts.gpus_per_node:
        raise UserError(
            f"--gpus-per-node: {opts.gpus_per_node} GPUs per node but the recipe's distributed.nproc is "
            f"{r.distributed.nproc} processes per node; give --gpus-per-node {r.distributed.nproc} or set "
            "distributed.nproc: auto (one process per GPU)"
        )
    assert loaded.path is not None, "load_recipe reads a file"
    out_dir = Path(r.output.dir).expanduser()
    if not out_dir.is_absolute():
        out_dir = Path.cwd() / out_dir  # the job runs in this directory (--chdir), so it is the same one
    path = (opts.output or out_dir / "slurm.sbatch").expanduser().absolute()
    if path.exists() and (not path.is_file() or HEADER not in path.read_text(errors="replace")[:400]):
        raise UserError(f"--output: {path} exists and is not a script finetune slurm wrote; choose another --output")
    plan = plan_for_cluster(opts)
    text, mem, margin = render_script(
        opts, loaded.path.resolve(), plan, Path.cwd(), out_dir, re.sub(r"[^A-Za-z0-9_.-]", "-", loaded.path.stem)
    )
    out_dir.mkdir(parents=True, exist_ok=True)  # SLURM writes the job's log there, and needs the directory
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    tmp.replace(path)
    return SlurmScript(path, text, mem, margin)


def run_slurm(opts: SlurmOptions, say: Any = print) -> int:
    """``finetune slurm``: write the script and say where, with what it asks for; the exit code."""
    from finetune.units import fmt_bytes

    if opts.nodes < 1 or opts.gpus_per_node < 1:
        raise UserError("--nodes and --gpus-per-node: give 1 or more")
    script = write_slurm_script(opts)
    mem = f", --mem {fmt_bytes(script.mem_bytes)}" if script.mem_bytes else ""
    say(
        f"wrote {script.path}: {opts.nodes} node(s) x {opts.gpus_per_node} GPU(s), one task per node{mem}, "
        f"USR1 {script.margin_s} s before the time limit (checkpoint, then requeue)"
    )
    say(f"submit with: sbatch {shlex.quote(str(script.path))}")
    return 0
