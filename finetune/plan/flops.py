"""Model FLOPs of one training token, and the model FLOPs utilisation (MFU) of a run.

Definition (the one MFU is quoted with, PaLM's appendix B; nanoGPT, torchtitan): MFU = the model's training
FLOPs per token x tokens per second / the peak FLOPs of the GPUs that ran them. *Model* FLOPs: what the
model's mathematics needs, not what the hardware executed, so activation checkpointing's recomputed forward
and the fused head + loss's recomputed logits are not counted (they are a memory-for-time trade the MFU
figure should show as a cost). Only matrix multiplications count (norms, activations, softmax and the loss
are a few per cent on any model that is not tiny, and FLOP counters leave them out too).

Per token, for a stack of ``L`` decoder layers with ``d = heads x head_dim`` attention channels and rows of
``T`` tokens:

    forward           2 x N                          N: weights of every matmul (linear layers, LoRA's A
                    + 4 x L x T x d                     and B, bottleneck adapters, the LM head)
    input gradients   2 x N_in + 8 x L x T x d       N_in: the matmuls whose input carries a gradient
    weight gradients  2 x N_trainable                N_trainable: the matmuls whose weight is trained

A full fine-tune is therefore 6N plus attention. With frozen embeddings (LoRA, QLoRA, prefix, adapters) no
gradient reaches the first layer's input, so its query/key/value projections compute none (N_in = N minus
them), and only the small adapters' weights get gradients: about 4N. The attention term counts the score
(Q K^T) and value (A V) matmuls over the whole T x T square, as PaLM does and as FLOP counters see an eager
or math attention (a causal kernel skips about half of it; the convention keeps figures comparable).
Prefix tuning's virtual tokens lengthen every row's keys and values. A mixture of experts' fused experts
count as the weights a token computes with: top-k of each layer's routed experts (``experts x top-k / experts``
of the fused weights); a model whose layers differ (DeepSeek-V3's dense first layers) counts each kind of
layer as many times as it has it. Prompt tuning's ``P`` virtual tokens are positions of their own: every matmul
runs on ``T + P`` positions for ``T`` tokens of data, so a data token costs ``(T + P) / T`` positions at
``T + P`` keys, and gradients reach the first layer's input (the virtual tokens' embeddings are trained), so no
input projection is spared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.plan.config import concrete

# What the first decoder layer's attention calls the projections that read the layer's input.
INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value", "Wqkv", "W_pack")


@dataclass(frozen=True)
class TrainingFlops:
    """Model FLOPs of one training token (forward + backward), by part."""

    forward: float
    input_gradients: float
    weight_gradients: float

    @property
    def per_token(self) -> float:
        """Forward + backward FLOPs per token."""
        return self.forward + self.input_gradients + self.weight_gradients


def training_flops_per_token(model: Any, *, seq_len: float) -> TrainingFlops:
    """The model FLOPs of training on one token in rows of ``seq_len`` tokens (see the module docstring).

    ``model`` is the model as the trainer builds it (adapters injected; on any device, including meta, sharded
    or not: sizes come from the modules' declared shapes, not their storage, so 4-bit weights and FSDP shards
    count whole). Trainable means ``weight.requires_grad``.
    """

    from finetune.model.adapters import prefix_tokens, prompt_tokens
    from finetune.plan.shapes import decoder_layer_names

    layers = decoder_layer_names(model)
    first = layers[0] + "." if layers else None
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    prompt = prompt_tokens(model)
    frozen_input = not prompt and (embeddings is None or not any(p.requires_grad for p in embeddings.parameters()))
    total = no_input_grad = trainable = 0.0
    for name, module in model.named_modules():
        found = matmul_weights(module, model.config)
        if found is None:
            continue
        size, trained = found
        total += size
        trainable += trained
        if frozen_input and first is not None and _reads_layer_input(name, first):
            no_input_grad += size
    config = model.config
    heads = config.num_attention_heads
    head_dim = attention_head_dim(config)
    keys = seq_len + prompt + prefix_tokens(model)
    attention = config.num_hidden_layers * keys * heads * head_dim
    scale = _positions_per_token(seq_len, prompt)
    return TrainingFlops(
        forward=scale * (2.0 * total + 4.0 * attention),
        input_gradients=scale * (2.0 * (total - no_input_grad) + 8.0 * attention),
        weight_gradients=scale * 2.0 * trainable,
    )


def attention_head_dim(config: Any) -> float:
    """The width per head the score and value matmuls run at: ``head_dim``, or for multi-head latent attention
    (DeepSeek-V3) the mean of the query/key width (``qk_nope_head_dim + qk_rope_head_dim``) and the value width."""
    if getattr(config, "qk_nope_head_dim", None) and getattr(config, "v_head_dim", None):
        return (config.qk_nope_head_dim + getattr(config, "qk_rope_head_dim", 0) + config.v_head_dim) / 2
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def matmul_weights(module: Any, config: Any) -> tuple[float, float] | None:
    """(the matmul weights one token computes with, those of them trained) of ``module``: a linear layer's, or
    a mixture of experts' fused experts' top-k share; None for anything else."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, nn.Linear):
        return module.in_features * module.out_features, module.in_features * module.out_features * float(
            module.weight.requires_grad
        )
    if isinstance(module, Conv1D):  # GPT-2's projections: weight stored (in, out)
        size = module.weight.shape[0] * module.weight.shape[1]
        return size, size * float(module.weight.requires_grad)
    if hasattr(module, "has_gate") and hasattr(module, "num_experts"):  # transformers' fused experts
        share = float(getattr(config, "num_experts_per_tok", 1) or 1) / max(1, int(module.num_experts))
        weights = [p for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
        size = sum(p.numel() for p in weights) * share
        return size, sum(p.numel() for p in weights if p.requires_grad) * share
    return None


def _positions_per_token(seq_len: float, prompt: int) -> float:
    """Positions the model computes per token of data in rows of ``seq_len`` tokens after ``prompt`` virtual
    tokens (1 without them)."""
    return (seq_len + prompt) / seq_len if prompt else 1.0


def config_flops_per_token(config: Any, *, seq_len: float, adapter: Any = None) -> TrainingFlops:
    """:func:`training_flops_per_token` of ``config``'s model as the trainer would build it, from the config
    alone: built on the meta device (no memory, no weights), with ``adapter`` (an
    :class:`~finetune.spec.AdapterSpec`; None: full fine-tuning) injected on the frozen base."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.model import llama4
    from finetune.model.methods import inject

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(concrete(config))
    llama4.adopt(model)  # Llama 4's experts behind the experts interface, as every run builds them
    if adapter is not None:
        model = inject(model, adapter, num_layers=config.num_hidden_layers, stand_in=True)
    return training_flops_per_token(model, seq_len=seq_len)


@dataclass(frozen=True)
class FlopsShape:
    """Where a model's matmul weights are, which is all :func:`training_flops_per_token` needs: the totals for
    any row width and tensor-parallel degree follow from one decoder layer and what lies outside the layers."""

    layers: int  # decoder layers
    block: int  # matmul weights of one decoder layer (its adapters' included)
    block_trainable: int  # ... of them trained
    outside: int  # matmul weights outside the layers (the LM head, a prefix encoder's projection)
    outside_trainable: int
    no_input_grad: int  # the first layer's input projections when no gradient reaches its input (else 0)
    attention_channels: int  # heads x head_dim of one layer
    prefix_tokens: int  # prefix tuning's virtual tokens before every row
    trainable_params: int  # every trained value of the whole model (matmul or not; tied weights once)
    block_trainable_params: int  # ... of them in one decoder layer
    prompt_tokens: int = 0  # prompt tuning's virtual tokens: positions of their own before every row

    def flops(self, seq_len: float, tp: int = 1) -> TrainingFlops:
        """Model FLOPs of one training token of one rank in rows of ``seq_len`` tokens, with the decoder layers
        split over ``tp`` tensor-parallel ranks (whatever lies outside them, the head, is computed whole by
        every rank, as TP replicates it)."""
        block, trained = self.block / tp, self.block_trainable / tp
        total = self.layers * block + self.outside
        attention = self.layers * self.keys(seq_len) * self.attention_channels / tp
        scale = _positions_per_token(seq_len, self.prompt_tokens)
        return TrainingFlops(
            forward=scale * (2.0 * total + 4.0 * attention),
            input_gradients=scale * (2.0 * (total - self.no_input_grad / tp) + 8.0 * attention),
            weight_gradients=scale * 2.0 * (self.layers * trained + self.outside_trainable),
        )

    def keys(self, seq_len: float) -> float:
        """Keys every position of a row of ``seq_len`` tokens attends over (with the virtual tokens)."""
        return seq_len + self.prompt_tokens + self.prefix_tokens

    def block_forward(self, seq_len: float, tp: int = 1) -> float:
        """Forward FLOPs per token of the decoder layers alone (what activation checkpointing recomputes)."""
        attention = self.layers * self.keys(seq_len) * self.attention_channels / tp
        scale = _positions_per_token(seq_len, self.prompt_tokens)
        return scale * (2.0 * self.layers * self.block / tp + 4.0 * attention)


_SHAPES: dict[Any, FlopsShape] = {}
_BY_OBJECT: dict[tuple[int, Any], tuple[Any, FlopsShape]] = {}  # (id(config), adapter) -> (config, shape)


def flops_shape(config: Any, adapter: Any = None) -> FlopsShape:
    """The :class:`FlopsShape` of ``config``'s model as the trainer builds it, with ``adapter`` (an
    :class:`~finetune.spec.AdapterSpec`; None: full fine-tuning) on the frozen base. Built on the meta device
    with one decoder layer (layers of a model are identical in shape), so it is instant at any size; cached
    per config and adapter in memory (a config object is read once: changing it after asking gives the old
    figures) and on disk beside the planner's inventories, so a warm plan builds no model.
    ``flops_shape(c, a).flops(t)`` equals ``config_flops_per_token(c, seq_len=t,
    adapter=a)``."""
    seen = _BY_OBJECT.get((id(config), adapter))
    if seen is not None and seen[0] is config:  # the same config object again: skip serialising it
        return seen[1]
    key = (config.to_json_string(use_diff=False), adapter)
    if key not in _SHAPES:
        path = _shape_path(key)
        shape = _load_shape(path)
        if shape is None:
            shape = _build_shape(config, adapter)
            _save_shape(path, shape)
        _SHAPES[key] = shape
    _BY_OBJECT[(id(config), adapter)] = (config, _SHAPES[key])
    return _SHAPES[key]


#: Bump when what a FlopsShape records changes: invalidates the disk cache.
FLOPS_SHAPE_VERSION = 5


def _shape_path(key: Any) -> Any:
    """``$FINETUNE_CACHE/flops/<digest>.json`` (keyed by the config, the adapter and the library versions that
    build the model, as the planner's inventories are), or None when there is no cache directory."""
    from finetune.plan.cache import cache_file

    return cache_file("flops", key, FLOPS_SHAPE_VERSION)


def _load_shape(path: Any) -> FlopsShape | None:
    from finetune.plan.cache import read_json

    d = read_json(path)
    try:
        return FlopsShape(**d) if isinstance(d, dict) else None
    except TypeError:
        return None


def _save_shape(path: Any, shape: FlopsShape) -> None:
    from dataclasses import asdict

    from finetune.plan.cache import write_json

    write_json(path, asdict(shape))


def _build_shape(config: Any, adapter: Any) -> FlopsShape:
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.model.adapters import prefix_tokens, prompt_tokens
    from finetune.model.methods import inject
    from finetune.plan.shapes import decoder_layer_names, layer_kinds, reduced_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(concrete(reduced_config(config, 1)))
    kinds = layer_kinds(config, model)
    if len(kinds) > 1:  # one layer of each kind, each weighted by its share of the layers
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(concrete(reduced_config(config, kinds[-1][0] + 1)))
    from finetune.model import llama4

    llama4.adopt(model)  # Llama 4's experts behind the experts interface, as every run builds them
    if adapter is not None:
        model = inject(model, adapter, num_layers=config.num_hidden_layers, stand_in=True)
    layers = decoder_layer_names(model)
    first = layers[0] + "." if layers else None
    weight = {f"{layers[i]}.": n / config.num_hidden_layers for i, n in kinds} if len(kinds) > 1 else (
        {first: 1.0} if first is not None else {})

    def layer_weight(name: str) -> float | None:  # None: outside the layers; 0: a repeat of a counted kind
        for prefix in layers:
            if name.startswith(prefix + ".") or f"{prefix}." in name:
                return weight.get(prefix + ".", 0.0)
        return None

    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    prompt = prompt_tokens(model)
    frozen_input = not prompt and (embeddings is None or not any(p.requires_grad for p in embeddings.parameters()))
    block = block_trained = outside = outside_trained = no_input_grad = 0.0
    for name, module in model.named_modules():
        found = matmul_weights(module, model.config)
        if found is None:
            continue
        size, trained = found
        share = layer_weight(name)
        if share is not None:
            block, block_trained = block + size * share, block_trained + trained * share
            if frozen_input and first is not None and _reads_layer_input(name, first):
                no_input_grad += size
        else:
            outside, outside_trained = outside + size, outside_trained + trained
    params = block_params = 0.0
    for name, p in model.named_parameters():
        if p.requires_grad:
            share = layer_weight(name)
            params += p.numel() * (config.num_hidden_layers * share if share is not None else 1)
            block_params += p.numel() * share if share is not None else 0
    heads = config.num_attention_heads
    head_dim = attention_head_dim(config)
    return FlopsShape(
        layers=config.num_hidden_layers, block=round(block), block_trainable=round(block_trained),
        outside=round(outside), outside_trainable=round(outside_trained), no_input_grad=round(no_input_grad),
        attention_channels=round(heads * head_dim), prefix_tokens=prefix_tokens(model), trainable_params=round(params),
        block_trainable_params=round(block_params),
        prompt_tokens=prompt,
    )


def _reads_layer_input(name: str, first_layer: str) -> bool:
    """Whether module ``name`` is one of the first layer's input projections (or its LoRA A, which reads the
    same input; LoRA's B reads A's output, which carries a gradient)."""
    if not name.startswith(first_layer) or "lora_B" in name:
        return False
    parts = name[len(first_layer) :].split(".")
    return any(p in INPUT_PROJECTIONS for p in parts)


@dataclass(frozen=True)
class Utilisation:
    """A run's model FLOPs utilisation against the peak of the GPUs it ran on."""

    mfu: float  # 0..1
    gpu_type: str
    dtype: str  # the peak's dtype: bf16, fp16, tf32 or fp32
    peak_flops: float  # of one GPU, FLOP/s

    def text(self) -> str:
        """'MFU: 41.2% of h100 bf16 peak (989.4 TFLOPS)'."""
        return f"MFU: {100 * self.mfu:.1f}% of {self.gpu_type} {self.dtype} peak ({self.peak_flops / 1e12:g} TFLOPS)"


def mfu(
    tokens_per_s: float, flops_per_token: float, gpu_type: str | None, dtype: str, gpus: int = 1
) -> Utilisation | None:
    """Model FLOPs utilisation of ``gpus`` GPUs of ``gpu_type`` (a ``plan.hardware.GPU_TYPES`` key) training
    ``tokens_per_s`` tokens per second (all GPUs together) at ``flops_per_token`` model FLOPs each, against the
    dense peak for matmuls in ``dtype``; None when that peak is unknown."""
    from finetune.plan.hardware import peak_flops

    peak = peak_flops(gpu_type, dtype)
    if peak is None or gpu_type is None:
        return None
    return Utilisation(tokens_per_s * flops_per_token / (peak * gpus), gpu_type.lower(), dtype, peak)
