"""Sharded loading: no rank ever holds the whole model (zero2/fsdp; every method, both inits).

The model is built on the meta device (parameters without storage; the small non-persistent buffers such
as rotary tables are real), QLoRA's linears become ``Linear4bit`` with packed 4-bit codes on meta, adapters
are injected, then ``finetune.train.parallel.parallelize.parallelize`` applies activation checkpointing and
``fully_shard`` as for any run. Only then does :func:`materialize` give each rank storage for *its* shards
and fill them:

- pretrained weights through ``torch.distributed.checkpoint`` with its Hugging Face safetensors reader:
  each rank reads only the slices of its shards (``safe_open(...).get_slice(name)[rows]``, memory-mapped),
  one tensor at a time, and ``copy_`` casts each slice into the storage dtype. No broadcast is needed: the
  file is read where it lies, so a rank's anonymous memory is its shards plus one slice.
- QLoRA's 4-bit weights: each rank reads one whole weight at a time, quantizes it exactly as transformers'
  quantizing loader does (finetune.train.model.quantize.quantize_weight), keeps its slice of the codes and the
  whole quantization state (bitsandbytes needs it whole after FSDP gathers the codes).
- ``model.init: random``: the seeded init is replayed one module at a time (finetune.train.model.seeded), giving
  the weights of ``torch.manual_seed(seed); from_config(...)`` bit for bit; each rank keeps its slices.
- Adapters initialised from the loaded model come after the base: DoRA's magnitudes from one gathered base
  weight at a time, peft's prefix encoder and the bottleneck adapters redrawn from the global generator where
  the whole-model load draws them. LoRA's A/B start the same way on every path (``init_adapters``): lora_A
  drawn per tensor from a generator seeded by ``train.seed`` and the tensor's name, lora_B zero.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from finetune.errors import UserError
from finetune.model import flex
from finetune.model.adapters import base_model_of
from finetune.model.kernels import use_experts_kernel
from finetune.model.methods import training_of
from finetune.recipe.schema import LoadedRecipe
from finetune.spec import ExecSpec
from finetune.storage.safetensors_stream import (
    SAFE_SINGLE,
    ShardWriter,
    StoredTensor,
    read_header,
    stored_name,
)
from finetune.train.model.build import (
    add_adapters,
    copy_slice,
    init_adapters,
    resolve_model_path,
    save_pretrained_base,
)
from finetune.train.precision import keep_fp32
from finetune.units import torch_dtype


def loads_sharded(spec: ExecSpec, world_size: int, experts: bool = False) -> bool:
    """Whether this run builds on meta and materialises per-rank shards (zero2/fsdp on several processes).

    Every method does, except LLM.int8 (8-bit) QLoRA and QLoRA with DoRA, which keep transformers' quantizing
    loader (each rank quantizes the whole base, then ``fully_shard`` shards it): peft computes DoRA's
    magnitudes from the dequantized weight when it injects, which a meta 4-bit weight cannot give.
    A 4-bit QLoRA of a mixture of experts (``experts``) loads this way on one process too: transformers'
    loader would hold its 16-bit experts, most of the model, before they are quantized.
    """
    one = spec.strategy.value == "single" or world_size == 1
    if experts and one and spec.quant is not None and spec.quant.bits == 4 and not spec.adapter_dora:
        return True
    if not (spec.strategy.uses_fsdp and world_size > 1):
        return False
    if spec.quant is not None and not (spec.quant.bits == 4 and spec.quant.shardable):
        return False
    # DoRA's magnitudes of a 4-bit base would need the codes dequantized on meta when peft injects them.
    return not (spec.quant is not None and spec.adapter is not None and spec.adapter.use_dora)


def build_on_meta(loaded: LoadedRecipe, spec: ExecSpec, device: torch.device | str) -> torch.nn.Module:
    """The base model (storage dtype, parameters on meta, buffers real) with adapters, ready for parallelize
    and to run on ``device`` (its experts kernel, finetune.model.kernels)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.train.runtime.heap import fix_mmap_threshold

    fix_mmap_threshold()  # before the first large block is freed (finetune/train/runtime/heap.py)
    r = loaded.recipe
    path = resolve_model_path(loaded)
    flex.install_if(spec.attention)
    config = AutoConfig.from_pretrained(
        path, trust_remote_code=r.model.trust_remote_code, local_files_only=True
    )
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config,
            dtype=torch_dtype(spec.base_dtype(False)),
            trust_remote_code=r.model.trust_remote_code,
            attn_implementation=spec.attention,
        )
    # Outside the context, whose register_parameter would give the tied head a fresh meta parameter again.
    model.tie_weights()
    keep_fp32(model, spec)
    use_experts_kernel(model, device, spec.compute_dtype)
    if spec.quant is not None:
        from finetune.train.model.quantize import quantize_on_meta

        quantize_on_meta(model, loaded, spec)
        if spec.quant.bits == 4:
            from finetune.model.experts import fused_experts, quantize_experts, quantized_forward

            quantize_experts(model, spec.quant, on_meta=True)
            for experts in fused_experts(model).values():
                quantized_forward(experts)
    # peft builds the prefix encoder (and LoRA's first A) on CPU, drawing from the global generator; those
    # values are replaced in materialize, and must not move the generator that the base's init and the redrawn
    # adapters continue from.
    with torch.random.fork_rng(devices=[]):
        model = add_adapters(model, loaded, spec, on_meta=True)
    model_config: Any = model.config  # a transformers PretrainedConfig (nn.Module types attributes as tensors)
    model_config.use_cache = False
    return model


