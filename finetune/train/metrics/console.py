"""Rank 0's console: the run's header, a live progress bar (or plain lines when not a terminal), the
evaluation lines and the summary."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from finetune.model.methods import method_type
from finetune.plan.types import Candidate, Plan
from finetune.units import fmt_bytes

if TYPE_CHECKING:
    from finetune.train.evaluate import EvalResult
    from finetune.train.state import RunResult


class Reporter:
    """Rank 0's console: a header, a live progress bar (or plain lines when not a terminal), a summary."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        # Not a terminal (a log file, CI): never wrap lines, so each log line stays one line.
        self.console = Console(highlight=False, soft_wrap=not sys.stdout.isatty())

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print on rank 0 only (``kwargs`` go to rich's Console.print)."""
        if self.enabled:
            self.console.print(*args, **kwargs)

    def plain(self, text: str) -> None:
        """Print ``text`` as is on rank 0: no markup, never wrapped (paths and commands stay copyable)."""
        self.print(text, markup=False, highlight=False, soft_wrap=True)

    def start(
        self, plan: Plan, trainable: int, total: int, steps: int, stats: dict[str, Any], world: int,
        notes: list[str] | None = None, experts_kernel: str | None = None,
    ) -> None:
        """The run's header: what the Plan chose, the sizes involved, the kernels the model runs (its attention,
        a mixture of experts' experts kernel ``experts_kernel``), and anything the data loader noticed."""
        c = plan.chosen
        self.print(
            f"[bold]finetune[/] {c.method} | {c.strategy} x{world}{f' (tp {c.tp})' if c.tp > 1 else ''} | "
            f"{c.precision} | micro-batch {c.micro_batch_size} x accumulation {c.grad_accum_steps} x "
            + (f"{c.dp} replica(s) of {c.tp} TP ranks" if c.tp > 1 else f"{world} process(es)")
            + f" | activation checkpointing {'on' if c.activation_checkpointing else 'off'}"
        )
        shown = {k: v for k, v in stats.items() if v or k in ("train", "eval")}
        self.print(
            f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / max(total, 1):.2f}%) | "
            f"{steps} steps | data: " + ", ".join(f"{k} {v}" for k, v in shown.items())
        )
        for note in notes or []:
            self.print(f"data: {note}")
        if plan.execution is not None:
            self.plain(kernels_line(plan, experts_kernel))
        if plan.execution is not None and plan.execution.compile:
            # finetune.train.parallel.parallelize.parallelize compiled each decoder block before wrapping (every load path)
            n = plan.model.get("layers")
            blocks = f"{n} decoder block{'s' if n != 1 else ''}" if n else "every decoder block"
            self.print(f"compile: {blocks} compiled (torch.compile)")
        if c.memory.total:
            self.print(f"plan: {fmt_bytes(c.memory.total)} per process predicted")

    @contextlib.contextmanager
    def progress(self, steps: int, start: int = 0) -> Iterator[Callable[..., None]]:
        """A context whose value ``advance(loss=, lr=, tokens_per_s=)`` moves the bar one step (from ``start``
        when a run resumes)."""
        if not self.enabled:
            yield lambda **_: None
            return
        if not sys.stdout.isatty():
            state = {"step": start, "t0": time.perf_counter()}
            every = max(1, steps // 20)

            def plain(loss: float, lr: float, tokens_per_s: float | None = None) -> None:
                state["step"] += 1
                s = state["step"]
                if s % every == 0 or s == steps:
                    tps = f" | {tokens_per_s:,.0f} tok/s" if tokens_per_s else ""
                    self.console.print(f"step {s}/{steps} | loss {loss:.4f} | lr {lr:.2e}{tps}")

            yield plain
            return
        columns = (
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("lr {task.fields[lr]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=self.console, transient=False) as bar:
            task = bar.add_task("train", total=steps, completed=start, loss="-", lr="-", tps="-")
            last_tps = {"v": "-"}

            def advance(loss: float, lr: float, tokens_per_s: float | None = None) -> None:
                if tokens_per_s:
                    last_tps["v"] = f"{tokens_per_s:,.0f}"
                bar.update(task, advance=1, loss=f"{loss:.4f}", lr=f"{lr:.2e}", tps=last_tps["v"])

            yield advance

    def eval_line(self, step: int, ev: EvalResult | None) -> None:
        """One line per periodic evaluation (step 0: before training)."""
        if ev is not None:
            when = "before training" if step == 0 else f"@ step {step}"
            self.print(f"eval {when}: {_eval_text(ev)}")

    def summary(
        self, result: RunResult, chosen: Candidate, skipped: int, gpu: bool = False,
        retain_before: EvalResult | None = None,
    ) -> None:
        """What was trained, the final eval, where the outputs are and how to load them; on a GPU (``gpu``) also
        tokens/s and the model FLOPs utilisation (a CPU has no peak to compare with: nothing is printed). With
        ``eval.retain``, the retain set's figures before training (``retain_before``) and after."""
        out = result.output_dir
        self.print(
            f"[bold green]done[/]: {result.steps} steps in {result.seconds:.1f}s, final loss "
            f"{result.final_loss:.4f}" + (f", {skipped} steps skipped (non-finite loss or gradients)" if skipped else "")
        )
        if gpu and result.tokens_per_s:
            u = result.utilisation
            mfu = u.text() if u is not None else _no_peak()
            self.plain(f"throughput: {result.tokens_per_s:,.0f} tokens/s (training steps after the first) | {mfu}")
        if result.eval is not None:
            self.print(f"final eval: {_eval_text(result.eval)}")
            for want, got in result.eval.samples:
                self.print(f"  expected {want!r:>14} generated {got!r}")
        retain = retain_change(retain_before, result.eval)
        if retain:
            self.plain(retain)
        self.print(method_type(chosen.method)().saved_message(str(out)))  # where it is and how to load it
        self.plain(f"plots: finetune report {out} (--out report.html for a page with the recipe and plan)")
        score = f", finetune eval {out} --tasks run --baseline (score it)" if result.eval is not None else ""
        self.plain(f"next: finetune chat {out} (talk to it){score}")


def _no_peak() -> str:
    """The MFU part of the throughput line on a GPU the peak table does not hold, naming the device."""
    import torch

    from finetune.plan.hardware import GPU_TYPES

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "this GPU"
    return f"MFU: n/a (no peak FLOPS known for {name}; set hardware.gpu_type to one of {', '.join(GPU_TYPES)})"


def _eval_text(ev: EvalResult) -> str:
    parts = []
    if ev.loss is not None:
        parts.append(f"loss {ev.loss:.4f}")
    if ev.exact_match is not None:
        parts.append(f"exact match {100 * ev.exact_match:.1f}% of {ev.n_prompts}")
    text = ", ".join(parts)
    if ev.retain_loss is not None:
        retain = f"retain loss {ev.retain_loss:.4f}"
        if ev.retain_exact_match is not None:
            retain += f", retain exact match {100 * ev.retain_exact_match:.1f}% of {ev.retain_prompts}"
        text = f"{text} | {retain}" if text else retain
    return text


def retain_change(before: EvalResult | None, after: EvalResult | None) -> str | None:
    """The summary's forgetting line, e.g. ``retain: loss 2.31 -> 2.45 (+0.14)``, with the exact match where the
    retain rows have answers; None without both measurements."""
    if before is None or after is None or before.retain_loss is None or after.retain_loss is None:
        return None
    a, b = before.retain_loss, after.retain_loss
    text = f"retain: loss {a:.2f} -> {b:.2f} ({b - a:+.2f})"
    if before.retain_exact_match is not None and after.retain_exact_match is not None:
        x, y = 100 * before.retain_exact_match, 100 * after.retain_exact_match
        text += f", exact match {x:.1f}% -> {y:.1f}% ({y - x:+.1f} points)"
    return text


def kernels_line(plan: Plan, experts_kernel: str | None) -> str:
    """What the model computes with: its attention implementation (and why, when the architecture chose it), and
    for a mixture of experts its experts, top-k and experts kernel."""
    assert plan.execution is not None
    attention = plan.execution.attention
    why = f" ({plan.model.get('model_type')} has no sdpa attention)" if plan.model.get("attention_for_architecture") else ""
    line = f"model: attention {attention}{why}"
    moe = plan.model.get("moe")
    if moe:
        shared = f" + {moe['shared_experts']} shared" if moe.get("shared_experts") else ""
        layers = f"{moe['layers']} layer{'s' if moe['layers'] != 1 else ''}"
        line += (f" | {moe['experts']} experts{shared} in {layers}, top-{moe['top_k']}"
                 f" | experts kernel {experts_kernel or 'eager'}")
        if plan.model.get("aux_loss_coef"):
            line += f" | load-balancing loss x {plan.model['aux_loss_coef']:g}"
    return line
