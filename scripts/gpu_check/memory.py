"""Section memory: the plan against the measured memory, through `finetune run --measure-memory`.

Three runs of the same job, each through the real CLI: full fine-tuning, LoRA and QLoRA (4-bit NF4), in bf16,
with an evaluation at the end. Each run's memory.json holds the plan's prediction of the step's tensor memory
beside torch's allocated peak over its first two steps (and the allocator's reserved bytes and the device
memory in use); the figures here are those, their ratios, the plan's chosen configuration, the losses, the final
evaluation, tokens/s and MFU. On the GPU the plan must be within :data:`TOLERANCE` of the allocated peak.

On the GPU: a ~150M-parameter Llama (:data:`~scripts.gpu_check.jobs.MID_LLAMA`), packed rows of 512 tokens,
global batch 16 in micro-batches of 8, 4 steps, each run in its own process (its own CUDA context).
``--dry-run``: LoRA alone (:data:`DRY_CONFIGS`) on a micro model, 2 steps, the CLI in this process (MemTracker
measures on the CPU): the section's CPU path end to end; the planner's CPU accuracy per method is
tests/plan's and scripts/plan_accuracy.py's.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from scripts.gpu_check import jobs
from scripts.gpu_check.report import Check

#: name -> (method, quantization bits, precision)
CONFIGS: dict[str, tuple[str, int | None, str]] = {
    "full-bf16": ("full", None, "bf16"),
    "lora-bf16": ("lora", None, "bf16"),
    "qlora4-bf16": ("qlora", 4, "bf16"),
}
#: The dry run's configurations.
DRY_CONFIGS = ("lora-bf16",)
#: On the GPU, the plan's prediction at the measured rows must be within this fraction of the allocated peak.
TOLERANCE = 0.10


def job(check: Check, name: str, model: Path, data: dict[str, str]) -> dict[str, Any]:
    """The recipe of configuration ``name``."""
    method, bits, precision = CONFIGS[name]
    gpu = not check.dry_run
    steps = 4 if gpu else 2
    sections: dict[str, Any] = {
        "method": method,
        "precision": precision,
        "data": {"train": data["train"], "eval": data["eval"], "format": "instruction",
                 "max_seq_len": 512 if gpu else 64, "packing": gpu, "cache_dir": str(check.work / "cache")},
        "train": {"max_steps": steps, "global_batch_size": 16 if gpu else 4, "micro_batch_size": 8 if gpu else 2,
                  "lr": 1e-4 if method == "full" else 1e-3, "seed": 0, "warmup_steps": 0},
        "lora": {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "eval": {"at_start": False, "max_samples": 16 if gpu else 4, "batch_size": 16 if gpu else 4,
                 "max_new_tokens": 8 if gpu else 2},
        "output": {"log_every": 1, "save_every": 0},
    }
    if bits is not None:
        sections["quantization"] = {"bits": bits}
    return jobs.recipe(check.work / name, model, **sections)


def summarize_run(out: Path) -> dict[str, Any]:
    """What a finished run left: its plan's choice, memory.json's figures, losses, evaluation, speed."""
    rows = jobs.step_rows(out)
    chosen = jobs.plan_chosen(out)
    evals = jobs.eval_rows(out)
    speeds = [r["tokens_per_s"] for r in rows[1:] if r.get("tokens_per_s")]
    mfus = [r["mfu"] for r in rows[1:] if isinstance(r.get("mfu"), (int, float))]
    return {
        "chosen": {k: chosen.get(k) for k in ("strategy", "precision", "micro_batch_size", "grad_accum_steps",
                                              "activation_checkpointing", "optimizer")},
        "memory": jobs.memory_figures(jobs.memory_json(out)),
        "losses": [r["loss"] for r in rows],
        "final_eval": evals[-1] if evals else None,
        "tokens_per_s": statistics.median(speeds) if speeds else None,
        "mfu": statistics.median(mfus) if mfus else None,
    }


def run(check: Check) -> None:
    """The section (see the module's docstring)."""
    gpu = not check.dry_run
    if gpu and not jobs.cuda():
        raise RuntimeError("no CUDA device visible")
    model = jobs.model_dir(check.work / "model", **(jobs.MID_LLAMA if gpu else jobs.MICRO_LLAMA))
    data = jobs.small_data(check.work / "data", 4000 if gpu else 32)
    names = list(CONFIGS) if gpu else list(DRY_CONFIGS)
    check.figure("configs", names)
    runs: dict[str, Any] = {}
    worst: tuple[float, str] = (0.0, "")
    for name in names:
        out = check.work / name
        path = jobs.write_recipe(check.work / f"{name}.yaml", job(check, name, model, data))
        rc, seconds, _ = jobs.finetune(["run", str(path), "--measure-memory"], in_process=not gpu)
        result = {"exit_code": rc, "seconds": round(seconds, 1), **summarize_run(out)}
        runs[name] = result
        check.figure("runs", runs)
        mem = result["memory"]
        ok = rc == 0 and mem.get("measured_peak") is not None
        check.expect(f"{name}: ran and wrote memory.json", ok, rc)
        if not ok:
            continue
        check.expect(f"{name}: finite losses and a final evaluation",
                     all(math.isfinite(x) for x in result["losses"]) and result["final_eval"] is not None)
        err = mem.get("error_at_measured_rows", mem.get("error"))
        if isinstance(err, (int, float)) and abs(err) >= worst[0]:
            worst = (abs(err), name)
        if gpu:
            check.expect(f"{name}: plan within {TOLERANCE:.0%} of the allocated peak",
                         isinstance(err, (int, float)) and abs(err) <= TOLERANCE, err)
    ran = sum(r["exit_code"] == 0 for r in runs.values())
    check.figure("headline", f"{ran}/{len(names)} runs; largest plan error {worst[0]:.1%} ({worst[1]})")
