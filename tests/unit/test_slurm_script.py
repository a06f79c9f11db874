"""`finetune slurm`: the sbatch script's contents, through the CLI (planning only: no GPU, no weights)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from finetune.cli import app
from finetune.commands.slurm import SlurmOptions, plan_for_cluster, signal_margin, time_seconds
from finetune.errors import UserError
from tests.support import tiny_recipe, write_recipe


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One script written for 2 nodes x 4 GPUs, and the plan it was written from."""
    d = tmp_path_factory.mktemp("slurm")
    recipe = write_recipe(d / "lora run.yaml", tiny_recipe(
        d / "out", method="lora", distributed={"strategy": "ddp"}, train={"global_batch_size": 64, "micro_batch_size": 4}
    ))
    script = d / "job.sbatch"
    args = ["slurm", str(recipe), "--nodes", "2", "--gpus-per-node", "4", "--time", "1-00:00:00", "--partition",
            "gpu", "--account", "proj-7", "--output", str(script), "--set", "train.lr=2e-4"]
    result = CliRunner().invoke(app, args)
    plan = plan_for_cluster(SlurmOptions(str(recipe), ["train.lr=2e-4"], 2, 4))
    return {"dir": d, "recipe": recipe, "script": script, "result": result, "plan": plan, "args": args}


def _directives(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]


def test_the_script_asks_one_task_per_node_requeue_and_a_warning_signal(job: dict) -> None:
    assert job["result"].exit_code == 0, job["result"].output
    text = job["script"].read_text()
    host = job["plan"].job["host_peak_per_node"]
    mem_gib = math.ceil(host * 1.1 / 2**30)
    margin = signal_margin(job["plan"], 2)
    assert margin == 120  # a tiny model's step and checkpoint take far less than the least margin
    assert _directives(text) == [
        "--job-name=lora-run", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--cpus-per-task=32",
        f"--mem={mem_gib}G", "--time=1-00:00:00", "--partition=gpu", "--account=proj-7", f"--chdir={Path.cwd()}",
        f"--output={job['dir'] / 'out' / 'slurm-%j.out'}", "--open-mode=append", "--requeue", "--signal=USR1@120",
    ]
    srun = [line for line in text.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1 and srun[0].endswith(f"run '{job['recipe']}' --set train.lr=2e-4 --resume auto")
    assert srun[0].startswith("srun --ntasks-per-node=1 ")
    # the status of a run stopped by SIGUSR1 (128 + 10) requeues the job; any other is the job's own
    assert 'if [ "$status" -eq 138 ]; then\n    scontrol requeue "$SLURM_JOB_ID"' in text
    assert text.rstrip().endswith('exit "$status"') and "export NCCL_" not in text.replace("#   export NCCL_", "")
    assert job["result"].output.splitlines() == [
        f"wrote {job['script']}: 2 node(s) x 4 GPU(s), one task per node, --mem {_gib(mem_gib)}, USR1 120 s before "
        "the time limit (checkpoint, then requeue)",
        f"submit with: sbatch {job['script']}",
    ]


def _gib(n: int) -> str:
    from finetune.units import fmt_bytes

    return fmt_bytes(n * 2**30)


def test_the_margin_grows_with_the_checkpoint_to_write(job: dict) -> None:
    plan = job["plan"]
    big = type(plan).from_dict({**plan.to_dict(), "job": {**plan.job, "checkpoint_bytes": 400 * 2**30}})
    step = plan.chosen.time.step if plan.chosen.time is not None else 0.0
    # 400 GiB at 1 GiB/s per node over 2 nodes, the step, and a minute
    assert signal_margin(big, 2) == math.ceil(step + 200 + 60)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("30", 1800), ("5:30", 330), ("02:00:00", 7200), ("1-0", 86400), ("2-03:04", 183840), ("1-00:00:10", 86410)],
)
def test_slurm_time_limits(value: str, seconds: int) -> None:
    assert time_seconds(value) == seconds


def test_what_cannot_be_written_is_one_sentence(job: dict, tmp_path: Path) -> None:
    runner = CliRunner()
    base = ["slurm", str(job["recipe"]), "--nodes", "2", "--gpus-per-node", "4"]
    out = runner.invoke(app, [*base, "--time", "3", "--output", str(tmp_path / "a.sbatch")])
    assert out.exit_code == 2 and out.output.strip() == (
        "error: --time: 3 leaves no room to train: the checkpoint before the limit needs about 120 s (SLURM's "
        "warning comes then); ask for at least 5 minutes"
    )
    foreign = tmp_path / "notes.txt"
    foreign.write_text("my notes\n")
    out = runner.invoke(app, [*base, "--output", str(foreign)])
    assert out.exit_code == 2 and out.output.strip() == (
        f"error: --output: {foreign} exists and is not a script finetune slurm wrote; choose another --output"
    )
    assert foreign.read_text() == "my notes\n"
    out = runner.invoke(app, [*base, "--set", "distributed.nproc=2", "--output", str(tmp_path / "b.sbatch")])
    assert out.exit_code == 2 and out.output.strip() == (
        "error: --gpus-per-node: 4 GPUs per node but the recipe's distributed.nproc is 2 processes per node; give "
        "--gpus-per-node 2 or set distributed.nproc: auto (one process per GPU)"
    )
    with pytest.raises(UserError, match="--time: `1:2:3:4` is not a SLURM time limit"):
        time_seconds("1:2:3:4")