def materialize(
    model: torch.nn.Module,
    loaded: LoadedRecipe,
    spec: ExecSpec,
    device: torch.device,
    base_dir: Path | None = None,
) -> None:
    """Give every (sharded) parameter storage on ``device`` and fill this rank's part (every rank calls).

    ``base_dir``: rank 0 of an adapter run from a random init saves the seeded base there.
    """

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    # FSDP2's CPU offload (train.offload) keeps the parameter shards in host memory: it refuses parameters
    # materialized on the GPU; the buffers (rotary frequencies, masks) are computed with on the device.
    offloaded = spec.offload != "none" and device.type != "cpu"
    model.to_empty(device=torch.device("cpu") if offloaded else device)
    with torch.no_grad():
        for module in model.modules():
            for key, b in list(module._buffers.items()):
                if b is not None and offloaded:
                    module._buffers[key] = b.to(device)
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    r = loaded.recipe
    targets = base_targets(model)
    quantized = quantized_targets(model, targets) if spec.quant is not None else {}
    quantized.update(expert_targets(model, targets) if spec.quant is not None else {})
    from finetune.train.model.seeded import release_free_heap

    if r.model.init == "random":
        fill_seeded(targets, quantized, loaded, spec, base_dir)
    else:
        path = Path(resolve_model_path(loaded))
        prefix = getattr(base_model_of(model), "base_model_prefix", "")
        load_pretrained_shards(targets, path, prefix)
        if quantized:
            with torch.no_grad(), _CheckpointTensors(path, prefix) as files:
                for key, (module, conv1d) in quantized.items():
                    _quantize_into(module, files.get(key), spec, conv1d)
                    release_free_heap()
    if spec.quant is not None:
        from finetune.train.model.quantize import disable_cpu_packed_inference

        disable_cpu_packed_inference(model)
    if spec.adapter is not None:
        redraw_injected(model, device)
        init_dora_magnitudes(model)
        if training_of(spec).decomposes:
            init_decomposed(model, spec.adapter.init)
        else:
            init_adapters(model, r.train.seed, gaussian=spec.adapter.init == "gaussian")


def redraw_injected(model: torch.nn.Module, device: torch.device) -> None:
    """Draw peft's prompt encoder (prefix or prompt tuning) and the bottleneck adapters now that the base is
    loaded, exactly as the
    whole-model load draws them when it injects them after loading: a twin of each module is built where
    that load builds it (the prefix encoder on CPU, as peft does, a bottleneck on the run's device) from the
    global generator in the same order, and this rank keeps its slices. Their initial values therefore
    follow the same seed whichever way the base was loaded."""
    from finetune.model.adapters import is_bottleneck_key

    for name, module in model.named_modules():
        if is_bottleneck_key(f"{name}.") and hasattr(module, "down") and hasattr(module, "up"):
            with torch.device(device):
                twin = type(module)(
                    module.down.in_features, module.down.out_features, _activation(module), module.gain is not None
                )
            _copy_module(module, twin.to(torch.float32))
        elif is_bottleneck_key(f"{name}.") and hasattr(module, "gain"):  # the LM head's gain starts at zero
            with torch.no_grad():
                module.gain.detach().zero_()
        encoders = getattr(module, "prompt_encoder", None)
        if isinstance(encoders, torch.nn.ModuleDict) and module is model:
            peft_config: Any = module.peft_config  # the peft model's adapter configs, by adapter name
            for name, encoder in encoders.items():
                # prompt tuning's PromptEmbedding also takes the word embeddings (read by a text init only)
                prompt = str(peft_config[name].peft_type).endswith("PROMPT_TUNING")
                twin = type(encoder)(peft_config[name], *((module.word_embeddings,) if prompt else ()))
                _copy_module(encoder, twin.to(device))


