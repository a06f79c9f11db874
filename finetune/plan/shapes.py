"""Model inventory without weights: exact parameter counts by block, dtype and trainability.

The model is built on the meta device from its config with ONE decoder layer when its decoder layers are
identical in shape, adapters are injected by finetune.model.adapters.inject (peft for LoRA/DoRA and prefix
tuning, whose prompt encoder is sized for every layer and counted outside the blocks; our bottleneck
modules), and the totals are
``outside-the-blocks + num_layers x one-block``: exact, and instant even for 405B parameters. A model whose
layers differ (DeepSeek-V3's first three layers are dense, the other 58 mixtures of experts) is built with one
layer of each kind (the first ``k`` layers, up to the first of the last kind), each kind's tensors counted as
many times as the model has layers of that kind (:func:`layer_kinds`).

A mixture of experts (transformers 5 stores its experts fused: ``mlp.experts.gate_up_proj`` is experts x 2*ffn x
hidden) is known as one: which tensors are expert weights and which the router, the experts per layer, how
many a token is routed to, the shared experts (:class:`MoE`).

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
from finetune.plan.types import ModelFacts
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
    # layers of different kinds (layer_kinds): the decoder layers this tensor's kind has (0: all of them), and
    # which layer of the built model holds it
    layers: int = 0
    layer: int = 0
    role: str = ""  # a mixture of experts' tensor: experts (fused routed experts), shared (shared experts), router
    dim0: int = 0  # its first dimension, which FSDP2 shards (0: not recorded)


@dataclass(frozen=True)
class MoE:
    """What a mixture of experts is made of (per layer that has experts)."""

    experts: int  # routed experts
    top_k: int  # experts each token is routed to
    shared_experts: int  # experts every token goes through (DeepSeek-V3: 1; 0 for most)
    layers: int  # decoder layers with experts (the others are dense)
    expert_params: int  # values of one routed expert (its slice of every fused weight), one layer
    aux_loss_coef: float | None  # the load-balancing loss's coefficient in the config (None: the model has none)
    hidden: int = 0  # the experts' input width
    ffn: int = 0  # one expert's intermediate width

    def routed_bytes_per_token(self, value_bytes: int) -> int:
        """Activations the routed experts keep for the backward per token, over every layer with experts, in
        transformers' grouped_mm path with weights of ``value_bytes``: per routed slot the gathered input and the
        weighted output (2 x hidden), the gate and up projections, the activation and their product (4 x ffn),
        and 40 bytes of sort and scatter indices (measured against the trace: tests/unit/test_moe.py)."""
        return self.layers * self.top_k * ((2 * self.hidden + 4 * self.ffn) * value_bytes + 40)

    @property
    def active_fraction(self) -> float:
        """The fraction of a layer's routed experts each token computes with."""
        return self.top_k / max(1, self.experts)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the plan's ``model.moe``)."""
        from dataclasses import asdict

        return asdict(self)


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
    # the architecture's tensors kept in fp32 (transformers' _keep_in_fp32_modules_strict: in any 16-bit
    # base; _keep_in_fp32_modules: in an fp16 one), as name patterns
    fp32_strict: tuple[str, ...] = ()
    fp32_fp16: tuple[str, ...] = ()
    moe: MoE | None = None  # a mixture of experts (None: dense)
    unit_layer: int = 0  # layers of different kinds: the built layer with the most parameters (one FSDP unit)
    kinds: tuple[tuple[int, int], ...] = ()  # layers of different kinds: (first layer, layers) of each (layer_kinds)

    @property
    def trace_depth(self) -> int:
        """Decoder layers the activation trace runs (finetune.plan.activations): two, or for layers of different
        kinds up to two layers of the last kind (the one the rest of the model repeats), at most every layer."""
        if len(self.kinds) <= 1:
            return 2
        return min(self.num_layers, max(2, self.kinds[-1][0] + 2))
    # dpo.reference_model's parameters (None: the reference, if any, is a copy of this model's)
    reference: Inventory | None = field(default=None, compare=False, repr=False)

    def copies(self, t: Tensor) -> int:
        """How many times the model holds ``t``: once outside the decoder layers, else once per layer of its
        kind."""
        if not t.in_block:
            return 1
        return t.layers or self.num_layers

    def in_unit(self, t: Tensor) -> bool:
        """Whether ``t`` belongs to one decoder layer as an FSDP unit sizes it (the largest kind of layer)."""
        return t.in_block and (not t.layers or t.layer == self.unit_layer)

    @property
    def keep_fp32(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The (strict, fp16-only) patterns of tensors the architecture keeps in fp32 (the execution spec's)."""
        return self.fp32_strict, self.fp32_fp16

    def count(self, tensors: list[Tensor], **where: Any) -> int:
        """Total values over the whole model of ``tensors`` matching the fields in ``where``."""
        n = 0
        for t in tensors:
            if all(getattr(t, k) == v for k, v in where.items()):
                n += t.numel * self.copies(t)
        return n

    @property
    def expert_params(self) -> int:
        """Values of the routed experts' weights over the whole model (0 for a dense model)."""
        return self.count(self.base, role="experts")

    @property
    def active_params(self) -> int:
        """Base values one token computes with: every weight but the routed experts it is not sent to."""
        if self.moe is None:
            return self.n_params
        return self.n_params - round(self.expert_params * (1 - self.moe.active_fraction))

    @property
    def n_params(self) -> int:
        """Base-model parameters (tied weights counted once)."""
        return self.count(self.base)

    @property
    def n_adapter(self) -> int:
        """LoRA adapter parameters."""
        return self.count(self.adapters)

    def block_numel(self, adapters: bool = False) -> int:
        """Values in one decoder layer (base, or adapters; the largest kind of layer)."""
        return sum(t.numel for t in (self.adapters if adapters else self.base) if self.in_unit(t))

    def largest_base_numel(self, quantizable_only: bool = False) -> int:
        """The largest single base parameter (for transient copies); ``quantizable_only``: of the quantized
        linear weights, which bitsandbytes dequantizes one at a time (the dequantized experts of a fused
        weight are the trace's: finetune.model.experts dequantizes the routed ones inside the traced forward)."""
        ts = [t.numel for t in self.base if (t.quantizable and not t.experts) or not quantizable_only]
        return max(ts) if ts else 0

    def n_expert_weights(self) -> int:
        """Values in the fused expert weights (all layers)."""
        return sum(t.numel * self.copies(t) for t in self.base if t.experts)

    def base_bytes(self, spec: ExecSpec, t: Tensor) -> int:
        """Stored bytes of one base parameter under ``spec`` (quantized codes and their constants, or a dtype)."""
        if quantized_under(spec, t):
            return quantized_bytes(t, spec.quant)  # type: ignore[arg-type]  # quantized_under checked it
        return t.numel * DTYPE_BYTES[spec.tensor_dtype(t.name, False)]

    def storage(self, spec: ExecSpec) -> StateBytes:
        """Bytes of parameters, and values trained, as ``spec`` stores them (see module docstring)."""
        base = block = 0
        for t in self.base:
            per = self.base_bytes(spec, t)
            base += per * self.copies(t)
            block += per if self.in_unit(t) else 0
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
            dtype = spec.tensor_dtype(t.name, quantized_under(spec, t))
            if quantized_under(spec, t) and t.experts:  # each expert's codes packed on their own
                per = DTYPE_BYTES[dtype]
                n = t.experts * ((t.numel // t.experts + 1) // (2 * per)) * per
            elif spec.quant is not None and quantized_under(spec, t):
                n = (t.numel + 1) // 2 if spec.quant.bits == 4 else t.numel
                n = -(-n // DTYPE_BYTES[dtype]) * DTYPE_BYTES[dtype]  # codes packed into a wider dtype
            else:
                n = t.numel * DTYPE_BYTES[dtype]
            out[dtype] = out.get(dtype, 0) + n * self.copies(t)
        if spec.method.adapters:
            out[spec.trainable_dtype] = out.get(spec.trainable_dtype, 0) + self.n_adapter * spec.trainable_bytes
        return out


def quantized_under(spec: ExecSpec, t: Tensor) -> bool:
    """Whether ``spec`` stores base parameter ``t`` quantized: a linear weight under QLoRA, a fused expert weight
    under 4-bit QLoRA (NF4 per expert; LLM.int8 leaves the experts in the compute dtype)."""
    return spec.quant is not None and t.quantizable and (not t.experts or spec.quant.bits == 4)


def moe_summary(inv: Inventory, spec: ExecSpec) -> ModelFacts:
    """What the plan's ``model`` says of a mixture of experts: its :class:`MoE`, the expert weights' count and
    share of the weights, the weights a token computes with, the activations its routed experts keep per token
    (computed in their weights' dtype: transformers' grouped matmul is not autocast's) and the load-balancing
    loss's coefficient."""
    assert inv.moe is not None, "a mixture of experts"
    expert = next((t for t in inv.base if t.role == "experts"), None)
    dtype = spec.fsdp_param_dtype or (spec.tensor_dtype(expert.name, False) if expert else spec.compute_dtype)
    return {
        "moe": inv.moe.to_dict(), "expert_parameters": inv.expert_params, "active_parameters": inv.active_params,
        "expert_fraction": inv.expert_params / max(1, inv.n_params), "aux_loss_coef": spec.aux_loss_coef,
        "routed_activation_bytes_per_token": inv.moe.routed_bytes_per_token(DTYPE_BYTES[dtype]),
    }


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
    """The modules that get LoRA adapters for the recipe's ``lora`` section (see finetune.model.adapters)."""
    from finetune.recipe.schema import lora_targets as targets

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
INVENTORY_VERSION = 7


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
        moe = d.pop("moe", None)
        for key in ("fp32_strict", "fp32_fp16"):
            d[key] = tuple(d.get(key, ()))
        d["kinds"] = tuple(tuple(k) for k in d.get("kinds", ()))
        return Inventory(**d, base=[Tensor(**t) for t in base], adapters=[Tensor(**t) for t in adapters],
                         moe=MoE(**moe) if moe else None)
    except (AttributeError, KeyError, TypeError):
        return None


def _save_inventory(path: Any, inv: Inventory) -> None:
    from dataclasses import asdict

    from finetune.plan.cache import write_json

    write_json(path, asdict(inv))


def _weights(experts: Any) -> tuple[str, ...]:
    from finetune.model.experts import expert_weight_names

    return expert_weight_names(experts)


def _build_inventory(config: Any, source: str, adapter: AdapterSpec | None) -> Inventory:
    """Count the parameters of ``config``'s model (one decoder layer of each kind, on the meta device) and of
    ``adapter``."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(concrete(reduced_config(config, 1)))
    kinds = layer_kinds(config, model)
    if len(kinds) > 1:  # built again with the first layer of every kind
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(concrete(reduced_config(config, kinds[-1][0] + 1)))
    from finetune.model import llama4

    llama4.adopt(model)  # Llama 4's experts behind the experts interface, as every run builds them
    layers = decoder_layer_names(model)
    counted = {layers[i]: (i, n if len(kinds) > 1 else 0) for i, n in kinds} if layers else {}
    out_emb = model.get_output_embeddings()
    params = list(model.named_parameters())
    last = params[-1][0].rsplit(".", 1)[0] if params else ""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers: bitsandbytes quantizes them too

    quant_modules = {
        n for n, m in model.named_modules()
        if (type(m) is nn.Linear or isinstance(m, Conv1D)) and m is not out_emb and n != last
    }
    roles = moe_roles(model)
    inv = Inventory(source, config.model_type, config.num_hidden_layers, type(model).__name__,
                    sdpa=bool(getattr(model, "_supports_sdpa", True)),
                    flex=bool(getattr(model, "_supports_flex_attn", True)),
                    fp32_strict=tuple(sorted(getattr(model, "_keep_in_fp32_modules_strict", None) or ())),
                    fp32_fp16=tuple(sorted(getattr(model, "_keep_in_fp32_modules", None) or ())))
    if layers:
        inv.block_class = type(model.get_submodule(layers[-1])).__name__
    from finetune.model.experts import fused_experts

    expert_weights = {f"{n}.{w}": m.num_experts for n, m in fused_experts(model).items() for w in _weights(m)}
    for name, p in params:
        layer, where = _layer_of(name, layers, counted)
        if where is None:
            continue  # a repeat of a kind already counted
        owner = name.rsplit(".", 1)[0]
        quantizable = owner in quant_modules and name.endswith(".weight")
        rows = 1
        if quantizable:  # GPT-2's Conv1D stores [in, out]
            rows = p.shape[1] if isinstance(model.get_submodule(owner), Conv1D) else p.shape[0]
        experts = int(expert_weights.get(name, 0))
        role = next((r for prefix, r in roles.items() if name.startswith(prefix + ".")), "")
        inv.base.append(Tensor(name, p.numel(), layer is not None, quantizable or experts > 0, False, rows, experts,
                               layers=where[1], layer=where[0], role=role, dim0=_dim0(p)))
    inv.moe = moe_facts(config, model, inv, kinds)
    inv.kinds = tuple(kinds) if len(kinds) > 1 else ()
    if len(kinds) > 1:
        inv.unit_layer = max(
            (i for i, _ in kinds),
            key=lambda i: sum(t.numel for t in inv.base if t.in_block and t.layer == i),
        )
    if adapter is not None:
        from finetune.model.methods import inject

        # prefix tuning: the prompt encoder sized for every layer of the real model (it lives outside the blocks)
        adapted = inject(model, adapter, num_layers=config.num_hidden_layers, stand_in=True)
        for name, p in adapted.named_parameters():
            if p.requires_grad:
                layer, where = _layer_of(name, layers, counted, anywhere=True)
                if where is not None:
                    inv.adapters.append(Tensor(name, p.numel(), layer is not None, False, True,
                                               layers=where[1], layer=where[0], dim0=_dim0(p)))
    return inv


def _layer_of(
    name: str, layers: list[str], counted: dict[str, tuple[int, int]], anywhere: bool = False
) -> tuple[str | None, tuple[int, int] | None]:
    """The decoder layer (qualified name) ``name`` lives in (None: outside the layers) and, when it is counted,
    (its built layer's index, the layers of its kind: 0 for all); (layer, None) for a layer of a kind already
    counted. ``anywhere``: the layer's name may follow a prefix (peft's ``base_model.model.``)."""
    for layer in layers:
        if name.startswith(layer + ".") or (anywhere and f"{layer}." in name):
            return layer, counted.get(layer)
    return None, (0, 0)


def layer_kinds(config: Any, model: Any) -> list[tuple[int, int]]:
    """The kinds of decoder layer ``config``'s model has, as (the first layer of the kind, how many layers are
    of it), in order of first appearance; [(0, num_layers)] when every layer has the same parameters.

    Each layer is built alone on the meta device, with its index (what decides its kind in transformers:
    DeepSeek-V3's ``first_k_dense_replace``, Qwen-MoE's ``decoder_sparse_step`` and ``mlp_only_layers``); a
    layer class that cannot be built that way counts as one kind."""
    import torch

    layers = decoder_layer_names(model)
    n = int(config.num_hidden_layers)
    if not layers or n <= 1:
        return [(0, n)]
    cls = type(model.get_submodule(layers[0]))
    full = concrete(config)
    seen: dict[tuple[Any, ...], list[int]] = {}
    try:
        with torch.device("meta"):
            for i in range(n):
                layer = cls(full, i)
                signature = tuple((k, tuple(v.shape)) for k, v in layer.named_parameters())
                seen.setdefault(signature, [0, 0])
                if seen[signature][1] == 0:
                    seen[signature][0] = i
                seen[signature][1] += 1
    except Exception:  # a custom layer signature: counted as identical layers
        return [(0, n)]
    return sorted((first, count) for first, count in seen.values())


def moe_roles(model: Any) -> dict[str, str]:
    """The mixture-of-experts modules of ``model`` by qualified name: ``experts`` (the fused routed experts of
    transformers' experts interface), ``shared`` (shared experts) and ``router`` (what scores the experts)."""
    roles: dict[str, str] = {}
    for name, m in model.named_modules():
        if hasattr(m, "has_gate") and hasattr(m, "is_transposed") and hasattr(m, "num_experts"):
            roles[name] = "experts"
            parent = name.rpartition(".")[0]
            for child, sub in model.get_submodule(parent).named_children() if parent else []:
                qualified = f"{parent}.{child}"
                if qualified == name:
                    continue
                kind = type(sub).__name__.lower()
                if child.startswith("shared_expert") and "gate" not in child:
                    roles[qualified] = "shared"
                elif child in ("gate", "router") or "router" in kind:
                    roles[qualified] = "router"
    return roles


def moe_facts(config: Any, model: Any, inv: Inventory, kinds: list[tuple[int, int]]) -> MoE | None:
    """The :class:`MoE` of ``model`` (built from ``config`` with one layer of each kind), None for a dense
    model."""
    experts = [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "num_experts")]
    if not experts:
        return None
    count = int(experts[0].num_experts)
    per_expert = sum(p.numel() for p in experts[0].parameters()) // max(1, count)
    down = getattr(experts[0], "down_proj", None)  # experts x hidden x ffn (x ffn x hidden when transposed)
    hidden, ffn = (0, 0) if down is None or down.dim() != 3 else (
        (down.shape[2], down.shape[1]) if getattr(experts[0], "is_transposed", False) else (down.shape[1], down.shape[2]))
    layer_counts = {t.layer: (t.layers or inv.num_layers) for t in inv.base if t.role == "experts" and t.in_block}
    moe_layers = sum(layer_counts.values())
    shared = getattr(config, "n_shared_experts", None)
    if shared is None:
        shared = 1 if any(t.role == "shared" for t in inv.base) else 0
    from finetune.model.llama4 import NO_AUX_LOSS

    defines = hasattr(config, "output_router_logits") and config.model_type not in NO_AUX_LOSS
    coef = getattr(config, "router_aux_loss_coef", None) if defines else None
    return MoE(
        experts=count, top_k=int(getattr(config, "num_experts_per_tok", 1) or 1), shared_experts=int(shared or 0),
        layers=moe_layers, expert_params=per_expert, aux_loss_coef=float(coef) if coef is not None else None,
        hidden=int(hidden), ffn=int(ffn),
    )


def _dim0(p: Any) -> int:
    """A parameter's first dimension (1 for a scalar)."""
    return int(p.shape[0]) if p.dim() > 0 else 1
