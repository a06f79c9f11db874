"""Sections harness, optimizer8bit, hsdp, qlora8 and pipeline: the tool's sharded path at world size 1,
driven function by function on the process group of the trainer's own initialisation.

One process group of one rank serves every section of a worker process (:func:`shared`): the trainer's
``DistContext.from_env`` is asked for it with torchrun's environment of one process; where that makes no
group at world size 1, the harness makes the one it gives several processes (nccl on a GPU, gloo on a CPU)
and says so. Its backend string and whether it takes a CPU tensor's all-reduce (FSDP2's CPU offload keeps
gradients on the host: clipping all-reduces them) are the first figures. A DistContext that counts as
distributed makes ``finetune.train.parallel.parallelize.parallelize`` shard with FSDP2 as on many GPUs. Each case builds
its model as the trainer's sharded path does (``load.build_on_meta`` -> ``parallelize`` -> ``load.materialize``)
and trains it with the tool's loss, precision helpers, optimizer and clipping:

- harness ``offload``: zero2 with ``train.offload: optimizer`` (FSDP2's CPUOffloadPolicy): two steps, the
  shards on the host, the losses of the unsharded run within 2%;
  ``full_bf16``: FSDP2 full fine-tuning in bf16 with fused AdamW on DTensor parameters against the unsharded
  run (2%); ``checkpointer``: the tool's Checkpointer saves, a fresh sharded model loads: equal weights and
  moments, the same next loss; ``dcp_default_group``: DCP through the default group; ``qlora``: QLoRA's 4-bit
  codes sharded by FSDP2 give the whole-model load's loss, two steps train the adapters; ``fp16``: the
  GradScaler on DTensor gradients;
- optimizer8bit: 8-bit AdamW over the local shards (LocalShardOptimizer): the device bytes a checkpoint's save
  adds over the training state (per trainable parameter; exporting one parameter's state at a time adds one
  parameter's fp32 moments at most), and the state restored exactly;
- hsdp: a (1, 1) ("dp_replicate", "dp_shard") mesh, losses against the unsharded run;
- qlora8: 8-bit QLoRA's saved-for-backward bytes in one forward against the plan's activations (10%);
- pipeline: a 2-stage split run stage after stage in one process (the stages' runner, the last stage's fused
  head): loss and gradients against the whole model.
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from typing import Any

from scripts.gpu_check.jobs import MICRO_LLAMA, MID_LLAMA, model_dir, recipe, small_data, write_recipe
from scripts.gpu_check.report import Check

#: The harness model on the GPU: 4 blocks of width 512 with a 32000-token vocabulary.
GPU_MODEL = {**MID_LLAMA, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}
STEPS = 2
_SHARED: Harness | None = None


def shared(check: Check) -> Harness:
    """The worker process's Harness (its process group, model and data), made by the first section that asks."""
    global _SHARED
    if _SHARED is None:
        _SHARED = Harness(check)
    _SHARED.check = check
    return _SHARED


