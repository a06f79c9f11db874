"""The training objective, shared by the trainer and the planner's activation tracer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from finetune.model import attention, router
from finetune.model.adapters import base_model_of, prompt_tokens
from finetune.objectives.loss_chunks import FUSED_CHUNK_BYTES, LossChunks

IGNORE_INDEX = -100


def shifted_labels(batch: dict[str, Any]) -> torch.Tensor:
    """Labels shifted one position left: position t holds the token that logits at t must predict.

    For packed rows (position_ids given, no attention mask) the first token of a document is not a
    target of the previous document's last token.
    """
    labels = batch["labels"]
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    if batch.get("position_ids") is not None and batch.get("attention_mask") is None:
        starts = batch["position_ids"][:, 1:] == 0
        shifted[:, :-1][starts] = IGNORE_INDEX
    return shifted


def count_target_tokens(batch: dict[str, Any]) -> int:
    """How many tokens of ``batch`` count in the loss (the normaliser, known before the forward pass).

    The trainer counts on the host copy of the batch, before it moves to the device: no device sync."""
    return int((shifted_labels(batch) != IGNORE_INDEX).sum())


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Which document each position of packed rows belongs to (0, 1, 2, ... along a row: a new document
    where the position does not follow the previous one), or None when every row holds one document: the
    answer transformers computes from ``position_ids`` when there is no attention mask. The trainer computes
    it on the host copy of a packed micro-batch and sends it with the batch (key ``document_ids``; an empty
    tensor for None)."""
    restarts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
    ids = restarts.cumsum(-1)
    return None if bool((ids[:, -1] == 0).all()) else ids


@contextlib.contextmanager
def known_documents(batch: dict[str, Any]) -> Iterator[None]:
    """Within this context transformers' mask code takes the documents of ``batch``'s rows from the host
    instead of reading them on the device.

    Without an attention mask transformers looks for packed documents in the position ids, one value read on
    the host per forward (a device sync: the host stops running ahead of the kernels). What it would find is
    known before the batch moves: none for unpacked right-padded rows (no mask, no position ids: the trainer
    drops the mask of such rows), ``document_ids`` for packed ones. Other batches (evaluation's, the planner's
    trace) are left to transformers. Correctness never depends on this: it gives the answer transformers
    would compute.
    """
    from transformers import masking_utils

    name = "find_packed_sequence_indices"
    unpacked = batch.get("attention_mask") is None and batch.get("position_ids") is None
    if not hasattr(masking_utils, name) or not (unpacked or "document_ids" in batch):
        yield
        return
    ids = None if unpacked else batch["document_ids"]
    known = ids if ids is not None and ids.numel() else None  # empty: one document per row
    original = getattr(masking_utils, name)
    setattr(masking_utils, name, lambda position_ids: known)
    try:
        yield
    finally:
        setattr(masking_utils, name, original)


def target_rows(batch: dict[str, Any], shard: tuple[int, int] | None = None) -> torch.Tensor | None:
    """The flat indices (into the (B*T,) shifted labels) of the positions that have a target, or None when
    every position has one: what the fused head selects. The trainer computes them on the host copy of the
    micro-batch and sends them with it (key ``target_rows``), so the forward needs no device-to-host sync to
    learn how many rows there are. ``shard``: (rank, ranks) under sequence parallelism, where the head sees
    only that rank's positions (:func:`sequence_bounds`): indices into its (B*T_rank,) labels."""
    shifted = shifted_labels(batch)
    if shard is not None:
        start, end = sequence_bounds(shifted.shape[1], *shard)
        shifted = shifted[:, start:end]
    keep = (shifted != IGNORE_INDEX).reshape(-1)
    index = keep.nonzero().squeeze(1)
    return None if index.numel() == keep.numel() else index


