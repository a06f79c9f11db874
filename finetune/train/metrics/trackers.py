"""Experiment trackers: the rows of metrics.jsonl, also sent to TensorBoard, Weights & Biases or MLflow.

``output.trackers: [tensorboard, wandb, mlflow]`` names them; each is driven through its own client, imported
only when named, on rank 0 only. Every tracker gets the same rows as metrics.jsonl (one call per row, at the
row's step), the resolved recipe and the plan as the run's configuration, and the plan's predicted and the
measured peak memory once. Everything is local by default: TensorBoard event files in ``output.dir/tensorboard``,
wandb in offline mode under ``output.dir/wandb`` (unless ``WANDB_MODE`` says otherwise), MLflow in a ``file:``
store at ``output.dir/mlruns`` (unless ``MLFLOW_TRACKING_URI`` names a server).

Resuming continues the same tracker run: the run ids live in ``output.dir/trackers.json``. Steps after the
resumed checkpoint that the interrupted run had already logged are not logged twice: TensorBoard purges them
(``purge_step``: its readers hide the stale events), wandb and MLflow skip steps they already hold (neither can
delete a logged point; an exact resume recomputes the same values).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from finetune.errors import UserError

#: The trackers ``output.trackers`` may name, and the module each needs.
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}

STATE_FILE = "trackers.json"


def check_installed(names: list[str]) -> None:
    """Raise a one-sentence UserError for the first named tracker whose library is not installed."""
    for name in names:
        module = TRACKER_MODULES[name]
        if importlib.util.find_spec(module) is None:
            raise UserError(
                f"output.trackers: `{name}` is named but the {module} package is not installed; "
                f"pip install 'finetune[{name}]' (or remove it from output.trackers)"
            )


class Tracker(Protocol):
    """What the training loop needs from a tracker."""

    def log(self, row: dict[str, Any]) -> None:
        """Log one metrics.jsonl row at ``row["step"]``."""

    def close(self) -> None:
        """Flush and finish the run."""


def numeric(row: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics row, without ``step`` (trackers take the step separately)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and v is not None
    }


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"train": {"lr": 1e-3}}`` -> ``{"train.lr": "0.001"}`` (MLflow params are flat strings)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, list | tuple) else str(v)
    return out


class TensorBoardTracker:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter``; the recipe and plan as text."""

    def __init__(self, out_dir: Path, config: dict[str, Any], resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = out_dir / "tensorboard"
        if resume_step is None:
            shutil.rmtree(log_dir, ignore_errors=True)  # a fresh start, like metrics.jsonl
        # purge_step: readers hide events at steps >= it written before (the interrupted run's extra steps).
        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)
        if resume_step is None:
            self.writer.add_text("recipe", "```\n" + json.dumps(config["recipe"], indent=2) + "\n```", 0)
            self.writer.add_text("plan", "```\n" + json.dumps(config["plan"], indent=2) + "\n```", 0)

    def log(self, row: dict[str, Any]) -> None:
        """One scalar per numeric field, at the row's step."""
        for k, v in numeric(row).items():
            self.writer.add_scalar(k, v, global_step=int(row["step"]))
        self.writer.flush()  # a killed run keeps what it logged, like metrics.jsonl

    def close(self) -> None:
        """Close the event file."""
        self.writer.close()


class WandbTracker:
    """A wandb run (offline unless WANDB_MODE says otherwise) whose id is kept for resuming."""

    def __init__(self, out_dir: Path, config: dict[str, Any], state: dict[str, Any], run_name: str) -> None:
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        self.state = state
        state.setdefault("id", uuid.uuid4().hex[:12])
        # Steps the earlier attempts of this run logged: a resumed run repeats some of them.
        self.done_upto = int(state.get("last_step", -1))
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "finetune"),
            name=run_name,
            id=state["id"],
            resume="allow",
            dir=str(out_dir),
            config=config,
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )

    def log(self, row: dict[str, Any]) -> None:
        """Log the row unless this wandb run already holds its step (a resumed run's repeated steps)."""
        step = int(row["step"])
        if step <= self.done_upto:
            return
        self.run.log(numeric(row), step=step)
        self.state["last_step"] = max(step, int(self.state.get("last_step", -1)))

    def close(self) -> None:
        """Finish the run (writes the offline run file's last records)."""
        self.run.finish()


