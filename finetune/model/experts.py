"""LoRA and NF4 on the fused expert weights of a mixture of experts.

transformers 5 keeps a mixture's experts as fused 3-D parameters of one module (``mlp.experts.gate_up_proj``:
experts x 2*ffn x hidden, ``mlp.experts.down_proj``: experts x hidden x ffn; gpt-oss stores them (in, out) and adds
biases) and runs them through one of its experts implementations (``config._experts_implementation``: eager,
grouped_mm or batched_mm). This module adapts and quantizes those weights, for the planner and the trainer alike:

- LoRA: per expert ``A`` (experts x r x in) and ``B`` (experts x out x r), two 3-D parameters per adapted weight
  of a peft LoRA layer (:func:`expert_lora_class`, registered with peft as the custom layer of the experts'
  classes), applied inside the experts' computation: the rows routed to expert ``e`` get
  ``x W_e^T + s (x A_e^T) B_e^T``, so no merged copy of a weight is ever made. FSDP2 shards ``A`` and ``B`` on
  dim 0, by expert, with their decoder layer.
- NF4: each expert's slice quantized on its own by bitsandbytes (``quantize_4bit``, blocks of 64), the codes of
  all experts one frozen (experts x packed) parameter, so FSDP2 shards them by expert too, the quantization
  states beside it (every rank keeps them whole, as for the linear layers). A forward dequantizes the experts
  that received tokens in this micro-batch, and the backward dequantizes them again instead of keeping them.
- Saving: the adapters are written in peft's ``target_parameters`` layout (``lora.ParamWrapper``: ``lora_A``
  (experts*r x in), ``lora_B`` (out x r*experts), nested ``base_layer`` wrappers when one module has several
  adapted weights), so ``PeftModel.from_pretrained`` loads them; ``finetune merge`` folds them expert by expert.

Every forward here (:func:`experts_forward`) runs the experts implementation the model was built with: eager (a
loop over the experts that got tokens), grouped_mm (rows sorted by expert, one grouped matmul per weight) or
batched_mm (a weight gathered per token-expert pair), with the frozen base's matmul in an autograd function
that keeps nothing for backward but the module (a frozen weight needs no input for a gradient).

The router (``mlp.gate``, gpt-oss's ``mlp.router``) is adapted only when ``lora.target_modules`` names it:
``all-linear`` means the experts and the linear layers, never the routers.

Pure Python at import: torch, peft and bitsandbytes are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from finetune.errors import UserError

#: The fused 3-D expert weights transformers' experts modules hold (``up_proj`` for experts without a gate).
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
#: Names of a mixture block's router beside its ``experts``.
ROUTER_NAMES = ("gate", "router")
#: What ``lora.target_modules`` may name to adapt every fused expert weight of every experts module.
EXPERTS_NAME = "experts"
#: Config keys holding a mixture's number of routed experts, over the architectures transformers ships.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


# --------------------------------------------------------------------------------------------------
# What a model has, and what lora.target_modules asks for (no torch)
# --------------------------------------------------------------------------------------------------


def has_fused_experts(config: Any) -> bool:
    """Whether ``config``'s model is a mixture of experts (transformers 5 fuses its experts' weights)."""
    text = getattr(config, "text_config", None) or config
    return any(int(getattr(text, k, 0) or 0) > 1 for k in EXPERT_COUNT_KEYS)


def routed_experts(config: Any) -> int | None:
    """The routed experts per layer of ``config``'s mixture of experts (None: the model has none)."""
    text = getattr(config, "text_config", None) or config
    found = [int(getattr(text, k, 0) or 0) for k in EXPERT_COUNT_KEYS]
    return next((n for n in found if n > 1), None)


def names_experts(target_modules: Any) -> bool:
    """Whether ``lora.target_modules`` adapts fused expert weights on a mixture of experts: ``all-linear``, or a
    name that is ``experts`` or one of :data:`EXPERT_WEIGHTS` (alone or as the last part of a dotted name)."""
    if isinstance(target_modules, str):
        return target_modules.lower() == "all-linear"
    leaves = {str(t).rsplit(".", 1)[-1] for t in (target_modules or ())}
    return bool(leaves & {EXPERTS_NAME, *EXPERT_WEIGHTS})


def adapts_experts(target_modules: Any, config: Any) -> bool:
    """Whether LoRA with ``target_modules`` (the resolved targets: the recipe's, else peft's choice for the
    architecture) adapts fused expert weights of ``config``'s model."""
    return has_fused_experts(config) and names_experts(target_modules)


def expert_facts(config: Any, target_modules: Any) -> dict[str, bool]:
    """The capability table's facts about a mixture of experts: whether ``config``'s model has fused expert
    weights, and whether LoRA with ``lora.target_modules`` (None: peft's choice for the architecture) adapts
    them."""
    if not has_fused_experts(config):
        return {"experts": False, "expert_lora": False}
    if target_modules is None:  # as finetune.recipe.schema.lora_targets resolves it
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

        target_modules = list(PEFT_DEFAULTS.get(str(config.model_type)) or []) or "all-linear"
    return {"experts": True, "expert_lora": names_experts(target_modules)}


def _matches(name: str, target: str) -> bool:
    """peft's rule for one ``target_modules`` entry: the whole name, or its last dotted parts."""
    return name == target or name.endswith("." + target)


@dataclass
class LoraTargets:
    """Where LoRA goes on a model: ``modules`` for peft's ``target_modules`` (names of linear layers and of the
    experts modules), ``experts`` the adapted 3-D weights of each experts module, ``parameters`` peft's
    ``target_parameters`` (a router's 2-D weight, when named)."""

    modules: list[str] | str
    experts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    parameters: list[str] = field(default_factory=list)


