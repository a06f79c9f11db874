"""Sections dpo, chat_eval and throughput: whole commands through the real CLI, as a user runs them.

- dpo: ``train.objective: dpo`` with LoRA (the reference: the base with the adapters off) on the shipped
  reverse-preference pairs, two steps and an evaluation: finite losses, the reward accuracy and margin in
  metrics.jsonl, an evaluation row.
- chat_eval: a two-step LoRA run, then ``finetune chat RUN --prompt`` (a reply, streamed through the same
  generation loop as evaluation) and ``finetune eval RUN --tasks run`` (exact match of the run's own eval
  prompts through lm-evaluation-harness; noted, not failed, where lm-eval is not installed).
- throughput: full fine-tuning of SmolLM2-135M's architecture (30 blocks of width 576, tied embeddings, seeded
  weights: tokens/s and MFU do not depend on their values) in bf16 on packed 2048-token rows, 8 steps:
  tokens/s and MFU (against the detected GPU's peak) of the steps after the first, from metrics.jsonl.

On the GPU each command runs in its own process (its CUDA context, what a user runs); ``--dry-run`` runs them
in this process on the micro model, 2 steps (throughput: tokens/s only; MFU needs a known GPU).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from scripts.gpu_check import jobs
from scripts.gpu_check.report import Check

#: SmolLM2-135M's architecture (its config.json, the token ids left to the tokenizer's config).
SMOLLM2: dict[str, Any] = {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
}


def _model(check: Check, **gpu_config: Any) -> Path:
    return jobs.model_dir(check.work / "model", **(gpu_config if not check.dry_run else jobs.MICRO_LLAMA))


def _run(check: Check, args: list[str], capture: bool = False) -> tuple[int, float, str]:
    return jobs.finetune(args, in_process=check.dry_run, capture=capture)


def dpo(check: Check) -> None:
    """Section dpo (see the module's docstring)."""
    gpu = not check.dry_run
    if gpu and not jobs.cuda():
        raise RuntimeError("no CUDA device visible")
    model = _model(check, **jobs.MID_LLAMA)
    data = jobs.small_data(check.work / "data", 256 if gpu else 16, source="reverse-preference")
    out = check.work / "dpo"
    r = jobs.recipe(
        out, model, method="lora", precision="bf16" if gpu else "fp32",
        lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        data={"train": data["train"], "eval": data["eval"], "format": "preference", "max_seq_len": 64,
              "cache_dir": str(check.work / "cache")},
        train={"objective": "dpo", "max_steps": 2, "global_batch_size": 16 if gpu else 4,
               "micro_batch_size": 16 if gpu else 4, "lr": 3e-4},
        dpo={"beta": 0.1, "loss_type": "sigmoid", "reference": "model"},
        eval={"at_start": False, "max_samples": 8 if gpu else 4, "batch_size": 8 if gpu else 4, "max_new_tokens": 4},
    )
    rc, seconds, _ = _run(check, ["run", str(jobs.write_recipe(check.work / "dpo.yaml", r))])
    rows = jobs.step_rows(out)
    evals = jobs.eval_rows(out)
    keys = sorted({k for row in rows for k in row if k.startswith(("rewards/", "logps/"))})
    check.figure("run", {"exit_code": rc, "seconds": round(seconds, 1), "losses": [x["loss"] for x in rows],
                         "reward_accuracy": [x.get("rewards/accuracy") for x in rows],
                         "reward_margin": [x.get("rewards/margin") for x in rows], "logged": keys,
                         "final_eval": evals[-1] if evals else None})
    check.expect("dpo: two steps with finite losses", rc == 0 and len(rows) == 2
                 and all(math.isfinite(x["loss"]) for x in rows), rc)
    check.expect("dpo: reward accuracy and margin logged", {"rewards/accuracy", "rewards/margin"} <= set(keys), keys)
    check.expect("dpo: an evaluation", bool(evals))
    check.figure("headline", f"losses {[round(x['loss'], 4) for x in rows]}, reward accuracy "
                             f"{rows[-1].get('rewards/accuracy') if rows else None}")


def chat_eval(check: Check) -> None:
    """Section chat_eval (see the module's docstring)."""
    import importlib.util

    gpu = not check.dry_run
    if gpu and not jobs.cuda():
        raise RuntimeError("no CUDA device visible")
    model = _model(check, **jobs.MID_LLAMA)
    data = jobs.small_data(check.work / "data", 64 if gpu else 16)
    out = check.work / "lora"
    r = jobs.recipe(
        out, model, method="lora", precision="bf16" if gpu else "fp32",
        lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        data={"train": data["train"], "eval": data["eval"], "format": "instruction", "max_seq_len": 64,
              "cache_dir": str(check.work / "cache")},
        train={"max_steps": 2, "global_batch_size": 8 if gpu else 4, "micro_batch_size": 8 if gpu else 4},
        eval={"at_start": False, "max_samples": 4, "batch_size": 4, "max_new_tokens": 4},
    )
    rc, _, _ = _run(check, ["run", str(jobs.write_recipe(check.work / "lora.yaml", r))])
    check.expect("the LoRA run finished", rc == 0, rc)
    if rc != 0:
        return
    rc_chat, chat_s, reply = _run(check, ["chat", str(out), "--prompt", "Reverse the letters.\nabc",
                                          "--max-new-tokens", "4"], capture=True)
    check.figure("chat", {"exit_code": rc_chat, "seconds": round(chat_s, 1), "stdout_tail": reply[-300:]})
    check.expect("finetune chat answers a prompt", rc_chat == 0, rc_chat)
    results = check.work / "eval.json"
    if importlib.util.find_spec("lm_eval") is None:
        check.note("lm-evaluation-harness is not installed: finetune eval is not run (pip install 'finetune[eval]')")
        check.figure("headline", f"chat ok in {chat_s:.1f} s; eval not run (no lm-eval)")
        return
    rc_eval, eval_s, text = _run(check, ["eval", str(out), "--tasks", "run", "--output", str(results)], capture=True)
    report = json.loads(results.read_text()) if results.is_file() else None
    check.figure("eval", {"exit_code": rc_eval, "seconds": round(eval_s, 1), "report": report,
                          "stdout_tail": text[-300:]})
    check.expect("finetune eval --tasks run scores the run", rc_eval == 0 and report is not None, rc_eval)
    check.figure("headline", f"chat ok in {chat_s:.1f} s; eval --tasks run in {eval_s:.1f} s")


def throughput(check: Check) -> None:
    """Section throughput (see the module's docstring)."""
    gpu = not check.dry_run
    if gpu and not jobs.cuda():
        raise RuntimeError("no CUDA device visible")
    model = _model(check, **SMOLLM2)
    data = jobs.small_data(check.work / "data", 4000 if gpu else 32)
    out = check.work / "run"
    steps = 8 if gpu else 2
    r = jobs.recipe(
        out, model, method="full", precision="bf16" if gpu else "fp32",
        data={"train": data["train"], "eval": None, "format": "instruction", "max_seq_len": 2048 if gpu else 64,
              "packing": True, "cache_dir": str(check.work / "cache")},
        train={"max_steps": steps, "global_batch_size": 16 if gpu else 2, "micro_batch_size": 8 if gpu else 2,
               "lr": 1e-4},
    )
    rc, seconds, _ = _run(check, ["run", str(jobs.write_recipe(check.work / "throughput.yaml", r))])
    rows = jobs.step_rows(out)
    speeds = [x["tokens_per_s"] for x in rows[1:] if x.get("tokens_per_s")] or [
        x["tokens_per_s"] for x in rows if x.get("tokens_per_s")]
    mfus = [x["mfu"] for x in rows[1:] if isinstance(x.get("mfu"), (int, float))]
    tps = statistics.median(speeds) if speeds else None
    mfu = statistics.median(mfus) if mfus else None
    check.figure("run", {"exit_code": rc, "seconds": round(seconds, 1), "steps": len(rows),
                         "losses": [x["loss"] for x in rows], "tokens_per_s": tps, "mfu": mfu,
                         "chosen": {k: v for k, v in jobs.plan_chosen(out).items()
                                    if k in ("strategy", "precision", "micro_batch_size", "activation_checkpointing")}})
    check.expect(f"{steps} steps with finite losses", rc == 0 and len(rows) == steps
                 and all(math.isfinite(x["loss"]) for x in rows), rc)
    check.expect("tokens/s measured", bool(tps), tps)
    if gpu:
        check.expect("MFU reported (a GPU the tool knows)", mfu is not None, mfu)
    check.figure("headline", f"{tps or 0:.0f} tok/s" + (f", MFU {mfu:.1%}" if isinstance(mfu, float) else ""))
