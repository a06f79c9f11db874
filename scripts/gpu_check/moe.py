"""Sections moe_experts and moe_lora: a mixture of experts (Qwen3-MoE's architecture, fused 3-D expert weights).

- moe_experts: the same model and batch under each experts implementation transformers offers
  (``model.set_experts_implementation``: eager loops over the experts, grouped_mm and batched_mm run them as
  one batched matrix product): forward + backward through the tool's loss, tokens/s (the median of the timed
  repeats after a warm-up), and the same loss under each (bf16 on the GPU: 2%; fp32 on the CPU: 1e-4).
  Skipped with "not in this build" where transformers has no experts implementations.
- moe_lora: LoRA with ``target_modules: all-linear`` built by the tool's loader: which expert weights get
  adapters. Where none does, the section is skipped ("not in this build": LoRA on the experts is a feature of
  later builds); else two steps through `finetune run`, whose saved adapter must hold the experts' weights.

GPU: 4 layers of width 1024, 32 experts of width 512, top 4, bf16, 4 x 1024 tokens; ``--dry-run``: the tiny
model of tests/support.py (8 experts, top 2), fp32, 2 x 64 tokens, one repeat.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import Any

from scripts.gpu_check import jobs
from scripts.gpu_check.report import Check, Skip

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
GPU_CONFIG = {"hidden_size": 1024, "intermediate_size": 2816, "moe_intermediate_size": 512, "num_experts": 32,
              "num_experts_per_tok": 4, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
              "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 2048}


def model_path(check: Check) -> Any:
    """The MoE model directory (tests/support.py's tiny qwen3_moe; larger on the GPU)."""
    from tests.support import arch_model_dir

    return arch_model_dir(check.work / "moe", "qwen3_moe", **({} if check.dry_run else GPU_CONFIG))


def experts(check: Check) -> None:
    """Section moe_experts (see the module's docstring)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.objectives.loss import causal_lm_loss

    gpu = not check.dry_run
    if gpu and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible")
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    config = AutoConfig.from_pretrained(model_path(check))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    if not hasattr(model, "set_experts_implementation"):
        raise Skip("not in this build: this transformers has no experts implementations to choose from")
    rows, tokens, repeats = (4, 1024, 3) if gpu else (2, 64, 1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, int(config.vocab_size) - 1, (rows, tokens), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids}
    experts_weights = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    check.figure("model", {"experts": int(config.num_experts), "top_k": int(config.num_experts_per_tok),
                           "layers": int(config.num_hidden_layers), "dtype": str(dtype),
                           "experts_share": round(experts_weights / sum(p.numel() for p in model.parameters()), 3),
                           "rows": rows, "tokens": tokens})

    def once() -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        started = time.perf_counter()
        s, n = causal_lm_loss(model, batch)
        (s / n).backward()
        if gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - started, float((s / n).detach())

    results: dict[str, Any] = {}
    for impl in IMPLEMENTATIONS:
        try:
            model.set_experts_implementation(impl)
            first, loss = once()
            times = [once()[0] for _ in range(repeats)] if gpu else [first]
        except Exception as exc:  # an implementation this build or device lacks is a finding, not a crash
            results[impl] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
            check.figure("results", results)
            continue
        seconds = statistics.median(times)
        results[impl] = {"tokens_per_s": round(rows * tokens / seconds, 1), "ms": round(1e3 * seconds, 2),
                         "first_call_ms": round(1e3 * first, 1), "loss": loss}
        check.figure("results", results)
    ran = {k: v for k, v in results.items() if "loss" in v}
    check.expect("every experts implementation ran", len(ran) == len(IMPLEMENTATIONS),
                 {k: v.get("error") for k, v in results.items() if "error" in v} or None)
    if ran:
        ref = ran.get("eager", next(iter(ran.values())))["loss"]
        spread = max(abs(v["loss"] - ref) / abs(ref) for v in ran.values())
        tol = 2e-2 if gpu else 1e-4
        check.figure("loss_max_rel_diff", spread)
        check.expect(f"the same loss under each implementation within {tol:g}", spread <= tol, spread)
        check.figure("headline", ", ".join(f"{k} {v['tokens_per_s']:.0f}" for k, v in ran.items())
                     + f" tok/s (forward + backward, {rows} x {tokens})")


def lora(check: Check) -> None:
    """Section moe_lora (see the module's docstring)."""
    import torch

    from finetune.recipe.schema import load_recipe
    from finetune.spec import execution_spec
    from finetune.train.model.build import build_model

    gpu = not check.dry_run
    if gpu and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible")
    path = model_path(check)
    data = jobs.small_data(check.work / "data", 64 if gpu else 16)
    precision = "bf16"  # what the planner traces an MoE in on every build
    r = jobs.recipe(check.work / "run", path, method="lora", precision=precision,
                    lora={"r": 4, "alpha": 8, "target_modules": "all-linear"},
                    data={"train": data["train"], "eval": None, "max_seq_len": 128 if gpu else 48,
                          "cache_dir": str(check.work / "cache")},
                    train={"max_steps": 2, "global_batch_size": 8 if gpu else 2, "micro_batch_size": 8 if gpu else 2})
    recipe_path = jobs.write_recipe(check.work / "moe-lora.yaml", r)
    loaded = load_recipe(str(recipe_path))
    rr = loaded.recipe
    spec = execution_spec("lora", "single", precision, checkpointing=False, lora=rr.lora)
    model = build_model(loaded, spec, torch.device("cpu"))
    adapted = sorted({n.split(".lora_")[0] for n, p in model.named_parameters()
                      if p.requires_grad and "lora_" in n and "experts" in n})
    layers = int(json.loads((path / "config.json").read_text())["num_hidden_layers"])
    check.figure("adapted_expert_weights", adapted)
    del model
    if not adapted:
        raise Skip("not in this build: LoRA (target_modules: all-linear) adapts no expert weight")
    rc, seconds, _ = jobs.finetune(["run", str(recipe_path)], in_process=not gpu)
    rows = jobs.step_rows(check.work / "run")
    saved = check.work / "run" / "adapter_model.safetensors"
    keys: list[str] = []
    if saved.is_file():
        from safetensors import safe_open

        with safe_open(str(saved), "pt") as f:
            keys = [k for k in f.keys() if "experts" in k]  # noqa: SIM118 (safe_open is no dict)
    check.figure("run", {"exit_code": rc, "seconds": round(seconds, 1), "losses": [x["loss"] for x in rows],
                         "saved_expert_tensors": len(keys)})
    check.expect("every layer's experts are adapted", len({a.split(".experts")[0] for a in adapted}) >= layers,
                 len(adapted))
    check.expect("two steps ran with finite losses", rc == 0 and len(rows) == 2
                 and all(math.isfinite(x["loss"]) for x in rows), rc)
    check.expect("the saved adapter holds the experts' adapters", len(keys) > 0, len(keys))
    check.figure("headline", f"{len(adapted)} expert weights adapted, {len(keys)} expert tensors saved")
