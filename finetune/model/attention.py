"""Attention dropout on CPU without keeping (B, H, T, T) tensors for backward.

With attention dropout (GPT-2's ``attn_pdrop``: 0.1) torch's CPU SDPA has no fused kernel and takes its math
path, which keeps, per layer and for backward, the fp32 attention probabilities, the fp32 dropout mask and
the dropped probabilities: three (B, H, T, T) fp32 tensors, plus fp32 copies of q, k and v. A model without
dropout (in eval mode, or whose config has none) keeps only SDPA's output and a per-row log-sum-exp, so on CPU
a GPT-2 trained with its dropout needed far more memory than the same step without it. On a GPU the fused
kernels draw the dropout mask inside the kernel and keep nothing of that size.

:func:`enable` marks a model's modules; transformers' ``sdpa`` attention (wrapped once by :func:`install`)
then runs a marked module's attention with dropout on CPU through :class:`_DropoutAttention`: the same
attention (softmax, dropout with probability p, 1/(1-p) scaling), one batch row at a time, keeping only q, k, v
and a seed. Backward draws the same dropout mask again from that seed and recomputes the probabilities. The
seed comes from torch's global generator, so a seeded run draws the same masks every time. Anything else (no
dropout, eval mode, no gradients, a GPU, torch.compile, unmarked models, position biases, soft-capping,
attention sinks) goes to transformers' own ``sdpa`` function unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

#: The attribute :func:`enable` sets on every module of a model.
MARK = "_finetune_dropout_attention"
_INSTALLED = False


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Mark every module of ``model`` so that its ``sdpa`` attention with dropout on CPU keeps no (B, H, T, T)
    tensor for backward; installs the wrapper if needed. Returns ``model``."""
    install()
    for module in model.modules():
        setattr(module, MARK, True)
    return model


def install() -> None:
    """Wrap transformers' ``sdpa`` attention function (once, for the whole process): a module marked by
    :func:`enable` runs attention with dropout on CPU through :func:`dropout_attention`; every other call
    goes to transformers' function as before."""
    global _INSTALLED
    if _INSTALLED:
        return
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(
        module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
        dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if _takes_dropout_path(module, query, dropout, kwargs):
            return dropout_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            **kwargs,
        )

    AttentionInterface.register("sdpa", attention)
    _INSTALLED = True


def _takes_dropout_path(module: Any, query: torch.Tensor, dropout: float, kwargs: dict[str, Any]) -> bool:
    """Whether this call is one :func:`dropout_attention` computes (see the module docstring)."""
    if not (dropout > 0 and getattr(module, MARK, False) and query.device.type == "cpu"):
        return False
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    return all(kwargs.get(k) is None for k in ("position_bias", "softcap", "s_aux")) and not kwargs.get(
        "output_attentions", False
    )


def dropout_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    dropout: float, scaling: float | None, is_causal: bool | None,
) -> tuple[torch.Tensor, None]:
    """What transformers' ``sdpa_attention_forward`` returns ((B, T, H, D) output, None) for ``query`` (B, H, T, D),
    ``key``/``value`` (B, KV heads, S, D) and a boolean (True: attend) or additive ``attention_mask``
    broadcastable to (B, H, T, S), computed by :class:`_DropoutAttention`."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    if causal and key.shape[2] > query.shape[2]:
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _DropoutAttention.apply(query, key, value, attention_mask, causal, float(scale), float(dropout), _seed(query))
    return out.transpose(1, 2).contiguous(), None


def _seed(like: torch.Tensor) -> int:
    """A seed for this call's dropout masks, drawn from torch's global generator (0 for fake tensors: the
    planner's trace has no values)."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(like):
        return 0
    return int(torch.randint(0, 2**62, (), device="cpu"))


def _generator(seed: int, like: torch.Tensor) -> torch.Generator | None:
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(like):
        return None
    return torch.Generator(device=like.device).manual_seed(seed)


def _probabilities(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float, p: float,
    gen: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch row: the fp32 attention probabilities (H, T, S) (rows with nothing to attend: 0, as SDPA) and
    the dropout keep-mask scaled by 1/(1-p), drawn from ``gen``."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if causal:
        t, n = s.shape[-2], s.shape[-1]
        s.masked_fill_(torch.ones(t, n, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    elif mask is not None:
        if mask.dtype == torch.bool:
            s.masked_fill_(~mask, float("-inf"))
        else:
            s.add_(mask.float())
    probs = torch.softmax(s, dim=-1).nan_to_num_(0.0)
    del s
    keep = torch.rand(probs.shape, generator=gen, device=probs.device, dtype=torch.float32)
    keep = (keep >= p).float().div_(1.0 - p)
    return probs, keep


class _DropoutAttention(torch.autograd.Function):
    """softmax(q k^T * scale + mask) with dropout p, times v; one batch row at a time in fp32, the result in
    q's dtype. Saves q, k, v (and the mask); backward recomputes each row's probabilities and draws its
    dropout mask again from the same seed."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
        scale: float, p: float, seed: int,
    ) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):
            out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
            gen = _generator(seed, q)
            for b in range(q.shape[0]):
                probs, keep = _probabilities(q[b], k[b], _row(mask, b), causal, scale, p, gen)
                out[b] = torch.matmul(probs.mul_(keep), v[b].float()).to(out.dtype)
                del probs, keep
        ctx.save_for_backward(q, k, v, mask)
        ctx.causal, ctx.scale, ctx.p, ctx.seed = causal, scale, p, seed
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, mask = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        with torch.autocast(q.device.type, enabled=False):
            gen = _generator(ctx.seed, q)
            for b in range(q.shape[0]):
                probs, keep = _probabilities(q[b], k[b], _row(mask, b), ctx.causal, ctx.scale, ctx.p, gen)
                do = grad[b].float()
                dv[b] = torch.matmul((probs * keep).transpose(-1, -2), do).to(dv.dtype)
                dp = torch.matmul(do, v[b].float().transpose(-1, -2)).mul_(keep)
                del keep
                ds = dp.sub_((dp * probs).sum(-1, keepdim=True)).mul_(probs).mul_(ctx.scale)
                del probs
                dq[b] = torch.matmul(ds, k[b].float()).to(dq.dtype)
                dk[b] = torch.matmul(ds.transpose(-1, -2), q[b].float()).to(dk.dtype)
        return dq, dk, dv, None, None, None, None, None


def _row(mask: torch.Tensor | None, b: int) -> torch.Tensor | None:
    """Batch row ``b`` of a mask broadcastable to (B, H, T, S) (a mask of one row serves every row)."""
    if mask is None:
        return None
    return mask[b if mask.shape[0] > 1 else 0]
