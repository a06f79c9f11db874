"""`finetune plan`: build the request (recipe or --model), walk the flowchart, print a table or JSON."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from finetune.errors import UserError
from finetune.plan.types import Plan, Status
from finetune.plan.walk import Note
from finetune.units import compact_bytes


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
    "distributed": {"tp": "auto"},  # the walk may try tensor parallelism when FSDP alone does not fit
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

    from finetune import recipe as schema
    from finetune.plan.hardware import parse_bytes

    for flag, (cls, field) in FLAG_FIELDS.items():
        value = getattr(opts, flag)
        if value is None:
            continue
        info = getattr(schema, cls).model_fields[field]
        try:
            kind = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
            pydantic.TypeAdapter(kind).validate_python(value)
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
    from finetune.locate import resolve_model_config
    from finetune.plan.flowchart import make_plan, request_from_recipe
    from finetune.plan.hardware import detect_hardware
    from finetune.recipe import load_recipe, recipe_with_overrides

    if opts.recipe:
        loaded = load_recipe(opts.recipe, list(opts.overrides))
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
        config, source = resolve_model_config(opts.model)
        req = replace(req, config=config, source=source)
    changes: dict[str, Any] = {}
    for key in ("method", "strategy", "precision", "seq_len", "micro_batch_size"):
        if getattr(opts, key) is not None:
            changes[key] = getattr(opts, key)
    if opts.tp is not None:
        changes["tp"] = opts.tp if opts.tp == "auto" else int(opts.tp)
    if opts.lora_r is not None:
        from finetune.recipe import LoraConfig

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
    from finetune.plan.hardware import parse_bytes
    from finetune.plan.job import this_machine_memory

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


def _count(n: float) -> str:
    """3037440 -> '3.04M', 8.03e9 -> '8.03B'."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def print_plan(plan: Plan, console: Any = None) -> None:
    """The table (chosen row first, highlighted), then the walk."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    hw, model = plan.hardware, plan.model
    cap = hw.get("memory_bytes", 0)
    console.print(
        f"[bold]{model.get('source')}[/]: {_count(model.get('parameters', 0))} parameters, "
        f"{model.get('layers')} layers; {model.get('seq_len')} tokens per sample, global batch "
        f"{model.get('global_batch_size')}; {hw.get('gpus_per_node')} x {hw.get('nodes')} "
        f"{'processes' if hw.get('device') == 'cpu' else 'GPUs'} of {compact_bytes(cap)} ({hw.get('name')})"
    )
    t = Table(show_lines=False, header_style="bold")
    with_tp = any(c.tp > 1 for c in plan.candidates)
    with_state = any((c.optimizer, c.offload) != ("adamw", "none") for c in plan.candidates)
    with_time = any(c.time is not None for c in plan.candidates)
    columns = ["method", "strategy", *(["state"] if with_state else []), "mb", "ckpt", "params", "grads", "optim",
               "activ", "buffers", "overhead", "total/GPU", "comm/step", *(["s/step"] if with_time else []), "fits"]
    for col in columns:
        t.add_column(col, justify="left" if col in ("method", "strategy", "state") else "right")
    for i, c in enumerate(plan.candidates):
        m = c.memory
        comm = f"{c.comm_bytes_per_step / 1e9:.1f}GB" if c.comm_bytes_per_step else "-"
        if with_tp and c.tp > 1:  # data-parallel bytes over the slowest link + TP's all-reduces inside the node
            comm = f"{comm} + tp {c.tp_comm_bytes_per_step / 1e9:.1f}GB"
        if c.comm_seconds_per_step:
            comm += f" {c.comm_seconds_per_step:.2f}s"
        untraced = c.status in (Status.STATES_OVER, Status.NOT_TRACED)
        acts = compact_bytes(m.activations) if not untraced else "-"
        total = compact_bytes(m.total) if not untraced else f">= {compact_bytes(m.total)}"
        fits = "yes" if c.fits else ("?" if c.status is Status.NOT_TRACED else "no")
        style = "bold green" if i == 0 else ("dim" if not c.fits else "")
        cells = [
            c.method + (" *" if i == 0 else ""), _strategy_cell(c), *([_state_cell(c)] if with_state else []),
            str(c.micro_batch_size), "on" if c.activation_checkpointing else "off", compact_bytes(m.params),
            compact_bytes(m.grads), compact_bytes(m.optimizer), acts, compact_bytes(m.buffers),
            compact_bytes(m.overhead), total, comm,
            *([f"{c.time.step:.2f}" if c.time is not None and not untraced else "-"] if with_time else []), fits,
        ]
        t.add_row(*cells, style=style)
    console.print(t)
    tp_note = "; tpN x S: tensor parallelism over N GPUs of a node, S over the replicas (+ tp: TP's all-reduces, " \
        "inside the node)" if with_tp else ""
    state_note = "; state: the optimizer (8-bit: bitsandbytes) and what lives in host memory" if with_state else ""
    time_note = "; s/step: predicted seconds per optimizer step" if with_time else ""
    console.print("[dim]- activations not traced: model states alone exceed the memory, or the walk stopped before "
                  "this method; comm: bytes each GPU sends per optimizer step, and the time over "
                  f"{hw.get('interconnect')}{tp_note}{state_note}{time_note}.[/]")
    ch = plan.chosen
    console.print(
        f"[bold]chosen[/]: {ch.method} / {_strategy_cell(ch)} / {ch.precision}"
        f"{'' if (ch.optimizer, ch.offload) == ('adamw', 'none') else ' / ' + _state_cell(ch)}, micro-batch {ch.micro_batch_size}, "
        f"gradient accumulation {ch.grad_accum_steps}, activation checkpointing "
        f"{'on' if ch.activation_checkpointing else 'off'}, {compact_bytes(ch.memory.total)} per GPU"
        + ("" if ch.fits else " [bold red](does not fit)[/]")
    )
    for sentence in plan.walk:
        console.print(f"  - {sentence}")
    job = plan.job
    if job:
        console.print(
            f"whole job: loading peaks at {compact_bytes(job['load_peak_per_gpu'])} per GPU (its shards + one tensor); "
            f"host memory per node {compact_bytes(job['host_loading_per_node'])} loading, "
            f"{compact_bytes(job['host_checkpoint_per_node'])} saving a checkpoint, "
            f"{compact_bytes(job['host_final_save_per_node'])} saving the final model ("
            f"{'of ' + compact_bytes(hw['host_memory']) if hw.get('host_memory') else 'not checked: --host-memory'}); disk {compact_bytes(job['checkpoint_bytes'])} per "
            f"checkpoint, {compact_bytes(job['final_model_bytes'])} for the final model"
        )
    if model.get("checkpoint_bytes"):
        console.print(
            f"checkpoints: {compact_bytes(model['checkpoint_bytes'])} each (weights + AdamW state); a run keeps output.keep "
            "of them and writes one more before pruning, and checks the free disk for that before it starts"
        )


def _state_cell(c: Any) -> str:
    """Where the optimizer state lives: ``adamw``, ``8-bit``, ``paged 8-bit``, ``+offload opt``."""
    name = {"adamw": "adamw", "adamw8bit": "8-bit", "paged_adamw8bit": "paged 8-bit"}.get(c.optimizer, c.optimizer)
    if c.offload == "optimizer":
        return f"{name} on host"
    if c.offload == "parameters":
        return f"{name}, params on host"
    return name


def _strategy_cell(c: Any) -> str:
    """``fsdp``; ``tp2 x fsdp`` (2-D mesh); ``tp8`` (one data-parallel replica)."""
    if c.tp == 1:
        return str(c.strategy)
    return f"tp{c.tp}" if c.dp == 1 else f"tp{c.tp} x {c.strategy}"


def plan_json(plan: Plan) -> str:
    """The stable JSON form of a plan."""
    return json.dumps(plan.to_dict(), indent=2)
