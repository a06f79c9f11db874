"""Section harness: the tool's sharded path at world size 1 over NCCL, driven function by function.

A process group of one rank (nccl on the GPU; gloo with CPU tensors under ``--dry-run``) and a DistContext that
counts as distributed, so that ``finetune.train.parallel.parallelize`` shards with FSDP2 as on many GPUs.
Each case builds its model as the trainer's sharded path does (``load.build_on_meta`` -> ``parallelize`` ->
``load.materialize``), trains it with the tool's loss, precision helpers, optimizer and clipping, and checks
one thing that only a GPU run can break:

- ``full_bf16``: FSDP2 full fine-tuning in bf16 with fused AdamW on DTensor parameters; its losses against the
  same steps unsharded (the whole-model load, autocast) within 2%;
- ``checkpointer``: the tool's Checkpointer saves the trained model and optimizer, a fresh sharded model loads
  them: equal weights and moments, and the next step's loss equal to the original's;
- ``dcp_default_group``: DCP save/load of the same state through the default process group (NCCL's collectives
  plan the checkpoint): equal weights after loading;
- ``qlora``: QLoRA 4-bit codes sharded by FSDP2, gathered and dequantized by bitsandbytes in forward: the loss
  of the sharded load equals the whole-model quantizing load's, and two steps train the adapters;
- ``fp16``: fp16 mixed precision under FSDP2 with the tool's GradScaler (unscale on DTensor gradients before
  clipping and the fused step): finite losses, a finite scale, weights that moved.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from scripts.gpu_check.jobs import MICRO_LLAMA, MID_LLAMA, model_dir, recipe, small_data, write_recipe
from scripts.gpu_check.report import Check

#: The harness model on the GPU: 4 blocks of width 512 with a 32000-token vocabulary.
GPU_MODEL = {**MID_LLAMA, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}
STEPS = 3


class Harness:
    """The process group, the data and the model builders shared by the cases."""

    def __init__(self, check: Check) -> None:
        import torch
        import torch.distributed as dist

        from finetune.train.distributed import DistContext

        self.check, self.torch = check, torch
        gpu = not check.dry_run
        if gpu and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible")
        self.device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        if gpu:
            torch.cuda.set_device(self.device)
        self.backend = "nccl" if gpu else "gloo"
        store = dist.FileStore(str(check.work / "store"), 1)
        dist.init_process_group(
            self.backend, store=store, rank=0, world_size=1, device_id=self.device if gpu else None
        )

        class OneRank(DistContext):
            """Rank 0 of 1 that shards as a multi-process run does (world size 1 is otherwise 'single')."""

            @property
            def distributed(self) -> bool:
                return True

        self.ctx = OneRank(0, 1, 0, self.device)
        self.model_path = model_dir(check.work / "model", **(GPU_MODEL if gpu else MICRO_LLAMA))
        self.seq, self.batch = (128, 8) if gpu else (64, 2)
        self.data = small_data(check.work / "data", 256 if gpu else 16)
        self._data: Any = None

    def loaded(self, name: str, method: str, precision: str, **sections: Any) -> Any:
        """The LoadedRecipe of one case (fsdp, the harness model, the reverse data)."""
        from finetune.recipe import load_recipe

        r = recipe(
            self.check.work / name, self.model_path, method=method, precision=precision,
            distributed={"strategy": "fsdp"},
            data={"train": self.data["train"], "max_seq_len": self.seq, "eval": None,
                  "cache_dir": str(self.check.work / "cache")},
            train={"max_steps": STEPS + 1, "global_batch_size": self.batch, "micro_batch_size": self.batch,
                   "lr": 1e-3, "seed": 0, "max_grad_norm": 1.0},
            lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
            quantization={"bits": 4},
            **sections,
        )
        return load_recipe(str(write_recipe(self.check.work / f"{name}.yaml", r)))

    def spec(self, loaded: Any, strategy: str = "fsdp") -> Any:
        """The execution spec of ``loaded`` under ``strategy`` at world size 1."""
        from finetune.spec import execution_spec

        r = loaded.recipe
        return execution_spec(
            r.method, strategy, r.precision, checkpointing=False, world_size=1, quantization=r.quantization,
            lora=r.lora, prefix=r.prefix, adapter=r.adapter, optimizer="adamw",
        )

    def batches(self, loaded: Any) -> list[list[dict[str, Any]]]:
        """The micro-batches of the first steps (the same for every case: same data, seed and batch)."""
        if self._data is None:
            from finetune.train.data import BatchStream, load_data
            from finetune.train.model import load_tokenizer

            tok = load_tokenizer(loaded)
            stream = BatchStream(load_data(loaded, tok).train, self.batch, 0, tok.pad_token_id)
            self._data = [
                [{k: v.to(self.device) for k, v in mb.items()}
                 for mb in stream.micro_batches(0, s, rank=0, world_size=1, micro_batch_size=self.batch)]
                for s in range(STEPS + 1)
            ]
            self.stream = stream
        return self._data

    def sharded(self, loaded: Any, spec: Any) -> Any:
        """The trainer's sharded path: built on meta, parallelized (FSDP2), then this rank's shards filled."""
        from finetune.train.load import build_on_meta, materialize
        from finetune.train.parallel import parallelize

        self.torch.manual_seed(0)
        model = parallelize(build_on_meta(loaded, spec), spec, self.ctx)
        materialize(model, loaded, spec, self.device)
        return model

    def whole(self, loaded: Any, spec: Any) -> Any:
        """The whole-model load (what one process builds), not wrapped."""
        from finetune.train.model import build_model

        self.torch.manual_seed(0)
        return build_model(loaded, spec, self.device)

    def optimizer(self, model: Any, loaded: Any, spec: Any) -> Any:
        """The tool's optimizer for ``spec`` (AdamW: fused)."""
        from finetune.train.optimizer import build_optimizer

        return build_optimizer(model, loaded.recipe.train, spec.strategy, name="adamw")

    def step(self, model: Any, opt: Any, spec: Any, micro: list[dict[str, Any]], scaler: Any = None) -> dict[str, float]:
        """One optimizer step as the trainer takes it: the tool's loss, autocast (when the spec asks), the loss
        scaler (fp16), the tool's clipping, the step. Returns the token-mean loss and the gradient norm."""
        from finetune.loss import causal_lm_loss, count_target_tokens
        from finetune.train.gradients import clip_gradients
        from finetune.train.precision import autocast_factory

        autocast = autocast_factory(spec, self.device)
        tokens = sum(count_target_tokens(mb) for mb in micro)
        total = 0.0
        for mb in micro:
            with autocast():
                s, _ = causal_lm_loss(model, mb)
            loss = s / tokens
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total += float(s.detach())
        params = [p for p in model.parameters() if p.requires_grad]
        norm = clip_gradients(params, opt, scaler, 1.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return {"loss": total / tokens, "grad_norm": float(norm)}

    def loss(self, model: Any, spec: Any, micro: list[dict[str, Any]]) -> float:
        """The token-mean loss of ``micro`` without a step."""
        from finetune.loss import causal_lm_loss, count_target_tokens
        from finetune.train.precision import autocast_factory

        autocast = autocast_factory(spec, self.device)
        tokens = sum(count_target_tokens(mb) for mb in micro)
        with self.torch.no_grad():
            total = 0.0
            for mb in micro:
                with autocast():
                    s, _ = causal_lm_loss(model, mb)
                total += float(s)
        return total / tokens


def full_state(model: Any) -> dict[str, Any]:
    """Every parameter gathered whole (DTensor.full_tensor), copied to the CPU (at world size 1 a full tensor can
    be the live shard itself)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
            for n, p in model.named_parameters()}


def optimizer_moments(opt: Any) -> list[Any]:
    """AdamW's exp_avg of every parameter, gathered whole, in parameter order."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            m = opt.state.get(p, {}).get("exp_avg")
            if m is not None:
                out.append((m.full_tensor() if hasattr(m, "full_tensor") else m).detach().float().cpu().clone())
    return out


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest absolute difference of two name -> tensor maps with the same keys."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k] - b[k]).abs().max()) for k in a) if a else 0.0


def case_full_bf16(h: Harness, check: Check) -> tuple[Any, Any, Any, Any]:
    """FSDP2 full fine-tuning in bf16 against the unsharded run; returns what the checkpoint cases reuse."""
    from torch.distributed.tensor import DTensor

    from finetune.train.parallel import is_sharded

    loaded = h.loaded("full_bf16", "full", "bf16")
    spec = h.spec(loaded)
    batches = h.batches(loaded)
    model = h.sharded(loaded, spec)
    opt = h.optimizer(model, loaded, spec)
    params = list(model.parameters())
    fused = all(g.get("fused") for g in opt.param_groups)
    check.expect("full_bf16: FSDP2 wrapped the model", is_sharded(model))
    check.expect("full_bf16: the parameters are DTensors", all(isinstance(p, DTensor) for p in params))
    check.expect("full_bf16: AdamW runs its fused kernel", fused, [g.get("fused") for g in opt.param_groups])
    sharded = [h.step(model, opt, spec, batches[s]) for s in range(STEPS)]
    single_spec = h.spec(loaded, "single")
    ref = h.whole(loaded, single_spec)
    ref_opt = h.optimizer(ref, loaded, single_spec)
    single = [h.step(ref, ref_opt, single_spec, batches[s]) for s in range(STEPS)]
    rel = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(sharded, single, strict=True))
    check.figure("full_bf16", {"steps": sharded, "unsharded_steps": single, "max_rel_loss_diff": rel,
                               "fused": fused, "param_dtype": str(params[0].dtype)})
    check.expect("full_bf16: finite losses", all(math.isfinite(s["loss"]) for s in sharded))
    check.expect("full_bf16: losses follow the unsharded run within 2%", rel < 0.02, round(rel, 5))
    del ref, ref_opt
    return loaded, spec, model, opt