def fused_experts(model: Any) -> dict[str, Any]:
    """The modules of ``model`` holding fused 3-D expert weights, by qualified name (a peft LoRA layer around
    one counts as its base's name)."""
    from torch import nn

    out: dict[str, Any] = {}
    for name, module in model.named_modules():
        if name.endswith(".base_layer"):  # the experts inside a LoRA layer: counted under the layer's name
            continue
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        if expert_weight_names(base) and not isinstance(base, nn.Linear):
            out[name] = base
    return out


def expert_weight_names(module: Any) -> tuple[str, ...]:
    """The fused 3-D expert weights of ``module`` (an experts module of transformers 5), in registration order
    (the order peft nests its wrappers in); empty for any other module."""
    if not hasattr(module, "is_transposed") or not hasattr(module, "num_experts"):
        return ()
    own = dict(module.named_parameters(recurse=False))
    nf4 = getattr(module, NF4_ATTR, None) or {}  # NF4 codes: (experts x packed values)
    return tuple(n for n in own if n in EXPERT_WEIGHTS and (own[n].dim() == 3 or n in nf4))


def resolve_lora_targets(model: Any, targets: list[str] | str) -> LoraTargets:
    """``lora.target_modules`` (resolved: a list of names or ``all-linear``) on ``model``.

    A model without fused experts gets ``targets`` as they are (peft resolves them). On a mixture of experts:
    ``all-linear`` is every linear layer but the head and the routers, plus every fused expert weight;
    ``experts`` names every fused expert weight, ``gate_up_proj``/``down_proj``/``up_proj`` those weights (and
    linear layers of that name, such as a shared expert's); a router is adapted only when named (``gate``,
    ``router``, or its full name), through peft's ``target_parameters`` when it is not a linear layer.
    """
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    experts = fused_experts(model)
    if not experts:
        return LoraTargets(targets)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    routers: dict[str, Any] = {}
    for name in experts:
        parent = name.rsplit(".", 1)[0]
        for r in ROUTER_NAMES:
            found = _submodule(model, f"{parent}.{r}")
            if found is not None:
                routers[f"{parent}.{r}"] = found
    linears = [
        n for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, Conv1D)) and m is not head and not n.endswith(".base_layer")
        and ".lora_" not in n
    ]
    if isinstance(targets, str):
        if targets.lower() != "all-linear":
            raise UserError(f"lora.target_modules: `{targets}` is not a list of names or all-linear")
        return LoraTargets(
            [n for n in linears if n not in routers], {n: expert_weight_names(m) for n, m in experts.items()}
        )
    modules: list[str] = []
    adapted: dict[str, tuple[str, ...]] = {}
    parameters: list[str] = []
    for name, module in experts.items():
        weights = expert_weight_names(module)
        chosen = tuple(
            w for w in weights if any(_matches(name, t) or _matches(f"{name}.{w}", t) for t in targets)
        )
        if chosen:
            adapted[name] = chosen
    # a router that subclasses a linear layer with a forward of its own (Llama 4's returns scores and logits) is
    # adapted through its weight, as a parameter: peft's linear layer would replace that forward
    own_forward = {n for n, r in routers.items() if isinstance(r, nn.Linear) and type(r).forward is not nn.Linear.forward}
    modules = [n for n in linears if n not in own_forward and any(_matches(n, t) for t in targets)]
    for name, router in routers.items():
        if name in modules or (isinstance(router, nn.Linear) and name not in own_forward):
            continue
        if any(_matches(name, t) or _matches(f"{name}.weight", t) for t in targets):
            parameters.append(f"{name}.weight")
    if not (modules or adapted or parameters):
        raise UserError(
            f"lora.target_modules: none of {', '.join(map(str, targets))} names a linear layer or an expert "
            f"weight of {type(model).__name__}; name modules it has (e.g. q_proj, experts) or use all-linear"
        )
    return LoraTargets(modules, adapted, parameters)


def _submodule(model: Any, name: str) -> Any:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


@contextlib.contextmanager
def peft_as_targeted() -> Iterator[None]:
    """peft exactly as targeted: no rewriting of the targets for transformers 4's layout.

    peft 0.21, on a transformers 5 model whose checkpoint layout changed (Mixtral, the Qwen2-MoE family,
    DeepSeek-V3), rewrites ``target_modules`` as transformers 4 named the layers: ``all-linear`` then also adapts
    the routers (``gate``, a linear layer in transformers 4), and ``gate_proj``/``up_proj``/``down_proj`` become
    the fused expert weights, leaving a dense MLP or a shared expert of those names without adapters.
    :func:`resolve_lora_targets` has already said which layers and weights get adapters; the rewrite is
    skipped for the duration.
    """
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # transformers 4 (no conversion)
        yield
        return
    kept = conversion.convert_peft_config_for_transformers

    def as_given(peft_config: Any, model: Any, conversions: Any) -> None:
        return None

    conversion.convert_peft_config_for_transformers = as_given
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = kept


# --------------------------------------------------------------------------------------------------
# The experts' forward: every implementation, frozen base (plain or NF4) + optional LoRA
# --------------------------------------------------------------------------------------------------


@dataclass
class ExpertLoRA:
    """One adapted expert weight's factors for a forward: ``a`` (experts x r x in), ``b`` (experts x out x r),
    the scale, and the dropout on its input."""

    a: Any
    b: Any
    scaling: float
    dropout: float = 0.0