def _activation(module: torch.nn.Module) -> str:
    names = {"ReLU": "relu", "GELU": "gelu", "SiLU": "silu", "Tanh": "tanh"}
    return names[type(module.act).__name__]


def _copy_module(dest: torch.nn.Module, source: torch.nn.Module) -> None:
    """This rank's slices of ``source``'s parameters into ``dest``'s (same names and shapes)."""
    with torch.no_grad():
        got = dict(source.named_parameters())
        for name, p in dest.named_parameters():
            copy_slice(p.detach(), got[name].detach().to(p.dtype))


def init_dora_magnitudes(model: torch.nn.Module) -> None:
    """DoRA's magnitudes, as peft computes them when it injects: the norm of each row of the base weight plus
    the (zero) LoRA update. One base weight at a time is gathered whole (every rank calls), its norms taken
    with peft's own function, and each rank keeps its slice of the magnitude vector."""
    module: Any  # peft LoRA layers (nn.Module's type does not know their attributes)
    for module in model.modules():
        magnitudes = getattr(module, "lora_magnitude_vector", None)
        if not magnitudes:
            continue
        weight = module.get_base_layer().weight
        full = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
        with torch.no_grad():
            for name, dora in magnitudes.items():
                a, b = module.lora_A[name].weight, module.lora_B[name].weight
                # lora_B starts at 0; peft injects the adapters in the base weight's dtype and upcasts them to
                # fp32 after, so the norm is taken (and rounded) in that dtype.
                zero = torch.zeros(b.shape[0], a.shape[1], dtype=full.dtype, device=full.device)
                norm = dora.get_weight_norm(full.detach(), zero, module.scaling[name], adapter_name=name)
                copy_slice(dora.weight.detach(), norm.to(dora.weight.dtype))
        del full


def init_decomposed(model: torch.nn.Module, init: str) -> None:
    """lora.init pissa/olora on a sharded model, one base weight at a time (every rank calls, in the same
    order): the weight is gathered whole, rank 0 alone decomposes it (:func:`finetune.model.adapters.decompose`,
    peft's arithmetic) and broadcasts ``A0`` and ``B0``, every rank subtracts ``scaling * B0 @ A0`` from the
    same gathered weight and keeps its slices of the residual, of ``A0`` and of ``B0``. The whole ``A0`` and
    ``B0`` are kept (``LORA_INIT_ATTR``, on every rank) for the final save's conversion to a plain LoRA of the
    original base. Broadcasting rather than decomposing on every rank: an SVD's signs are only as
    reproducible as the LAPACK build and its threads, and the slices of one weight must come from one
    decomposition."""
    import torch.distributed as dist

    from finetune.model.adapters import LORA_INIT_ATTR, decompose, subtract_initial

    shared = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    initial: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    module: Any  # peft LoRA layers (nn.Module's type does not know their attributes)
    for module in model.modules():
        adapters = getattr(module, "lora_A", None)
        if not isinstance(adapters, torch.nn.ModuleDict) or not hasattr(module, "get_base_layer"):
            continue
        weight = module.get_base_layer().weight
        full = weight.full_tensor() if hasattr(weight, "full_tensor") else weight.detach()
        with torch.no_grad():
            for adapter in adapters:
                a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
                scaling = module.scaling[adapter]
                # peft's olora ignores fan_in_fan_out; so do we, to give the same model
                transposed = init == "pissa" and getattr(module, "fan_in_fan_out", False)
                if not shared or dist.get_rank() == 0:
                    a0, b0 = decompose(full, init, module.r[adapter], scaling, fan_in_fan_out=transposed)
                else:  # only rank 0's decomposition is used: the others skip the SVD/QR
                    a0 = torch.empty(a.shape, dtype=torch.float32, device=full.device)
                    b0 = torch.empty(b.shape, dtype=torch.float32, device=full.device)
                if shared:
                    dist.broadcast(a0, src=0)
                    dist.broadcast(b0, src=0)
                residual = subtract_initial(full, a0, b0, scaling, transposed=transposed)
                # peft injects A and B in the base weight's dtype and upcasts them after (the residual is
                # taken before, from the fp32 ones): round them the same way, as the whole-model load has them
                a0, b0 = a0.to(full.dtype).to(a.dtype), b0.to(full.dtype).to(b.dtype)
                copy_slice(weight.detach(), residual)
                copy_slice(a.detach(), a0)
                copy_slice(b.detach(), b0)
                initial[names[id(a)]] = a0.cpu()
                initial[names[id(b)]] = b0.cpu()
                full = residual  # a second adapter on the same layer decomposes what the first left
        del full
    from finetune.train.parallel.parallelize import unwrap

    setattr(unwrap(model), LORA_INIT_ATTR, initial)