def case_checkpoints(h: Harness, check: Check, loaded: Any, spec: Any, model: Any, opt: Any) -> None:
    """The tool's Checkpointer, then DCP through the default group, each loaded into a fresh sharded model."""
    import torch.distributed.checkpoint as dcp

    from finetune.recipe import recipe_to_yaml
    from finetune.train import checkpoint as ck
    from finetune.train.state import DataPosition, TrainState

    batches = h.batches(loaded)
    state = TrainState(step=STEPS)

    def states(m: Any, o: Any, st: TrainState) -> dict[str, Any]:
        return {"model": ck.ModelState(m, adapters_only=False), "optimizer": ck.OptimizerState(m, o),
                "scheduler": None, "scaler": None, "rng": ck.RNGState(0, 1), "train": st,
                "data": DataPosition(h.stream, st)}

    files = ck.RunFiles(identity={"method": "full"}, recipe_yaml=recipe_to_yaml(loaded.recipe), plan={}, keep=2,
                        total_steps=STEPS + 1)
    out = h.check.work / "full_bf16"
    path = ck.Checkpointer(out, 0, 1, states(model, opt, state), files).save(STEPS)
    want, want_m = full_state(model), optimizer_moments(opt)
    fresh = h.sharded(loaded, spec)
    fresh_opt = h.optimizer(fresh, loaded, spec)
    h.step(fresh, fresh_opt, spec, batches[0])  # moments exist, and differ from the saved ones
    fresh_state = TrainState()
    ck.Checkpointer(out, 0, 1, states(fresh, fresh_opt, fresh_state), files).load(path)
    got, got_m = full_state(fresh), optimizer_moments(fresh_opt)
    weights = max_diff(want, got)
    moments = max(float((a - b).abs().max()) for a, b in zip(want_m, got_m, strict=True)) if want_m else math.inf
    nxt = h.step(model, opt, spec, batches[STEPS])
    nxt_loaded = h.step(fresh, fresh_opt, spec, batches[STEPS])
    check.figure("checkpointer", {"path": str(path.name), "weights_max_diff": weights, "moments_max_diff": moments,
                                  "next_loss": nxt["loss"], "next_loss_after_load": nxt_loaded["loss"],
                                  "step_restored": fresh_state.step})
    check.expect("checkpointer: weights restored exactly", weights == 0.0, weights)
    check.expect("checkpointer: AdamW moments restored exactly", moments == 0.0, moments)
    check.expect("checkpointer: the next step's loss repeats", nxt["loss"] == nxt_loaded["loss"],
                 [nxt["loss"], nxt_loaded["loss"]])
    # DCP through torch.distributed's default group (nccl on the GPU): the save plan and its metadata cross it.
    where = str(h.check.work / "dcp")
    dcp.save({"model": ck.ModelState(model, False), "optimizer": ck.OptimizerState(model, opt)}, checkpoint_id=where)
    want = full_state(model)
    other = h.sharded(loaded, spec)
    other_opt = h.optimizer(other, loaded, spec)
    dcp.load({"model": ck.ModelState(other, False), "optimizer": ck.OptimizerState(other, other_opt)},
             checkpoint_id=where)
    diff = max_diff(want, full_state(other))
    check.figure("dcp_default_group", {"backend": h.backend, "weights_max_diff": diff,
                                       "files": sorted(p.name for p in Path(where).iterdir())})
    check.expect("dcp_default_group: weights restored exactly", diff == 0.0, diff)