@dataclass
class _Routing:
    """Which rows go to which expert. ``ids``: each row's expert (rows sorted by expert unless the kernel is
    batched_mm); ``offsets``: int32 cumulative rows per expert (sorted kernels); ``sizes``: the same as a host
    list (eager, and any kernel over a quantized base); ``valid``: rows of an expert this rank holds (expert
    parallelism's sentinels are not), None when every row is."""

    kernel: str
    num_experts: int
    ids: Any
    offsets: Any = None
    sizes: list[int] | None = None
    valid: Any = None

    def hit(self) -> list[int]:
        """The experts that received rows (every expert on fake tensors: the planner's worst case)."""
        if self.sizes is None:
            return list(range(self.num_experts))
        return [e for e, n in enumerate(self.sizes) if n > 0]


def implementation(experts: Any, x: Any) -> str:
    """The experts implementation ``experts`` runs with (its config's), eager on fake tensors where the loop
    would read values (the grouped kernel keeps what the loop keeps)."""
    kernel = str(getattr(getattr(experts, "config", None), "_experts_implementation", None) or "eager")
    if kernel not in ("eager", "grouped_mm", "batched_mm"):
        kernel = "grouped_mm"  # a hub kernel (deepgemm, sonicmoe): the same grouped computation
    if kernel == "eager" and _is_fake(x):
        return "grouped_mm"
    return kernel


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def experts_forward(
    experts: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any,
    lora: dict[str, list[ExpertLoRA]] | None = None,
) -> Any:
    """The output of ``experts`` (a transformers experts module whose base weights are frozen, plain or NF4)
    for ``hidden_states`` (tokens x hidden) routed by ``top_k_index`` / ``top_k_weights`` (tokens x top-k),
    with ``lora``'s factors added per adapted weight; the arithmetic of transformers' own implementations."""
    import torch

    kernel = implementation(experts, hidden_states)
    num_experts = int(experts.num_experts)
    top_k = top_k_index.size(-1)
    tokens = hidden_states.size(0)
    ids = top_k_index.reshape(-1)
    weights = top_k_weights.reshape(-1)
    valid = ids < num_experts if getattr(experts, "_is_expert_parallel", False) else None
    fake = _is_fake(hidden_states)
    if kernel == "batched_mm":
        rows = hidden_states.repeat_interleave(top_k, dim=0)
        routing = _Routing(kernel, num_experts, ids.clamp(max=num_experts - 1), valid=valid)
        if _quantized(experts) and not fake:
            routing.sizes = torch.histc(routing.ids.float(), bins=num_experts, min=0, max=num_experts - 1).long().tolist()
        perm = None
    else:
        sorted_ids, perm = torch.sort(ids)
        rows = hidden_states[perm // top_k]
        weights = weights[perm]
        valid = valid[perm] if valid is not None else None
        clamped = sorted_ids.clamp(max=num_experts - 1)
        # histc (fixed bins, values past the last expert dropped: expert parallelism's sentinels), as transformers
        # counts them: a bincount's size would depend on the values, which fake tensors do not have
        counts = torch.histc(sorted_ids.float(), bins=num_experts, min=0, max=num_experts - 1).long()
        routing = _Routing(kernel, num_experts, clamped, torch.cumsum(counts, 0, dtype=torch.int32), valid=valid)
        if not fake and (kernel == "eager" or _quantized(experts)):
            routing.sizes = counts.tolist()
    up = "gate_up_proj" if experts.has_gate else "up_proj"
    h = _adapted_linear(experts, up, rows, routing, (lora or {}).get(up, []))
    h = experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)
    out = _adapted_linear(experts, "down_proj", h, routing, (lora or {}).get("down_proj", []))
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    if valid is not None:
        out = out.masked_fill(~valid.unsqueeze(-1), 0.0)
    out = out * weights.unsqueeze(-1).to(out.dtype)
    if perm is not None:
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.size(0), device=perm.device)
        out = out[inverse]
    return out.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _adapted_linear(experts: Any, name: str, x: Any, routing: _Routing, factors: list[ExpertLoRA]) -> Any:
    """``x W_e^T (+ bias_e)`` for each row's expert ``e`` with the frozen weight ``name``, plus each LoRA's
    ``s (dropout(x) A_e^T) B_e^T``."""
    import torch

    y = _FrozenExperts.apply(x, experts, name, routing)
    bias = getattr(experts, f"{name}_bias", None) if getattr(experts, "has_bias", False) else None
    if bias is not None:
        y = y + bias[routing.ids].to(y.dtype)
    for f in factors:
        inp = torch.nn.functional.dropout(x, p=f.dropout, training=True) if f.dropout > 0 else x
        y = y + _lora_delta(inp, f, routing) * f.scaling
    return y


def _lora_delta(x: Any, f: ExpertLoRA, routing: _Routing) -> Any:
    """``(x A_e^T) B_e^T`` per row, the factors in ``x``'s dtype (autocast does not reach grouped matmuls)."""
    import torch

    a, b = f.a.to(x.dtype), f.b.to(x.dtype)
    if routing.kernel == "batched_mm":
        h = torch.bmm(a[routing.ids], x.unsqueeze(-1))  # (rows, r, 1)
        return torch.bmm(b[routing.ids], h).squeeze(-1)
    if routing.kernel == "eager":
        assert routing.sizes is not None, "eager reads the rows per expert"
        parts, start = [], 0
        for e, n in enumerate(routing.sizes):
            if n:
                part = x[start : start + n]
                parts.append(part @ a[e].t() @ b[e].t())
                start += n
        return _cat_rows(parts, x, b.size(1))
    h = _grouped(x, a.transpose(-2, -1), routing.offsets)
    return _grouped(h, b.transpose(-2, -1), routing.offsets)


