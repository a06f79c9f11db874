"""Section vocab: Llama 3's 128256-token vocabulary through the fused head and loss.

A micro Llama (2 blocks) with ``vocab_size: 128256`` trained through `finetune run --measure-memory`: the head
and the loss are fused (finetune.loss.fused_head), so the (B, T, V) logits never exist whole. Figures: the
plan's prediction against the measured peak, and what the fp32 logits alone would take. On the GPU a second run
with ``FINETUNE_FUSED_HEAD=0`` (the chunked loss over materialised logits) must give the same first loss, and
shows the peak the fusion saves. ``--dry-run``: the fused run on the CPU, in this process.
"""

from __future__ import annotations

import math
from typing import Any

from scripts.gpu_check import jobs
from scripts.gpu_check.report import Check

VOCAB = 128256
GPU_MODEL = {**jobs.MID_LLAMA, "vocab_size": VOCAB, "hidden_size": 512, "intermediate_size": 1376,
             "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}


def run(check: Check) -> None:
    """The section (see the module's docstring)."""
    gpu = not check.dry_run
    if gpu and not jobs.cuda():
        raise RuntimeError("no CUDA device visible")
    model = jobs.model_dir(check.work / "model", **(GPU_MODEL if gpu else {**jobs.MICRO_LLAMA, "vocab_size": VOCAB}))
    data = jobs.small_data(check.work / "data", 2000 if gpu else 16)
    seq, rows = (1024, 8) if gpu else (64, 2)
    logits_bytes = rows * seq * VOCAB * 4
    check.figure("fp32_logits_bytes", logits_bytes)
    runs: dict[str, Any] = {}
    for name, env in (("fused", {}), ("unfused", {"FINETUNE_FUSED_HEAD": "0"})):
        if name == "unfused" and not gpu:
            break  # the switch is read when finetune.loss is imported: a child process, the GPU's runs
        out = check.work / name
        r = jobs.recipe(
            out, model, method="full", precision="bf16" if gpu else "fp32",
            data={"train": data["train"], "eval": None, "format": "instruction", "max_seq_len": seq, "packing": True,
                  "cache_dir": str(check.work / "cache")},
            train={"max_steps": 3 if gpu else 2, "global_batch_size": rows, "micro_batch_size": rows, "lr": 1e-4},
        )
        path = jobs.write_recipe(check.work / f"{name}.yaml", r)
        rc, seconds, _ = jobs.finetune(["run", str(path), "--measure-memory"], in_process=not gpu, env=env)
        steps = jobs.step_rows(out)
        runs[name] = {"exit_code": rc, "seconds": round(seconds, 1), "losses": [x["loss"] for x in steps],
                      "tokens_per_s": steps[-1].get("tokens_per_s") if steps else None,
                      "memory": jobs.memory_figures(jobs.memory_json(out))}
        check.figure("runs", runs)
        check.expect(f"{name}: ran", rc == 0 and bool(steps), rc)
    fused = runs["fused"]
    peak = fused["memory"].get("measured_peak")
    if fused["losses"]:
        check.expect("fused: finite losses", all(math.isfinite(x) for x in fused["losses"]))
    if peak:
        err = fused["memory"].get("error_at_measured_rows", fused["memory"].get("error"))
        check.figure("plan_error", err)
        if gpu:
            check.expect("fused: plan within 30% of the allocated peak", isinstance(err, float) and abs(err) <= 0.3, err)
    if "unfused" in runs and runs["unfused"]["losses"] and fused["losses"]:
        first = abs(runs["unfused"]["losses"][0] - fused["losses"][0]) / abs(fused["losses"][0])
        check.figure("first_loss_rel_diff", first)
        check.expect("unfused: the same first loss within 1e-3", first <= 1e-3, first)
        other = runs["unfused"]["memory"].get("measured_peak")
        if other and peak:
            check.figure("unfused_over_fused_peak", round(other / peak, 3))
    check.figure("headline", f"V={VOCAB}: peak {jobs.size(peak)} (plan {jobs.size(fused['memory'].get('predicted'))}); "
                             f"fp32 logits alone {jobs.size(logits_bytes)}")
