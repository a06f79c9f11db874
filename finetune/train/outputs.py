"""What a run shows and leaves behind: progress, metrics.jsonl, the final model or adapter."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from finetune.errors import UserError
from finetune.methods import method_type
from finetune.plan.types import Candidate, Plan
from finetune.recipe import LoadedRecipe, recipe_to_yaml
from finetune.train.distributed import DistContext
from finetune.units import fmt_bytes

if TYPE_CHECKING:
    from finetune.train.evaluate import EvalResult
    from finetune.train.loop import RunResult


class MetricsWriter:
    """Appends one JSON object per logged step to metrics.jsonl (rank 0 only)."""

    def __init__(self, path: Path, enabled: bool, trackers: Any = None) -> None:
        self.path = path
        self.enabled = enabled
        self.trackers = trackers  # finetune.train.trackers.Trackers: the same rows, to TensorBoard/wandb/MLflow
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict[str, Any]) -> None:
        """Append ``row`` and flush, so a killed run keeps every line written so far."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.track(row)

    def track(self, row: dict[str, Any]) -> None:
        """Send ``row`` to the trackers only (what metrics.jsonl keeps elsewhere, e.g. memory.json)."""
        if self.enabled and self.trackers is not None:
            self.trackers.log(row)

    def close(self) -> None:
        """Finish the trackers' runs."""
        if self.trackers is not None:
            self.trackers.close()


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
        notes: list[str] | None = None,
    ) -> None:
        """The run's header: what the Plan chose, the sizes involved, and anything the data loader noticed."""
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
        if plan.execution is not None and plan.execution.compile:
            # finetune.train.parallel.parallelize compiled each decoder block before wrapping (every load path)
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

    def summary(self, result: RunResult, chosen: Candidate, skipped: int, gpu: bool = False) -> None:
        """What was trained, the final eval, where the outputs are and how to load them; on a GPU (``gpu``) also
        tokens/s and the model FLOPs utilisation (a CPU has no peak to compare with: nothing is printed)."""
        out = result.output_dir
        self.print(
            f"[bold green]done[/]: {result.steps} steps in {result.seconds:.1f}s, final loss "
            f"{result.final_loss:.4f}" + (f", {skipped} steps skipped (non-finite loss or gradients)" if skipped else "")
        )
        if gpu and result.tokens_per_s:
            u = result.utilisation
            mfu = u.text() if u is not None else "MFU: n/a (no peak FLOPS known for this GPU; set hardware.gpu_type)"
            self.plain(f"throughput: {result.tokens_per_s:,.0f} tokens/s (training steps after the first) | {mfu}")
        if result.eval is not None:
            self.print(f"final eval: {_eval_text(result.eval)}")
            for want, got in result.eval.samples:
                self.print(f"  expected {want!r:>14} generated {got!r}")
        self.print(method_type(chosen.method)().saved_message(str(out)))  # where it is and how to load it
        self.plain(f"plots: finetune report {out} (--out report.html for a page with the recipe and plan)")


def _eval_text(ev: EvalResult) -> str:
    parts = []
    if ev.loss is not None:
        parts.append(f"loss {ev.loss:.4f}")
    if ev.exact_match is not None:
        parts.append(f"exact match {100 * ev.exact_match:.1f}% of {ev.n_prompts}")
    return ", ".join(parts)


def _save_plain_lora(inner: Any, out_dir: Path, state: dict[str, Any]) -> None:
    """A pissa/olora run's adapter saved as a plain LoRA (rank 2r) of the original base: the base weights the
    run trained on had the initial adapter subtracted, and no one else has them (merge and
    PeftModel.from_pretrained load the original base)."""
    import math

    from finetune.adapters import LORA_INIT_ATTR, plain_lora

    config = inner.peft_config["default"]
    kept = (config.r, config.lora_alpha, config.init_lora_weights)
    config.r, config.init_lora_weights = 2 * kept[0], True
    config.lora_alpha = kept[1] * (math.sqrt(2) if config.use_rslora else 2)
    try:
        plain = plain_lora(state, getattr(inner, LORA_INIT_ATTR))
        inner.save_pretrained(out_dir, state_dict=plain, safe_serialization=True)
    finally:
        config.r, config.lora_alpha, config.init_lora_weights = kept