def _cat_rows(parts: list[Any], x: Any, width: int) -> Any:
    """The per-expert row blocks stacked; rows past the last expert's (expert parallelism's sentinels) zero."""
    import torch

    done = sum(p.size(0) for p in parts)
    if done < x.size(0):
        parts.append(x.new_zeros(x.size(0) - done, width))
    return torch.cat(parts) if parts else x.new_zeros(0, width)


def _grouped(x: Any, w: Any, offsets: Any) -> Any:
    """``x`` (rows x in, sorted by group) times ``w`` (groups x in x out) per group, through torch's grouped
    matmul where its kernel takes the operands and their transposes (16-byte strides; bf16 on fake tensors),
    else transformers' per-group fallback (the same saved tensors); on fake tensors in another dtype (the
    planner's trace), :class:`_TracedGroupedProduct`."""
    import torch
    import transformers.integrations.moe  # noqa: F401  # registers transformers::grouped_mm_fallback

    # The backward multiplies the transposes too, so every matrix dimension must give 16-byte strides.
    widths = (x.size(-1), w.size(-2), w.size(-1))
    usable = (hasattr(torch.nn.functional, "grouped_mm") and _aligned(x) and _aligned(w)
              and all(n * x.element_size() % 16 == 0 for n in widths))
    if _is_fake(x) and not (usable and x.dtype == torch.bfloat16):  # torch's fake grouped_mm takes bf16 only
        out = _TracedGroupedProduct.apply(x, w, offsets)
    elif usable:
        out = torch.nn.functional.grouped_mm(x, w, offs=offsets)
    elif hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        out = torch.ops.transformers.grouped_mm_fallback(x, w, offsets)
    else:  # an older transformers: the same per-group products, through autograd
        ends = [int(e) for e in offsets.tolist()]
        parts = [x[a:b] @ w[g] for g, (a, b) in enumerate(zip([0, *ends[:-1]], ends, strict=True))]
        out = _cat_rows(parts, x, w.size(-1))
    return _ContiguousGrad.apply(out)


def _aligned(t: Any) -> bool:
    size = t.element_size()
    return all(s == 1 or (s * size) % 16 == 0 for s in t.stride()) and (_is_fake(t) or t.data_ptr() % 16 == 0)


def _frozen_product(experts: Any, name: str, x: Any, routing: _Routing, transposed: bool) -> Any:
    """``x W_e^T`` per row (``transposed``: ``x W_e``, the backward's) with ``name`` as the base stores it:
    the parameter itself, or the experts that got rows dequantized from NF4."""
    import torch

    hit = routing.hit() if _quantized(experts) else None
    w = _base_weight(experts, name, hit)  # (experts or hit experts) x stored rows x stored cols
    # as (groups, in, out): stored (out, in) unless the experts are stored transposed (gpt-oss)
    w = w if experts.is_transposed else w.transpose(-2, -1)
    if transposed:
        w = w.transpose(-2, -1)
    if routing.kernel == "batched_mm":
        index = routing.ids
        if hit is not None:
            remap = torch.zeros(routing.num_experts, dtype=torch.long, device=index.device)
            remap[torch.tensor(hit, device=index.device)] = torch.arange(len(hit), device=index.device)
            index = remap[index]
        return torch.bmm(x.unsqueeze(1), w[index]).squeeze(1)
    if routing.kernel == "eager":
        assert routing.sizes is not None, "eager reads the rows per expert"
        parts, start, g = [], 0, 0
        for e, n in enumerate(routing.sizes):
            if n:
                parts.append(x[start : start + n] @ w[g if hit is not None else e])
                start += n
                g += 1
        return _cat_rows(parts, x, w.size(-1))
    offsets = routing.offsets
    if hit is not None and routing.sizes is not None:
        offsets = torch.tensor(
            [sum(routing.sizes[: e + 1]) for e in hit], dtype=torch.int32, device=x.device
        )
    return _grouped(x, w.contiguous() if not _aligned(w) else w, offsets)


def _frozen_experts_class() -> Any:
    import torch

    class FrozenExperts(torch.autograd.Function):
        """The frozen expert weight's matmul keeping nothing for backward: its gradient wrt the input is the
        output's gradient times the same weight, read (or dequantized) again from the module."""

        @staticmethod
        def forward(ctx: Any, x: Any, experts: Any, name: str, routing: _Routing) -> Any:
            ctx.experts, ctx.name, ctx.routing = experts, name, routing
            return _frozen_product(experts, name, x, routing, transposed=False)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            grad_x = None
            if ctx.needs_input_grad[0]:
                grad_x = _frozen_product(ctx.experts, ctx.name, grad.contiguous(), ctx.routing, transposed=True)
            return grad_x, None, None, None

    return FrozenExperts


def _contiguous_grad_class() -> Any:
    import torch

    class ContiguousGrad(torch.autograd.Function):
        """Identity whose backward hands on a contiguous gradient (grouped_mm's backward needs real strides)."""

        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad.contiguous()

    return ContiguousGrad


