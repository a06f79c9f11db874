"""Llama 4's mixture of experts behind transformers 5's experts interface.

transformers 5 keeps Llama 4's routed experts fused as it keeps the other mixtures' (``feed_forward.experts``:
``gate_up_proj`` experts x hidden x 2*ffn and ``down_proj`` experts x ffn x hidden, stored (in, out) as gpt-oss
stores them), but not behind its experts interface (``experts(hidden_states, top_k_index, top_k_weights)``, the
``is_transposed``/``has_gate`` attributes and the grouped_mm / batched_mm implementations): its ``Llama4TextMoe``
scales each token by its router scores (the sigmoid of each routed logit) *before* the experts and runs every
expert on every token, the rows of the experts a token is not routed to being zeros. LoRA and NF4 on the experts
(:mod:`finetune.model.experts`), the routing counts (:mod:`finetune.model.router`), the experts kernel and expert
parallelism all work on the interface, so :func:`adopt` gives every Llama 4 mixture block of a model:

- experts with the interface's attributes (transposed, gate and up concatenated, no bias) and its forward: the
  implementation the config names (``_experts_implementation``: transformers' grouped_mm or batched_mm, or for
  eager a loop over the experts that received rows);
- a block forward that routes as Llama 4 does (the top-k of the router's logits, scored by the router) and hands
  the experts one row per (token, routed expert): the token times its score, with weight 1. A token's output is
  the sum of its rows' outputs plus the shared expert's, which is Llama 4's output without the zero rows: the
  experts compute top-k rows per token instead of one per expert.

transformers computes no load-balancing loss for Llama 4 (its config's ``router_aux_loss_coef`` is read by
nothing): :data:`NO_AUX_LOSS` says so to the router and the planner.
"""

from __future__ import annotations

from typing import Any

#: The mixture block class of Llama 4's text model in transformers 5.
BLOCK = "Llama4TextMoe"
#: Model types whose mixtures define no load-balancing loss though their configs carry a coefficient.
NO_AUX_LOSS = ("llama4_text", "llama4")


def adopt(model: Any) -> bool:
    """Put every Llama 4 mixture block of ``model`` (a transformers model, before adapters) behind the experts
    interface, in place (again: nothing more); returns whether ``model`` has any. The experts read their
    implementation from ``model.config._experts_implementation``."""
    import types

    found = False
    for module in model.modules():
        if type(module).__name__ != BLOCK:
            continue
        found = True
        experts = module.experts
        if hasattr(experts, "is_transposed"):
            continue
        from transformers.integrations.moe import _default_apply_gate

        experts.config = model.config
        experts.has_gate, experts.has_bias, experts.has_post_expert_norm = True, False, False
        experts.is_transposed, experts.is_concatenated, experts._is_expert_parallel = True, True, False
        experts._apply_gate = types.MethodType(_default_apply_gate, experts)
        experts.forward = types.MethodType(_experts_forward, experts)
        module.forward = types.MethodType(_block_forward, module)
    return found


def _block_forward(self: Any, hidden_states: Any) -> tuple[Any, Any]:
    """Llama 4's mixture block (``Llama4TextMoe.forward``) with its routed experts called through the interface:
    (the block's output, the router's logits)."""
    import torch

    x = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(x)  # scores: each routed logit's sigmoid, 0 for the others
    routed = torch.topk(logits, self.top_k, dim=-1).indices  # the router's own choice (the same top-k)
    weights = scores.gather(1, routed)
    rows = (x.unsqueeze(1) * weights.unsqueeze(-1)).reshape(-1, x.size(-1))
    out = self.experts(rows, routed.reshape(-1, 1), torch.ones_like(weights).reshape(-1, 1))
    shared = self.shared_expert(x)
    return shared + out.view(x.size(0), self.top_k, -1).sum(dim=1).to(shared.dtype), logits


def _experts_forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The experts of the interface: the config's implementation (eager: :func:`_eager`)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    kernel = self.config._experts_implementation or "eager"
    run = _eager if kernel == "eager" else ALL_EXPERTS_FUNCTIONS.get_interface(kernel, _eager)
    return run(self, hidden_states, top_k_index, top_k_weights)


def _eager(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """A loop over the experts that received rows: ``act(x W_gate) * (x W_up)`` then ``W_down``, weighted."""
    import torch

    out = torch.zeros_like(hidden_states)
    for e in torch.unique(top_k_index).tolist():
        token, slot = torch.where(top_k_index == e)
        h = self._apply_gate(hidden_states[token] @ self.gate_up_proj[e]) @ self.down_proj[e]
        out.index_add_(0, token, (h * top_k_weights[token, slot, None]).to(out.dtype))
    return out