def release() -> None:
    """Leave the shared process group and free the device's cached memory: the sections after the harness's
    run `finetune` in processes of their own, whose device memory figures must not count this one's."""
    global _SHARED
    if _SHARED is None:
        return
    import gc

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in _SHARED.saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _SHARED = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Harness:
    """The process group, the data and the model builders shared by the cases."""

    def __init__(self, check: Check) -> None:
        import torch
        import torch.distributed as dist

        from finetune.train.parallel.distributed import DistContext

        self.check, self.torch = check, torch
        gpu = not check.dry_run
        if gpu and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible")
        self.work = check.root / "scratch" / "harness-shared"
        self.work.mkdir(parents=True, exist_ok=True)
        # torchrun's environment of a one-process job (restored by release()), then the trainer's own
        # initialisation
        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        self.saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        # as the trainer asks for a run that offloads (the offload case): gloo beside NCCL for CPU tensors
        base = DistContext.from_env(offload=True)
        self.device = base.device
        if dist.is_initialized():
            self.initialised_by = "DistContext.from_env"
        else:
            # what from_env asks for several processes: nccl on a GPU, gloo on a CPU
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, rank=0, world_size=1,
                                    device_id=self.device if self.device.type == "cuda" else None)
            self.initialised_by = (f"the harness ({backend}, as DistContext.from_env does for several processes: "
                                   "it makes no process group at world size 1)")
        self.backend = str(dist.get_backend())
        try:
            probe = torch.ones(1)
            dist.all_reduce(probe)
            self.cpu_collective: str | None = None
        except Exception as exc:  # an NCCL-only group: what FSDP2's CPU offload trips on
            self.cpu_collective = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]

        class OneRank(DistContext):
            """Rank 0 of 1 that shards as a multi-process run does (world size 1 is otherwise 'single')."""

            @property
            def distributed(self) -> bool:
                return True

        self.ctx = OneRank(0, 1, 0, self.device)
        self.model_path = model_dir(self.work / "model", **(GPU_MODEL if gpu else MICRO_LLAMA))
        self.seq, self.batch = (128, 8) if gpu else (64, 2)
        self.data = small_data(self.work / "data", 256 if gpu else 16)
        self._data: Any = None

    def process_group(self) -> dict[str, Any]:
        """What the process group is: who made it, its backend, whether it all-reduces a CPU tensor."""
        return {"initialised_by": self.initialised_by, "backend": self.backend,
                "cpu_all_reduce": "ok" if self.cpu_collective is None else self.cpu_collective}

    def loaded(self, name: str, method: str, precision: str, **sections: Any) -> Any:
        """The LoadedRecipe of one case (fsdp, the harness model, the reverse data); ``sections`` update the
        case's sections (a dict updates one, anything else replaces it)."""
        from finetune.recipe.schema import load_recipe

        parts: dict[str, Any] = {
            "distributed": {"strategy": "fsdp"},
            "data": {"train": self.data["train"], "max_seq_len": self.seq, "eval": None,
                     "cache_dir": str(self.work / "cache")},
            "train": {"max_steps": STEPS + 1, "global_batch_size": self.batch, "micro_batch_size": self.batch,
                      "lr": 1e-3, "seed": 0, "max_grad_norm": 1.0},
            "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
            "quantization": {"bits": 4},
        }
        for key, value in sections.items():
            parts[key] = {**parts[key], **value} if isinstance(value, dict) and key in parts else value
        r = recipe(self.work / name, self.model_path, method=method, precision=precision, **parts)
        return load_recipe(str(write_recipe(self.work / f"{name}.yaml", r)))

    def spec(self, loaded: Any, strategy: str = "fsdp", **options: Any) -> Any:
        """The execution spec of ``loaded`` under ``strategy`` at world size 1 (``options``: execution_spec's,
        e.g. ``offload``, ``optimizer``, ``pp``)."""
        from finetune.spec import execution_spec

        r = loaded.recipe
        kw: dict[str, Any] = {"optimizer": "adamw", "world_size": 1, **options}
        return execution_spec(
            r.method, strategy, r.precision, checkpointing=False, quantization=r.quantization,
            lora=r.lora, prefix=r.prefix, adapter=r.adapter, prompt=r.prompt, **kw,
        )

    def batches(self, loaded: Any) -> list[list[dict[str, Any]]]:
        """The micro-batches of the first steps (the same for every case: same data, seed and batch)."""
        if self._data is None:
            from finetune.train.data import BatchStream, load_data
            from finetune.train.model.build import load_tokenizer

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
        from finetune.train.model.load import build_on_meta, materialize
        from finetune.train.parallel.parallelize import parallelize

        self.torch.manual_seed(0)
        model = parallelize(build_on_meta(loaded, spec, self.device), spec, self.ctx.laid_out(spec))
        materialize(model, loaded, spec, self.device)
        return model

    def whole(self, loaded: Any, spec: Any) -> Any:
        """The whole-model load (what one process builds), not wrapped."""
        from finetune.train.model.build import build_model

        self.torch.manual_seed(0)
        return build_model(loaded, spec, self.device)

    def optimizer(self, model: Any, loaded: Any, spec: Any) -> Any:
        """The tool's optimizer for ``spec`` (AdamW: fused; adamw8bit over the local shards)."""
        from finetune.train.optimizer import build_optimizer

        return build_optimizer(model, loaded.recipe.train, spec.strategy, name=spec.optimizer)

    def step(self, model: Any, opt: Any, spec: Any, micro: list[dict[str, Any]], scaler: Any = None) -> dict[str, float]:
        """One optimizer step as the trainer takes it: the tool's loss, autocast (when the spec asks), the loss
        scaler (fp16), the tool's clipping, the step. Returns the token-mean loss and the gradient norm."""
        from finetune.objectives.loss import causal_lm_loss, count_target_tokens
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
        from finetune.objectives.loss import causal_lm_loss, count_target_tokens
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

    from finetune.train.parallel.parallelize import is_sharded

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

    from finetune.recipe.schema import recipe_to_yaml
    from finetune.train.checkpoint import checkpointer as ck
    from finetune.train.state import DataPosition, TrainState

    batches = h.batches(loaded)
    state = TrainState(step=STEPS)

    def states(m: Any, o: Any, st: TrainState) -> dict[str, Any]:
        return {"model": ck.ModelState(m, adapters_only=False), "optimizer": ck.OptimizerState(m, o),
                "scheduler": None, "scaler": None, "rng": ck.RNGState(0, 1), "train": st,
                "data": DataPosition(h.stream, st)}

    files = ck.RunFiles(identity={"method": "full"}, recipe_yaml=recipe_to_yaml(loaded.recipe), plan={}, keep=2,
                        total_steps=STEPS + 1)
    out = h.work / "full_bf16"
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
    where = str(h.work / "dcp")
    dcp.save({"model": ck.ModelState(model, False), "optimizer": ck.OptimizerState(model, opt)}, checkpoint_id=where)
    want = full_state(model)
    other = h.sharded(loaded, spec)
    other_opt = h.optimizer(other, loaded, spec)
    dcp.load({"model": ck.ModelState(other, False), "optimizer": ck.OptimizerState(other, other_opt)},
             storage_reader=ck.safe_reader(where), planner=ck._SafeLoadPlanner())  # the trainer's safe load
    diff = max_diff(want, full_state(other))
    check.figure("dcp_default_group", {"backend": h.backend, "weights_max_diff": diff,
                                       "files": sorted(p.name for p in Path(where).iterdir())})
    check.expect("dcp_default_group: weights restored exactly", diff == 0.0, diff)


