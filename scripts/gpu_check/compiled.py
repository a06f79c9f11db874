"""Section compile: ``train.compile`` with LoRA and activation checkpointing on a model of more than 8 blocks.

Two runs of the same LoRA job through `finetune run` (bf16, activation checkpointing on, 12 blocks): compiled
and eager. Each decoder block is compiled (finetune.train.parallel.parallelize.compile_blocks), the checkpoint traced into
its graph; the blocks share one compiled graph. Figures: the first step's seconds (the compilation), steady
tokens/s of both, their losses, which must agree within 2% (inductor's kernels round differently).

``--dry-run``: the plan of the compiled recipe (`finetune plan --json`, a 9-block micro model) -- the capability
table admits the combination and the plan carries it into the execution spec; compiling on 2 CPU cores would
take minutes, so the runs are the GPU's.
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from scripts.gpu_check import jobs
from scripts.gpu_check.report import Check

GPU_MODEL = {**jobs.MID_LLAMA, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64}
TOLERANCE = 2e-2


def job(check: Check, name: str, model: Any, data: dict[str, str], compiled: bool) -> dict[str, Any]:
    """The LoRA recipe, compiled or not."""
    gpu = not check.dry_run
    return jobs.recipe(
        check.work / name, model, method="lora", precision="bf16",
        lora={"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        data={"train": data["train"], "eval": None, "format": "instruction", "max_seq_len": 512 if gpu else 64,
              "packing": True, "cache_dir": str(check.work / "cache")},
        train={"max_steps": 8, "global_batch_size": 16, "micro_batch_size": 8, "lr": 1e-3,
               "activation_checkpointing": True, "compile": compiled},
    )


def run(check: Check) -> None:
    """The section (see the module's docstring)."""
    gpu = not check.dry_run
    blocks = GPU_MODEL["num_hidden_layers"] if gpu else 9
    model = jobs.model_dir(check.work / "model", **(GPU_MODEL if gpu else {**jobs.MICRO_LLAMA,
                                                                           "num_hidden_layers": blocks}))
    data = jobs.small_data(check.work / "data", 4000 if gpu else 64)
    check.figure("blocks", blocks)
    if not gpu:
        path = jobs.write_recipe(check.work / "compiled.yaml", job(check, "compiled", model, data, True))
        rc, seconds, text = jobs.finetune(["plan", str(path), "--json"], in_process=True, capture=True)
        check.expect("plan: the compiled LoRA recipe with checkpointing is admitted", rc == 0, rc)
        plan = json.loads(text) if rc == 0 else {}
        chosen, execution = plan.get("chosen", {}), plan.get("execution") or {}
        check.figure("plan", {"seconds": round(seconds, 1), "method": chosen.get("method"),
                              "activation_checkpointing": chosen.get("activation_checkpointing"),
                              "compile": execution.get("compile"), "memory": (chosen.get("memory") or {}).get("total")})
        check.expect("plan: compile and checkpointing reach the execution spec",
                     execution.get("compile") is True and chosen.get("activation_checkpointing") is True,
                     [execution.get("compile"), chosen.get("activation_checkpointing")])
        check.figure("not_run", "the compiled and eager runs (inductor on 2 CPU cores takes minutes): GPU only")
        check.figure("headline", f"plan admits compile + LoRA + checkpointing on {blocks} blocks; runs need CUDA")
        return
    if not jobs.cuda():
        raise RuntimeError("no CUDA device visible")
    runs: dict[str, Any] = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        path = jobs.write_recipe(check.work / f"{name}.yaml", job(check, name, model, data, compiled))
        rc, seconds, _ = jobs.finetune(["run", str(path)], in_process=False)
        rows = jobs.step_rows(check.work / name)
        step_seconds = [r["tokens"] - (rows[i - 1]["tokens"] if i else 0) for i, r in enumerate(rows)]
        step_seconds = [t / r["tokens_per_s"] for t, r in zip(step_seconds, rows, strict=True) if r.get("tokens_per_s")]
        speeds = [r["tokens_per_s"] for r in rows[2:] if r.get("tokens_per_s")]
        runs[name] = {"exit_code": rc, "seconds": round(seconds, 1), "losses": [r["loss"] for r in rows],
                      "first_step_seconds": step_seconds[0] if step_seconds else None,
                      "tokens_per_s": statistics.median(speeds) if speeds else None,
                      "mfu": statistics.median([r["mfu"] for r in rows[2:] if isinstance(r.get("mfu"), float)] or [0])}
        check.figure("runs", runs)
        check.expect(f"{name}: ran", rc == 0 and bool(rows), rc)
    eager, comp = runs["eager"], runs["compiled"]
    if eager["losses"] and comp["losses"]:
        rel = jobs.max_rel(comp["losses"], eager["losses"])
        check.figure("max_rel_loss_diff", rel if math.isfinite(rel) else None)
        check.expect(f"compiled losses follow eager within {TOLERANCE:g}", rel <= TOLERANCE, rel)
        speedup = (comp["tokens_per_s"] or 0) / (eager["tokens_per_s"] or 1)
        check.figure("speedup", round(speedup, 3))
        check.figure(
            "headline",
            f"{blocks} blocks: compiled {comp['tokens_per_s'] or 0:.0f} vs eager {eager['tokens_per_s'] or 0:.0f} "
            f"tok/s ({speedup:.2f}x), first step {comp['first_step_seconds'] or 0:.0f} s; loss diff {rel:.1e}",
        )
