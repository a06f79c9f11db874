"""Section attention: flex attention's loss against sdpa's (and eager's) on the same batch and weights.

The same model is built three times through the tool's own loader (``finetune.train.model.build_model``,
seeded random init, so the weights are equal), once per ``model.attn_implementation``; one packed
micro-batch from the tool's data pipeline (documents separated by ``position_ids``, which flex attention turns
into a block mask and sdpa/eager into a dense one) goes through the tool's loss (the fused head) and backward.
The losses and gradient norms must agree: on the GPU in bf16 within 1% (loss) and 3% (gradient norm); on the
CPU in fp32 within 1e-4. flex's first call includes its compilation (seconds, shown).
"""

from __future__ import annotations

import time
from typing import Any

from scripts.gpu_check import jobs
from scripts.gpu_check.report import Check

IMPLEMENTATIONS = ("sdpa", "flex_attention", "eager")
GPU_MODEL = {**jobs.MID_LLAMA, "num_hidden_layers": 4}


def run(check: Check) -> None:
    """The section (see the module's docstring)."""
    import torch

    from finetune.loss import causal_lm_loss
    from finetune.recipe import load_recipe
    from finetune.spec import execution_spec
    from finetune.train.data import BatchStream, load_data
    from finetune.train.model import build_model, load_tokenizer
    from finetune.train.precision import autocast_factory

    gpu = not check.dry_run
    if gpu and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible")
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    precision = "bf16" if gpu else "fp32"
    model_path = jobs.model_dir(check.work / "model", **(GPU_MODEL if gpu else jobs.MICRO_LLAMA))
    data = jobs.small_data(check.work / "data", 400 if gpu else 32)
    seq, rows = (1024, 4) if gpu else (128, 2)
    results: dict[str, Any] = {}
    batch: dict[str, Any] | None = None
    for impl in IMPLEMENTATIONS:
        r = jobs.recipe(
            check.work / impl, model_path, precision=precision, model={"attn_implementation": impl},
            data={"train": data["train"], "eval": None, "format": "instruction", "max_seq_len": seq, "packing": True,
                  "cache_dir": str(check.work / "cache")},
            train={"global_batch_size": rows, "micro_batch_size": rows},
        )
        loaded = load_recipe(str(jobs.write_recipe(check.work / f"{impl}.yaml", r)))
        spec = execution_spec("full", "single", precision, checkpointing=False)
        if batch is None:
            tok = load_tokenizer(loaded)
            stream = BatchStream(load_data(loaded, tok).train, rows, 0, tok.pad_token_id)
            batch = {k: v.to(device) for k, v in stream.micro_batches(0, 0, rank=0, world_size=1,
                                                                       micro_batch_size=rows)[0].items()}
            check.figure("batch", {"shape": list(batch["input_ids"].shape), "keys": sorted(batch),
                                   "documents": int((batch["position_ids"] == 0).sum()) if "position_ids" in batch
                                   else None})
        torch.manual_seed(0)
        model = build_model(loaded, spec, device)
        model.train()
        autocast = autocast_factory(spec, device)
        started = time.perf_counter()
        with autocast():
            s, n = causal_lm_loss(model, batch)
        loss = s / n
        loss.backward()
        if gpu:
            torch.cuda.synchronize()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads, 2.0))
        results[impl] = {"loss": float(loss.detach()), "grad_norm": norm, "seconds": round(time.perf_counter() - started, 2),
                         "first_weight_sum": float(next(model.parameters()).detach().float().sum())}
        check.figure("results", results)
        del model, grads, loss, s
        if gpu:
            torch.cuda.empty_cache()
    sdpa = results["sdpa"]
    loss_tol, grad_tol = (1e-2, 3e-2) if gpu else (1e-4, 1e-4)
    check.expect("the three models start from the same weights",
                 len({round(v["first_weight_sum"], 3) for v in results.values()}) == 1)
    for impl in ("flex_attention", "eager"):
        got = results[impl]
        dl = abs(got["loss"] - sdpa["loss"]) / abs(sdpa["loss"])
        dg = abs(got["grad_norm"] - sdpa["grad_norm"]) / abs(sdpa["grad_norm"])
        check.figure(f"{impl}_vs_sdpa", {"loss_rel_diff": dl, "grad_norm_rel_diff": dg})
        check.expect(f"{impl}: the loss follows sdpa's within {loss_tol:g}", dl <= loss_tol, dl)
        check.expect(f"{impl}: the gradient norm follows sdpa's within {grad_tol:g}", dg <= grad_tol, dg)
    flex = check.figures["flex_attention_vs_sdpa"]
    check.figure("headline", f"flex vs sdpa: loss {flex['loss_rel_diff']:.1e}, grad norm {flex['grad_norm_rel_diff']:.1e} "
                             f"(rel.); flex's first call {results['flex_attention']['seconds']:.1f} s")