def case_qlora(h: Harness, check: Check) -> None:
    """QLoRA 4-bit under FSDP2: sharded load against the whole-model quantizing load, then two steps."""
    from finetune.train.parallel.parallelize import parallelize

    loaded = h.loaded("qlora", "qlora", "bf16")
    spec = h.spec(loaded)
    batches = h.batches(loaded)
    model = h.sharded(loaded, spec)
    # bitsandbytes' own Linear4bit layers (peft's LoRA wrappers around them share the class name)
    codes = [m.weight for m in model.modules()
             if type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")]
    whole = parallelize(h.whole(loaded, spec), spec, h.ctx.laid_out(spec))
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


def case_offload(h: Harness, check: Check) -> None:
    """zero2 with the optimizer offloaded (FSDP2's CPUOffloadPolicy): the shards and the step on the host."""
    loaded = h.loaded("offload", "full", "bf16", train={"offload": "optimizer"})
    spec = h.spec(loaded, "zero2", offload="optimizer")
    batches = h.batches(loaded)
    model = h.sharded(loaded, spec)
    opt = h.optimizer(model, loaded, spec)
    places = sorted({str(getattr(p, "_local_tensor", p).device) for p in model.parameters()})
    steps = [h.step(model, opt, spec, batches[s]) for s in range(STEPS)]
    single_spec = h.spec(loaded, "single")
    ref = h.whole(loaded, single_spec)
    ref_opt = h.optimizer(ref, loaded, single_spec)
    single = [h.step(ref, ref_opt, single_spec, batches[s]) for s in range(STEPS)]
    rel = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(steps, single, strict=True))
    check.figure("offload", {"steps": steps, "unsharded_steps": single, "max_rel_loss_diff": rel,
                             "shards_on": places, "offload": spec.offload})
    check.expect("offload: the shards live in host memory", places == ["cpu"], places)
    check.expect("offload: finite losses", all(math.isfinite(s["loss"]) for s in steps))
    check.expect("offload: losses follow the unsharded run within 2%", rel < 0.02, round(rel, 5))


def harness(check: Check) -> None:
    """Section harness (see the module's docstring); each case is recorded even when a later one fails."""
    h = shared(check)
    group = check.figure("process_group", h.process_group())
    check.figure("backend", h.backend)
    check.figure("device", str(h.device))
    if group["cpu_all_reduce"] != "ok":
        check.note(f"the default process group takes no CPU tensor ({group['cpu_all_reduce']}): FSDP2's CPU "
                   "offload all-reduces its host gradients through it")
    failures = []
    for name, case in (("offload", case_offload), ("full_bf16+checkpoints", None), ("qlora", case_qlora),
                       ("fp16", case_fp16)):
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
    bad = sum(not c["ok"] for c in check.data["checks"])
    check.figure("headline", f"{h.backend} ({'from_env' if h.initialised_by == 'DistContext.from_env' else 'harness'}"
                             f"-made): " + ("offload, bf16, checkpoints, QLoRA, fp16 pass" if not bad
                                            else f"{bad} check(s) failed"))


