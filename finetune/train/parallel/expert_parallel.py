"""Expert parallelism (``distributed.ep``): a mixture's routed experts split over the ep ranks, tokens sent to
them by all-to-all.

The ep ranks are ``ep`` neighbouring ranks of the data-parallel shard dimension (finetune/train/parallel/layout.py: ep
borrows its ranks from dp_shard). Each holds experts ``[r*E/ep, (r+1)*E/ep)`` of every experts module: its
fused 3-D weights (and their biases, and LoRA's per-expert factors) become DTensors on the layout's
:attr:`~finetune.train.parallel.layout.ParallelLayout.ep_mesh`, sharded on dim 0, so loading, saving and checkpoints see
the whole tensors as under any other sharding (:func:`shard_experts`). FSDP2 then shards each rank's experts
over what is left of dp_shard (``expert_fsdp_mesh``), while every other weight is sharded over the whole of
dp_shard (finetune/train/parallel/parallelize.py: ``apply_fsdp``).

One experts forward under ep (:func:`dispatch_forward`; the router, its load-balancing loss and the routing
counts run before it on this rank's tokens, as without ep):

1. the (token, slot) pairs are sorted by expert, so the rows for each ep rank are contiguous;
2. the rows per expert are exchanged (a small all-to-all of counts), then the rows themselves
   (``all_to_all_single`` with uneven splits, :class:`AllToAll`, whose backward is the reverse exchange);
3. the received rows (from every ep rank, each block sorted by expert) run through this rank's experts with the
   model's own experts implementation (eager, grouped_mm, the LoRA layer's) on the local weights, one slot per
   row and a routing weight of 1;
4. the outputs go back by the reverse all-to-all, are put back in token order, weighted by the router's
   top-k weights on the token's own rank (so the router's gradient stays local) and summed over the slots.

Gradients: an expert's weight gradient on its rank sums what every ep rank's tokens contributed (the
all-to-all's backward brings their output gradients); FSDP2 then sums it over the expert's replicas (the
other ranks of ``expert_fsdp_mesh``) and divides by the whole data-parallel degree, as it divides the dense
weights' (``set_gradient_divide_factor``), so the loss normalisation (summed over target tokens, divided by the global
batch's) and single-process parity hold.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

from finetune.model.router import experts_modules

#: Attribute set on an experts module once its experts are split: (ep degree, its process group, the routed
#: experts of the whole module).
EP_ATTR = "_finetune_ep"
#: Attribute holding an experts module's own forward (its class's, or the instance's: Llama 4's experts behind
#: the experts interface), which the dispatch runs on this rank's experts.
EP_INNER = "_finetune_ep_inner"


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        import torch.distributed as dist

        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def apply_expert_parallel(model: torch.nn.Module, ep_mesh: Any) -> list[torch.nn.Module]:
    """Split every experts module of ``model`` (the module its block calls: the experts, or the LoRA layer
    around them) over ``ep_mesh`` and route its tokens by all-to-all; returns those modules (each becomes an
    FSDP2 unit of its own over the expert mesh). ``model`` may be on the meta device."""
    found = [m for m, _ in experts_modules(model)]
    assert found, "expert parallelism on a model without fused experts is refused by the capability table"
    counts = dict((id(m), n) for m, n in experts_modules(model))
    for module in found:
        shard_experts(module, ep_mesh)
        setattr(module, EP_ATTR, (ep_mesh.size(), ep_mesh.get_group(), counts[id(module)]))
        setattr(module, EP_INNER, module.forward)
        module.forward = types.MethodType(dispatch_forward, module)
    return found


def shard_experts(module: torch.nn.Module, ep_mesh: Any) -> None:
    """Every parameter under ``module`` (experts x ...: the fused weights, their biases, LoRA's factors) as a
    DTensor on ``ep_mesh`` sharded on dim 0: this rank keeps its ``1/ep`` of the experts (a meta tensor stays
    on meta)."""
    from torch.distributed.tensor import DTensor, Shard

    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            assert not isinstance(p, DTensor), f"{name} is already distributed"
            assert p.dim() >= 1 and p.size(0) % ep == 0, f"{name} {tuple(p.shape)} does not split over ep {ep}"
            n = p.size(0) // ep
            local = p.detach()[rank * n : (rank + 1) * n]
            local = local if local.device.type == "meta" else local.clone()
            whole = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            setattr(sub, name, torch.nn.Parameter(whole, requires_grad=p.requires_grad))


def local_experts(module: torch.nn.Module) -> int:
    """The routed experts ``module`` holds on this rank (all of them without expert parallelism)."""
    ep = getattr(module, EP_ATTR, None)
    return ep[2] // ep[0] if ep else int(experts_modules(module)[0][1])


@contextlib.contextmanager
def _local_view(module: torch.nn.Module, local_count: int) -> Iterator[None]:
    """Inside: ``module``'s DTensor parameters are their local experts (``to_local``, differentiable) and its
    experts count is ``local_count``, so the model's own experts code runs on this rank's experts."""
    from torch.distributed.tensor import DTensor

    swapped: list[tuple[torch.nn.Module, str, Any]] = []
    counted: list[tuple[Any, int]] = []
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if isinstance(p, DTensor):
                swapped.append((sub, name, p))
                sub._parameters[name] = p.to_local()
        if hasattr(sub, "has_gate") and hasattr(sub, "num_experts"):
            experts: Any = sub  # a transformers experts module: num_experts is an int attribute
            counted.append((experts, int(experts.num_experts)))
            experts.num_experts = local_count
    try:
        yield
    finally:
        for sub, name, p in swapped:
            sub._parameters[name] = p
        for experts, n in counted:
            experts.num_experts = n


def dispatch_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' output for ``hidden_states`` (tokens x hidden) routed by ``top_k_index`` / ``top_k_weights``
    (tokens x top-k, global expert ids), computed by the ep ranks that hold the experts (the module docstring)."""
    ep, group, total = getattr(self, EP_ATTR)
    local = total // ep
    tokens, top_k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)
    rows = hidden_states[order // top_k]
    sent = torch.bincount(ids, minlength=total).to(torch.int64)  # rows per global expert
    received = torch.empty_like(sent)
    import torch.distributed as dist

    dist.all_to_all_single(received, sent, group=group)  # [source rank, local expert]: rows from each rank
    send_splits = sent.view(ep, local).sum(1).tolist()
    recv_counts = received.view(ep, local)
    recv_splits = recv_counts.sum(1).tolist()
    arrived = AllToAll.apply(rows, recv_splits, send_splits, group)
    local_ids = torch.arange(local, device=ids.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
    ones = torch.ones(local_ids.size(0), 1, dtype=top_k_weights.dtype, device=top_k_weights.device)
    with _local_view(self, local):
        computed = _in_graph(getattr(self, EP_INNER)(arrived, local_ids.unsqueeze(-1), ones), arrived, self)
    returned = AllToAll.apply(computed, send_splits, recv_splits, group)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.size(0), device=order.device)
    out = returned[inverse].view(tokens, top_k, -1) * top_k_weights.unsqueeze(-1).to(returned.dtype)
    return out.sum(dim=1).to(hidden_states.dtype)


def _in_graph(out: torch.Tensor, arrived: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """``out`` attached to the autograd graph whenever this rank's experts could have made it so: a rank that
    received no rows computes no expert, yet its return all-to-all must still run in backward, as every other
    ep rank's does (whether it requires a gradient is then the same on every rank)."""
    if not torch.is_grad_enabled() or out.requires_grad:
        return out
    anchors = [arrived] if arrived.requires_grad else []
    anchors += [p for p in module.parameters() if p.requires_grad][:1]
    for a in anchors:
        out = out + (a.sum() * 0).to(out.dtype)
    return out
