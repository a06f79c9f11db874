"""A mixture of experts' router in training: its load-balancing loss, and how evenly it loads the experts.

The load-balancing loss (Switch Transformer's, as transformers computes it for Qwen3-MoE, Mixtral and gpt-oss
when the model is called with ``output_router_logits``) is a property of one forward's tokens: the number of
experts times the sum over experts of (the expert's routed slots per token) x (its mean router probability).
It is top-k when the router spreads tokens evenly, more the more it favours some experts. The project's loss is summed over target tokens and divided by the global batch's target tokens
(:mod:`finetune.objectives.loss`), so the term is added the same way: a micro-batch adds ``coef x aux x its target
tokens`` to its summed loss, which the trainer divides by the global count. The step's objective is then
``cross-entropy + coef x (the target-token-weighted mean of the micro-batches' aux)``, the same for any split
of the same micro-batches over gradient accumulation and data-parallel ranks (loss parity); a model without
such a loss (DeepSeek-V3 balances its experts with a bias instead) adds nothing.

How evenly the experts are loaded is counted for every mixture of experts from the routing itself: a hook on
each experts module (transformers' experts interface: ``experts(hidden_states, top_k_index, top_k_weights)``; the
LoRA layer around it when the experts are adapted)
adds up the tokens routed to each expert in the training forwards of a step (not checkpointing's recomputed
ones, nor evaluation's). The trainer logs ``aux_loss`` and ``expert_load`` (the largest, over layers, of the
busiest expert's tokens over the mean expert's: 1.0 is perfectly even) per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

#: The attribute :func:`enable` sets on the model the loss is called with.
MARK = "_finetune_router"


@dataclass
class RouterState:
    """What one model's router adds to the loss and has counted since the last :meth:`take`."""

    coef: float  # the load-balancing loss's coefficient (0: not added)
    experts: int  # routed experts per layer
    layers: int  # layers with experts (hooked)
    aux_sum: torch.Tensor | None = None  # sum over micro-batches of aux x target tokens (detached)
    counts: torch.Tensor | None = None  # (layers, experts) tokens routed since the last take
    counting: bool = False  # inside a training forward (hooks count only then)
    hooks: list[Any] = field(default_factory=list, repr=False)

    def add_counts(self, layer: int, top_k_index: torch.Tensor) -> None:
        """Count one layer's routed slots (``top_k_index``: tokens x top-k expert ids)."""
        ids = top_k_index.detach().reshape(-1)
        hist = torch.zeros(self.experts, dtype=torch.float32, device=ids.device)
        hist.index_add_(0, ids.clamp(0, self.experts - 1).long(), torch.ones_like(ids, dtype=torch.float32))
        if self.counts is None or self.counts.device != hist.device:
            self.counts = torch.zeros(self.layers, self.experts, dtype=torch.float32, device=hist.device)
        self.counts[layer] += hist

    def add_aux(self, aux: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add one micro-batch's load-balancing loss, weighted by its target tokens."""
        value = aux.detach().double() * tokens.detach().double()
        self.aux_sum = value if self.aux_sum is None else self.aux_sum + value.to(self.aux_sum.device)

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the summed aux x tokens, the tokens per expert per layer) since the last call; both reset."""
        out = (self.aux_sum, self.counts)
        self.aux_sum, self.counts = None, None
        return out


def experts_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """The fused experts of ``model`` (through any wrapper), in order: for each, the module its block calls
    with the routing (the experts themselves, or the LoRA layer wrapping them: its ``base_layer`` is theirs),
    and its number of routed experts."""
    found: dict[str, tuple[torch.nn.Module, int]] = {}
    for name, m in model.named_modules():
        if hasattr(m, "has_gate") and hasattr(m, "num_experts"):
            outer = name
            while outer.endswith(".base_layer"):
                outer = outer.removesuffix(".base_layer")
            count: Any = m.num_experts  # an int attribute of transformers' experts modules
            found.setdefault(outer, (model.get_submodule(outer), int(count)))
    return list(found.values())


def defines_aux_loss(model: torch.nn.Module) -> bool:
    """Whether the transformers model inside ``model`` computes a load-balancing loss (``output_router_logits``)."""
    from finetune.model.llama4 import NO_AUX_LOSS

    config = _config(model)
    return (config is not None and hasattr(config, "output_router_logits") and hasattr(config, "router_aux_loss_coef")
            and getattr(config, "model_type", None) not in NO_AUX_LOSS)


def model_aux_coef(model: torch.nn.Module) -> float:
    """The coefficient the model's config gives its load-balancing loss (0 when it defines none)."""
    config = _config(model)
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if defines_aux_loss(model) else 0.0


def enable(model: torch.nn.Module, coef: float) -> RouterState | None:
    """Count ``model``'s routing and add its load-balancing loss times ``coef`` (0: none) to
    :func:`finetune.objectives.loss.causal_lm_loss`'s sum; None (nothing done) for a model without experts."""
    found = experts_modules(model)
    if not found:
        return None
    state = RouterState(coef=float(coef) if defines_aux_loss(model) else 0.0, experts=found[0][1], layers=len(found))
    for i, (module, _) in enumerate(found):

        def hook(_m: Any, args: Any, kwargs: Any, i: int = i) -> None:
            if state.counting:
                ids = args[1] if len(args) > 1 else kwargs.get("top_k_index")
                if ids is not None:
                    state.add_counts(i, ids)

        state.hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    setattr(model, MARK, state)
    return state


def state_of(model: torch.nn.Module) -> RouterState | None:
    """The :class:`RouterState` :func:`enable` gave ``model`` (None: not enabled)."""
    return getattr(model, MARK, None)


@contextlib.contextmanager
def training_forward(model: torch.nn.Module) -> Iterator[dict[str, Any]]:
    """Around one forward of :func:`finetune.objectives.loss.causal_lm_loss`: the routing is counted (a training forward
    only), and the keywords the model needs to compute its load-balancing loss."""
    state = state_of(model)
    if state is None or not model.training:
        yield {}
        return
    state.counting = True
    try:
        yield {"output_router_logits": True} if state.coef else {}
    finally:
        state.counting = False


def add_aux_loss(model: torch.nn.Module, output: Any, loss_sum: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``loss_sum`` with ``coef x aux x targets`` added when ``model``'s router adds its loss (see the module
    docstring), recording the aux value for the step's metrics."""
    state = state_of(model)
    aux = getattr(output, "aux_loss", None)
    if state is None or not state.coef or not model.training or not isinstance(aux, torch.Tensor):
        return loss_sum
    state.add_aux(aux, targets)
    return loss_sum + (state.coef * aux * targets).to(loss_sum.dtype)


def load_imbalance(counts: torch.Tensor) -> float:
    """The largest, over layers, of the busiest expert's routed tokens over the mean expert's (1.0: even)."""
    mean = counts.mean(dim=-1).clamp(min=1e-9)
    return float((counts.max(dim=-1).values / mean).max())


def _config(model: torch.nn.Module) -> Any:
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "num_hidden_layers"):
            return config
    return None