class MlflowTracker:
    """An MLflow run (a ``file:`` store under output.dir unless MLFLOW_TRACKING_URI is set), resumed by id."""

    def __init__(self, out_dir: Path, config: dict[str, Any], state: dict[str, Any], run_name: str) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (out_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # mlflow 3 refuses its file store unless told it is wanted; a local, serverless store is the point here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.state = state
        run_id = state.get("run_id")
        self.logged: set[tuple[str, int]] = set()
        if run_id is not None:
            for key in self.client.get_run(run_id).data.metrics:
                self.logged.update((key, m.step) for m in self.client.get_metric_history(run_id, key))
            self.client.update_run(run_id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "finetune")
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            params = flatten(
                {"recipe": config["recipe"], "plan": {"chosen": config["plan"].get("chosen", {})}}
            )
            # MLflow caps a param value at 6000 characters and a batch at 100 params.
            items = [Param(k, v[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):
                self.client.log_batch(run_id, params=items[i : i + 100])
            self.client.log_dict(run_id, config["recipe"], "recipe.json")
            self.client.log_dict(run_id, config["plan"], "plan.json")
            state["run_id"] = run_id
        self.run_id = run_id

    def log(self, row: dict[str, Any]) -> None:
        """Log the row's metrics this run does not hold yet at this step."""
        step, now = int(row["step"]), int(time.time() * 1000)
        metrics = [
            self._metric(k, v, now, step) for k, v in numeric(row).items() if (k, step) not in self.logged
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)
            self.logged.update((m.key, step) for m in metrics)

    def close(self) -> None:
        """Mark the run finished."""
        self.client.set_terminated(self.run_id)


class Trackers:
    """The named trackers of a run (empty on ranks other than 0): ``log(row)`` fans a metrics row out."""

    def __init__(self, trackers: list[Tracker], state_path: Path | None, state: dict[str, Any]) -> None:
        self.trackers = trackers
        self.state_path = state_path
        self.state = state

    @classmethod
    def open(
        cls,
        names: list[str],
        out_dir: Path,
        config: dict[str, Any],
        *,
        resume_step: int | None,
        enabled: bool,
    ) -> Trackers:
        """Start (``resume_step`` None) or continue the named trackers' runs in ``out_dir``."""
        if not enabled or not names:
            return cls([], None, {})
        check_installed(names)
        path = out_dir / STATE_FILE
        state: dict[str, Any] = {}
        if resume_step is not None and path.is_file():
            state = json.loads(path.read_text())
        run_name = out_dir.resolve().name
        built: list[Tracker] = []
        for name in dict.fromkeys(names):  # once each, in the order given
            if name == "tensorboard":
                built.append(TensorBoardTracker(out_dir, config, resume_step))
            elif name == "wandb":
                built.append(WandbTracker(out_dir, config, state.setdefault("wandb", {}), run_name))
            elif name == "mlflow":
                built.append(MlflowTracker(out_dir, config, state.setdefault("mlflow", {}), run_name))
        self = cls(built, path, state)
        self._save()
        return self

    def _save(self) -> None:
        if self.state_path is not None:
            self.state_path.write_text(json.dumps(self.state, indent=2) + "\n")

    def log(self, row: dict[str, Any]) -> None:
        """Send one metrics.jsonl row to every tracker."""
        for t in self.trackers:
            t.log(row)
        if self.trackers:
            self._save()

    def close(self) -> None:
        """Finish every tracker's run (idempotent)."""
        for t in self.trackers:
            t.close()
        self.trackers = []
        self._save()