def sequence_bounds(length: int, rank: int, ranks: int) -> tuple[int, int]:
    """The positions [start, end) of a ``length``-long sequence that ``rank`` of ``ranks`` holds when it is
    split as DTensor's ``Shard(1)`` splits it (``torch.chunk``: ceil(length/ranks) each, the last ones shorter
    or empty)."""
    chunk = -(-length // ranks)
    start = min(rank * chunk, length)
    return start, min(start + chunk, length)


# The attribute of the output head that holds its SequenceShard under sequence parallelism
SEQUENCE_SHARD = "_finetune_sequence_shard"


@dataclass
class SequenceShard:
    """This rank's place among the tensor-parallel ranks that split the residual stream over the sequence
    (sequence parallelism, set on the head by finetune.train.parallel.parallelize).

    The final norm's output reaches the head through :meth:`hand_over`: this rank's rows inside :meth:`rows`
    (:func:`causal_lm_loss`: the fused head and loss run on them, so the head's inputs, logits and
    temporaries take 1/tp of the memory and of the work), the whole sequence otherwise (generation, the
    preference objectives).
    """

    rank: int
    size: int
    group: Any  # the tensor-parallel process group (None in the planner's trace of one rank)
    local: bool = False

    def bounds(self, length: int) -> tuple[int, int]:
        """This rank's positions of a ``length``-long sequence (:func:`sequence_bounds`)."""
        return sequence_bounds(length, self.rank, self.size)

    @contextlib.contextmanager
    def rows(self) -> Iterator[None]:
        """Within this context the head receives this rank's rows only."""
        self.local = True
        try:
            yield
        finally:
            self.local = False

    def hand_over(self, hidden: Any) -> Any:
        """The final norm's sequence-sharded output as the head's input: this rank's rows, or all of them."""
        from torch.distributed.tensor import DTensor

        if not isinstance(hidden, DTensor):
            return hidden
        return hidden.to_local() if self.local else hidden.full_tensor()

    def total(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """``loss_sum`` (this rank's rows) with the value summed over the ranks and the gradient of this rank's
        part: each rank's backward starts from its own rows, and the collectives of the blocks' backward carry
        every rank's part to the weights (the replicated ones sum theirs over the ranks)."""
        import torch.distributed as dist

        if self.group is None:  # the planner's trace of rank 0 (finetune.plan.tensor_parallel)
            return loss_sum
        whole = loss_sum.detach().clone()
        dist.all_reduce(whole, group=self.group)
        return loss_sum + (whole - loss_sum.detach())



def causal_lm_loss(
    model: torch.nn.Module, batch: dict[str, Any], chunks: LossChunks | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over the label tokens of ``batch``, and how many tokens were counted.

    The output head and the loss are fused (:func:`loss_head`): the head's forward computes the fp32 loss
    from the last hidden state chunk by chunk, so the (B, T, V) logits never exist whole, nor their
    gradient. Models whose head is not a plain bias-free linear layer (a LoRA-adapted head, a biased head,
    Gemma 2's logit soft-capping) fall back to the chunked loss over materialised logits. A mixture of experts
    whose router :func:`finetune.model.router.enable` set up adds its load-balancing loss times its coefficient per
    target token (:mod:`finetune.model.router`), and has its routing counted. Attention with
    dropout on CPU keeps no (B, H, T, T) tensor for backward (:mod:`finetune.model.attention`, enabled on the model
    here, so the trainer and the planner's trace run the same attention). Returning the
    *sum* lets the trainer normalise by the number of label tokens in the whole global batch, so that
    gradient accumulation and data parallelism give exactly the single-process result.

    A prompt-tuned model (peft) puts its virtual tokens before every row: their positions get no target
    (:func:`before_virtual_tokens`), so the head and the loss line up with the longer rows.

    ``chunks``: the chunk sizes and whether the head is fused
    (:class:`~finetune.objectives.loss_chunks.LossChunks`; its defaults when None, as the planner's trace has them).
    """
    shifted = shifted_labels(batch)
    rows = batch.get("target_rows")
    virtual = prompt_tokens(model)
    if virtual:
        shifted, rows = before_virtual_tokens(shifted, rows, virtual)
    kwargs = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch.get("attention_mask"),
        "position_ids": batch.get("position_ids"),
        "use_cache": False,
    }
    if not getattr(model, attention.MARK, False):
        attention.enable(model)
    # a mixture of experts' load-balancing loss, except under sequence parallelism (each rank sees its rows only)
    chunks = chunks or LossChunks()
    head = fusable_head(model) if chunks.fused_head else None
    sharded = head is not None and getattr(head, SEQUENCE_SHARD, None) is not None
    routing: contextlib.AbstractContextManager[dict[str, Any]] = (
        contextlib.nullcontext({}) if sharded else router.training_forward(model)
    )
    # target_rows: the trainer's, found on the host copy (of this rank's positions under sequence parallelism;
    # tensor parallelism refuses prompt tuning)
    with loss_head(model, shifted, rows, chunks) as finish, known_documents(batch), routing as extra:
        out = model(**kwargs, **extra)
        loss_sum = finish(out.logits)
    targets = (shifted != IGNORE_INDEX).sum()
    return (loss_sum if sharded else router.add_aux_loss(model, out, loss_sum, targets)), targets


@contextlib.contextmanager
def loss_head(
    model: torch.nn.Module, targets: torch.Tensor, rows: torch.Tensor | None = None, chunks: LossChunks | None = None
) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Within this context a forward of ``model``'s output head leads to the summed next-token cross-entropy
    against ``targets`` (the shifted labels, (B, T)): the function it yields turns what the head returned into
    that sum. :func:`causal_lm_loss` runs the whole model inside it, the last pipeline stage its final norm and
    head (finetune.train.parallel.pipeline).

    The head is fused with the loss (:class:`fused_head`: the head returns the sum itself) where
    :func:`fusable_head` allows it; under sequence parallelism it runs on this rank's rows of the sequence and
    the sum is the TP group's (:class:`SequenceShard`). A model whose head is not a plain bias-free linear layer
    (a LoRA-adapted head, a biased head, Gemma 2's logit soft-capping) returns logits, of which the chunked loss
    is taken (:class:`_ChunkedCrossEntropy`). ``rows``: :func:`target_rows` of the batch, when known; ``chunks``:
    the loss's settings (:class:`~finetune.objectives.loss_chunks.LossChunks`; its defaults when None).
    """
    chunks = chunks or LossChunks()
    head = fusable_head(model)
    if head is not None and chunks.fused_head:
        shard: SequenceShard | None = getattr(head, SEQUENCE_SHARD, None)
        if shard is not None:  # sequence parallelism: the head and the loss on this rank's rows
            start, end = shard.bounds(targets.shape[1])
            with shard.rows(), fused_head(head, targets[:, start:end], rows, shard.group, chunks.fused_bytes):
                yield shard.total
            return
        with fused_head(head, targets, rows, chunk_bytes=chunks.fused_bytes):
            yield lambda loss_sum: loss_sum
        return

    def chunked(logits: torch.Tensor) -> torch.Tensor:
        n = chunks.logits_rows(logits.shape[-1])
        return _ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), n)

    yield chunked


def before_virtual_tokens(
    shifted: torch.Tensor, rows: torch.Tensor | None, virtual: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The shifted labels of rows that a prompt-tuned model lengthens by ``virtual`` positions at their start
    (none of which has a target), and the fused head's target ``rows`` (flat indices into the (B*T,) labels)
    moved to the same positions of the (B*(virtual+T),) ones: index ``b*T + t`` becomes ``b*(virtual+T) +
    virtual + t``, computed where ``rows`` are (no device sync)."""
    width = shifted.shape[1]
    padded = torch.nn.functional.pad(shifted, (virtual, 0), value=IGNORE_INDEX)
    if rows is None:
        return padded, None
    return padded, rows + virtual * (torch.div(rows, width, rounding_mode="floor") + 1)


def fusable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The output head of ``model`` (through DDP and peft wrappers) when the fused loss can stand in for
    it: a plain ``nn.Linear`` without bias, on a model that does not post-process its logits."""
    inner = base_model_of(getattr(model, "module", model))  # through DDP, then peft
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if get is not None else None
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    config = getattr(inner, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    return head


class fused_head:
    """Within this context, ``head``'s forward returns the summed fp32 cross-entropy of its logits against
    ``targets`` (shape (B, T), IGNORE_INDEX = no loss) instead of the logits: the model's output ``.logits``
    is then that scalar.

    The loss runs inside the head's own forward so every wrapper sees an ordinary forward: FSDP2 has the
    root unit's parameters (the head, or the tied embedding) gathered, DDP's reducer sees the weight used.
    """

    def __init__(
        self, head: torch.nn.Linear, targets: torch.Tensor, rows: torch.Tensor | None = None, group: Any = None,
        chunk_bytes: int = FUSED_CHUNK_BYTES,
    ) -> None:
        self.head, self.targets, self.rows = head, targets, rows  # rows: target_rows(batch), when known
        self.group = group  # sequence parallelism: the ranks whose rows share the head (its gradient summed)
        self.chunk_bytes = chunk_bytes  # fp32 logits per chunk (LossChunks.fused_bytes)

    def __enter__(self) -> fused_head:
        head, targets, index, group, chunk_bytes = self.head, self.targets, self.rows, self.group, self.chunk_bytes

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            device = hidden.device.type
            if torch.is_autocast_enabled(device):
                dtype = torch.get_autocast_dtype(device)
            else:
                dtype = torch.promote_types(hidden.dtype, head.weight.dtype)
            h = hidden.reshape(-1, hidden.shape[-1])
            rows = max(1, chunk_bytes // (4 * head.weight.shape[0]))
            with torch.autocast(device, enabled=False):
                return _FusedLinearCrossEntropy.apply(
                    h, head.weight, targets.reshape(-1), rows, dtype, index, group
                )

        head.forward = forward  # type: ignore[method-assign,assignment]  # this instance only, undone in __exit__
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.head.forward  # the class's forward again


def _target_rows(targets: torch.Tensor) -> torch.Tensor | None:
    """Indices of the rows that have a target, or None to keep every row: when all have one (no copy
    needed), and in the planner's fake-tensor trace, which has no values and plans the worst case.

    One host sync on an accelerator (the number of rows): the trainer sends :func:`target_rows` with the
    batch instead, so only evaluation and direct callers pay it.
    """
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(targets) or targets.device.type == "meta":
        return None
    index = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    return None if index.numel() == targets.numel() else index


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Summed fp32 cross-entropy of the logits ``h @ w.T`` (computed in ``dtype``) against ``targets``,
    ``rows`` rows at a time. Only the rows that have a target (not IGNORE_INDEX) go through the head: with a
    completion-only loss most rows are prompt tokens, whose logits would cost the head's matmul three times
    (forward, recomputation, gradient) for nothing. Only those rows of ``h``, ``w`` (no copy), their targets
    and one log-sum-exp per row are kept; backward recomputes each chunk's logits and writes the gradients
    of ``h`` (zero on the rows without a target) and of ``w`` when it is trained, chunk by chunk. With ``group``
    (sequence parallelism: ``h`` holds this rank's rows of the sequence) ``w``'s gradient is summed over the
    group's ranks, so the replicated head gets every row's."""

    @staticmethod
    def forward(
        ctx: Any, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, rows: int, dtype: torch.dtype,
        known_rows: torch.Tensor | None = None, group: Any = None,
    ) -> torch.Tensor:
        index = known_rows if known_rows is not None else _target_rows(targets)
        hk, yk = (h, targets) if index is None else (h.index_select(0, index), targets.index_select(0, index))
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        lse = torch.empty(hk.shape[0], dtype=torch.float32, device=h.device)
        wc = w.to(dtype)
        for start in range(0, hk.shape[0], rows):
            z = torch.nn.functional.linear(hk[start : start + rows].to(dtype), wc).float()
            y = yk[start : start + rows]
            keep = y != IGNORE_INDEX  # all True unless every row was kept (no selection)
            picked = z.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
            lse[start : start + rows] = torch.logsumexp(z, dim=-1)
            total = total + torch.where(keep, lse[start : start + rows] - picked, 0.0).sum()
            del z
        ctx.save_for_backward(hk, w, yk, lse, index)
        ctx.rows, ctx.dtype, ctx.h_shape, ctx.all_rows = rows, dtype, h.shape, index is None
        ctx.group = group
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        hk, w, yk, lse, index = ctx.saved_tensors
        dtype, rows = ctx.dtype, ctx.rows
        wc = w.to(dtype)
        grad_hk = torch.empty_like(hk) if ctx.needs_input_grad[0] else None
        # The head's gradient is accumulated in fp32 over chunks (a 16-bit sum of many chunks would round).
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if ctx.needs_input_grad[1] else None
        for start in range(0, hk.shape[0], rows):
            end = start + rows
            hc = hk[start:end].to(dtype)
            p = torch.nn.functional.linear(hc, wc)
            p = p.float() if p.dtype != torch.float32 else p  # a fresh tensor either way: edited in place
            p = p.sub_(lse[start:end].unsqueeze(1)).exp_()  # softmax, from the forward's log-sum-exp
            y = yk[start:end]
            keep = (y != IGNORE_INDEX).unsqueeze(1)
            p.scatter_add_(1, y.clamp(min=0).unsqueeze(1), keep.to(p.dtype).neg())
            g = p.mul_(grad).masked_fill_(~keep, 0.0)  # d loss / d logits; ignored rows exactly 0
            del p
            if grad_hk is not None:
                grad_hk[start:end] = g.to(dtype) @ wc
            if grad_w is not None:
                if dtype == torch.float32:
                    grad_w.addmm_(g.t(), hc)
                else:
                    grad_w.add_(g.to(dtype).t() @ hc)
        grad_h = grad_hk
        if grad_hk is not None and not ctx.all_rows:
            grad_h = grad_hk.new_zeros(ctx.h_shape).index_copy_(0, index, grad_hk)
        if grad_w is not None:
            if ctx.group is not None:
                torch.distributed.all_reduce(grad_w, group=ctx.group)
            grad_w = grad_w.to(w.dtype)
        return grad_h, grad_w, None, None, None, None, None


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of (N, V) logits against (N,) targets (IGNORE_INDEX rows count nothing), in fp32,
    ``rows`` rows at a time. Backward: softmax minus one-hot, chunk by chunk, times the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)  # kept: N floats
        for start in range(0, logits.shape[0], rows):
            x = logits[start : start + rows].float()
            y = targets[start : start + rows]
            keep = y != IGNORE_INDEX
            picked = x.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
            lse[start : start + rows] = torch.logsumexp(x, dim=-1)
            total = total + torch.where(keep, lse[start : start + rows] - picked, 0.0).sum()
        ctx.save_for_backward(logits, targets, lse)
        ctx.rows = rows
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors
        out = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            end = start + ctx.rows
            p = logits[start:end].to(torch.float32, copy=True)  # a copy also for fp32 logits: edited in place
            p = p.sub_(lse[start:end].unsqueeze(1)).exp_()  # softmax, from the forward's log-sum-exp
            y = targets[start:end]
            keep = (y != IGNORE_INDEX).unsqueeze(1)
            p.scatter_add_(1, y.clamp(min=0).unsqueeze(1), keep.to(p.dtype).neg())
            out[start:end] = p.mul_(grad).masked_fill_(~keep, 0.0)  # ignored rows: exactly 0, even at inf
        return out, None, None