def _traced_grouped_product_class() -> Any:
    import torch

    class TracedGroupedProduct(torch.autograd.Function):
        """The grouped product on fake tensors, which have shapes but no values: its output's shape, the input
        and the weights kept for the backward (what torch's grouped_mm and transformers' fallback keep), and
        gradients of their shapes. transformers' fallback reads the group offsets' values in its backward
        before 5.24 (``offs.tolist()``), which a fake tensor cannot give."""

        @staticmethod
        def forward(ctx: Any, x: Any, w: Any, offsets: Any) -> Any:
            ctx.save_for_backward(x, w)
            return x.new_empty(x.size(0), w.size(-1))

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            x, w = ctx.saved_tensors
            return torch.empty_like(x), torch.empty_like(w), None

    return TracedGroupedProduct


class _Deferred(type):
    """Builds an autograd function when first applied (this module is imported without torch)."""

    def apply(cls, *args: Any) -> Any:
        fn = cls.__dict__.get("_fn")
        if fn is None:
            fn = cls._build()  # type: ignore[attr-defined]
            cls._fn = fn
        return fn.apply(*args)


class _FrozenExperts(metaclass=_Deferred):
    _build = staticmethod(_frozen_experts_class)


class _ContiguousGrad(metaclass=_Deferred):
    _build = staticmethod(_contiguous_grad_class)


class _TracedGroupedProduct(metaclass=_Deferred):
    _build = staticmethod(_traced_grouped_product_class)


# --------------------------------------------------------------------------------------------------
# NF4 expert weights
# --------------------------------------------------------------------------------------------------

#: Attribute of an experts module holding its NF4 weights' layouts and quantization states ({name: NF4Experts}).
NF4_ATTR = "_finetune_nf4"
#: Values per quantization block (bitsandbytes' default for 4-bit weights, as the linear layers use).
BLOCKSIZE = 64


@dataclass
class NF4Experts:
    """One fused expert weight in NF4: each expert's (rows x cols) slice quantized on its own. ``states``: the
    bitsandbytes ``QuantState`` of each expert (None until the weights are loaded); ``compute_dtype``: what a
    slice is dequantized to. ``stand_in``: the planner's model, whose codes are the compute-dtype weights
    themselves (a dequantization is then a copy of the routed experts)."""

    shape: tuple[int, int]
    compute_dtype: Any
    states: list[Any] | None = None
    stand_in: bool = False


def _quantized(experts: Any) -> bool:
    return bool(getattr(experts, NF4_ATTR, None))


def nf4_codes_class() -> Any:
    """The parameter type of an experts module's NF4 codes (experts x packed values, frozen): bitsandbytes'
    packed bytes in the storage dtype (uint8, or the compute dtype under FSDP2 so it can shard them)."""
    global _CODES
    if _CODES is None:
        import torch

        class ExpertCodes4bit(torch.nn.Parameter):
            """Packed NF4 codes of every expert's slice of one fused weight (two codes per byte)."""

        _CODES = ExpertCodes4bit
    return _CODES


_CODES: Any = None


def packed_width(rows: int, cols: int, itemsize: int) -> int:
    """Elements of the storage dtype holding one expert's packed codes (bitsandbytes' packed shape)."""
    return (rows * cols + 1) // (itemsize * 2)


def storage_dtype(quant: Any) -> Any:
    """The torch dtype the packed codes of ``quant`` (a ``QuantSpec``) are stored in."""
    import torch

    from finetune.units import torch_dtype

    return torch.uint8 if quant.storage_dtype == "uint8" else torch_dtype(quant.storage_dtype)


def quantize_experts(model: Any, quant: Any, *, on_meta: bool = False) -> list[str]:
    """Every fused expert weight of ``model`` in NF4 (``quant``: the execution spec's ``QuantSpec``), in place;
    returns the qualified names of the quantized weights.

    A real weight is quantized expert by expert on its device and its 16-bit tensor freed; ``on_meta``: the
    codes are meta tensors of the packed shape, filled by :func:`quantize_expert_weight` as the sharded load
    reads each weight (:func:`quantize_expert_slices`).
    """
    import torch

    from finetune.units import torch_dtype

    compute = torch_dtype(quant.compute_dtype)
    storage = storage_dtype(quant)
    done = []
    for name, experts in fused_experts(model).items():
        layouts: dict[str, NF4Experts] = {}
        for w in expert_weight_names(experts):
            p = getattr(experts, w)
            n_exp, rows, cols = p.shape
            layouts[w] = NF4Experts((rows, cols), compute)
            if on_meta or p.device.type == "meta":
                codes = torch.empty(n_exp, packed_width(rows, cols, storage.itemsize), dtype=storage, device="meta")
                setattr(experts, w, nf4_codes_class()(codes, requires_grad=False))
            else:
                codes, states = _quantize_all(p.detach(), quant)
                setattr(experts, w, nf4_codes_class()(codes, requires_grad=False))
                layouts[w].states = states
            done.append(f"{name}.{w}")
        setattr(experts, NF4_ATTR, layouts)
    return done


def _quantize_all(weight: Any, quant: Any) -> tuple[Any, list[Any]]:
    """(experts x packed codes, each expert's QuantState) of one fused weight, quantized on its device."""
    import bitsandbytes.functional as bnbf
    import torch

    from finetune.units import torch_dtype

    compute, storage = torch_dtype(quant.compute_dtype), storage_dtype(quant)
    codes, states = [], []
    for e in range(weight.size(0)):
        packed, state = bnbf.quantize_4bit(
            weight[e].to(compute).contiguous(), blocksize=BLOCKSIZE, compress_statistics=quant.double_quant,
            quant_type=quant.quant_type, quant_storage=storage,
        )
        codes.append(packed.reshape(-1))
        states.append(state)
    return torch.stack(codes), states


