"""What is trained on a frozen base, injected by one function for the planner and the trainer alike.

:func:`finetune.model.methods.inject` turns an :class:`~finetune.spec.AdapterSpec` into modules on a model: peft LoRA (with DoRA,
rsLoRA, gaussian init), peft prefix tuning, peft prompt tuning, or bottleneck adapters (Houlsby et al.: down-projection,
non-linearity, up-projection, added to the output of the attention and/or the MLP of every decoder layer).

The planner's inventory and activation traces (finetune/plan) and the trainer (finetune/train/model/build.py)
all call it, so what is counted and traced is what is trained.

Bottleneck adapters are our own small modules: AdapterHub's ``adapters`` package (1.3.0) pins
transformers 4.57 and does not import with transformers 5 (see docs/architecture.md, Decisions). Each is a
child of its decoder layer (so FSDP shards it with the layer, DDP and activation checkpointing see it like
any weight) and is called by a forward hook on the layer's attention or MLP module: the base's modules and
code are untouched. A run saves them as ``bottleneck_adapter.safetensors`` + ``bottleneck_config.json``
(:func:`save_bottlenecks`), loaded onto the base with :func:`load_bottlenecks`.

Heavy imports (torch, peft) happen inside the functions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.spec import AdapterSpec

BOTTLENECK_WEIGHTS = "bottleneck_adapter.safetensors"
BOTTLENECK_CONFIG = "bottleneck_config.json"
#: Child names of a decoder layer's attention and MLP, over the architectures transformers ships.
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "feed_forward", "ffn")
#: Names of the injected modules inside a decoder layer (the state-dict keys contain them).
SLOT_NAMES = {"attention": "bottleneck_attn", "mlp": "bottleneck_mlp"}
#: Name of the LM head's input gain (``adapter.train_norms``), a child of the model that owns the head.
HEAD_GAIN_NAME = "bottleneck_head"
#: Name of the bottleneck on the token embeddings' output (``adapter.embeddings``), a child of their owner.
EMBED_NAME = "bottleneck_embed"
#: LoRA initialisations that decompose the base weights (and subtract the initial adapter from them).
DECOMPOSING_INITS = ("pissa", "olora")
#: Attribute of a pissa/olora peft model holding its initial adapter ({parameter name: tensor}).
LORA_INIT_ATTR = "_finetune_initial_lora"


def base_model_of(model: Any) -> Any:
    """The transformers model that a peft model wraps (its ``get_base_model()``); ``model`` itself when it is
    not a peft model (a plain model, or one with bottleneck adapters, which are its own children)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def peft_inject(model: Any, config: Any, key: str) -> Any:
    """``get_peft_model`` with ``config``; a config that does not fit the model (e.g. target modules it does not
    have) is one sentence naming the recipe ``key``."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, config)
    except ValueError as exc:
        raise UserError(f"{key}: {exc}") from None


def plain_lora(state: dict[str, Any], initial: dict[str, Any]) -> dict[str, Any]:
    """A pissa/olora adapter's trained ``state`` as a plain LoRA of rank 2r on the original base weights.

    Those inits move ``scale * B0 @ A0`` (the initial adapter, ``initial``) out of each base weight, so the
    trained model is ``W - s B0 A0 + s B A``, i.e. the original ``W`` plus ``s [B, -B0] @ [A; A0]``: A and A0
    stacked, B and -B0 side by side. The config is saved with r and alpha doubled (alpha x sqrt(2) under
    rsLoRA), which keeps the scale ``s`` (peft's ``path_initial_model_for_weight_conversion`` does the same,
    but by loading the initial adapter into the model, which a sharded model cannot).
    """
    import torch

    out: dict[str, Any] = {}
    for name, t in state.items():
        if ".lora_A." in name:
            out[name] = torch.cat([t, initial[name].to(t.device, t.dtype)], dim=0)
        elif ".lora_B." in name:
            out[name] = torch.cat([t, -initial[name].to(t.device, t.dtype)], dim=1)
        else:
            out[name] = t
    return out


def decompose(
    weight: Any, init: str, r: int, scaling: float, *, fan_in_fan_out: bool = False
) -> tuple[Any, Any]:
    """``(A0, B0)`` of one whole base ``weight`` for ``lora.init: pissa | olora``, with peft's own arithmetic
    (``LoraLayer.pissa_init`` / ``olora_init``, peft 0.21): pissa takes the top ``r`` singular triplets with
    ``sqrt(S / scaling)`` on each side, olora the first ``r`` columns of Q and rows of R (fp32).

    The sharded load calls it one gathered weight at a time (peft would decompose meta tensors when it
    injects); :func:`subtract_initial` then gives the residual base weight.
    """
    import torch

    w = weight.to(torch.float32)
    if init == "pissa":
        v, s, uh = torch.linalg.svd(w.T if fan_in_fan_out else w, full_matrices=False)
        sr = s[:r] / scaling
        return torch.diag(torch.sqrt(sr)) @ uh[:r], v[:, :r] @ torch.diag(torch.sqrt(sr))
    if init == "olora":
        q, rr = torch.linalg.qr(w)
        return rr[:r].contiguous(), q[:, :r].contiguous()
    raise ValueError(f"{init} is not a decomposing LoRA init")


def subtract_initial(weight: Any, a0: Any, b0: Any, scaling: float, *, transposed: bool = False) -> Any:
    """The residual base weight ``weight - scaling * B0 @ A0``, computed in fp32 and stored in ``weight``'s
    dtype as peft does; ``transposed``: the weight is stored (in, out) (GPT-2's Conv1D under pissa)."""
    import torch

    w = weight.to(torch.float32)
    w = w.T if transposed else w
    residual = (w - scaling * b0 @ a0).to(weight.dtype)
    return residual.T if transposed else residual


def prefix_tokens(model: Any) -> int:
    """Virtual tokens a prefix-tuned peft model puts before every sequence (0 for any other model)."""
    return _virtual_tokens(model, "PREFIX_TUNING")


def prompt_tokens(model: Any) -> int:
    """Virtual token embeddings a prompt-tuned peft model puts before every sequence's own (0 for any other
    model): positions every layer computes, whose outputs have no targets."""
    return _virtual_tokens(model, "PROMPT_TUNING")


def _virtual_tokens(model: Any, peft_type: str) -> int:
    inner = getattr(model, "module", model)  # DDP
    config = getattr(inner, "active_peft_config", None)
    if config is not None and str(getattr(config, "peft_type", "")).endswith(peft_type):
        return int(config.num_virtual_tokens)
    return 0


# --------------------------------------------------------------------------------------------------
# Bottleneck adapters
# --------------------------------------------------------------------------------------------------


def _bottleneck_class() -> Any:
    import torch
    from torch import nn

    class Bottleneck(nn.Module):
        """``h + up(act(down(h)))``, computed in the adapter's dtype; ``up`` starts at zero (identity).

        With ``gain``, also a trained per-feature gain ``1 + g`` (``g`` starts at zero) on the input of the
        sublayer it follows, i.e. on the output of the layer norm before it: the layer-norm training of
        Houlsby et al. as a factor of the norm's weight, so the base stays untouched."""

        def __init__(self, hidden: int, size: int, non_linearity: str, gain: bool = False) -> None:
            super().__init__()
            self.down = nn.Linear(hidden, size)
            self.up = nn.Linear(size, hidden)
            self.act = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh}[non_linearity]()
            self.gain = nn.Parameter(torch.zeros(hidden)) if gain else None
            if self.up.weight.device.type != "meta":
                nn.init.zeros_(self.up.weight)
                nn.init.zeros_(self.up.bias)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            x = h.to(self.down.weight.dtype)
            return h + self.up(self.act(self.down(x))).to(h.dtype)

        def scale_input(self, h: torch.Tensor) -> torch.Tensor:
            """The sublayer's input times the trained gain (in the gain's dtype, returned in ``h``'s)."""
            assert self.gain is not None, "called only on modules built with a gain"
            return (h.to(self.gain.dtype) * (1 + self.gain)).to(h.dtype)

    class Gain(nn.Module):
        """A trained per-feature gain ``1 + g`` (``g`` starts at zero) on a module's input: the final layer
        norm's training, on the input of the LM head."""

        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.zeros(hidden))

        scale_input = Bottleneck.scale_input

    return Bottleneck, Gain


