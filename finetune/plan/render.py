"""`finetune plan`'s output: the table of candidates (chosen first), the walk, the whole job's figures, or JSON."""

from __future__ import annotations

import json
import sys
from typing import Any

from finetune.plan.types import ModelFacts, Plan, Status
from finetune.units import compact_bytes


def _count(n: float) -> str:
    """3037440 -> '3.04M', 8.03e9 -> '8.03B'."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def moe_text(model: ModelFacts) -> str:
    """What the plan's header says of a mixture of experts ('' for a dense model): the experts per layer, the
    top-k, the shared experts, what the experts hold and what a token computes with."""
    moe = model.get("moe")
    if not moe:
        return ""
    shared = f" + {moe['shared_experts']} shared" if moe.get("shared_experts") else ""
    routed = model.get("routed_activation_bytes_per_token", 0)
    layers = f"{moe['layers']} layer{'s' if moe['layers'] != 1 else ''}"
    return (f" ({moe['experts']} experts{shared}, top-{moe['top_k']}, in {layers}: the experts hold "
            f"{100 * model.get('expert_fraction', 0):.0f}% of the weights; {_count(model.get('active_parameters', 0))} "
            f"active per token; its routed experts keep {compact_bytes(routed)} of activations per token)")


def print_plan(plan: Plan, console: Any = None) -> None:
    """The table (chosen row first, highlighted), then the walk."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    hw, model = plan.hardware, plan.model
    cap = hw.get("memory_bytes", 0)
    console.print(
        f"[bold]{model.get('source')}[/]: {_count(model.get('parameters', 0))} parameters{moe_text(model)}, "
        f"{model.get('layers')} layers; {model.get('seq_len')} tokens per sample, global batch "
        f"{model.get('global_batch_size')}; {hw.get('gpus_per_node')} x {hw.get('nodes')} "
        f"{'processes' if hw.get('device') == 'cpu' else 'GPUs'} of {compact_bytes(cap)} ({hw.get('name')})"
    )
    experts = model.get("experts")
    if experts:
        share = experts["values"] / max(1, model.get("parameters", 0))
        console.print(
            f"experts: {experts['tensors']} fused expert weights hold {_count(experts['values'])} values "
            f"({share:.0%} of the model), stored in {compact_bytes(experts['stored_bytes'])}; "
            f"{plan.chosen.method} adapts {experts['adapted']} and stores {experts['quantized']} in NF4 (each expert "
            "on its own)"
        )
    t = Table(show_lines=False, header_style="bold")
    with_tp = any(c.tp > 1 for c in plan.candidates)
    with_pp = any(c.pp > 1 for c in plan.candidates)
    with_state = any((c.optimizer, c.offload) != ("adamw", "none") for c in plan.candidates)
    with_time = any(c.time is not None for c in plan.candidates)
    columns = ["method", "strategy", *(["pp/dp/tp"] if with_tp or with_pp else []), *(["state"] if with_state else []),
               "mb", "ckpt", "params", "grads", "optim",
               "activ", "buffers", "overhead", "total/GPU", "comm/step", *(["s/step"] if with_time else []), "fits"]
    for col in columns:
        t.add_column(col, justify="left" if col in ("method", "strategy", "state") else "right")
    for i, c in enumerate(plan.candidates):
        m = c.memory
        comm = f"{c.comm_bytes_per_step / 1e9:.1f}GB" if c.comm_bytes_per_step else "-"
        if c.strategy.hybrid:  # inside a node + across nodes
            comm = (f"{c.comm_intra_node_bytes_per_step / 1e9:.1f}GB + x-node "
                    f"{c.comm_inter_node_bytes_per_step / 1e9:.1f}GB")
        if with_tp and c.tp > 1:  # data-parallel bytes over the slowest link + TP's all-reduces inside the node
            comm = f"{comm} + tp {c.tp_comm_bytes_per_step / 1e9:.1f}GB"
        if c.pp > 1:  # + the pipeline's point-to-point sends
            pp_part = f"pp {c.pp_comm_bytes_per_step / 1e9:.1f}GB"
            comm = pp_part if comm == "-" else f"{comm} + {pp_part}"
        if c.comm_seconds_per_step:
            comm += f" {c.comm_seconds_per_step:.2f}s"
        untraced = c.status in (Status.STATES_OVER, Status.NOT_TRACED)
        acts = compact_bytes(m.activations) if not untraced else "-"
        total = compact_bytes(m.total) if not untraced else f">= {compact_bytes(m.total)}"
        fits = "yes" if c.fits else ("?" if c.status is Status.NOT_TRACED else "no")
        style = "bold green" if i == 0 else ("dim" if not c.fits else "")
        cells = [
            c.method + (" *" if i == 0 else ""), _strategy_cell(c),
            *([f"{c.pp}/{c.dp}/{c.tp}"] if with_tp or with_pp else []), *([_state_cell(c)] if with_state else []),
            str(c.micro_batch_size), "on" if c.activation_checkpointing else "off", compact_bytes(m.params),
            compact_bytes(m.grads), compact_bytes(m.optimizer), acts, compact_bytes(m.buffers),
            compact_bytes(m.overhead), total, comm,
            *([f"{c.time.step:.2f}" if c.time is not None and not untraced else "-"] if with_time else []), fits,
        ]
        t.add_row(*cells, style=style)
    console.print(t)
    tp_note = "; tpN x S: tensor parallelism over N GPUs of a node, S over the replicas (+ tp: TP's all-reduces, " \
        "inside the node)" if with_tp else ""
    if with_pp:
        tp_note += ("; ppN: the layers in pipeline stages over N GPUs, across nodes (+ pp: activations and their "
                    "gradients sent between stages), total/GPU the worst stage's")
    state_note = "; state: the optimizer (8-bit: bitsandbytes) and what lives in host memory" if with_state else ""
    time_note = "; s/step: predicted seconds per optimizer step" if with_time else ""
    if any(c.strategy.hybrid for c in plan.candidates):
        time_note += "; hsdp: bytes inside a node (NVLink on GPUs) + bytes across nodes"
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
    if ch.pp > 1 and ch.stage_memory:
        console.print(f"pipeline stages (layers {list(ch.pp_layers)}, {ch.pp_schedule}): " + ", ".join(
            f"rank {r} {compact_bytes(m.total)}" for r, m in enumerate(ch.stage_memory)
        ) + " per GPU")
    for sentence in plan.walk:
        console.print(f"  - {sentence}")
    job = plan.job
    if job:
        console.print(
            f"whole job: loading peaks at {compact_bytes(job['load_peak_per_gpu'])} per GPU (its shards + one tensor); "
            f"host memory per node {compact_bytes(job['host_loading_per_node'])} loading, "
            + (  # on a CPU device the training step's memory is host memory
                f"{compact_bytes(job['host_training_per_node'])} training, "
                if hw.get("device") == "cpu" and "host_training_per_node" in job
                else ""
            ) +
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
    """``fsdp``; ``tp2 x fsdp`` (2-D mesh); ``tp8`` (one data-parallel replica); ``pp4 x tp8 x fsdp``."""
    pipe = f"pp{c.pp}" if c.pp > 1 else ""
    inner = [f"tp{c.tp}"] if c.tp > 1 else []
    if c.dp > 1 or not (pipe or inner):
        inner.append(str(c.strategy))
    return " x ".join(([pipe] if pipe else []) + inner)


def plan_json(plan: Plan) -> str:
    """The stable JSON form of a plan."""
    return json.dumps(plan.to_dict(), indent=2)
