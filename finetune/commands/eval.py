"""``finetune eval RUN_OR_MODEL --tasks ...``: lm-evaluation-harness over what a run left, and over its base.

The model (a full model, an adapter over its base, a merged model, any Hugging Face model directory:
:mod:`finetune.inference`) is wrapped in lm-eval's ``HFLM`` and evaluated on the tasks asked for:

- ``run`` (or ``recipe:eval``): the run's own held-out prompts, as the run built them (the same tokenized
  prompts, written back as text that re-tokenizes to the same ids), generated greedily for
  ``eval.max_new_tokens`` tokens and compared whitespace-trimmed with the answers: the run's exact match;
- ``retain`` (or ``recipe:retain``): the rows of the run's ``eval.retain`` that have answers, the same way;
- a YAML task file (lm-eval's task format) over local data, e.g. ``dataset_path: json`` with
  ``dataset_kwargs: {data_files: {test: rows.jsonl}}`` (a relative file is looked up next to the YAML);
- any task lm-eval knows whose data is in the local Hugging Face datasets cache (``HF_DATASETS_OFFLINE=1``
  unless the environment says otherwise).

``--baseline`` evaluates a second model (by default the run's base) on the same tasks, and the table shows
each metric of both and their difference. Every check (the directory, each task, its data) happens before a
model is loaded, and the JSON is written only after every evaluation finished.

A task file runs no code unless ``--allow-task-code``: its YAML (and every file it includes) is read as plain
YAML first, and a ``!function`` (which imports a module beside it) or any other non-plain tag is refused in one
sentence; its prompt templates render in Jinja's sandbox (lm-eval's own environment would let a template reach
Python). Model code of a directory runs only with ``--trust-remote-code``.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from finetune.errors import UserError

if TYPE_CHECKING:
    from finetune.recipe.schema import LoadedRecipe
    from finetune.storage.rundir import RunDir

#: The names of the run's own tasks on ``--tasks``.
RUN_TASKS = ("run", "recipe:eval")
RETAIN_TASKS = ("retain", "recipe:retain")
INSTALL = "pip install 'lm-eval>=0.4.13' (or pip install -e '.[eval]' in a checkout)"
#: The run's exact match compares whitespace-trimmed texts; lm-eval's exact_match trims with these.
TRIM = ["^\\s+", "\\s+$"]


def require_lm_eval() -> str:
    """lm-eval's version; one sentence with the command that installs it when it is not installed."""
    try:
        import lm_eval
    except ImportError:
        raise UserError(f"finetune eval needs lm-evaluation-harness (lm-eval), which is not installed; {INSTALL}") from None
    from importlib.metadata import version

    return str(getattr(lm_eval, "__version__", None) or version("lm-eval"))


def parse_tasks(values: list[str]) -> list[str]:
    """The task names of every ``--tasks`` (comma-separated, repeatable), in order, each once."""
    names: list[str] = []
    for value in values:
        for name in value.split(","):
            name = name.strip()
            if name and name not in names:
                names.append(name)
    if not names:
        raise UserError("--tasks: give at least one task, e.g. --tasks run (the run's own eval) or --tasks hellaswag")
    return names


@dataclass
class TaskRequest:
    """One ``--tasks`` entry, as lm-eval takes it: a registered name, or a config dict built here."""

    name: str
    spec: str | dict[str, Any]
    registered: bool = False
    notes: list[str] = field(default_factory=list)


def _prompt_rows(prompts: list[Any], tokenizer: Any, key: str) -> tuple[list[dict[str, str]], list[str]]:
    """The prompts (token ids) as texts lm-eval re-tokenizes to the same ids, with their answers; a note when
    some do not re-tokenize the same."""
    bos = tokenizer.bos_token
    rows, differ = [], 0
    for p in prompts:
        text = tokenizer.decode(p.prompt_ids, skip_special_tokens=False)
        # what lm-eval's HFLM does: no special tokens when the text starts with BOS, the tokenizer's default else
        again = tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]
        differ += list(again) != list(p.prompt_ids)
        rows.append({"prompt": text, "answer": p.answer.strip()})
    notes = [f"{key}: {differ} of {len(prompts)} prompts re-tokenize differently from the run's"] if differ else []
    return rows, notes