def quantize_expert_slices(weight: Any, quant: Any) -> tuple[Any, list[Any]]:
    """(experts x packed codes in the storage dtype, each expert's ``QuantState``) of one fused weight (experts
    x rows x cols), each expert's slice cast to the compute dtype and quantized on its own, on its device."""
    return _quantize_all(weight, quant)


def set_expert_states(experts: Any, name: str, states: list[Any]) -> None:
    """Give ``experts``' NF4 weight ``name`` its experts' quantization states (the sharded load's)."""
    getattr(experts, NF4_ATTR)[name].states = states


def _base_weight(experts: Any, name: str, hit: list[int] | None) -> Any:
    """The frozen weight ``name`` as (experts x rows x cols): the parameter, or ``hit``'s experts dequantized.
    Under expert parallelism the parameter is a DTensor of every expert (read again in backward, after the
    forward's local view of it ended): this rank's experts are its local shard."""
    import torch
    from torch.distributed.tensor import DTensor

    w = getattr(experts, name)
    if isinstance(w, DTensor):
        w = w.to_local()
    layout = getattr(experts, NF4_ATTR, {}).get(name)
    if layout is None:
        return w
    assert hit is not None, "a quantized weight is dequantized for the routed experts"
    if layout.stand_in:
        return w[hit] if len(hit) < w.size(0) else w.clone()
    import bitsandbytes.functional as bnbf

    assert layout.states is not None, f"{name}'s NF4 codes were never filled"
    codes = w.detach()
    slices = [bnbf.dequantize_4bit(codes[e].reshape(-1, 1), layout.states[e]) for e in hit]
    if not slices:
        return torch.empty(0, *layout.shape, dtype=layout.compute_dtype, device=codes.device)
    return torch.stack(slices).to(layout.compute_dtype)


def dequantized_expert_weight(weight: Any, quant: Any) -> Any:
    """One fused checkpoint weight as an NF4-quantized model computes with it: each expert's slice cast to the
    compute dtype, quantized and dequantized as :func:`quantize_experts` does; returned in fp32."""
    import bitsandbytes.functional as bnbf
    import torch

    codes, states = _quantize_all(weight.cpu(), quant)
    return torch.stack([bnbf.dequantize_4bit(codes[e].reshape(-1, 1), s) for e, s in enumerate(states)]).float()


def stand_in_nf4(model: Any) -> None:
    """The planner's QLoRA model (meta or fake weights): every fused expert weight frozen and run as NF4 is,
    with a copy of the routed experts' weights in the compute dtype standing in for each dequantization."""
    for experts in fused_experts(model).values():
        layouts = {}
        for w in expert_weight_names(experts):
            p = getattr(experts, w)
            p.requires_grad_(False)
            layouts[w] = NF4Experts(tuple(p.shape[1:]), p.dtype, stand_in=True)
        setattr(experts, NF4_ATTR, layouts)
        quantized_forward(experts)


