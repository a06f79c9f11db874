"""What a directory holds: a run's output.dir, an adapter directory, a merge, or any Hugging Face model directory.

    read_run(value, flag)      -> RunDir    # the files, read once: no weights, no torch
    read_outputs(value, flag)  -> RunDir    # a run's output.dir at any point: training, stopped or done
    find_base(run, base)       -> BaseRef   # where the base of an adapter is

Every command that opens what a run left (``chat``, ``eval``, ``merge``, ``serve``, ``export``, ``report``)
reads it here, by one set of rules:

- **what it holds** (:attr:`RunDir.kind`): ``model`` (``config.json`` with safetensors weights: a full
  fine-tune, a merge, any model), ``peft`` (``adapter_config.json`` with its weights: LoRA, QLoRA, DoRA,
  prefix or prompt tuning) or ``bottleneck`` (``bottleneck_config.json`` with its weights); a run that has not
  saved yet, a config without weights or an incomplete adapter is one sentence naming the argument;
- **its recipe and plan** (``recipe.yaml``, ``plan.json``), and for a merge, the recipe of the run whose
  adapter it folded (``finetune_merge.json`` names it), since that says how the model was trained and prompted;
  the recipe typed (:meth:`RunDir.loaded_recipe`), with the user's ``trust_remote_code``;
- **what the run measured** (``metrics.jsonl``, ``memory.json``), which ``report`` draws, also while the run is
  still training (:func:`read_outputs`);
- **the method** (:attr:`RunDir.method`): the recipe's, else what the adapter's files say;
- **the dtypes** the run computed in (:attr:`RunDir.compute_dtype`, :attr:`RunDir.autocast_dtype`,
  :attr:`RunDir.model_dtype`, :attr:`RunDir.base_dtype`), from the plan's execution spec, with the recipe as
  the fallback for a plan that has none;
- **the base** of an adapter (:func:`find_base`): ``--base``, else the run's recipe (``base/`` for a random
  init), else the adapter's ``base_model_name_or_path``.

Nothing here decides whether code from a directory may run: ``trust_remote_code`` is the user's choice, an
argument of the loader (:mod:`finetune.inference`), never a value read from the directory being opened (a
run's recipe is read with ``model.trust_remote_code`` off, :func:`finetune.recipe.schema.opened_run_recipe`, so that
nothing rebuilt from it runs a directory's code either). An index's shard names are checked as the directory
is read (no separators, no ``..``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from finetune.errors import UserError
from finetune.model.adapters import BOTTLENECK_CONFIG, BOTTLENECK_WEIGHTS
from finetune.model.methods import METHOD_TYPES
from finetune.recipe.locate import locate_model
from finetune.recipe.schema import LoadedRecipe, opened_run_recipe, recipe_from_dict
from finetune.spec import ExecSpec, Method
from finetune.storage.safetensors_stream import SAFE_INDEX, SAFE_SINGLE, read_weight_map

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
#: What a run writes as it trains: a JSON line per logged step, and the measured memory beside the plan's.
METRICS = "metrics.jsonl"
MEMORY = "memory.json"
#: Written into every merged directory: what was merged, and the mark that lets ``merge --force`` replace it.
MERGE_MARKER = "finetune_merge.json"
#: The method of a bare adapter directory (no recipe), by what its files say.
_PEFT_METHODS = {"LORA": "lora", "PREFIX_TUNING": "prefix", "PROMPT_TUNING": "prompt"}

#: What a directory holds: a whole model, a peft adapter, bottleneck adapters; ``run``: a run's output.dir that
#: has saved no model yet (only :func:`read_outputs` answers it).
Kind = Literal["model", "peft", "bottleneck", "run"]


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; one sentence when the file is not one (the directory is damaged)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not readable JSON ({err}); the directory is damaged") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} does not hold a JSON object; the directory is damaged")
    return data


def has_weights(d: Path) -> bool:
    """Whether ``d`` is a model directory transformers loads: a config and safetensors weights (one file or
    an index of shards)."""
    return (d / "config.json").is_file() and ((d / SAFE_SINGLE).is_file() or (d / SAFE_INDEX).is_file())


def adapter_weights(d: Path) -> Path | None:
    """The weights file of the peft adapter in ``d`` (None when there is none)."""
    return next((d / w for w in ADAPTER_WEIGHTS if (d / w).is_file()), None)


def holds(d: Path) -> Kind | None:
    """What ``d`` holds by its files alone, as :func:`read_run` tells it apart (reading nothing): ``peft`` with an
    ``adapter_config.json``, ``bottleneck`` with a ``bottleneck_config.json``, ``model`` with a config and
    safetensors weights; None otherwise. Whether an adapter's weights are there is :func:`adapter_weights`'s."""
    if (d / ADAPTER_CONFIG).is_file():
        return "peft"
    if (d / BOTTLENECK_CONFIG).is_file():
        return "bottleneck"
    return "model" if has_weights(d) else None


def with_user_trust(recipe: dict[str, Any] | None, trust_remote_code: bool) -> dict[str, Any]:
    """A run's recipe with ``model.trust_remote_code`` set to the user's choice (``--trust-remote-code``), for
    what is rebuilt from it (a random init's weights): the directory's own value is never used."""
    recipe = recipe or {}
    return {**recipe, "model": {**(recipe.get("model") or {}), "trust_remote_code": trust_remote_code}}


def _run_files(d: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The recipe and plan a run saved in ``d`` (None where it saved none)."""
    recipe = plan = None
    if (d / "recipe.yaml").is_file():
        try:
            data = yaml.safe_load((d / "recipe.yaml").read_text())
        except yaml.YAMLError as err:
            why = " ".join(str(err).split())  # one line: YAML's message marks the place on lines of its own
            raise UserError(f"{d / 'recipe.yaml'} is not valid YAML ({why}); the run directory is damaged") from None
        recipe = opened_run_recipe(data)  # remote code stays off: only the user's --trust-remote-code turns it on
    if (d / "plan.json").is_file():
        plan = read_json(d / "plan.json")
    return recipe, plan


@dataclass
class RunDir:
    """One directory a command opens, and what surrounds it.

    ``kind``: ``model`` (a Hugging Face model directory: a full run's output, a merge, any model), ``peft``
    (a PEFT adapter) or ``bottleneck``. ``recipe`` / ``plan``: the run's saved recipe and plan (for a merge, the
    recipe of the adapter's run it folded, and no plan), None for a bare directory. ``name``: how the user calls
    it (``NAME=DIR``, else the directory's name); ``flag``: the argument that named it, for messages.
    """

    path: Path
    kind: Kind
    name: str
    recipe: dict[str, Any] | None = None
    plan: dict[str, Any] | None = None
    adapter_config: dict[str, Any] = field(default_factory=dict)
    flag: str = "RUN_OR_MODEL"
    merged_from: Path | None = None  # a merge: the adapter directory it folded

    # -- what it is -----------------------------------------------------------------------------------------
    @property
    def is_run(self) -> bool:
        """Whether a recipe says how it was trained (a run's output.dir, or a merge of one)."""
        return self.recipe is not None

    @property
    def is_adapter(self) -> bool:
        """An adapter that goes onto a base (peft or bottleneck), not a whole model."""
        return self.kind in ("peft", "bottleneck")

    def loaded_recipe(self, trust_remote_code: bool = False) -> LoadedRecipe:
        """The run's recipe, typed (an empty one without ``recipe.yaml``), its relative paths resolved next to the
        run; ``model.trust_remote_code`` is the caller's (the user's flag), never the directory's. Raises
        :class:`~finetune.recipe.schema.RecipeError` when it does not validate: the caller says what that stops."""
        return recipe_from_dict(with_user_trust(self.recipe, trust_remote_code), base_dir=self.path)

    # -- what the run measured (finetune report) --------------------------------------------------------------
    @property
    def recipe_text(self) -> str:
        """``recipe.yaml`` as the run saved it ("" without one)."""
        path = self.path / "recipe.yaml"
        return path.read_text() if path.is_file() else ""

    @property
    def memory(self) -> dict[str, Any]:
        """``memory.json``: the plan's prediction beside every rank's measurement ({} before it is written)."""
        path = self.path / MEMORY
        return read_json(path) if path.is_file() else {}

    def metrics(self) -> list[dict[str, Any]]:
        """The rows of ``metrics.jsonl`` ([] without one). A run killed mid-write leaves a partial last line,
        which is left out; any other line that is not JSON is one sentence naming it."""
        path = self.path / METRICS
        if not path.is_file():
            return []
        lines = path.read_text().splitlines()
        rows = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if n == len(lines):
                    break
                raise UserError(f"{path}:{n}: not a JSON line; the file is damaged") from None
        return rows

    @property
    def peft_type(self) -> str | None:
        """The adapter's peft type (LORA, PREFIX_TUNING, PROMPT_TUNING, ...); ``BOTTLENECK`` for bottleneck
        adapters; None for a whole model or a run that has saved none yet."""
        if self.kind in ("model", "run"):
            return None
        if self.kind == "bottleneck":
            return "BOTTLENECK"
        return str(self.adapter_config.get("peft_type", "LORA"))

    @property
    def method(self) -> str | None:
        """The training method: the recipe's (``full``, ``lora``, ``qlora``, ``prefix``, ``prompt``,
        ``adapter``), else what an adapter's files say; None for a model directory that is not a run."""
        named = (self.recipe or {}).get("method")
        if self.kind == "run":
            return str(named) if named is not None else None
        if self.kind == "model":
            return str(named) if named is not None and self.merged_from is None else None
        if isinstance(named, str) and named not in ("auto", "full"):
            return named
        if self.kind == "bottleneck":
            return "adapter"
        return _PEFT_METHODS.get(str(self.peft_type), str(self.peft_type).lower())

    @property
    def quantized_base(self) -> bool:
        """Whether the run trained on a 4/8-bit base (QLoRA)."""
        return self.is_adapter and self.method in METHOD_TYPES and Method(self.method).quantized

    @property
    def execution(self) -> ExecSpec | None:
        """The execution spec the run trained with (its plan's), None without one."""
        execution = (self.plan or {}).get("execution")
        if not execution:
            return None
        try:
            return ExecSpec.from_dict(execution)
        except (KeyError, TypeError, ValueError):
            return None

    # -- the dtypes the run computed in ---------------------------------------------------------------------
    @property
    def compute_dtype(self) -> str:
        """The dtype the run's matmuls ran in (``fp32``, ``bf16``, ``fp16``); for a quantized base, the dtype
        its 4/8-bit weights were dequantized to. From the plan's execution spec; a plan without one: the
        recipe's ``quantization.compute_dtype``, else its precision (``auto``: the plan's chosen one), else fp32."""
        spec = self.execution
        if spec is not None:
            return spec.quant.compute_dtype if spec.quant is not None else spec.compute_dtype
        recipe = self.recipe or {}
        q = (recipe.get("quantization") or {}).get("compute_dtype", "auto") if self.quantized_base else "auto"
        if q != "auto":
            return str(q)
        precision = recipe.get("precision", "auto")
        if precision == "auto":
            precision = ((self.plan or {}).get("chosen") or {}).get("precision", "auto")
        return {"bf16-pure": "bf16", "auto": "fp32"}.get(str(precision), str(precision))

    @property
    def autocast_dtype(self) -> str | None:
        """The dtype the run's evaluation autocast to (None: it ran without autocast)."""
        spec = self.execution
        return spec.compute_dtype if spec is not None and spec.autocast else None

    @property
    def model_dtype(self) -> str | None:
        """The dtype a whole model's weights computed in (the trained weights', or FSDP's parameter dtype);
        None: the saved dtype."""
        spec = self.execution
        return (spec.fsdp_param_dtype or spec.trainable_dtype) if spec is not None else None

    @property
    def base_dtype(self) -> str | None:
        """The dtype an adapter's frozen base was kept in (None: the saved dtype)."""
        spec = self.execution
        return spec.frozen_dtype if spec is not None and spec.frozen_dtype else None

    @property
    def init(self) -> str:
        """The recipe's ``model.init`` (``pretrained`` or ``random``)."""
        return str(((self.recipe or {}).get("model") or {}).get("init", "pretrained"))

    @property
    def model_path(self) -> str | None:
        """The recipe's ``model.path`` (None without a recipe)."""
        path = ((self.recipe or {}).get("model") or {}).get("path")
        return str(path) if path else None

    def describe(self) -> str:
        """A few words: what it is and where."""
        if self.kind == "run":
            return f"{self.path} (a run that has saved no model yet)"
        if self.kind == "model":
            return f"{self.path} (full model)"
        return f"{self.path} ({self.method} adapter)"


def _located(value: str, flag: str) -> Path:
    d = Path(os.path.expanduser(value))
    if d.exists():
        return d
    location = locate_model(value, Path.cwd())
    if location.has_weights:
        return Path(location.path)
    raise UserError(
        f"{flag} {value} does not exist; give a run's output.dir, a `finetune merge` output or a Hugging Face "
        "model directory"
    )


def read_run(value: str, flag: str = "RUN_OR_MODEL", name: str | None = None) -> RunDir:
    """What ``value`` (a path, or a hub id in the local cache) holds, or one sentence naming ``flag`` and
    what to give instead. Reads files only: no weights, no torch."""
    d = _located(value, flag)
    if not d.is_dir():
        raise UserError(f"{flag} {value} is a file; give a run's output.dir, an adapter or a model directory")
    label = name or d.resolve().name
    kind = holds(d)
    if kind == "peft":
        if adapter_weights(d) is None:
            raise UserError(
                f"{flag} {value} has {ADAPTER_CONFIG} but no adapter_model.safetensors; the adapter is incomplete"
            )
        recipe, plan = _run_files(d)
        return RunDir(d, "peft", label, recipe, plan, read_json(d / ADAPTER_CONFIG), flag)
    if kind == "bottleneck":
        if not (d / BOTTLENECK_WEIGHTS).is_file():
            raise UserError(
                f"{flag} {value} has {BOTTLENECK_CONFIG} but no {BOTTLENECK_WEIGHTS}; the adapter is incomplete"
            )
        recipe, plan = _run_files(d)
        return RunDir(d, "bottleneck", label, recipe, plan, read_json(d / BOTTLENECK_CONFIG), flag)
    if (d / "config.json").is_file():
        if (d / SAFE_INDEX).is_file():
            read_weight_map(d / SAFE_INDEX)  # every shard a file of the directory, before anything reads one
        if not has_weights(d):
            raise UserError(
                f"{flag} {value} has a config.json but no safetensors weights; give a trained model (a model.init: "
                "random config has no weights to talk to)"
            )
        recipe, plan = _run_files(d)
        merged_from = None
        if recipe is None and (d / MERGE_MARKER).is_file():  # a merge: the run it folded says how it was prompted
            folded = Path(str(read_json(d / MERGE_MARKER).get("adapter", "")))
            if folded.is_dir():
                merged_from = folded
                recipe, _ = _run_files(folded)
        return RunDir(d, "model", label, recipe, plan, flag=flag, merged_from=merged_from)
    if (d / "recipe.yaml").is_file():
        raise UserError(
            f"{flag} {value} is a run directory without a trained model or adapter yet; give it once the run has "
            "finished (its final save writes the model or adapter there)"
        )
    raise UserError(
        f"{flag} {value} is neither a run nor a model directory: it holds no model (no {ADAPTER_CONFIG}, "
        f"{BOTTLENECK_CONFIG} or config.json); give a run's output.dir, a `finetune merge` output or a Hugging "
        "Face model directory"
    )


def read_outputs(value: str, flag: str = "RUN_DIR") -> RunDir:
    """A run's output.dir at any point of the run (training, stopped, finished, or a copy): what it holds so far
    (``kind`` ``run`` before its final save, else what :func:`holds` says), its recipe, plan, metrics and memory;
    one sentence naming ``flag`` when it has no ``metrics.jsonl`` (it is not a run's output.dir). Reads files
    only: no weights, no torch."""
    d = Path(os.path.expanduser(value))
    if not (d / METRICS).is_file():
        raise UserError(f"{flag}: {d} has no {METRICS}; give the output.dir of a `finetune run`")
    recipe, plan = _run_files(d)
    return RunDir(d, holds(d) or "run", d.resolve().name, recipe, plan, flag=flag)


# --------------------------------------------------------------------------------------------------
# The base of an adapter
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BaseRef:
    """Where an adapter's base is. ``path``: the base model directory, or for ``rebuild`` the config directory
    of a ``model.init: random`` run whose weights are redrawn from ``train.seed`` (as the run drew them);
    ``where``: how it was found, for messages."""

    path: Path
    where: str
    rebuild: bool = False


def _model_dir(value: str, base_dir: Path) -> Path | None:
    """A local model directory for ``value`` (relative to ``base_dir``, cwd, built-ins, or the HF cache)."""
    location = locate_model(value, base_dir)
    return Path(location.path) if location.has_weights else None


def _is_quantized(model_dir: Path) -> bool:
    config = model_dir / "config.json"
    return config.is_file() and bool(read_json(config).get("quantization_config"))


def find_base(run: RunDir, base: str | None = None, *, rebuild: bool = True) -> BaseRef:
    """The base model directory of the adapter ``run``: ``base`` (``--base``), else the run's recipe
    (``base/`` for a random init), else the adapter's ``base_model_name_or_path``. One sentence when it
    cannot be found, is stored quantized or holds no safetensors weights.

    A random-init qlora run whose ``base/`` is missing or holds the 4-bit model needs its fp32 base redrawn
    from its config and ``train.seed``: with ``rebuild`` the answer says so (``BaseRef.rebuild``; the loader
    redraws it), without it that is refused.
    """
    saved_base = run.path / "base"
    recipe = run.recipe
    if base is not None:
        found = _model_dir(base, Path.cwd())
        if found is None:
            raise UserError(f"--base {base} is not a model directory")
        where = f"--base {base}"
    elif recipe is not None:
        if run.init == "random":
            usable = saved_base.is_dir() and not _is_quantized(saved_base)
            if not usable and run.quantized_base and rebuild:
                path = run.model_path or ""
                config_dir = _model_dir(path, run.path) if path else None
                if config_dir is None:
                    raise UserError(
                        f"{run.path} was trained from a random init of `{path}`, whose config cannot be found; "
                        "pass --base DIR"
                    )
                return BaseRef(config_dir, "model.init: random, train.seed", rebuild=True)
            if not saved_base.is_dir():
                raise UserError(
                    f"{run.path} was trained from a random init and its base weights ({saved_base}) are missing; "
                    "pass --base DIR with the weights the run started from"
                )
            found, where = saved_base, f"{saved_base} (model.init: random)"
        else:
            path = run.model_path or ""
            found = _model_dir(path, run.path) if path else None
            if found is None and saved_base.is_dir():
                found = saved_base
            if found is None:
                raise UserError(
                    f"cannot find the base model of {run.path}: its recipe.yaml says model.path `{path}`, which is "
                    "not a local directory (looked next to the run, in the current directory and in the HF "
                    "cache); pass --base DIR"
                )
            where = f"model.path `{path}` of {run.path / 'recipe.yaml'}"
    elif saved_base.is_dir():
        found, where = saved_base, str(saved_base)
    else:
        name = run.adapter_config.get("base_model_name_or_path")
        found = _model_dir(str(name), Path.cwd()) if name else None
        if found is None:
            raise UserError(
                f"cannot find the base model of {run.path}: it has no recipe.yaml and its adapter_config.json names "
                f"base_model_name_or_path `{name}`, which is not a local directory; pass --base DIR"
            )
        where = f"base_model_name_or_path `{name}`"
    if not (found / "config.json").is_file():
        raise UserError(f"the base model {found} (from {where}) has no config.json; pass --base DIR")
    if _is_quantized(found):
        raise UserError(f"the base model {found} is stored quantized; the 16-bit base is needed: pass --base DIR")
    if (found / SAFE_INDEX).is_file():
        read_weight_map(found / SAFE_INDEX)  # every shard a file of the base's directory
    elif not (found / SAFE_SINGLE).is_file():
        raise UserError(
            f"the base model {found} has no safetensors weights ({SAFE_SINGLE} or {SAFE_INDEX}); "
            "re-save it with save_pretrained(safe_serialization=True)"
        )
    return BaseRef(found, where)
