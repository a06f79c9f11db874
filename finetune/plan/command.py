"""`finetune plan`'s inputs: the command line and the recipe (or --model) made into a request and hardware,
walked into a :class:`~finetune.plan.types.Plan` (printed by finetune/plan/render.py)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from finetune.errors import UserError
from finetune.plan.types import Plan
from finetune.plan.walk import Note


@dataclass(kw_only=True)
class PlanOptions:
    """The command line of ``finetune plan`` (None: from the recipe, else the default)."""

    recipe: str | None = None
    overrides: tuple[str, ...] = ()
    model: str | None = None
    method: str | None = None
    strategy: str | None = None
    precision: str | None = None
    seq_len: int | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    gpus: int | None = None
    gpu_memory: str | None = None
    gpu_type: str | None = None
    nodes: int | None = None
    interconnect: str | None = None
    lora_r: int | None = None
    tp: str | None = None  # distributed.tp: N or auto (default: the recipe's; auto with --model alone)
    host_memory: str | None = None  # per node; None: this machine's


@contextlib.contextmanager
def without_bitsandbytes() -> Iterator[None]:
    """Hide bitsandbytes from peft while planning (it costs seconds to import and planning never needs it).

    Only for the ``finetune plan`` process, which never trains: peft decides at import time whether its
    4-bit layers exist.
    """
    if "bitsandbytes" in sys.modules or "peft" in sys.modules:
        yield
        return
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]  # importlib.util.find_spec -> None
    try:
        yield
    finally:
        del sys.modules["bitsandbytes"]


#: What ``finetune plan --model`` plans when neither a flag nor a ``--set`` says otherwise.
MODEL_ONLY_RECIPE: dict[str, Any] = {
    "method": "auto",
    "data": {"train": "(none: planning only)", "packing": True},
    "distributed": {"tp": "auto", "pp": "auto"},  # the walk may try TP, then PP, when FSDP alone does not fit
}


# flag -> (recipe section class name, field): a flag is checked by the recipe key it stands for
FLAG_FIELDS = {
    "method": ("Recipe", "method"),
    "strategy": ("DistributedConfig", "strategy"),
    "precision": ("Recipe", "precision"),
    "seq_len": ("DataConfig", "max_seq_len"),
    "global_batch_size": ("TrainConfig", "global_batch_size"),
    "micro_batch_size": ("TrainConfig", "micro_batch_size"),
    "lora_r": ("LoraConfig", "r"),
    "tp": ("DistributedConfig", "tp"),
    "gpus": ("HardwareConfig", "gpus"),
    "nodes": ("HardwareConfig", "nodes"),
}


def check_flags(opts: PlanOptions) -> None:
    """Refuse a bad flag in one sentence, by the same rules as the recipe key it stands for (before any
    slow import): ``--method lorra`` -> did you mean `lora`?; ``--seq-len 0`` -> the bound."""
    from typing import Annotated, get_args

    import pydantic

    from finetune.recipe import schema
    from finetune.units import parse_bytes

    for flag, (cls, field) in FLAG_FIELDS.items():
        value = getattr(opts, flag)
        if value is None:
            continue
        info = getattr(schema, cls).model_fields[field]
        try:
            kind = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
            pydantic.TypeAdapter(cast(Any, kind)).validate_python(value)
        except pydantic.ValidationError as err:
            name = "--" + flag.replace("_", "-")
            choices = [a for a in get_args(info.annotation) if isinstance(a, str)]
            if choices and isinstance(value, str):
                hint = schema.suggest(value, choices)
                hint = f"; {hint}" if hint.startswith("did you mean") else ""
                raise UserError(f"{name}: `{value}` is not one of {', '.join(choices)}{hint}") from None
            bound = err.errors()[0]["msg"].lower().replace("input should be ", "must be ")
            raise UserError(f"{name}: {value} is not allowed: it {bound}") from None
    if opts.gpu_memory is not None and parse_bytes(opts.gpu_memory) <= 0:
        raise UserError(f"--gpu-memory: {opts.gpu_memory} is no memory; write e.g. 80GiB or 24GB")


def build_plan(opts: PlanOptions) -> Plan:
    """The plan for ``opts``: a recipe (with --set overrides and its hardware section) and/or flags."""
    check_flags(opts)
    from finetune.plan.config import planning_config
    from finetune.plan.flowchart import make_plan
    from finetune.plan.hardware import detect_hardware
    from finetune.plan.request import request_from_recipe
    from finetune.recipe.locate import locate_model
    from finetune.recipe.schema import RecipeError, load_recipe, output_problems, recipe_with_overrides

    if opts.recipe:
        loaded = load_recipe(opts.recipe, list(opts.overrides))
        problems = output_problems(loaded)  # validate and run refuse it too
        if problems:
            raise RecipeError(problems)
    elif opts.model:
        # A recipe with the defaults of a plan from flags alone; the --set overrides apply to it and are
        # checked by the schema exactly as they are on a recipe file.
        loaded = recipe_with_overrides(MODEL_ONLY_RECIPE | {"model": {"path": opts.model}}, list(opts.overrides))
    else:
        raise UserError("give a recipe file or --model NAME (e.g. --model llama-3.1-8b)")
    req = request_from_recipe(loaded)
    hw_section: Any = loaded.recipe.hardware
    overridden = {o.split("=", 1)[0].strip() for o in opts.overrides}
    if opts.model and opts.recipe:
        config, source = planning_config(locate_model(opts.model, Path.cwd()))
        req = replace(req, config=config, source=source)
    changes: dict[str, Any] = {}
    for key in ("method", "strategy", "precision", "seq_len", "micro_batch_size"):
        if getattr(opts, key) is not None:
            changes[key] = getattr(opts, key)
    if opts.tp is not None:
        changes["tp"] = opts.tp if opts.tp == "auto" else int(opts.tp)
    if opts.lora_r is not None:
        from finetune.recipe.schema import LoraConfig

        base = req.lora or LoraConfig()
        changes["lora"] = base.model_copy(update={"r": opts.lora_r})
    req = replace(req, **changes)

    def pick(flag: Any, key: str) -> Any:
        if flag is not None:
            return flag
        val = getattr(hw_section, key, None) if hw_section is not None else None
        return None if val == "auto" else val

    hw = detect_hardware(
        gpus=pick(opts.gpus, "gpus"),
        gpu_memory=pick(opts.gpu_memory, "gpu_memory"),
        gpu_type=pick(opts.gpu_type, "gpu_type"),
        nodes=pick(opts.nodes, "nodes"),
        interconnect=pick(opts.interconnect, "interconnect"),
    )
    from finetune.plan.job import this_machine_memory
    from finetune.units import parse_bytes

    if opts.host_memory is not None:
        host = parse_bytes(opts.host_memory)
        if host <= 0:
            raise UserError(f"--host-memory: {opts.host_memory} is no memory; write e.g. 512GiB")
    else:  # this machine's, when the plan is for it; a plan for other GPUs checks host memory only when given
        host = this_machine_memory() if hw.detected or hw.device == "cpu" else 0
    hw = replace(hw, host_memory=host)
    if opts.global_batch_size is not None:
        req = replace(req, global_batch_size=opts.global_batch_size)
    elif not opts.recipe and "train.global_batch_size" not in overridden:
        req = replace(req, global_batch_size=max(8, hw.world))
    if hw.device == "cuda" and not hw.detected and opts.gpu_memory is None and opts.gpu_type is None and (
        hw_section is None or (hw_section.gpu_memory is None and hw_section.gpu_type is None)
    ):
        note = "No GPU is visible: planning for 80 GiB GPUs with bf16 (set --gpus/--gpu-memory/--gpu-type)."
    else:
        note = ""
    plan = make_plan(req, hw)
    if note:
        plan.walk.insert(0, note)
        plan.steps.insert(0, Note(note).to_dict())
    return plan