def _state_tensors(state: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor of an optimizer's state_dict()['state'], by a path name (DTensors gathered whole)."""
    import torch

    out: dict[str, Any] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(_state_tensors(v, f"{prefix}{k}/"))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(_state_tensors(v, f"{prefix}{i}/"))
    elif isinstance(state, torch.Tensor):
        whole = state.full_tensor() if hasattr(state, "full_tensor") else state
        out[prefix.rstrip("/")] = whole.detach().float().cpu().clone()
    return out


def optimizer8bit(check: Check) -> None:
    """Section optimizer8bit (see the module's docstring)."""
    import torch

    from finetune.recipe.schema import recipe_to_yaml
    from finetune.train.checkpoint import checkpointer as ck
    from finetune.train.state import DataPosition, TrainState

    h = shared(check)
    check.figure("process_group", h.process_group())
    loaded = h.loaded("opt8", "full", "bf16", train={"optimizer": "adamw8bit"})
    spec = h.spec(loaded, "fsdp", optimizer="adamw8bit")
    batches = h.batches(loaded)
    model = h.sharded(loaded, spec)
    opt = h.optimizer(model, loaded, spec)
    check.expect("the 8-bit optimizer runs over the local shards", type(opt).__name__ == "LocalShardOptimizer",
                 type(opt).__name__)
    steps = [h.step(model, opt, spec, batches[s]) for s in range(STEPS)]
    check.expect("finite losses", all(math.isfinite(s["loss"]) for s in steps), steps)
    trainable = [getattr(p, "_local_tensor", p) for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in trainable)
    largest = max(p.numel() for p in trainable)
    state = TrainState(step=STEPS)

    def states(m: Any, o: Any, st: TrainState) -> dict[str, Any]:
        return {"model": ck.ModelState(m, adapters_only=False), "optimizer": ck.OptimizerState(m, o),
                "scheduler": None, "scaler": None, "rng": ck.RNGState(0, 1), "train": st,
                "data": DataPosition(h.stream, st)}

    files = ck.RunFiles(identity={"method": "full"}, recipe_yaml=recipe_to_yaml(loaded.recipe), plan={}, keep=2,
                        total_steps=STEPS + 1)
    out = h.work / "opt8"
    want = _state_tensors(opt.state_dict()["state"])
    cuda = h.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    path = ck.Checkpointer(out, 0, 1, states(model, opt, state), files).save(STEPS)
    save = {"trainable_parameters": numel, "largest_parameter": largest, "path": path.name}
    if cuda:
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        # one parameter's two moments in fp32 at a time (exported to the host per parameter), and DCP's own
        # staging (bounded by the largest tensor it writes)
        bound = 8 * largest + 4 * largest + 2**20
        save.update({"extra_device_bytes": extra, "extra_bytes_per_parameter": round(extra / numel, 3),
                     "bound_bytes": bound})
        check.figure("save", save)
        check.expect("the save adds at most one parameter's fp32 state on the device", extra <= bound,
                     {"extra": extra, "bound": bound})
    else:
        check.figure("save", save)
        check.note("the save's device memory is measured on a GPU only")
    fresh = h.sharded(loaded, spec)
    fresh_opt = h.optimizer(fresh, loaded, spec)
    h.step(fresh, fresh_opt, spec, batches[0])  # a state exists, and differs from the saved one
    ck.Checkpointer(out, 0, 1, states(fresh, fresh_opt, TrainState()), files).load(path)
    got = _state_tensors(fresh_opt.state_dict()["state"])
    diff = max((float((want[k] - got[k]).abs().max()) for k in want), default=math.inf) if want.keys() == got.keys() \
        else math.inf
    nxt, nxt_loaded = h.step(model, opt, spec, batches[STEPS]), h.step(fresh, fresh_opt, spec, batches[STEPS])
    check.figure("load", {"state_tensors": len(want), "state_max_diff": diff if math.isfinite(diff) else None,
                          "next_loss": nxt["loss"], "next_loss_after_load": nxt_loaded["loss"]})
    check.expect("the 8-bit state is restored exactly", diff == 0.0, diff if math.isfinite(diff) else None)
    check.expect("the next step's loss repeats", nxt["loss"] == nxt_loaded["loss"], [nxt["loss"], nxt_loaded["loss"]])
    per = f"{save['extra_bytes_per_parameter']} B/param on the device, " if cuda else ""
    check.figure("headline", f"save: {per}state restored exactly: {diff == 0.0}")


def hsdp(check: Check) -> None:
    """Section hsdp (see the module's docstring)."""
    h = shared(check)
    loaded = h.loaded("hsdp", "full", "bf16", distributed={"strategy": "hsdp"})
    spec = h.spec(loaded, "hsdp", nodes=1)
    batches = h.batches(loaded)
    model = h.sharded(loaded, spec)
    opt = h.optimizer(model, loaded, spec)
    first = next(model.parameters())
    mesh = getattr(first, "device_mesh", None)
    layout = {"mesh_shape": list(mesh.shape) if mesh is not None else None,
              "mesh_dims": list(mesh.mesh_dim_names or ()) if mesh is not None else None,
              "placements": [str(p) for p in getattr(first, "placements", ())]}
    check.figure("layout", layout)
    check.expect("a (1, 1) (dp_replicate, dp_shard) mesh", layout["mesh_shape"] == [1, 1]
                 and layout["mesh_dims"] == ["dp_replicate", "dp_shard"], layout)
    steps = [h.step(model, opt, spec, batches[s]) for s in range(STEPS)]
    single_spec = h.spec(loaded, "single")
    ref = h.whole(loaded, single_spec)
    ref_opt = h.optimizer(ref, loaded, single_spec)
    single = [h.step(ref, ref_opt, single_spec, batches[s]) for s in range(STEPS)]
    rel = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(steps, single, strict=True))
    check.figure("steps", {"hsdp": steps, "unsharded": single, "max_rel_loss_diff": rel})
    check.expect("losses follow the unsharded run within 2%", rel < 0.02, round(rel, 5))
    check.figure("headline", f"mesh {layout['mesh_shape']}: losses within {rel:.1e} of the unsharded run")