def _generation_task(name: str, rows: list[dict[str, str]], max_new_tokens: int, workdir: Path) -> dict[str, Any]:
    """An lm-eval task config: greedy generation of ``max_new_tokens`` tokens (stopping at EOS) from each row's
    prompt, exact match with its answer, both trimmed of whitespace."""
    path = workdir / f"{name.replace(':', '-')}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(path)}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "prompt",
        "doc_to_target": "answer",
        "generation_kwargs": {"until": [], "do_sample": False, "max_gen_toks": max_new_tokens},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "regexes_to_ignore": TRIM}],
        "num_fewshot": 0,
    }


def _run_recipe(run: RunDir, key: str) -> LoadedRecipe:
    """The recipe of the run ``--tasks key`` evaluates on its own data (:meth:`RunDir.loaded_recipe`)."""
    from finetune.recipe.schema import RecipeError

    if run.recipe is None:
        raise UserError(
            f"--tasks {key}: {run.path} is not a finetune run (no recipe.yaml), so it has no {key} data; give a "
            "YAML task over a local file or an lm-eval task"
        )
    try:
        return run.loaded_recipe()
    except RecipeError as err:
        raise UserError(f"--tasks {key}: {run.path / 'recipe.yaml'} is not a valid recipe ({err})") from None


def run_task(run: RunDir, tokenizer: Any, name: str, workdir: Path) -> TaskRequest:
    """The run's held-out prompts (``data.eval`` / ``data.eval_fraction``, ``eval.max_samples``) as the run's
    evaluation built them, as an lm-eval generation task scored by exact match."""
    from finetune.train.data import load_data

    loaded = _run_recipe(run, name)
    try:
        data = load_data(loaded, tokenizer)
    except UserError as err:
        raise UserError(f"--tasks {name}: {err}") from None
    if not data.eval_prompts:
        raise UserError(
            f"--tasks {name}: the run's recipe has no held-out prompts with answers (data.eval or "
            "data.eval_fraction, in the instruction or chat format); give a YAML task over a local file"
        )
    rows, notes = _prompt_rows(data.eval_prompts, tokenizer, name)
    spec = _generation_task(name, rows, loaded.recipe.eval.max_new_tokens, workdir)
    return TaskRequest(name, spec, notes=notes)


def retain_task(run: RunDir, tokenizer: Any, name: str, workdir: Path) -> TaskRequest:
    """The rows of the run's ``eval.retain`` that have answers, as an lm-eval generation task (exact match)."""
    from finetune.train.data.retain import load_retain

    loaded = _run_recipe(run, name)
    if not loaded.recipe.eval.retain:
        raise UserError(f"--tasks {name}: the run's recipe has no eval.retain")
    try:
        retain = load_retain(loaded, tokenizer)
    except UserError as err:
        raise UserError(f"--tasks {name}: {err}") from None
    if retain is None or not retain.prompts:
        raise UserError(
            f"--tasks {name}: the rows of eval.retain have no answers (text rows); their loss is in the run's "
            "metrics.jsonl (retain_loss)"
        )
    rows, notes = _prompt_rows(retain.prompts, tokenizer, name)
    spec = _generation_task(name, rows, loaded.recipe.eval.max_new_tokens, workdir)
    return TaskRequest(name, spec, notes=notes)


#: The tags plain YAML resolves to (what a task file may hold without --allow-task-code).
PLAIN_TAGS = frozenset(tag for tag in yaml.SafeLoader.yaml_constructors if tag is not None)