def fill_seeded(
    targets: dict[str, torch.Tensor],
    quantized: dict[str, tuple[torch.nn.Module, bool]],
    loaded: LoadedRecipe,
    spec: ExecSpec,
    base_dir: Path | None,
) -> None:
    """Fill ``targets`` (and quantize ``quantized``) with today's seeded random init, drawn one tensor at a time
    (finetune.train.model.seeded); ``base_dir``: rank 0 of an adapter run also writes the seeded base there, tensor
    by tensor. A model whose init cannot be replayed that way is built whole, as before."""
    from finetune.train.model.seeded import NotReplayable, replay_seeded_init

    r = loaded.recipe
    config, dtype, kwargs = _seeded_args(loaded, spec)
    writer: list = []

    def start_base(meta: torch.nn.Module) -> None:
        if base_dir is None:
            return
        base_dir.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(base_dir)
        if getattr(meta, "generation_config", None) is not None:  # as save_pretrained writes it
            generation_config: Any = meta.generation_config
            generation_config.save_pretrained(base_dir)
        specs = [
            (n, list(p.shape), p.dtype) for n, p in meta.named_parameters() if n in targets or n in quantized
        ]
        writer.append(ShardWriter(base_dir / SAFE_SINGLE, specs))

    def keep(name: str, full: torch.Tensor) -> None:
        if name in quantized:
            module, conv1d = quantized[name]
            _quantize_into(module, full, spec, conv1d)
        elif name in targets:
            copy_slice(targets[name], full)
        else:
            return  # a tied head: tying discards its own draw
        if writer:
            writer[0].write_at(name, full)

    try:
        with torch.no_grad():
            replay_seeded_init(config, dtype, r.train.seed, keep, on_built=start_base, **kwargs)
        if writer:
            writer[0].close_any_order()
        return
    except NotReplayable:
        pass
    seeded = _seeded_model(loaded, spec)
    if base_dir is not None:
        save_pretrained_base(seeded, base_dir)
    source = seeded.state_dict()
    with torch.no_grad():
        for key, dest in targets.items():
            copy_slice(dest, source.pop(key))
        for key, (module, conv1d) in quantized.items():
            _quantize_into(module, source.pop(key), spec, conv1d)


def quantized_targets(
    model: torch.nn.Module, targets: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.nn.Module, bool]]:
    """The 4-bit weights among ``targets`` (taken out of it), each with its ``Linear4bit`` module and whether
    the checkpoint stores it transposed (GPT-2's Conv1D)."""
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D

    out: dict[str, tuple[torch.nn.Module, bool]] = {}
    prefix = _peft_prefix(model)
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            key = _checkpoint_key(f"{name}.weight", prefix)
            targets.pop(key)
            out[key] = (module, issubclass(getattr(module, "source_cls", torch.nn.Linear), Conv1D))
    return out


def expert_targets(
    model: torch.nn.Module, targets: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.nn.Module, bool]]:
    """The NF4 fused expert weights among ``targets`` (taken out of it), each with an :class:`_ExpertWeight`
    naming its experts module and weight (quantized as a whole checkpoint tensor, expert by expert)."""
    from finetune.model.experts import NF4_ATTR, fused_experts

    out: dict[str, tuple[torch.nn.Module, bool]] = {}
    prefix = _peft_prefix(model)
    for name, experts in fused_experts(model).items():
        for w in getattr(experts, NF4_ATTR, {}):
            key = _checkpoint_key(f"{name}.{w}", prefix)
            targets.pop(key)
            out[key] = (_ExpertWeight(experts, w), False)
    return out