def qlora8(check: Check) -> None:
    """Section qlora8 (see the module's docstring): the bytes one decoder layer saves for backward in a real
    forward (tensors first saved inside it, its input included, weights excluded) against the planner's traced
    retained activations of one layer (``layer_acts``: a 3-layer trace less a 2-layer one) for the same rows."""
    import torch
    from transformers import AutoConfig

    from finetune.objectives.loss import causal_lm_loss
    from finetune.plan.activations import TRACE_LAYERS, TraceSpec, activation_profile
    from finetune.train.parallel.parallelize import decoder_blocks
    from finetune.train.precision import autocast_factory

    h = shared(check)
    rows = h.batch
    loaded = h.loaded("qlora8", "qlora", "bf16", quantization={"bits": 8}, distributed={"strategy": "single"})
    spec = h.spec(loaded, "single")
    gen = torch.Generator().manual_seed(0)  # full rows of data.max_seq_len, as the plan counts them
    ids = torch.randint(3, 200, (rows, h.seq), generator=gen).to(h.device)
    model = h.whole(loaded, spec)
    autocast = autocast_factory(spec, h.device)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    blocks = decoder_blocks(model)
    where: dict[str, Any] = {"layer": None}
    per_layer: dict[int, dict[int, int]] = {i: {} for i in range(len(blocks))}
    seen: set[int] = set()
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda _m, _a, i=i: where.update(layer=i))
        block.register_forward_hook(lambda _m, _a, _o: where.update(layer=None))

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights and ptr not in seen and where["layer"] is not None:
            seen.add(ptr)
            per_layer[where["layer"]][ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        s, _ = causal_lm_loss(model, {"input_ids": ids, "labels": ids.clone()})
    s.backward()
    measured = sum(per_layer[len(blocks) - 1].values())  # the last layer: its input is a layer's output
    layers = sum(1 for m in model.modules() if type(m).__name__ == "Linear8bitLt")
    trace = TraceSpec.of(spec, seq_len=h.seq, packed=False, attn_implementation="sdpa", device=h.device.type)
    profile = activation_profile(AutoConfig.from_pretrained(h.model_path), trace)
    planned = profile.at(TRACE_LAYERS + 1, rows)["first"].acts - profile.at(TRACE_LAYERS, rows)["first"].acts
    err = planned / measured - 1 if measured else math.inf
    check.figure("layer", {"linear8bit_layers": layers, "rows": rows, "tokens_per_row": h.seq,
                           "saved_bytes_per_layer": measured, "planned_layer_acts": planned,
                           "saved_bytes_each_layer": [sum(v.values()) for v in per_layer.values()]})
    check.figure("plan_error", round(err, 4) if math.isfinite(err) else None)
    check.expect("the model holds bitsandbytes' 8-bit layers", layers > 0, layers)
    check.expect("the loss is finite and trains the adapters", math.isfinite(float(s.detach()))
                 and any(p.grad is not None for n, p in model.named_parameters() if "lora_" in n))
    check.expect("the plan's retained activations of a layer within 10% of what it saves for backward",
                 abs(err) <= 0.10, round(err, 4) if math.isfinite(err) else None)
    check.figure("headline", f"a layer saves {measured / 2**10:.0f} KiB for backward, the plan counts "
                             f"{planned / 2**10:.0f} KiB ({err:+.1%}) at {rows} x {h.seq} tokens")


def pipeline(check: Check) -> None:
    """Section pipeline (see the module's docstring)."""
    import torch

    from finetune.objectives.loss import IGNORE_INDEX, causal_lm_loss, shifted_labels
    from finetune.train.model.load import build_on_meta, materialize
    from finetune.train.parallel.pipeline import StageRunner, check_stageable, prune_to_stages, stage_layers
    from finetune.train.precision import autocast_factory

    h = shared(check)
    loaded = h.loaded("pipeline", "full", "bf16" if h.device.type == "cuda" else "fp32",
                      distributed={"strategy": "ddp"})
    layers = int((GPU_MODEL if h.device.type == "cuda" else MICRO_LLAMA)["num_hidden_layers"])
    split = (layers // 2, layers - layers // 2)
    spec = h.spec(loaded, "ddp", world_size=2, pp=2, pp_layers=split)
    autocast = autocast_factory(spec, h.device)
    micro = h.batches(loaded)[0]
    pad = 0
    ids = torch.cat([torch.nn.functional.pad(mb["input_ids"], (0, h.seq - mb["input_ids"].shape[1]), value=pad)
                     for mb in micro])
    labels = torch.cat([torch.nn.functional.pad(shifted_labels(mb), (0, h.seq - mb["labels"].shape[1]),
                                                value=IGNORE_INDEX) for mb in micro])
    stages = []
    for s, rng in enumerate(stage_layers(spec)):
        torch.manual_seed(0)
        model = build_on_meta(loaded, spec, h.device)
        check_stageable(model)
        prune_to_stages(model, list(rng), first=s == 0, last=s == len(split) - 1)
        materialize(model, loaded, spec, h.device)
        stages.append((model, StageRunner(model, spec, [s], autocast)))
    hidden = stages[0][1].run(0, ids)
    loss = stages[1][1].run(1, hidden, labels)
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for m, _ in stages for n, p in m.named_parameters()
             if p.grad is not None}
    whole = h.whole(loaded, h.spec(loaded, "single"))
    with autocast():
        ref, _ = causal_lm_loss(whole, {"input_ids": ids, "labels": torch.cat(
            [torch.nn.functional.pad(mb["labels"], (0, h.seq - mb["labels"].shape[1]), value=IGNORE_INDEX)
             for mb in micro])})
    ref.backward()
    want = {n: p.grad.detach().float().cpu() for n, p in whole.named_parameters() if p.grad is not None}
    common = sorted(set(grads) & set(want))
    rel_loss = abs(float(loss) - float(ref)) / abs(float(ref))
    rel_grad = max((float((grads[n] - want[n]).norm() / want[n].norm().clamp(min=1e-12)) for n in common),
                   default=math.inf)
    tol = (2e-2, 5e-2) if h.device.type == "cuda" else (1e-5, 1e-4)
    check.figure("stages", {"split": list(split), "parameters_per_stage": [sum(1 for _ in m.parameters())
                                                                          for m, _ in stages],
                            "loss": float(loss), "whole_loss": float(ref), "loss_rel_diff": rel_loss,
                            "grads_compared": len(common), "whole_grads": len(want),
                            "grad_max_rel_diff": rel_grad if math.isfinite(rel_grad) else None})
    check.expect("every parameter of the whole model is in one stage, with a gradient", len(common) == len(want),
                 [len(common), len(want)])
    check.expect(f"the stages' loss is the whole model's within {tol[0]:g}", rel_loss <= tol[0], rel_loss)
    check.expect(f"the stages' gradients are the whole model's within {tol[1]:g}", rel_grad <= tol[1], rel_grad)
    check.figure("headline", f"{len(split)} stages {list(split)}: loss {rel_loss:.1e}, gradients {rel_grad:.1e} "
                             "from the whole model's")