def task_code(path: Path, seen: frozenset[Path] = frozenset()) -> tuple[str, str] | None:
    """(``file:line``, what) of the first thing in a task file, or in a file it includes, that would run code
    when lm-eval reads it: a ``!function`` or a tag plain YAML does not have. Read by composing the YAML (no
    object is built), so reading it runs nothing; None when the file is plain YAML."""
    path = path.expanduser().resolve()
    if path in seen or not path.is_file():
        return None  # a cycle or a missing include: lm-eval's own reading says so
    try:
        root = yaml.compose(path.read_text(), Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None  # not YAML: lm-eval's own reading says so
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        if node.tag not in PLAIN_TAGS:
            what = f"`!function {node.value}`" if node.tag == "!function" else f"the tag `{node.tag}`"
            return f"{path}:{node.start_mark.line + 1}", what
        if isinstance(node, yaml.MappingNode):
            stack += [part for pair in node.value for part in pair]
        elif isinstance(node, yaml.SequenceNode):
            stack += list(node.value)
    includes: list[str] = []
    if isinstance(root, yaml.MappingNode):
        for key, value in root.value:
            if key.value == "include":
                items = value.value if isinstance(value, yaml.SequenceNode) else [value]
                includes += [str(item.value) for item in items if isinstance(item, yaml.ScalarNode)]
    for inc in includes:
        found = task_code(path.parent / inc if not Path(inc).is_absolute() else Path(inc), seen | {path})
        if found is not None:
            return found
    return None


def yaml_task(path: Path, allow_code: bool = False) -> TaskRequest:
    """A user's lm-eval task file; relative ``data_files`` are looked up next to it (then in the current
    directory), and a local file that does not exist is one sentence. Without ``allow_code`` a file that would
    import or run code (:func:`task_code`) is refused before lm-eval reads it."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if not allow_code:
        found = task_code(path)
        if found is not None:
            where, what = found
            raise UserError(
                f"--tasks {where}: {what} would run code from beside the task file; pass --allow-task-code if "
                "you trust the task's author, or remove it"
            )
    try:
        cfg = load_yaml(path)
    except Exception as err:  # YAML syntax, a missing include or !function module: lm-eval's own words
        raise UserError(f"--tasks {path}: not a task file lm-eval can read ({err})") from None
    if "task" not in cfg:
        raise UserError(f"--tasks {path}: the file has no `task:` name; an lm-eval task file names its task")
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if files is not None:
        cfg["dataset_kwargs"] = {**cfg["dataset_kwargs"], "data_files": _local_files(files, path)}
    return TaskRequest(str(cfg["task"]), cfg)


def _local_files(files: Any, task_file: Path) -> Any:
    """``data_files`` with each relative file made absolute (next to the task file, else the current directory)."""
    if isinstance(files, dict):
        return {k: _local_files(v, task_file) for k, v in files.items()}
    if isinstance(files, list):
        return [_local_files(v, task_file) for v in files]
    value = str(files)
    if "://" in value or any(ch in value for ch in "*?["):
        return value
    for candidate in (task_file.parent / value, Path.cwd() / value):
        if candidate.is_file():
            return str(candidate.resolve())
    raise UserError(
        f"--tasks {task_file}: dataset_kwargs.data_files names {value}, which is not a file (looked next to the "
        "task file and in the current directory)"
    )


def _task_manager(requests: list[TaskRequest]) -> Any:
    """lm-eval's TaskManager: with its own task index only when a registered task is asked for (building that
    index reads every task file lm-eval ships)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=any(r.registered for r in requests))


def check_registered(requests: list[TaskRequest], manager: Any) -> None:
    """Each registered name must be one lm-eval knows: one sentence with the closest names otherwise."""
    for r in requests:
        if r.registered and r.name not in manager.all_tasks:
            close = difflib.get_close_matches(r.name, manager.all_tasks, n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(f'`{c}`' for c in close)}? " if close else ""
            raise UserError(
                f"--tasks {r.name}: lm-eval has no task of that name; {hint}`lm-eval ls tasks` lists them, and "
                "`run`, `retain` or a YAML task file name this tool's own"
            )


def load_tasks(requests: list[TaskRequest], manager: Any) -> None:
    """Build every task once (reading its data), so that a task whose data is not local is refused before any
    model is loaded."""
    for r in requests:
        try:
            manager.load([r.spec])
        except UserError:
            raise
        except Exception as err:
            if _not_local(err):
                cfg = r.spec if isinstance(r.spec, dict) else getattr(manager.task_index.get(r.name), "cfg", None)
                dataset = (cfg or {}).get("dataset_path") or "its dataset"
                raise UserError(
                    f"--tasks {r.name}: its data ({dataset}) is not in the local Hugging Face datasets cache "
                    "(finetune eval runs with HF_DATASETS_OFFLINE=1); load it once where the Hub is reachable "
                    "(HF_DATASETS_OFFLINE=0 finetune eval ...), or write a YAML task over a local file"
                ) from None
            raise UserError(f"--tasks {r.name}: lm-eval cannot build this task ({type(err).__name__}: {err})") from None


def _not_local(err: BaseException) -> bool:
    """Whether building a task failed for want of its data (offline, not in the datasets cache)."""
    text = f"{type(err).__name__}: {err}".lower()
    return isinstance(err, (ConnectionError, FileNotFoundError)) or any(
        w in text for w in ("offline", "couldn't reach", "datasetnotfound", "couldn't find")
    )