def quantized_forward(experts: Any) -> None:
    """Run ``experts`` (NF4, or the planner's stand-in) through :func:`experts_forward` (no adapters)."""

    def forward(hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        return experts_forward(experts, hidden_states, top_k_index, top_k_weights)

    experts.forward = forward


def is_expert_codes(p: Any) -> bool:
    """Whether parameter ``p`` holds NF4 expert codes."""
    return _CODES is not None and isinstance(p, _CODES)


# --------------------------------------------------------------------------------------------------
# LoRA on expert weights: a peft LoRA layer
# --------------------------------------------------------------------------------------------------


def expert_lora_class() -> Any:
    """The peft LoRA layer of an experts module (built once; peft is imported here)."""
    global _LAYER
    if _LAYER is not None:
        return _LAYER
    import torch
    from peft.tuners.lora.layer import LoraLayer
    from torch import nn

    class ExpertsLoraLayer(nn.Module, LoraLayer):
        """LoRA on an experts module's fused weights: per adapted weight, ``lora_A[adapter][weight]``
        (experts x r x in) and ``lora_B[adapter][weight]`` (experts x out x r), added inside the experts'
        computation (:func:`experts_forward`)."""

        adapter_layer_names = ("lora_A", "lora_B")

        def __init__(
            self, base_layer: nn.Module, adapter_name: str, config: Any = None, r: int = 0, lora_alpha: float = 1,
            weights: dict[str, tuple[str, ...]] | None = None, target_name: str = "", **kwargs: Any,
        ) -> None:
            nn.Module.__init__(self)
            LoraLayer.__init__(self, base_layer)
            self._active_adapter = adapter_name
            self.adapted: dict[str, tuple[str, ...]] = {}
            chosen = (weights or {}).get(target_name.removesuffix(".base_layer"))
            self.update_layer(adapter_name, r, lora_alpha, config, weight_names=chosen)

        def _get_in_out_features(self, module: nn.Module) -> tuple[None, None]:
            return None, None

        def update_layer(  # peft's signature, with the weights to adapt
            self, adapter_name: str, r: int, lora_alpha: float, config: Any,
            weight_names: tuple[str, ...] | None = None, **kwargs: Any,
        ) -> None:
            experts = self.get_base_layer()
            names = weight_names or expert_weight_names(experts)
            a, b = nn.ParameterDict(), nn.ParameterDict()
            for w in names:
                (n_exp, fan_in, fan_out), device = expert_shape(experts, w), getattr(experts, w).device
                a[w] = nn.Parameter(torch.empty(n_exp, r, fan_in, device=device, dtype=torch.float32))
                b[w] = nn.Parameter(torch.zeros(n_exp, fan_out, r, device=device, dtype=torch.float32))
                if device.type != "meta":
                    init_lora_a(a[w].data, None)
            self.lora_A[adapter_name], self.lora_B[adapter_name] = a, b
            self.adapted[adapter_name] = tuple(names)
            self.r[adapter_name] = r
            self.lora_alpha[adapter_name] = lora_alpha
            rslora = bool(getattr(config, "use_rslora", False))
            self.use_rslora[adapter_name] = rslora
            self.scaling[adapter_name] = lora_alpha / math.sqrt(r) if rslora else lora_alpha / r
            self.lora_dropout[adapter_name] = nn.Dropout(float(getattr(config, "lora_dropout", 0.0) or 0.0))
            self.set_adapter(self.active_adapters)

        def factors(self) -> dict[str, list[ExpertLoRA]]:
            """The active adapters' factors per adapted weight (none while adapters are disabled)."""
            out: dict[str, list[ExpertLoRA]] = {}
            if self.disable_adapters or self.merged:
                return out
            for adapter in self.active_adapters:
                if adapter not in self.lora_A:
                    continue
                dropout: Any = self.lora_dropout[adapter]
                p = float(dropout.p) if self.training else 0.0
                for w in self.adapted[adapter]:
                    a, b = self.pair(adapter, w)
                    out.setdefault(w, []).append(ExpertLoRA(a, b, float(self.scaling[adapter]), p))
            return out

        def pair(self, adapter: str, weight: str) -> tuple[Any, Any]:
            """(A, B) of ``adapter`` on fused weight ``weight``."""
            a: Any = self.lora_A[adapter]
            b: Any = self.lora_B[adapter]
            return a[weight], b[weight]

        def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            factors = self.factors()
            experts = self.get_base_layer()
            if not factors and not _quantized(experts):
                return experts(hidden_states, top_k_index, top_k_weights)
            return experts_forward(experts, hidden_states, top_k_index, top_k_weights, factors)

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            experts: Any = self.get_base_layer()
            if _quantized(experts):
                raise ValueError("cannot merge LoRA into NF4 expert weights; finetune merge folds into 16 bits")
            for adapter in adapter_names or self.active_adapters:
                if adapter in self.lora_A and adapter not in self.merged_adapters:
                    with torch.no_grad():
                        for w in self.adapted[adapter]:
                            p = getattr(experts, w)
                            a, b = self.pair(adapter, w)
                            p.add_(expert_delta(a, b, self.scaling[adapter], experts.is_transposed).to(p.dtype))
                    self.merged_adapters.append(adapter)

        def unmerge(self) -> None:
            experts: Any = self.get_base_layer()
            while self.merged_adapters:
                adapter = self.merged_adapters.pop()
                with torch.no_grad():
                    for w in self.adapted[adapter]:
                        p = getattr(experts, w)
                        a, b = self.pair(adapter, w)
                        p.sub_(expert_delta(a, b, self.scaling[adapter], experts.is_transposed).to(p.dtype))

        def __repr__(self) -> str:
            return "lora." + super().__repr__()

    _LAYER = ExpertsLoraLayer
    return _LAYER


_LAYER: Any = None


def expert_shape(experts: Any, name: str) -> tuple[int, int, int]:
    """(experts, in features, out features) of fused weight ``name`` (stored (out, in), or (in, out) when the
    experts are stored transposed)."""
    layout = getattr(experts, NF4_ATTR, {}).get(name)
    p = getattr(experts, name)
    rows, cols = layout.shape if layout is not None else tuple(p.shape[1:])
    n_exp = int(experts.num_experts)
    return (n_exp, rows, cols) if experts.is_transposed else (n_exp, cols, rows)


def expert_delta(a: Any, b: Any, scaling: float, transposed: bool) -> Any:
    """``s B_e A_e`` for every expert in fp32 (experts x out x in), in the stored layout (``transposed``:
    experts x in x out)."""
    import torch

    delta = torch.bmm(b.float(), a.float()) * scaling
    return delta.transpose(-2, -1) if transposed else delta


def init_lora_a(a: Any, generator: Any) -> None:
    """peft's default ``lora_A`` draw for each expert's (r x in) slice: Kaiming-uniform with a=sqrt(5), i.e.
    uniform in +-1/sqrt(in), as a linear layer's ``lora_A`` of that shape."""
    bound = 1.0 / math.sqrt(a.size(-1))
    a.uniform_(-bound, bound, generator=generator)


def seeded_generator(seed: int, name: str) -> Any:
    """The generator a tensor of the adapters is drawn from: seeded by the run's seed and the tensor's name."""
    import torch

    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def lora_config_with_experts(config: Any, model: Any, targets: LoraTargets) -> Any:
    """peft's ``LoraConfig`` ``config`` aimed at ``targets``: the linear layers and experts modules as
    ``target_modules`` (the experts' LoRA layer registered for their classes), routers as
    ``target_parameters``."""
    import functools

    experts = fused_experts(model)
    config.target_modules = [*targets.modules, *targets.experts]
    config.target_parameters = list(targets.parameters) or None
    if targets.experts:
        cls = expert_lora_class()
        make = functools.partial(cls, weights=dict(targets.experts))
        config._register_custom_module({type(experts[n]): make for n in targets.experts})
    return config


# --------------------------------------------------------------------------------------------------
# peft's target_parameters layout (saving) and back (merge)
# --------------------------------------------------------------------------------------------------


def peft_layout(state: dict[str, Any], model: Any) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The trained ``state`` (qualified name -> whole tensor) split into what peft saves itself and the expert
    adapters in peft's ``lora.ParamWrapper`` layout, keyed as ``adapter_model.safetensors`` holds them; returns
    (the rest, the expert tensors, the ``target_parameters`` to save).

    peft wraps a module's adapted parameters one in another in their registration order (the first is the
    innermost, reached through ``base_layer``), with ``lora_A`` (experts*r x in), row ``e*r + i`` expert
    ``e``'s row ``i``, and ``lora_B`` (out x r*experts), column ``i*experts + e`` expert ``e``'s column ``i``.
    """
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "adapted") and hasattr(m, "factors")}
    rest = {k: v for k, v in state.items() if not any(k.startswith(f"{n}.lora_") for n in layers)}
    tensors: dict[str, Any] = {}
    targets: list[str] = []
    for name, layer in layers.items():
        adapter = "default"
        weights = layer.adapted.get(adapter, ())
        for depth, w in enumerate(reversed(weights)):  # the last adapted weight is the outermost wrapper
            where = name + ".base_layer" * depth
            a, b = state[f"{name}.lora_A.{adapter}.{w}"], state[f"{name}.lora_B.{adapter}.{w}"]
            n_exp, r = a.shape[0], a.shape[1]
            tensors[f"{where}.lora_A.weight"] = a.reshape(n_exp * r, a.shape[2]).contiguous()
            tensors[f"{where}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], r * n_exp).contiguous()
            targets.append(f"{name.removeprefix('base_model.model.')}.{w}")
    return rest, tensors, sorted(set(targets))


def add_to_peft_dir(out_dir: Any, tensors: dict[str, Any], targets: list[str], experts: list[str]) -> None:
    """Amend the adapter directory peft wrote (``save_pretrained`` of everything else) with the expert adapters:
    their tensors in ``adapter_model.safetensors``, ``target_parameters`` in ``adapter_config.json`` and the
    experts modules (``experts``, qualified names without peft's prefix) out of ``target_modules``.
    ``lora_dropout`` is saved as 0: it is a training setting, and peft refuses to load a ``ParamWrapper``
    with one (the adapter computes the same without it)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    weights = out / "adapter_model.safetensors"
    saved = load_file(str(weights)) if weights.is_file() else {}
    save_file({**saved, **tensors}, str(weights), metadata={"format": "pt"})
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    modules = config.get("target_modules") or []
    if isinstance(modules, list):
        config["target_modules"] = sorted(m for m in modules if m not in set(experts))
    config["target_parameters"] = sorted({*(config.get("target_parameters") or []), *targets})
    config["lora_dropout"] = 0.0
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def experts_layer_names(model: Any) -> list[str]:
    """Qualified names (without peft's ``base_model.model.`` prefix) of ``model``'s experts LoRA layers."""
    return [
        n.removeprefix("base_model.model.") for n, m in model.named_modules()
        if hasattr(m, "adapted") and hasattr(m, "factors")
    ]


def from_peft_layout(a: Any, b: Any, num_experts: int) -> tuple[Any, Any]:
    """One ``lora.ParamWrapper``'s ``lora_A`` (experts*r x in) and ``lora_B`` (out x r*experts) as per-expert
    factors: A (experts x r x in), B (experts x out x r)."""
    r = a.shape[0] // num_experts
    return a.reshape(num_experts, r, a.shape[1]), b.reshape(b.shape[0], r, num_experts).permute(2, 0, 1)


# --------------------------------------------------------------------------------------------------
# Checkpoints that keep one tensor per expert (the Hub's layout, and transformers 5's save_pretrained)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertPiece:
    """Where one per-expert checkpoint tensor lives in a fused weight: ``fused`` (the model's name), the
    ``expert``, and rows ``part`` of ``parts`` equal blocks (``gate_proj`` then ``up_proj`` in ``gate_up_proj``)."""

    fused: str
    expert: int
    part: int
    parts: int
    siblings: tuple[str, ...]  # the checkpoint keys of every part of this expert, in order


def checkpoint_pieces(model_type: str, keys: Any) -> dict[str, ExpertPiece]:
    """The checkpoint ``keys`` that transformers fuses into expert weights when it loads ``model_type`` (its
    conversion mapping: per-expert ``experts.N.gate_proj.weight`` etc. stacked by expert, gate and up
    concatenated), each with its :class:`ExpertPiece`; empty for a checkpoint that stores them fused."""
    import re

    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers 4: no fused experts
        return {}
    renamings, converters = [], []
    for conv in get_checkpoint_conversion_mapping(model_type) or []:
        sources, target = list(conv.source_patterns), list(conv.target_patterns)
        if type(conv).__name__ == "WeightRenaming":
            renamings.append((sources[0], target[0]))
        elif len(target) == 1 and all("*" in s for s in sources):
            converters.append((sources, target[0]))
    out: dict[str, ExpertPiece] = {}
    for key in keys:
        name = key
        for src, tgt in renamings:
            name = re.sub(src, tgt, name)
        for sources, target in converters:
            for i, src in enumerate(sources):
                m = re.search(re.escape(src).replace(r"\*", r"(\d+)"), name)
                if m is None:
                    continue
                fused = name[: m.start()] + target + name[m.end() :]
                siblings = tuple(key[: key.rfind(src.split("*")[1])] + s.split("*")[1] for s in sources) \
                    if len(sources) > 1 else (key,)
                out[key] = ExpertPiece(fused, int(m.group(1)), i, len(sources), siblings)
    return out