class _ExpertWeight(torch.nn.Module):
    """Which experts module and fused weight a checkpoint tensor quantizes into (not part of the model)."""

    def __init__(self, experts: torch.nn.Module, name: str) -> None:
        super().__init__()
        self.__dict__["experts"] = experts  # not a child: this module is only a marker
        self.weight_name = name


def _quantize_into(module: torch.nn.Module, full: torch.Tensor, spec: ExecSpec, conv1d: bool) -> None:
    """Quantize one whole checkpoint weight, keep this rank's slice of its codes and the whole quantization
    state (which every rank needs when FSDP has gathered the codes for a forward)."""
    from finetune.train.model.quantize import quantize_weight

    assert spec.quant is not None
    if isinstance(module, _ExpertWeight):  # a fused expert weight: each expert's slice quantized on its own
        from finetune.model.experts import quantize_expert_slices, set_expert_states

        codes = getattr(module.experts, module.weight_name)
        packed, states = quantize_expert_slices(full.to(codes.device), spec.quant)
        copy_slice(codes.detach(), packed)
        set_expert_states(module.experts, module.weight_name, states)
        return
    linear4bit: Any = module  # bitsandbytes' Linear4bit (nn.Module types attributes as tensors)
    device = linear4bit.weight.device
    # On the run's device, as the quantizing loader does (bitsandbytes' CUDA and CPU kernels may round apart).
    packed, state = quantize_weight(full.to(device), spec.quant, conv1d)
    copy_slice(linear4bit.weight.detach(), packed)
    linear4bit.quant_state = state


class _CheckpointTensors:
    """Whole tensors read one at a time from a safetensors directory (memory-mapped, by their file);
    ``prefix``: the model's ``base_model_prefix``, which older checkpoints leave out."""

    def __init__(self, path: Path, prefix: str) -> None:
        self.path = path
        self.prefix = prefix
        self.handles: dict[str, object] = {}
        self.stored: dict[str, StoredTensor] = {}

    def __enter__(self) -> _CheckpointTensors:
        from safetensors import safe_open

        self.stored = read_header(self.path)
        for name in sorted({t.file for t in self.stored.values()}):
            self.handles[name] = safe_open(str(self.path / name), framework="pt")
        return self

    def __exit__(self, *exc: object) -> None:
        self.handles.clear()

    def get(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (or its name without the prefix in an older checkpoint); a fused expert
        weight that the checkpoint keeps one tensor per expert is assembled from them."""
        found = stored_name(key, self.stored, self.prefix)
        if found is None:
            pieces = expert_pieces(self.path, self.stored, key, self.prefix)
            if pieces:
                return fused_from_pieces(pieces, self._read)
            raise UserError(
                f"model.path: {self.path} has no tensor {key}; is it a checkpoint of this architecture?"
            )
        return self._read(found)

    def _read(self, name: str) -> torch.Tensor:
        return self.handles[self.stored[name].file].get_tensor(name)  # type: ignore[attr-defined]


def expert_pieces(path: Path, stored: dict[str, StoredTensor], key: str, prefix: str) -> dict[str, Any]:
    """The checkpoint's per-expert tensors that transformers fuses into the model's ``key`` (empty when the
    checkpoint does not keep them so), each with its place (finetune.model.experts.ExpertPiece)."""
    import json

    from finetune.model.experts import checkpoint_pieces

    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    pieces = checkpoint_pieces(str(config.get("model_type", "")), stored)
    bare = key[len(prefix) + 1 :] if prefix and key.startswith(prefix + ".") else None
    return {k: p for k, p in pieces.items() if p.fused in (key, bare)}


def fused_from_pieces(pieces: dict[str, Any], read: Any) -> torch.Tensor:
    """A fused expert weight (experts x rows x cols) from its per-expert tensors: each expert's parts (gate,
    then up) concatenated by rows, the experts stacked, one tensor read at a time."""
    experts = max(p.expert for p in pieces.values()) + 1
    order = sorted(pieces, key=lambda k: (pieces[k].expert, pieces[k].part))
    first = read(order[0])
    parts = pieces[order[0]].parts
    out = torch.empty(experts, parts * first.shape[0], first.shape[1], dtype=first.dtype)
    rows = first.shape[0]
    for k in order:
        piece = pieces[k]
        out[piece.expert, piece.part * rows : (piece.part + 1) * rows] = first if k == order[0] else read(k)
    return out


def _seeded_args(loaded: LoadedRecipe, spec: ExecSpec) -> tuple[Any, torch.dtype, dict[str, Any]]:
    """The config, dtype and keywords of today's seeded ``from_config`` (fp32 for QLoRA, which quantizes the
    seeded fp32 weights as finetune.train.model.quantize.load_quantized does)."""
    from transformers import AutoConfig

    r = loaded.recipe
    flex.install_if(spec.attention)
    config = AutoConfig.from_pretrained(
        resolve_model_path(loaded), trust_remote_code=r.model.trust_remote_code, local_files_only=True
    )
    dtype = torch.float32 if spec.quant is not None else torch_dtype(spec.base_dtype(False))
    kwargs = {
        "trust_remote_code": r.model.trust_remote_code,
        "attn_implementation": spec.attention,
    }
    return config, dtype, kwargs


def _seeded_model(loaded: LoadedRecipe, spec: ExecSpec) -> torch.nn.Module:
    """Today's seeded random init, bit for bit, built whole: ``torch.manual_seed(train.seed)`` then
    ``from_config`` (the fallback of :func:`fill_seeded`)."""
    from transformers import AutoModelForCausalLM

    config, dtype, kwargs = _seeded_args(loaded, spec)
    torch.manual_seed(loaded.recipe.train.seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)


def write_seeded_base(loaded: LoadedRecipe, spec: ExecSpec, base_dir: Path) -> None:
    """The whole seeded random base (``model.init: random`` of an adapter run) written to ``base_dir``, for merge
    and reloading: built on this rank alone (a pipeline stage holds only its layers), without moving the run's
    random generators."""
    with torch.random.fork_rng(devices=[]):
        save_pretrained_base(_seeded_model(loaded, spec), base_dir)


def base_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base weights to fill, keyed by their name in a Hugging Face checkpoint (adapters left out).

    A peft model's ``base_model.model.X.base_layer.weight`` is ``X.weight`` in the checkpoint. A parameter
    shared by two names (tied embeddings) is listed once, under its first name.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    prefix = _peft_prefix(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in model.state_dict(keep_vars=True).items():
        if _is_injected(name):
            continue
        key = _checkpoint_key(name, prefix)
        p = params.get(name, t)
        if id(p) in seen:
            continue
        seen.add(id(p))
        out[key] = t.detach()
    return out


def _peft_prefix(model: torch.nn.Module) -> str:
    """What a peft model puts before the base model's names: ``base_model.model.`` around a LoRA tuner,
    ``base_model.`` for prompt learning (prefix tuning), nothing for a plain model."""
    if not hasattr(model, "peft_config"):
        return ""
    peft_model: Any = model  # a peft PeftModel (it has peft_config)
    return "base_model." if peft_model.active_peft_config.is_prompt_learning else "base_model.model."


def _checkpoint_key(name: str, prefix: str) -> str:
    """A peft model's ``base_model.model.X.base_layer.weight`` is ``X.weight`` in the checkpoint."""
    return name.removeprefix(prefix).replace(".base_layer.", ".")