def build_requests(
    names: list[str], run: RunDir, tokenizer: Any, workdir: Path, allow_code: bool = False
) -> list[TaskRequest]:
    """A :class:`TaskRequest` per ``--tasks`` name: the run's own tasks (of ``run``, the model evaluated) and task
    files built here, the rest registered names for lm-eval."""
    requests: list[TaskRequest] = []
    for name in names:
        if name in RUN_TASKS:
            requests.append(run_task(run, tokenizer, name, workdir))
        elif name in RETAIN_TASKS:
            requests.append(retain_task(run, tokenizer, name, workdir))
        elif name.endswith((".yaml", ".yml")):
            path = Path(name).expanduser()
            if not path.is_file():
                raise UserError(f"--tasks {name}: no such task file")
            requests.append(yaml_task(path, allow_code))
        else:
            requests.append(TaskRequest(name, name, registered=True))
    return requests


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


@dataclass
class Scores:
    """One model's results: per task, metric -> value, the number of documents and a few samples."""

    model: str
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _metric_name(key: str) -> str:
    metric, _, filt = key.partition(",")
    return metric if filt in ("", "none") else f"{metric} ({filt})"


def evaluate_model(
    loaded: Any, requests: list[TaskRequest], manager: Any, *, batch_size: int, limit: int | None
) -> Scores:
    """Run lm-eval's ``simple_evaluate`` over ``loaded`` (a :class:`~finetune.inference.Session`)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(
        pretrained=loaded.model, tokenizer=loaded.fmt().tokenizer, batch_size=batch_size,
        mixed_precision_dtype=loaded.autocast_dtype,
    )
    out = simple_evaluate(
        model=lm, tasks=[r.spec for r in requests], task_manager=manager, limit=limit, bootstrap_iters=0,
        log_samples=True,
    )
    assert out is not None, "a single process is lm-eval's rank 0"
    scores = Scores(loaded.label)
    for task, values in out["results"].items():
        scores.metrics[task] = {
            _metric_name(k): float(v) for k, v in values.items()
            if k != "alias" and "_stderr" not in k and not k.startswith("sample_len") and isinstance(v, (int, float))
        }
    for task, n in (out.get("n-samples") or {}).items():
        scores.counts[task] = int(n.get("effective", n.get("original", 0)))
    for task, rows in (out.get("samples") or {}).items():
        scores.samples[task] = [
            {"doc_id": s.get("doc_id"), "target": s.get("target"),
             "response": (s.get("filtered_resps") or [None])[0]}
            for s in rows
        ]
    return scores


@dataclass
class EvalReport:
    """What ``finetune eval`` prints and writes."""

    model: Scores
    baseline: Scores | None
    tasks: list[str]
    lm_eval_version: str
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[tuple[str, str, float, float | None]]:
        """(task, metric, model value, baseline value) for every metric of every task lm-eval reported."""
        out = []
        for task, metrics in self.model.metrics.items():
            for metric, value in metrics.items():
                base = self.baseline.metrics.get(task, {}).get(metric) if self.baseline else None
                out.append((task, metric, value, base))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON written by ``--output``."""
        tasks: dict[str, Any] = {}
        for task, metric, value, base in self.rows():
            t = tasks.setdefault(task, {"n": self.model.counts.get(task), "metrics": {}})
            t["metrics"][metric] = value
            if self.baseline is not None:
                t.setdefault("baseline", {})[metric] = base
                t.setdefault("difference", {})[metric] = None if base is None else value - base
        return {
            "model": self.model.model,
            "baseline": self.baseline.model if self.baseline else None,
            "lm_eval_version": self.lm_eval_version,
            "tasks": tasks,
            "samples": {"model": self.model.samples, **({"baseline": self.baseline.samples} if self.baseline else {})},
            "notes": self.notes,
        }


@contextmanager
def sandboxed_templates(sandbox: bool) -> Iterator[None]:
    """lm-eval's prompt templates rendered in Jinja's sandbox (its own environment, lm_eval.utils.env, is not
    one: a template could reach Python's objects and run a command); with ``sandbox`` False, lm-eval's own."""
    import lm_eval.utils as lm_utils

    if not sandbox:
        yield
        return
    from jinja2 import BaseLoader, StrictUndefined
    from jinja2.sandbox import SandboxedEnvironment

    own = lm_utils.env
    env = SandboxedEnvironment(loader=BaseLoader(), undefined=StrictUndefined, keep_trailing_newline=True)
    env.filters.update(own.filters)
    lm_utils.env = env
    try:
        yield
    finally:
        lm_utils.env = own


