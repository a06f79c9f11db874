"""Section attention: one forward + backward at 4096 tokens under three attention paths, timed.

- ``sdpa``: one document per row (no ``position_ids``): the causal kernel (flash attention on a GPU);
- ``sdpa_packed``: the same tokens as packed documents (``position_ids`` restarting at each one): transformers
  builds a dense (B, 1, T, T) mask, which takes sdpa off its flash kernel;
- ``flex_packed``: the same packed rows under ``model.attn_implementation: flex_attention``: a block mask, the
  fused kernel skipping the blocks between documents.

The model is built three times through the tool's loader (seeded random init: equal weights), the loss is the
tool's (fused head). Figures: milliseconds per forward + backward (the median of the timed repeats after a
warm-up; flex's first call, its compilation, apart), the packed paths' losses and gradient norms, which must
agree (bf16 on the GPU: 1% and 3%; fp32 on the CPU: 1e-4). ``--dry-run``: 128 tokens, one repeat, the CPU's
flex fallback (finetune/model/flex.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from scripts.gpu_check import jobs
from scripts.gpu_check.report import Check

PATHS = {"sdpa": ("sdpa", False), "sdpa_packed": ("sdpa", True), "flex_packed": ("flex_attention", True)}
GPU_MODEL = {**jobs.MID_LLAMA, "num_hidden_layers": 4, "max_position_embeddings": 4096}


def run(check: Check) -> None:
    """The section (see the module's docstring)."""
    import torch

    from finetune.objectives.loss import causal_lm_loss
    from finetune.recipe.schema import load_recipe
    from finetune.spec import execution_spec
    from finetune.train.model.build import build_model
    from finetune.train.precision import autocast_factory

    gpu = not check.dry_run
    if gpu and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible")
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    precision = "bf16" if gpu else "fp32"
    model_path = jobs.model_dir(check.work / "model", **(GPU_MODEL if gpu else jobs.MICRO_LLAMA))
    tokens, rows, docs, repeats = (4096, 2, 16, 3) if gpu else (128, 2, 4, 1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (rows, tokens), generator=gen)
    cuts = sorted(torch.randperm(tokens - 1, generator=gen)[: docs - 1].add(1).tolist())
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, tokens], strict=True)]
    positions = torch.cat([torch.arange(n) for n in lengths]).repeat(rows, 1)
    batches = {
        False: {"input_ids": ids.to(device), "labels": ids.to(device)},
        True: {"input_ids": ids.to(device), "labels": ids.to(device), "position_ids": positions.to(device)},
    }
    check.figure("batch", {"rows": rows, "tokens": tokens, "documents_per_row": docs, "repeats": repeats,
                           "precision": precision})
    results: dict[str, Any] = {}
    spec = execution_spec("full", "single", precision, checkpointing=False)
    autocast = autocast_factory(spec, device)

    def once(model: Any, batch: dict[str, Any]) -> tuple[float, float, float]:
        model.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        started = time.perf_counter()
        with autocast():
            s, n = causal_lm_loss(model, batch)
        loss = s / n
        loss.backward()
        if gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return seconds, float(loss.detach()), float(torch.nn.utils.get_total_norm(grads, 2.0))

    for name, (impl, packed) in PATHS.items():
        r = jobs.recipe(check.work / name, model_path, precision=precision, model={"attn_implementation": impl},
                        data={"train": str(jobs.DATA / "reverse" / "train.jsonl"), "eval": None,
                              "max_seq_len": tokens, "packing": packed})
        loaded = load_recipe(str(jobs.write_recipe(check.work / f"{name}.yaml", r)))
        torch.manual_seed(0)
        model = build_model(loaded, spec, device)
        model.train()
        first, loss, norm = once(model, batches[packed])
        times = [once(model, batches[packed])[0] for _ in range(repeats)] if gpu else [first]
        results[name] = {"ms": round(1e3 * statistics.median(times), 2), "first_call_ms": round(1e3 * first, 1),
                         "loss": loss, "grad_norm": norm}
        check.figure("results", results)
        del model
        if gpu:
            torch.cuda.empty_cache()
    sdpa, flex = results["sdpa_packed"], results["flex_packed"]
    loss_tol, grad_tol = (1e-2, 3e-2) if gpu else (1e-4, 1e-4)
    dl = abs(flex["loss"] - sdpa["loss"]) / abs(sdpa["loss"])
    dg = abs(flex["grad_norm"] - sdpa["grad_norm"]) / abs(sdpa["grad_norm"])
    check.figure("flex_vs_sdpa_packed", {"loss_rel_diff": dl, "grad_norm_rel_diff": dg,
                                         "speedup": round(sdpa["ms"] / flex["ms"], 3) if flex["ms"] else None})
    check.expect(f"flex packed: the loss follows sdpa packed's within {loss_tol:g}", dl <= loss_tol, dl)
    check.expect(f"flex packed: the gradient norm follows sdpa packed's within {grad_tol:g}", dg <= grad_tol, dg)
    check.figure("headline", f"{tokens} tokens x {rows}: sdpa {results['sdpa']['ms']:.1f} ms, sdpa packed "
                             f"{sdpa['ms']:.1f} ms, flex packed {flex['ms']:.1f} ms (first call "
                             f"{flex['first_call_ms'] / 1e3:.1f} s); loss diff {dl:.1e}")
