"""Section optimizer8bit: ``train.optimizer: adamw8bit`` (bitsandbytes' 8-bit AdamW) against AdamW.

The same full fine-tuning run twice through `finetune run --measure-memory`, once per optimizer: the losses of
the 8-bit run must follow AdamW's (both moments are kept in 8 bits, block-wise; the updates differ by their
rounding), its measured peak must be lower, and the plan's optimizer-state bytes of the two runs are shown
beside the measured difference. GPU: the memory section's ~150M Llama in bf16, 6 steps; ``--dry-run``: the
micro model in fp32, 2 steps, in this process.
"""

from __future__ import annotations

import math
from typing import Any

from scripts.gpu_check import jobs
from scripts.gpu_check.report import Check

OPTIMIZERS = ("adamw", "adamw8bit")
#: The 8-bit run's losses may differ from AdamW's by this fraction (GPU: bf16; CPU: fp32, 2 steps).
TOLERANCE = {True: 2e-2, False: 5e-2}


def run(check: Check) -> None:
    """The section (see the module's docstring)."""
    gpu = not check.dry_run
    if gpu and not jobs.cuda():
        raise RuntimeError("no CUDA device visible")
    model = jobs.model_dir(check.work / "model", **(jobs.MID_LLAMA if gpu else jobs.MICRO_LLAMA))
    data = jobs.small_data(check.work / "data", 4000 if gpu else 24)
    runs: dict[str, Any] = {}
    for name in OPTIMIZERS:
        out = check.work / name
        r = jobs.recipe(
            out, model, method="full", precision="bf16" if gpu else "fp32",
            data={"train": data["train"], "eval": None, "format": "instruction", "max_seq_len": 512 if gpu else 64,
                  "packing": gpu, "cache_dir": str(check.work / "cache")},
            train={"max_steps": 6 if gpu else 3, "global_batch_size": 16 if gpu else 4,
                   "micro_batch_size": 8 if gpu else 4, "lr": 1e-3, "optimizer": name},
        )
        path = jobs.write_recipe(check.work / f"{name}.yaml", r)
        rc, seconds, _ = jobs.finetune(["run", str(path), "--measure-memory"], in_process=check.dry_run)
        mem = jobs.memory_figures(jobs.memory_json(out))
        chosen = jobs.plan_chosen(out)
        runs[name] = {
            "exit_code": rc, "seconds": round(seconds, 1), "losses": [x["loss"] for x in jobs.step_rows(out)],
            "planned_optimizer_bytes": (chosen.get("memory") or {}).get("optimizer"),
            "plan_optimizer": chosen.get("optimizer"), "memory": mem,
        }
        check.figure("runs", runs)
        check.expect(f"{name}: ran", rc == 0 and bool(runs[name]["losses"]), rc)
    a, b = runs["adamw"], runs["adamw8bit"]
    if not (a["losses"] and b["losses"]):
        return
    rel = jobs.max_rel(b["losses"], a["losses"])
    check.figure("max_rel_loss_diff", rel if math.isfinite(rel) else None)
    check.expect("adamw8bit: the plan keeps 8-bit state", b["plan_optimizer"] == "adamw8bit", b["plan_optimizer"])
    check.expect(f"adamw8bit: losses follow AdamW's within {TOLERANCE[gpu]:g}", rel <= TOLERANCE[gpu], rel)
    peak_a, peak_b = a["memory"].get("measured_peak"), b["memory"].get("measured_peak")
    plan_a, plan_b = a["planned_optimizer_bytes"], b["planned_optimizer_bytes"]
    if peak_a and peak_b:
        check.figure("measured_saving_bytes", peak_a - peak_b)
        check.expect("adamw8bit: a lower measured peak", peak_b < peak_a, [peak_a, peak_b])
    if plan_a and plan_b:
        check.figure("planned_saving_bytes", plan_a - plan_b)
        check.figure("planned_state_ratio", round(plan_b / plan_a, 4))
    check.figure(
        "headline",
        f"loss diff {rel:.2e}; optimizer state planned {jobs.size(plan_b)} vs {jobs.size(plan_a)}, "
        f"peak {jobs.size(peak_b)} vs {jobs.size(peak_a)}",
    )
