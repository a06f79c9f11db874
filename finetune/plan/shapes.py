"""Model inventory without weights: exact parameter counts by block, dtype and trainability.

The model is built on the meta device from its config with ONE decoder layer (decoder layers of one model
are identical in shape), adapters are injected by finetune.adapters.inject (peft for LoRA/DoRA and prefix
tuning, whose prompt encoder is sized for every layer and counted outside the blocks; our bottleneck
modules), and the totals are
``outside-the-blocks + num_layers x one-block``: exact, and instant even for 405B parameters.

Storage follows the execution spec (finetune/spec.py), which the trainer builds exactly:
  full   every parameter in the master dtype (fp32; bf16 for bf16-pure), all trainable.
  lora   frozen base in model.dtype (auto: the compute dtype), adapters fp32, adapters trainable.
  qlora  decoder-block linear weights in bitsandbytes NF4/FP4 (4 bits per weight plus quantization
         constants) or LLM.int8 (1 byte per weight plus an fp32 scale per row); every other base parameter in
         quantization.compute_dtype (the trainer does not upcast them as peft's
         prepare_model_for_kbit_training would); adapters fp32.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from finetune.plan.config import concrete
from finetune.spec import DTYPE_BYTES, AdapterSpec, ExecSpec, QuantSpec, adapter_spec

# bitsandbytes 4-bit layout (Params4bit + QuantState with double quantization), per quantized weight of n values
NF4_BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256
NF4_CONST_BYTES = 16 * 4 + 256 * 4 + 4  # NF4 code table, nested code table, nested offset (fp32)

def nf4_bytes(n: int, double_quant: bool = True) -> int:
    """Bytes bitsandbytes stores for one NF4-quantized weight of ``n`` values (packed data + constants)."""
    packed = (n + 1) // 2
    blocks = math.ceil(n / NF4_BLOCKSIZE)
    if not double_quant:
        return packed + blocks * 4 + 16 * 4
    return packed + blocks + math.ceil(blocks / NESTED_BLOCKSIZE) * 4 + NF4_CONST_BYTES


@dataclass(frozen=True)
class Tensor:
    """One parameter: name (in the one-layer model), values, where it lives, what it is."""

    name: str
    numel: int
    in_block: bool  # inside a decoder layer (repeated num_layers times)
    quantizable: bool  # a Linear weight that bitsandbytes would quantize
    adapter: bool  # a trained adapter weight (LoRA/DoRA, prefix encoder, bottleneck)
    rows: int = 1  # output features of a quantizable weight (LLM.int8 keeps one scale per row)
    experts: int = 0  # a fused expert weight (experts x rows x cols): its experts, each quantized on its own (NF4)


@dataclass
class Inventory:
    """Parameters of one model (and its LoRA adapters), built without weights."""

    source: str
    model_type: str
    num_layers: int
    block_class: str
    base: list[Tensor] = field(default_factory=list)
    adapters: list[Tensor] = field(default_factory=list)
    sdpa: bool = True  # transformers builds the architecture with SDPA attention
    flex: bool = True  # ... and with flex attention
    # dpo.reference_model's parameters (None: the reference, if any, is a copy of this model's)
    reference: Inventory | None = field(default=None, compare=False, repr=False)

    def count(self, tensors: list[Tensor], **where: bool) -> int:
        """Total values over the whole model of ``tensors`` matching the flags in ``where``."""
        n = 0
        for t in tensors:
            if all(getattr(t, k) == v for k, v in where.items()):
                n += t.numel * (self.num_layers if t.in_block else 1)
        return n

    @property
    def n_params(self) -> int:
        """Base-model parameters (tied weights counted once)."""
        return self.count(self.base)

    @property
    def n_adapter(self) -> int:
        """LoRA adapter parameters."""
        return self.count(self.adapters)

    def block_numel(self, adapters: bool = False) -> int:
        """Values in one decoder layer (base, or adapters)."""
        return sum(t.numel for t in (self.adapters if adapters else self.base) if t.in_block)

    def largest_base_numel(self, quantizable_only: bool = False) -> int:
        """The largest single base parameter (for transient copies); ``quantizable_only``: of the quantized
        linear weights, which bitsandbytes dequantizes one at a time (the dequantized experts of a fused
        weight are the trace's: finetune.experts dequantizes the routed ones inside the traced forward)."""
        ts = [t.numel for t in self.base if (t.quantizable and not t.experts) or not quantizable_only]
        return max(ts) if ts else 0

    def n_expert_weights(self) -> int:
        """Values in the fused expert weights (all layers)."""
        return sum(t.numel * (self.num_layers if t.in_block else 1) for t in self.base if t.experts)

    def base_bytes(self, spec: ExecSpec, t: Tensor) -> int:
        """Stored bytes of one base parameter under ``spec`` (quantized codes and their constants, or a dtype)."""
        if quantized_under(spec, t):
            return quantized_bytes(t, spec.quant)  # type: ignore[arg-type]  # quantized_under checked it
        return t.numel * DTYPE_BYTES[spec.base_dtype(quantized_under(spec, t))]

    def storage(self, spec: ExecSpec) -> StateBytes:
        """Bytes of parameters, and values trained, as ``spec`` stores them (see module docstring)."""
        base = block = 0
        for t in self.base:
            per = self.base_bytes(spec, t)
            base += per * (self.num_layers if t.in_block else 1)
            block += per if t.in_block else 0
        if not spec.method.adapters:
            return StateBytes(
                param_bytes=base,
                block_param_bytes=block,
                trainable=self.n_params,
                block_trainable=self.block_numel(),
                param_dtype_bytes=spec.trainable_bytes,
                largest_trainable=self.largest_base_numel(),
            )
        per_adapter = spec.trainable_bytes
        return StateBytes(
            param_bytes=base + self.n_adapter * per_adapter,
            block_param_bytes=block + self.block_numel(adapters=True) * per_adapter,
            trainable=self.n_adapter,
            block_trainable=self.block_numel(adapters=True),
            param_dtype_bytes=per_adapter,
            largest_trainable=max((t.numel for t in self.adapters), default=0),
        )

    def bytes_by_dtype(self, spec: ExecSpec) -> dict[str, int]:
        """Stored parameter bytes per dtype name as ``spec`` builds the model (quantized codes without their
        constants, which bitsandbytes keeps outside the parameters): what the trainer checks at run start."""
        out: dict[str, int] = {}
        for t in self.base:
            dtype = spec.base_dtype(quantized_under(spec, t))
            if quantized_under(spec, t) and t.experts:  # each expert's codes packed on their own
                per = DTYPE_BYTES[dtype]
                n = t.experts * ((t.numel // t.experts + 1) // (2 * per)) * per
            elif spec.quant is not None and quantized_under(spec, t):
                n = (t.numel + 1) // 2 if spec.quant.bits == 4 else t.numel
                n = -(-n // DTYPE_BYTES[dtype]) * DTYPE_BYTES[dtype]  # codes packed into a wider dtype
            else:
                n = t.numel * DTYPE_BYTES[dtype]
            out[dtype] = out.get(dtype, 0) + n * (self.num_layers if t.in_block else 1)
        if spec.method.adapters:
            out[spec.trainable_dtype] = out.get(spec.trainable_dtype, 0) + self.n_adapter * spec.trainable_bytes
        return out


def quantized_under(spec: ExecSpec, t: Tensor) -> bool:
    """Whether ``spec`` stores base parameter ``t`` quantized: a linear weight under QLoRA, a fused expert weight
    under 4-bit QLoRA (NF4 per expert; LLM.int8 leaves the experts in the compute dtype)."""
    return spec.quant is not None and t.quantizable and (not t.experts or spec.quant.bits == 4)


def quantized_bytes(t: Tensor, quant: QuantSpec) -> int:
    """Bytes bitsandbytes keeps for one quantized weight: NF4/FP4 codes and constants (a fused expert weight:
    each expert's), or LLM.int8 codes and one fp32 scale per output row."""
    if t.experts:  # each expert's codes, absmax, code table and offset; the nested table is bitsandbytes' one
        shared = 256 * 4 if quant.double_quant else 0
        return t.experts * (nf4_bytes(t.numel // t.experts, quant.double_quant) - shared) + shared
    if quant.bits == 8:
        return t.numel + 4 * t.rows
    return nf4_bytes(t.numel, quant.double_quant)


@dataclass
class StateBytes:
    """What the model states of one method cost, before sharding."""

    param_bytes: int  # all stored parameters (base + adapters)
    block_param_bytes: int  # the same for one decoder layer
    trainable: int  # values with gradients and optimizer state
    block_trainable: int  # the same for one decoder layer
    param_dtype_bytes: int  # bytes per trainable value (its gradient and optimizer states have this dtype)
    largest_trainable: int  # values in the largest trainable tensor


def reduced_config(config: Any, num_layers: int) -> Any:
    """A copy of ``config`` with ``num_layers`` decoder layers (per-layer lists cut to match)."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = num_layers
    for key in ("layer_types", "sliding_window_pattern_list"):
        val = getattr(cfg, key, None)
        if isinstance(val, list) and len(val) >= num_layers:
            setattr(cfg, key, val[:num_layers])
    return cfg


def decoder_layer_names(model: Any) -> list[str]:
    """Qualified names of the decoder layers (the classes in ``_no_split_modules``), in order."""
    classes = set(getattr(model, "_no_split_modules", None) or [])
    names = [n for n, m in model.named_modules() if type(m).__name__ in classes]
    if not names:
        from torch import nn

        for n, m in model.named_modules():
            if isinstance(m, nn.ModuleList) and len(m) > 0:
                return [f"{n}.{i}" for i in range(len(m))]
    return names


def lora_targets(lora: Any, model_type: str) -> list[str] | str:
    """The modules that get LoRA adapters for the recipe's ``lora`` section (see finetune.adapters)."""
    from finetune.adapters import lora_targets as targets

    return targets(lora.target_modules, model_type)


def as_adapter_spec(adapter: Any) -> AdapterSpec | None:
    """An :class:`AdapterSpec`, from one or from a recipe ``lora`` section (LoRA's shape)."""
    if adapter is None or isinstance(adapter, AdapterSpec):
        return adapter
    return adapter_spec("lora", adapter)


def build_inventory(config: Any, source: str, adapter: Any = None) -> Inventory:
    """Count every parameter of ``config``'s model (and of what ``adapter`` trains on it when given: an
    :class:`AdapterSpec`, or a recipe ``lora`` section)."""
    spec = as_adapter_spec(adapter)
    key = (config.to_json_string(use_diff=False), source, spec)
    return _inventory_cached(key, config, source, spec)


_INV_CACHE: dict[Any, Inventory] = {}


#: Bump when what an inventory records changes: invalidates the disk cache.
INVENTORY_VERSION = 3


def _inventory_cached(key: Any, config: Any, source: str, adapter: AdapterSpec | None) -> Inventory:
    """The inventory of ``key``, from memory, else from the disk cache, else built (and cached on disk)."""
    if key in _INV_CACHE:
        return _INV_CACHE[key]
    path = _inventory_path(key)
    inv = _load_inventory(path) if path is not None else None
    if inv is None:
        inv = _build_inventory(config, source, adapter)
        _save_inventory(path, inv)
    _INV_CACHE[key] = inv
    return inv


def _inventory_path(key: Any) -> Any:
    """``$FINETUNE_CACHE/inventories/<digest>.json`` (keyed by the config, the adapter and the library
    versions that build the model), or None when there is no cache directory."""
    from finetune.plan.cache import cache_file

    return cache_file("inventories", key, INVENTORY_VERSION)


def _load_inventory(path: Any) -> Inventory | None:
    from finetune.plan.cache import read_json

    d = read_json(path)
    try:
        base, adapters = d.pop("base"), d.pop("adapters")
        return Inventory(**d, base=[Tensor(**t) for t in base], adapters=[Tensor(**t) for t in adapters])
    except (AttributeError, KeyError, TypeError):
        return None


def _save_inventory(path: Any, inv: Inventory) -> None:
    from dataclasses import asdict

    from finetune.plan.cache import write_json

    write_json(path, asdict(inv))


def _weights(experts: Any) -> tuple[str, ...]:
    from finetune.experts import expert_weight_names

    return expert_weight_names(experts)


def _build_inventory(config: Any, source: str, adapter: AdapterSpec | None) -> Inventory:
    """Count the parameters of ``config``'s model (one decoder layer, on the meta device) and of ``adapter``."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    cfg = reduced_config(config, 1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(concrete(cfg))
    layers = decoder_layer_names(model)
    block_prefix = layers[0] + "." if layers else "\0"
    out_emb = model.get_output_embeddings()
    params = list(model.named_parameters())
    last = params[-1][0].rsplit(".", 1)[0] if params else ""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers: bitsandbytes quantizes them too

    quant_modules = {
        n for n, m in model.named_modules()
        if (type(m) is nn.Linear or isinstance(m, Conv1D)) and m is not out_emb and n != last
    }
    inv = Inventory(source, config.model_type, config.num_hidden_layers, type(model).__name__,
                    sdpa=bool(getattr(model, "_supports_sdpa", True)),
                    flex=bool(getattr(model, "_supports_flex_attn", True)))
    if layers:
        inv.block_class = type(model.get_submodule(layers[0])).__name__
    from finetune.experts import fused_experts

    expert_weights = {f"{n}.{w}": m.num_experts for n, m in fused_experts(model).items() for w in _weights(m)}
    for name, p in params:
        owner = name.rsplit(".", 1)[0]
        quantizable = owner in quant_modules and name.endswith(".weight")
        rows = 1
        if quantizable:  # GPT-2's Conv1D stores [in, out]
            rows = p.shape[1] if isinstance(model.get_submodule(owner), Conv1D) else p.shape[0]
        experts = int(expert_weights.get(name, 0))
        inv.base.append(
            Tensor(name, p.numel(), name.startswith(block_prefix), quantizable or experts > 0, False, rows, experts)
        )
    if adapter is not None:
        from finetune.methods import inject

        # prefix tuning: the prompt encoder sized for every layer of the real model (it lives outside the blocks)
        adapted = inject(model, adapter, num_layers=config.num_hidden_layers, stand_in=True)
        for name, p in adapted.named_parameters():
            if p.requires_grad:
                inv.adapters.append(Tensor(name, p.numel(), block_prefix in name, False, True))
    return inv