def _decoder_layers(model: Any) -> list[Any]:
    """The decoder layers (the classes in ``_no_split_modules``; else the longest ModuleList's children)."""
    from torch import nn

    classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if layers:
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    longest: nn.ModuleList = max(lists, key=len)
    return list(longest)


def _child(layer: Any, names: tuple[str, ...]) -> tuple[str, Any] | None:
    for name in names:
        mod = getattr(layer, name, None)
        if mod is not None:
            return name, mod
    return None


def _add_to_output(adapter: Any) -> Any:
    """A forward hook adding ``adapter`` to a module's output (a tensor, or a tuple whose first is)."""

    def hook(module: Any, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (adapter(output[0]), *output[1:])
        return adapter(output)

    return hook


def _scale_input(adapter: Any) -> Any:
    """A forward pre-hook multiplying a sublayer's hidden states (positional, or the ``hidden_states``
    keyword transformers passes to attention) by ``adapter``'s gain."""

    def hook(module: Any, args: Any, kwargs: Any) -> Any:
        if args:
            return (adapter.scale_input(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": adapter.scale_input(kwargs["hidden_states"])}

    return hook


def slots(spec: AdapterSpec) -> list[str]:
    """Where bottlenecks go: attention, mlp, or both (Houlsby's placement)."""
    return ["attention", "mlp"] if spec.placement == "both" else [spec.placement]


def add_bottlenecks(model: Any, spec: AdapterSpec) -> Any:
    """Freeze ``model`` and put ``spec``'s bottlenecks on it: the trained modules of method ``adapter``."""
    for p in model.parameters():
        p.requires_grad_(False)
    inject_bottlenecks(model, spec)
    return model


def inject_bottlenecks(model: Any, spec: AdapterSpec) -> list[str]:
    """Add a bottleneck after the attention and/or MLP of every decoder layer of ``model`` (in place; fp32,
    on the layer's device), and with ``spec.embeddings`` one on the token embeddings' output; return the
    qualified names of the added modules."""
    import torch

    hidden = int(model.config.hidden_size)
    size = spec.bottleneck_size(hidden)
    cls, gain_cls = _bottleneck_class()
    layers = _decoder_layers(model)
    if not layers:
        raise UserError(f"method: adapter: cannot find the decoder layers of {type(model).__name__}")
    names = {id(m): n for n, m in model.named_modules()}
    added = []
    for layer in layers:
        device = next(layer.parameters()).device
        for slot in slots(spec):
            found = _child(layer, ATTENTION_NAMES if slot == "attention" else MLP_NAMES)
            if found is None:
                raise UserError(
                    f"adapter.placement: {type(layer).__name__} has no {slot} module named "
                    f"{' or '.join(ATTENTION_NAMES if slot == 'attention' else MLP_NAMES)}; use another placement"
                )
            with torch.device(device):
                adapter = cls(hidden, size, spec.non_linearity, spec.train_norms).to(torch.float32)
            layer.add_module(SLOT_NAMES[slot], adapter)
            found[1].register_forward_hook(_add_to_output(adapter))
            if spec.train_norms:
                found[1].register_forward_pre_hook(_scale_input(adapter), with_kwargs=True)
            added.append(f"{names[id(layer)]}.{SLOT_NAMES[slot]}")
    if spec.embeddings:  # after the layers' bottlenecks: the order a sharded load redraws them in
        embed = model.get_input_embeddings()
        owner = next(m for m in model.modules() if any(c is embed for c in m.children()))
        with torch.device(embed.weight.device):
            adapter = cls(hidden, size, spec.non_linearity).to(torch.float32)
        owner.add_module(EMBED_NAME, adapter)
        embed.register_forward_hook(_add_to_output(adapter))
        added.append(".".join(filter(None, (names[id(owner)], EMBED_NAME))))
    head = model.get_output_embeddings() if spec.train_norms else None
    if head is not None:
        owner = next(m for m in model.modules() if any(c is head for c in m.children()))
        with torch.device(head.weight.device):
            gain = gain_cls(hidden).to(torch.float32)
        owner.add_module(HEAD_GAIN_NAME, gain)
        head.register_forward_pre_hook(_scale_input(gain), with_kwargs=True)
        added.append(".".join(filter(None, (names[id(owner)], HEAD_GAIN_NAME))))
    model._finetune_bottleneck = spec  # save_bottlenecks knows the model carries them
    return added


def has_bottlenecks(model: Any) -> bool:
    """Whether ``model`` (or the model inside a DDP wrapper) carries bottleneck adapters."""
    return getattr(getattr(model, "module", model), "_finetune_bottleneck", None) is not None


def is_bottleneck_key(name: str) -> bool:
    """Whether a state-dict key belongs to a bottleneck adapter."""
    return any(f".{s}." in f".{name}" for s in (*SLOT_NAMES.values(), HEAD_GAIN_NAME, EMBED_NAME))


def save_bottlenecks(
    model: Any, out_dir: Path, state: dict[str, Any] | None = None, base: str | None = None
) -> None:
    """Write the bottleneck weights (``state``: a full state dict gathered from FSDP; None: the model's own)
    and their config to ``out_dir``."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    spec: AdapterSpec = model._finetune_bottleneck
    state = state if state is not None else model.state_dict()
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items() if is_bottleneck_key(k)}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / BOTTLENECK_WEIGHTS), metadata={"format": "pt"})
    config = {"type": "bottleneck", **asdict(spec), "base_model_name_or_path": base}
    (out_dir / BOTTLENECK_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def load_bottlenecks(model: Any, adapter_dir: str | Path) -> Any:
    """Put the bottleneck adapters saved in ``adapter_dir`` onto ``model`` (a base of the same shape)."""
    from safetensors.torch import load_file

    d = Path(adapter_dir)
    config = json.loads((d / BOTTLENECK_CONFIG).read_text())
    fields = {k: v for k, v in config.items() if k in AdapterSpec.__dataclass_fields__}
    spec = AdapterSpec(**fields)
    add_bottlenecks(model, spec)
    weights = load_file(str(d / BOTTLENECK_WEIGHTS))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    lacking = [k for k in missing if is_bottleneck_key(k)]
    if unexpected or lacking:
        raise UserError(f"{d}: the saved adapters do not fit this model ({(unexpected or lacking)[0]})")
    return model


def prefix_text_ids(text: str, tokenizer: Any, num_virtual_tokens: int, section: str = "prefix") -> list[int]:
    """The token ids whose keys/values start a prefix of ``num_virtual_tokens`` (prefix.init: text), or whose
    embeddings start prompt tuning's virtual tokens (``section`` prompt): ``text`` tokenized without special
    tokens, then cut to ``num_virtual_tokens`` when longer or repeated from its start when shorter. For a
    prefix the base runs over these ids as one sequence, so each virtual token's key carries the rotary
    position it has in the prefix (0 .. num_virtual_tokens - 1), where peft puts it."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise UserError(
            f"{section}.init_text: the text has no tokens; give a task instruction, or {section}.init: random"
        )
    return [ids[i % len(ids)] for i in range(num_virtual_tokens)]


def init_prompt_from_text(model: Any, ids: list[int]) -> None:
    """Set a prompt-tuned peft ``model``'s virtual tokens to its frozen base's own input embeddings of ``ids``
    (Lester et al. 2021: vectors started from real tokens learn faster and more stably than a random draw,
    most of all on small models). peft's own text init loads a tokenizer by name; this one takes the run's ids.
    The base's input embeddings must be whole on this process (not sharded)."""
    import torch

    weight = model.prompt_encoder[model.active_adapter].embedding.weight
    table = model.word_embeddings.weight
    with torch.no_grad():
        rows = table[torch.tensor(ids, device=table.device)]
        weight.copy_(rows.to(device=weight.device, dtype=weight.dtype))


def init_prefix_from_text(model: Any, ids: list[int]) -> None:
    """Set a prefix-tuned peft ``model``'s prefix (no projection) to its frozen base's own keys and values of
    ``ids`` in every layer (Li & Liang 2021: a prefix started from real words' activations learns from little
    data; peft's random draw puts the base far from its pretrained behaviour at step 0).

    peft's prompt encoder stores one row per virtual token holding, layer after layer, the keys then the
    values, each laid out (key/value head, head dim): ``get_prompt``'s view of it. The whole base must be on
    this process (not sharded)."""
    import torch

    from finetune.versions import output_cache

    encoder = model.prompt_encoder[model.active_adapter]
    weight = encoder.embedding.weight
    base = model.get_base_model()
    device = weight.device
    with torch.no_grad(), model.disable_adapter():
        out = base(input_ids=torch.tensor([ids], device=device), use_cache=True)
    cache = output_cache(out)
    rows = []
    for layer in range(len(cache.layers)):
        for t in (cache.layers[layer].keys, cache.layers[layer].values):  # (1, kv heads, tokens, head dim)
            rows.append(t[0].transpose(0, 1).reshape(len(ids), -1))
    with torch.no_grad():
        weight.copy_(torch.cat(rows, dim=1).to(weight.dtype))