def save_final(
    model: torch.nn.Module, inner: torch.nn.Module, tokenizer: Any, out_dir: Path, ctx: DistContext, *,
    adapters: bool, max_shard_bytes: int,
) -> None:
    """Write the trained model (HF directory) or adapter (PEFT directory) and the tokenizer, on rank 0.

    Every rank calls this. Nothing is gathered whole: a full fine-tune is streamed one tensor at a time
    (:func:`write_model_streamed`); an adapter run gathers only the adapters.
    """
    from transformers.utils import logging as hf_logging

    from finetune.adapters import LORA_INIT_ATTR, has_bottlenecks, prefix_tokens, save_bottlenecks
    from finetune.train.parallel import is_sharded

    hf_logging.disable_progress_bar()  # "Writing model shards" bars between our own lines
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    # peft saves a prefix by running its prompt encoder, which FSDP2 keeps sharded in the root unit: gather
    # the root's parameters on every rank for the save (a collective), and shard them again after.
    gather_root = ctx.distributed and is_sharded(model) and prefix_tokens(inner) > 0
    if gather_root:
        model.unshard()
    if adapters:  # the trained parameters only, each gathered whole (the frozen base is never gathered)
        state = {name: _whole(p) for name, p in inner.named_parameters() if p.requires_grad}
        if ctx.is_main:
            if has_bottlenecks(inner):  # our own adapter format; the base stays where it is
                save_bottlenecks(inner, out_dir, state, base=getattr(inner.config, "_name_or_path", None))
            elif getattr(inner, LORA_INIT_ATTR, None) is not None:
                _save_plain_lora(inner, out_dir, state)
            else:
                inner.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    else:
        write_model_streamed(inner, out_dir, ctx, max_shard_bytes)
        if ctx.is_main:
            inner.config.save_pretrained(out_dir)
            if getattr(inner, "generation_config", None) is not None:
                inner.generation_config.save_pretrained(out_dir)
    if ctx.is_main:
        tokenizer.save_pretrained(out_dir)
    ctx.barrier()
    if gather_root:
        model.reshard()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on CPU (a DTensor is all-gathered: every rank must call)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().cpu()


def write_model_streamed(inner: torch.nn.Module, out_dir: Path, ctx: DistContext, max_shard_bytes: int) -> list[str]:
    """The model's weights as ``from_pretrained`` reads them, one tensor at a time (every rank calls).

    Shapes and dtypes are known without gathering, so the safetensors headers and the split into files of
    at most ``max_shard_bytes`` are fixed up front; then each tensor is all-gathered (a DTensor), written by
    rank 0 and dropped, so no rank holds more than one whole tensor beyond its shards. A weight shared by two
    names (tied embeddings) is written once, under its first name, as ``save_pretrained`` does. Returns the
    file names (on every rank).
    """
    from finetune.safetensors_stream import SAFE_INDEX, ShardWriter, plan_shards, write_index

    named: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    tensors = dict(inner.named_parameters(remove_duplicate=False))
    tensors.update(inner.named_buffers(remove_duplicate=False))
    for name in inner.state_dict(keep_vars=True):
        t = tensors[name]
        if id(t) not in seen:
            seen.add(id(t))
            named[name] = t
    specs = [(name, list(t.shape), t.dtype) for name, t in named.items()]
    shards = plan_shards(specs, max_shard_bytes)
    if ctx.is_main:
        for old in [*out_dir.glob("model*.safetensors"), out_dir / SAFE_INDEX]:
            old.unlink(missing_ok=True)  # an earlier run's shards would mix with these
    for file, file_specs in shards:
        writer = ShardWriter(out_dir / file, file_specs) if ctx.is_main else None
        for name, _, _ in file_specs:
            whole = _whole(named[name])
            if writer is not None:
                writer.write(name, whole)
            del whole
        if writer is not None:
            writer.close()
    if ctx.is_main:
        write_index(out_dir, shards)
    return [file for file, _ in shards]


def write_run_files(loaded: LoadedRecipe, plan_dict: dict[str, Any]) -> Path:
    """Save the resolved recipe and the plan in the output directory (before training, by global rank 0)."""
    out = Path(loaded.recipe.output.dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"output.dir: cannot create {out} ({exc.strerror}); choose a writable directory") from None
    if not os.access(out, os.W_OK):
        raise UserError(f"output.dir: {out} is not writable; choose a writable directory")
    (out / "recipe.yaml").write_text(recipe_to_yaml(loaded.recipe))
    (out / "plan.json").write_text(json.dumps(plan_dict, indent=2) + "\n")
    return out