def run_eval(
    target: str, task_values: list[str], *, baseline: str | None = None, output: Path | None = None,
    batch_size: int = 16, limit: int | None = None, say: Any = print, trust_remote_code: bool = False,
    allow_task_code: bool = False,
) -> EvalReport:
    """``finetune eval``: check everything, evaluate the model (and the baseline), then write ``output``.

    ``baseline``: None (no baseline), ``base`` (the model the run started from) or a model directory.
    ``trust_remote_code``: model code of the directories may run (the user's flag; a run's recipe never turns it
    on); ``allow_task_code``: task files may import code (``!function``) and render unsandboxed templates.
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    version = require_lm_eval()
    names = parse_tasks(task_values)
    if output is not None and not output.parent.is_dir():
        raise UserError(f"--output: the directory {output.parent} does not exist; create it or choose another file")
    from finetune.inference import load, load_baseline, select

    _quiet()
    with tempfile.TemporaryDirectory(prefix="finetune-eval-") as tmp, sandboxed_templates(not allow_task_code):
        selection = select(target, [], None, Path(tmp), trust_remote_code=trust_remote_code)
        run = selection.run(selection.names[0])
        tokenizer = selection.tokenizers(trust_remote_code)[selection.names[0]]
        requests = build_requests(names, run, tokenizer, Path(tmp), allow_task_code)
        manager = _task_manager(requests)
        check_registered(requests, manager)
        load_tasks(requests, manager)
        notes = [n for r in requests for n in r.notes]
        if baseline is not None and baseline != "base":
            base_selection = select(baseline, [], None, Path(tmp), flag="--baseline", trust_remote_code=trust_remote_code)
        loaded = load(selection, trust_remote_code=trust_remote_code)
        say(f"evaluating {loaded.label} on {', '.join(r.name for r in requests)}")
        scores = evaluate_model(loaded, requests, manager, batch_size=batch_size, limit=limit)
        base_scores = None
        if baseline is not None:
            if baseline == "base":
                base, base_notes = load_baseline(selection, trust_remote_code=trust_remote_code)
            else:
                base, base_notes = load(base_selection, trust_remote_code=trust_remote_code), []
            del loaded
            notes += base_notes
            say(f"evaluating the baseline {base.label}")
            base_scores = evaluate_model(base, requests, manager, batch_size=batch_size, limit=limit)
    report = EvalReport(scores, base_scores, [r.name for r in requests], version, notes)
    if output is not None:
        tmp_out = output.with_name(output.name + ".tmp")
        tmp_out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        tmp_out.replace(output)
    return report


def _quiet() -> None:
    """Only lm-eval's generation progress: not its log lines, nor the datasets and weights loading bars."""
    import datasets
    from transformers.utils import logging as hf_logging

    for name in ("lm_eval", "lm-eval", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()


def print_report(report: EvalReport, console: Any) -> None:
    """The table: task, metric, the model's value, the baseline's and the difference."""
    from rich.table import Table

    table = Table(title=None, show_edge=False, header_style="bold")
    for col in ("task", "metric", "n", "model", *(("baseline", "difference") if report.baseline else ())):
        table.add_column(col, justify="left" if col in ("task", "metric") else "right")
    for task, metric, value, base in report.rows():
        cells = [task, metric, str(report.model.counts.get(task, "")), _fmt(metric, value)]
        if report.baseline is not None:
            cells += [_fmt(metric, base), _fmt(metric, None if base is None else value - base, signed=True)]
        table.add_row(*cells)
    console.print(f"model: {report.model.model}")
    if report.baseline is not None:
        console.print(f"baseline: {report.baseline.model}")
    console.print(table)
    for note in report.notes:
        console.print(f"note: {note}")


def _fmt(metric: str, value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    if metric.startswith(("exact_match", "acc", "f1", "em")):  # fractions: shown as percentages
        return f"{100 * value:+.1f}%" if signed else f"{100 * value:.1f}%"
    return f"{value:+.4f}" if signed else f"{value:.4f}"