def case_qlora(h: Harness, check: Check) -> None:
    """QLoRA 4-bit under FSDP2: sharded load against the whole-model quantizing load, then two steps."""
    from finetune.train.parallel import parallelize

    loaded = h.loaded("qlora", "qlora", "bf16")
    spec = h.spec(loaded)
    batches = h.batches(loaded)
    model = h.sharded(loaded, spec)
    # bitsandbytes' own Linear4bit layers (peft's LoRA wrappers around them share the class name)
    codes = [m.weight for m in model.modules()
             if type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")]
    whole = parallelize(h.whole(loaded, spec), spec, h.ctx)
    sharded_loss, whole_loss = h.loss(model, spec, batches[0]), h.loss(whole, spec, batches[0])
    del whole
    opt = h.optimizer(model, loaded, spec)
    steps = [h.step(model, opt, spec, batches[s]) for s in range(2)]
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    moved = any(float((p.full_tensor() if hasattr(p, "full_tensor") else p).detach().abs().max()) > 0 for p in lora_b)
    check.figure("qlora", {"linear4bit_layers": len(codes), "codes_dtype": str(codes[0].dtype) if codes else None,
                           "codes_are_dtensors": all(type(c).__name__ == "DTensor" for c in codes),
                           "sharded_load_loss": sharded_loss, "whole_load_loss": whole_loss, "steps": steps})
    check.expect("qlora: the model holds Linear4bit layers", len(codes) > 0, len(codes))
    check.expect("qlora: sharded and whole-model loads give the same loss",
                 abs(sharded_loss - whole_loss) <= 1e-3 * abs(whole_loss), [sharded_loss, whole_loss])
    check.expect("qlora: finite losses, adapters trained", all(math.isfinite(s["loss"]) for s in steps) and moved)


def case_fp16(h: Harness, check: Check) -> None:
    """fp16 under FSDP2 with the tool's GradScaler."""
    from finetune.train.precision import grad_scaler

    loaded = h.loaded("fp16", "full", "fp16")
    spec = h.spec(loaded)
    batches = h.batches(loaded)
    model = h.sharded(loaded, spec)
    opt = h.optimizer(model, loaded, spec)
    scaler = grad_scaler(spec, h.device)
    initial = full_state(model)
    steps = []
    for s in range(STEPS):
        row = h.step(model, opt, spec, batches[s], scaler)
        row["scale"] = float(scaler.get_scale()) if scaler is not None else None
        steps.append(row)
    moved = max_diff(initial, full_state(model))
    check.figure("fp16", {"loss_scaling": bool(spec.loss_scaling), "steps": steps, "weights_moved_max": moved})
    check.expect("fp16: the spec scales the loss", scaler is not None)
    check.expect("fp16: finite losses and scale", all(math.isfinite(s["loss"]) and math.isfinite(s["scale"] or 0.0)
                                                      for s in steps))
    check.expect("fp16: the weights moved", moved > 0, moved)


def run(check: Check) -> None:
    """The section (see the module's docstring); each case is recorded even when a later one fails."""
    h = Harness(check)
    check.figure("backend", h.backend)
    check.figure("device", str(h.device))
    failures = []
    for name, case in (("full_bf16+checkpoints", None), ("qlora", case_qlora), ("fp16", case_fp16)):
        try:
            if case is None:
                loaded, spec, model, opt = case_full_bf16(h, check)
                case_checkpoints(h, check, loaded, spec, model, opt)
                del model, opt
            else:
                case(h, check)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            failures.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300])
            check.expect(f"{name}: ran", False, failures[-1])
        if h.device.type == "cuda":
            h.torch.cuda.empty_cache()
    check.figure("headline", f"{h.backend}: " + ("every case passed" if not failures and all(
        c["ok"] for c in check.data["checks"]) else f"{sum(not c['ok'] for c in check.data['checks'])} check(s) failed"))