def _is_injected(name: str) -> bool:
    """LoRA/DoRA tensors, the prefix encoder, bottleneck adapters: not in the base checkpoint."""
    from finetune.model.adapters import is_bottleneck_key

    return ".lora_" in name or name.startswith("prompt_encoder.") or is_bottleneck_key(name)


def load_pretrained_shards(targets: dict[str, torch.Tensor], path: Path, prefix: str) -> None:
    """Fill ``targets`` (DTensor shards or whole tensors) from the safetensors files in ``path``; each rank
    reads its own slices (torch.distributed.checkpoint's Hugging Face reader), cast by ``copy_``.
    ``prefix``: the model's ``base_model_prefix``, which older checkpoints leave out."""
    import torch.distributed.checkpoint as dcp

    have = read_header(path)
    wanted: dict[str, torch.Tensor] = {}
    fused: dict[str, torch.Tensor] = {}  # fused expert weights the checkpoint keeps one tensor per expert
    for key, t in targets.items():
        found = stored_name(key, have, prefix)
        if found is None and expert_pieces(path, have, key, prefix):
            fused[key] = t
            continue
        if found is None:
            raise UserError(
                f"model.path: {path} has no tensor {key}; is it a checkpoint of this architecture?"
            )
        wanted[found] = t
    if wanted:
        dcp.load(wanted, storage_reader=dcp.HuggingFaceStorageReader(str(path)))
    if fused:
        with torch.no_grad(), _CheckpointTensors(path, prefix) as files:
            for key, t in fused.items():
                copy_slice(t, files.get(key))
