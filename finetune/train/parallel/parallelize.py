"""Apply the Plan's strategy to a model: single process, DDP, ZeRO-1, ZeRO-2 or FSDP (torch.distributed).

Every strategy is torch's own:

- ``ddp``: ``DistributedDataParallel`` (gradients all-reduced and averaged in buckets during backward; the
  gradients are views into those buckets, see :func:`data_parallel`).
- ``zero1``: the same DDP wrapper; the optimizer is a ``ZeroRedundancyOptimizer`` (optimizer.build_optimizer), so
  each rank keeps the AdamW state of its share of the parameters and broadcasts its updated share.
- ``zero2``: FSDP2 ``fully_shard(block, reshard_after_forward=False)`` on every decoder block, then on the
  root: gradients and optimizer state are sharded, parameters stay gathered from forward to backward.
- ``fsdp``: the same with ``reshard_after_forward=True`` on the blocks (ZeRO-3): each block's parameters are
  all-gathered for its forward, freed, and gathered again for its backward.
- ``hsdp``: fsdp over a 2-D ``(dp_replicate, dp_shard)`` device mesh of (nodes, processes per node): each node's
  ranks shard the model among themselves (the all-gathers and reduce-scatters stay inside the node) and the
  nodes hold replicas, whose gradient shards are all-reduced across nodes after each reduce-scatter.
- ``train.offload`` (zero2/fsdp): FSDP2's ``CPUOffloadPolicy`` on every unit: shards, gradients, optimizer
  state and step in host memory (:func:`offload_policy`).

- ``distributed.tp: N`` (tensor parallelism): the linear layers of every decoder block are split over the
  ``tp`` ranks of a node by ``torch.distributed.tensor.parallel`` (``ColwiseParallel`` / ``RowwiseParallel``,
  as transformers' ``config.base_model_tp_plan`` names them), then zero2/fsdp shard over the data-parallel
  dimension (FSDP2 over TP's DTensors is 2-D). Embeddings, norms and
  the head are replicated over ``tp``; with ``distributed.sequence_parallel`` (the default) the norms, the
  residual stream, the embeddings' output and the head's rows in the loss are split over the sequence
  (:func:`apply_sequence_parallel`).

Order inside :func:`parallelize` (as torchtitan's ``parallelize``): tensor parallelism, then activation
checkpointing per block, then ``torch.compile`` per block (``train.compile``), then sharding bottom-up
(blocks, then the root) or DDP, then prefetch wiring. Checkpointing and compilation are applied here and
nowhere else, so they hold for every strategy and both load paths (a whole model, or one built on meta and
materialised after sharding). Everything is read from the execution spec (finetune/spec.py), and every mesh is
a view of the layout's one world mesh (finetune/train/parallel/layout.py: ``tp_mesh``, ``fsdp_mesh``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from finetune.errors import UserError
from finetune.model.adapters import base_model_of
from finetune.spec import ExecSpec
from finetune.train.parallel.distributed import DistContext
from finetune.units import torch_dtype


def parallelize(model: torch.nn.Module, spec: ExecSpec, ctx: DistContext) -> torch.nn.Module:
    """Apply the execution spec: tensor parallelism, activation checkpointing and compilation of the decoder
    blocks (every strategy), then the strategy's wrapping over the data-parallel ranks, on ``ctx``'s parallel
    layout (its meshes: :class:`~finetune.train.parallel.layout.ParallelLayout`).

    ``model`` may still be on the meta device (the sharded load path): compiling only marks each block, the
    graphs are traced at its first forward, after :func:`finetune.train.model.load.materialize`.
    """
    # each rank would train alone on its slice: refused by the capability table when the plan is made
    assert not (ctx.distributed and not spec.strategy.distributed), "strategy single on several processes"
    layout = ctx.layout
    assert (layout.tp, layout.pp, layout.ep, layout.fsdp) == (spec.tp, 1, spec.ep, spec.strategy.uses_fsdp) or (
        not ctx.distributed
    ), (
        "the context is laid out as the spec says (DistContext.laid_out), a whole model on every stage"
    )
    if spec.tensor_parallel:
        import logging

        # Gathering a TP x FSDP parameter (saving) is two all-gathers, which DTensor warns about on every
        # rank for every save; the cost is known and the result exact.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        apply_tensor_parallel(model, layout.tp_mesh, sequence_parallel=spec.sequence_parallel)
    if spec.ep > 1:
        from finetune.train.parallel.expert_parallel import apply_expert_parallel

        # Before checkpointing: a recomputed block dispatches its tokens again, as its forward did.
        apply_expert_parallel(model, layout.ep_mesh)
    if spec.checkpointing:
        # Before sharding, so that each block's recomputation sits inside the block FSDP gathers for it.
        apply_activation_checkpointing(model)
    if spec.compile:
        # After checkpointing (the checkpoint is traced into each block's graph) and before sharding: DDP's
        # reducer stays outside the blocks, and FSDP2's block hooks (all-gather, reshard) are dynamo-disabled,
        # so they run eagerly around each block's graph.
        compile_blocks(model)
    # offload is FSDP2's policy: the capability table admits it under zero2/fsdp only
    assert spec.offload == "none" or spec.strategy.uses_fsdp, "train.offload without zero2/fsdp"
    if not ctx.distributed:
        return model
    if spec.strategy.uses_fsdp:
        return apply_fsdp(model, spec, ctx)
    if layout.dp == 1:  # tp over every rank (one data-parallel replica, checked before launch): nothing to replicate
        return model
    assert not spec.tensor_parallel, "ddp/zero1 with tp and several replicas is refused before launch"
    return data_parallel(model, ctx)


# transformers' TP plan styles this trainer applies (torch's ColwiseParallel and RowwiseParallel)
_TP_STYLES = ("colwise", "rowwise")


def tensor_parallel_plan(model: torch.nn.Module) -> dict[str, str]:
    """Module name (relative to the base model's decoder, e.g. ``layers.0.self_attn.q_proj``) -> colwise |
    rowwise, from transformers' ``config.base_model_tp_plan`` (one clear sentence when there is none)."""
    import re

    base = base_model_of(model)
    arch = type(base).__name__
    tp_plan = getattr(base.config, "base_model_tp_plan", None)
    if not tp_plan:
        raise UserError(
            f"distributed.tp: {arch} has no tensor-parallel plan in transformers (config.base_model_tp_plan); "
            "set distributed.tp: 1 and shard it with fsdp instead"
        )
    decoder = getattr(base, base.base_model_prefix, base)
    names = [n for n, _ in decoder.named_modules()]
    out: dict[str, str] = {}
    for pattern, kind in tp_plan.items():
        if kind not in _TP_STYLES:
            raise UserError(
                f"distributed.tp: {arch}'s tensor-parallel plan splits {pattern} as `{kind}`, which finetune does "
                "not apply (only colwise and rowwise); set distributed.tp: 1"
            )
        rx = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        for n in names:
            if rx.fullmatch(n):
                out[n] = kind
    return out


def apply_tensor_parallel(
    model: torch.nn.Module, tp_mesh: Any, *, sequence_parallel: bool = False, pipeline_stage: bool = False
) -> None:
    """Split every decoder block's linears over ``tp_mesh`` (Megatron's column-then-row pairs).

    A column-parallel linear (q/k/v, gate/up) keeps ``out/tp`` output features on each rank and returns them
    as a local tensor, so attention runs on ``heads/tp`` heads and the MLP on ``intermediate/tp`` features;
    the row-parallel one that follows (o_proj, down_proj) takes them and all-reduces its output (one
    all-reduce per attention and one per MLP in forward; their input gradients are all-reduced in backward).

    LoRA adapters are split the same way (docs/architecture.md, "Tensor parallelism"): on a column-parallel
    layer lora_A stays replicated and lora_B is column-split, so the adapter's output has the base layer's
    local columns; on a row-parallel layer lora_A is row-split (its input is the local shard) and lora_B
    replicated, after lora_A's all-reduce.

    ``sequence_parallel``: Megatron's sequence parallelism on top (:func:`apply_sequence_parallel`;
    ``pipeline_stage``: the model is a pipeline stage, which may lack the embeddings and the final norm).
    """
    from torch.distributed.tensor import Shard, distribute_module
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    base = base_model_of(model)
    decoder = getattr(base, base.base_model_prefix, base)
    # Under sequence parallelism a row-parallel linear reduce-scatters its output over the sequence (a DTensor
    # sharded on dim 1, which the residual add and the next norm take as it is) in place of the all-reduce.
    rowwise = (
        (lambda: RowwiseParallel(output_layouts=Shard(1), use_local_output=False))
        if sequence_parallel
        else RowwiseParallel
    )
    styles: dict[str, Any] = {}
    replicated: list[str] = []
    for name, kind in tensor_parallel_plan(model).items():
        module = decoder.get_submodule(name)
        style = ColwiseParallel if kind == "colwise" else rowwise
        if isinstance(module, torch.nn.Linear):
            styles[name] = style()
            continue
        base_layer = getattr(module, "base_layer", None)  # a peft LoRA layer around the linear
        if not isinstance(base_layer, torch.nn.Linear):
            raise UserError(
                f"distributed.tp: {name} is a {type(module).__name__}, not a linear layer tensor parallelism can "
                "split (quantized weights cannot be split); set distributed.tp: 1"
            )
        styles[f"{name}.base_layer"] = style()
        split = "lora_B" if kind == "colwise" else "lora_A"
        for adapter in getattr(module, split, {}):
            styles[f"{name}.{split}.{adapter}"] = style()
            if sequence_parallel and kind == "rowwise":
                # lora_A's output is reduce-scattered like the base layer's; the replicated lora_B then maps
                # this rank's rows, so its output adds to the base layer's sequence shard
                styles[f"{name}.lora_B.{adapter}"] = SequenceParallel()
            elif sequence_parallel:
                # the gathered input is a replicated DTensor (apply_sequence_parallel): lora_A, replicated,
                # takes it as one (its gradient then sums the ranks' partial ones, as the norms' do)
                replicated.append(f"{name}.lora_A.{adapter}")
    with _frozen_kept(decoder):
        parallelize_module(decoder, tp_mesh, styles)
        for name in replicated:
            distribute_module(decoder.get_submodule(name), tp_mesh)
    for name, style in styles.items():
        if isinstance(style, SequenceParallel):  # a row-parallel lora_B (above)
            decoder.get_submodule(name).register_forward_pre_hook(_contiguous_shard)
    if sequence_parallel:
        apply_sequence_parallel(model, tp_mesh, pipeline_stage=pipeline_stage)


def apply_sequence_parallel(model: torch.nn.Module, tp_mesh: Any, *, pipeline_stage: bool = False) -> None:
    """Megatron's sequence parallelism over TP's ranks (torch's ``SequenceParallel``, as torchtitan applies it):
    between the blocks' linears every rank holds ``T/tp`` positions of the residual stream.

    - the embedding's output is split over the sequence (each rank keeps its rows of the replicated lookup;
      backward all-gathers its gradient);
    - the norms of every block and the final norm run on the rank's rows (``SequenceParallel``: weights
      replicated, their gradients summed over the ranks);
    - the module around the column-parallel linears (the attention, the MLP) all-gathers its input once, so
      q/k/v (gate/up) and the rotary embedding see whole sequences (the rotary table is computed by the model
      on the whole sequence before the blocks); the row-parallel linears reduce-scatter their outputs
      (:func:`apply_tensor_parallel`): one all-gather and one reduce-scatter per attention and per MLP in place
      of one all-reduce, the same bytes in a ring;
    - the head: inside :func:`finetune.objectives.loss.causal_lm_loss` the final norm hands it the rank's rows and the loss
      is computed on them (:class:`~finetune.objectives.loss.SequenceShard`); any other forward (generation, the
      preference objectives' log-probabilities) gathers the whole sequence for it.

    Llama-style blocks have no dropout on the residual stream; the attention's dropout runs on each rank's
    heads as without sequence parallelism.

    ``pipeline_stage``: ``model`` is a pipeline stage (finetune.train.parallel.pipeline), whose embeddings exist on the
    first stage only and whose final norm and head on the last only; the stages pass each rank's rows.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel, parallelize_module

    from finetune.objectives.loss import SEQUENCE_SHARD, SequenceShard

    base = base_model_of(model)
    decoder = getattr(base, base.base_model_prefix, base)
    blocks = decoder_blocks(model)
    styles: dict[str, Any] = {}
    names = {id(m): n for n, m in decoder.named_modules()}
    for block in blocks:
        for child_name, child in block.named_children():
            if "Norm" in type(child).__name__:
                styles[f"{names[id(block)]}.{child_name}"] = SequenceParallel()
    final = [n for n, m in decoder.named_children() if "Norm" in type(m).__name__]
    embed = base.get_input_embeddings()
    found = len(final) == 1 and id(embed) in names
    if pipeline_stage:  # a stage without the embeddings (not the first) or the final norm (not the last)
        found = len(final) <= 1 and (embed is None or id(embed) in names)
    if not found or not styles:
        raise UserError(
            f"distributed.sequence_parallel: finetune cannot find the embeddings and norms of "
            f"{type(base).__name__}'s residual stream; set distributed.sequence_parallel: false"
        )
    if final:
        styles[final[0]] = SequenceParallel()
    if embed is not None:
        styles[names[id(embed)]] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        )
    with _frozen_kept(decoder):
        parallelize_module(decoder, tp_mesh, styles)
    # one all-gather at the input of each module that holds column-parallel linears
    block_ids, gathering = {id(b) for b in blocks}, set()
    for name, kind in tensor_parallel_plan(model).items():
        parent = decoder.get_submodule(name.rpartition(".")[0])
        if kind != "colwise" or id(parent) in gathering:
            continue
        if id(parent) in block_ids:
            raise UserError(
                f"distributed.sequence_parallel: {name} sits directly in a decoder block of {type(base).__name__}, "
                "so its input cannot be gathered apart from the residual stream; set distributed.sequence_parallel: "
                "false"
            )
        parent.register_forward_pre_hook(_gather_sequence, with_kwargs=True)
        gathering.add(id(parent))
    shard = SequenceShard(rank=tp_mesh.get_local_rank(), size=tp_mesh.size(), group=tp_mesh.get_group())
    head = base.get_output_embeddings()
    if head is not None:
        setattr(head, SEQUENCE_SHARD, shard)
    if final:
        decoder.get_submodule(final[0]).register_forward_hook(lambda m, a, out: shard.hand_over(out))
    # Without FSDP the replicated weights that run on sequence shards (norms, a row-parallel lora_B) keep their
    # gradients as partial sums until summed here; FSDP2 sums them itself before its reduce-scatter (and its
    # parameters are other tensors, on which these hooks do not run).
    for p in decoder.parameters():
        if p.requires_grad and _replicated(p):
            p.register_post_accumulate_grad_hook(_sum_partial_grad)


@contextlib.contextmanager
def _frozen_kept(module: torch.nn.Module) -> Any:
    """Parameters frozen before (a LoRA base's norms) frozen after: torch's styles that replicate a weight
    (``SequenceParallel``, ``distribute_module``) make it a new parameter that requires a gradient."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    yield
    for name, p in module.named_parameters():
        if name in frozen:
            p.requires_grad_(False)


def _gather_sequence(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: every sequence-sharded DTensor input all-gathered into a replicated DTensor.

    The column-parallel linears take it as it is; in backward their partial input gradients add up as one
    partial DTensor, reduce-scattered once back to the sequence shards (a local tensor would be all-reduced
    by each linear).
    """
    from torch.distributed.tensor import DTensor, Replicate

    def whole(x: Any) -> Any:
        return x.redistribute(placements=[Replicate()]) if isinstance(x, DTensor) else x

    return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}


def _contiguous_shard(module: torch.nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: a DTensor input whose local shard is not contiguous (the shorter shard of an uneven
    reduce-scatter is a narrowed view), with a contiguous copy of it: ``nn.Linear`` views its input flat."""
    from torch.distributed.tensor import DTensor

    x = args[0]
    if not isinstance(x, DTensor):
        return args
    local = x.to_local()
    if local.is_contiguous():
        return args
    whole = DTensor.from_local(local.contiguous(), x.device_mesh, x.placements, shape=x.shape, stride=x.stride())
    return (whole, *args[1:])


def _replicated(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Replicate

    return isinstance(p, DTensor) and all(isinstance(pl, Replicate) for pl in p.placements)


def _sum_partial_grad(p: torch.Tensor) -> None:
    """Post-accumulate-grad hook: a partial-sum gradient of a replicated weight, summed over its ranks."""
    grad: Any = p.grad
    if grad is not None and tuple(grad.placements) != tuple(p.placements):  # type: ignore[attr-defined]
        p.grad = grad.redistribute(placements=p.placements)  # type: ignore[attr-defined]


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder block in backward (non-reentrant torch.utils.checkpoint)."""
    base = base_model_of(model)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(base, "enable_input_require_grads"):
        # With a frozen embedding, the checkpointed blocks' inputs must require grad for backward to reach them.
        base.enable_input_require_grads()


def compile_blocks(model: torch.nn.Module) -> int:
    """``torch.compile`` every decoder block in place (``nn.Module.compile``), block by block as torchtitan
    does; returns how many blocks were compiled.

    The blocks share their code, so the graphs dynamo traces for the first serve all. Each block stays where
    it is, with its name and parameters (no ``_orig_mod`` wrapper: state-dict keys and checkpoints are those
    of an eager run); its ``_compiled_call_impl`` (the compiled ``_call_impl``: hooks and forward) runs in
    place of the eager call. The head, loss and embeddings stay eager.
    """
    blocks = decoder_blocks(model)
    for block in blocks:
        block.compile()
    return len(blocks)


def is_compiled(block: torch.nn.Module) -> bool:
    """Whether ``block`` runs through ``torch.compile`` (``nn.Module.compile`` was applied to it)."""
    return getattr(block, "_compiled_call_impl", None) is not None


def data_parallel(model: torch.nn.Module, ctx: DistContext, bucket_view: bool = True) -> torch.nn.Module:
    """DistributedDataParallel over the trainable parameters (ddp, and zero1 under its sharded optimizer).

    ``bucket_view`` (``gradient_as_bucket_view``): each gradient is a view into DDP's all-reduce buckets,
    which then hold the only copy of the gradients. Backward still computes each parameter's gradient into a
    tensor of its own (the optimizer sets them to None after every step); DDP copies it into its bucket,
    divided by the world size, and points ``.grad`` at the bucket at once, so one parameter's gradient at a
    time exists twice. Under gradient accumulation the non-final micro-batches run under ``no_sync``, where
    DDP does not touch the gradients: those are ordinary tensors beside the buckets until the final
    micro-batch's backward copies them in. ``False`` (torch's default) keeps the buckets as a second copy of
    every gradient (scripts/ddp_bucket_memory.py measures both).
    """
    from torch.nn.parallel import DistributedDataParallel

    from finetune.versions import ddp_no_buffer_sync

    # Frozen weights (a LoRA base, QLoRA's 4-bit codes) are identical on every rank by construction (same
    # checkpoint, or the same seed) and never change: broadcasting them at wrap time would only cost time.
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # No buffer sync before every forward: the only buffers are rotary tables, identical on every rank.
    return DistributedDataParallel(
        model, device_ids=device_ids, gradient_as_bucket_view=bucket_view, **ddp_no_buffer_sync()
    )


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated decoder blocks, found generically: the classes its ``_no_split_modules`` names.

    transformers lists there the block class that must never be split across devices (LlamaDecoderLayer,
    Qwen2DecoderLayer, GPT2Block, ...), which is exactly the unit FSDP should shard and gather as one. A
    model without it falls back to the children of its longest ``nn.ModuleList``.
    """
    base = base_model_of(model)
    names = set(getattr(base, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if lists:
        longest: torch.nn.ModuleList = max(lists, key=len)
        return list(longest)
    raise UserError(
        f"distributed.strategy: cannot find the decoder blocks of {type(base).__name__} to shard "
        "(no _no_split_modules and no ModuleList); use ddp or zero1"
    )


def mixed_precision_policy(spec: ExecSpec) -> Any:
    """FSDP2's policy: 16-bit parameters for compute and fp32 gradient reduction (bf16/fp16), else none."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if spec.fsdp_param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=torch_dtype(spec.fsdp_param_dtype), reduce_dtype=torch_dtype(spec.reduce_dtype or "fp32")
    )


def offload_policy(spec: ExecSpec, device: torch.device) -> Any:
    """FSDP2's offload policy for ``train.offload`` (finetune/recipe/capabilities.py admits it under zero2/fsdp only).

    ``optimizer`` (zero2) and ``parameters`` (fsdp) are both torch's ``CPUOffloadPolicy``: the sharded fp32
    parameters, their gradients and the optimizer state live in host memory, the optimizer step runs on the
    host, and each unit's shard is copied to the device before its all-gather (gradients come back after
    their reduce-scatter). What stays on the device is what the strategy gathers: every unit from its forward
    to its backward under zero2 (the compute copy ZeRO-Offload keeps), one unit at a time under fsdp.
    Pinned host memory where there is a GPU to copy to; on a CPU device the copies are no-ops (the host is the
    device) and pinning needs an accelerator, so it is off. ``none``: FSDP2's default (no offload).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if spec.offload == "none":
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type != "cpu")


def apply_fsdp(model: torch.nn.Module, spec: ExecSpec, ctx: DistContext) -> torch.nn.Module:
    """FSDP2 per decoder block and at the root, over the layout's FSDP mesh (``dp_shard``; hsdp's 2-D
    ``(dp_replicate, dp_shard)``, sharded over the second dimension and replicated over the first); ZeRO-2
    keeps parameters gathered after forward; ``spec.offload`` keeps the shards and the optimizer step in host
    memory (:func:`offload_policy`). A pipeline stage model is sharded as a whole one."""
    from torch.distributed.fsdp import fully_shard

    layout = ctx.layout
    if layout.hybrid:
        # torchrun numbers the ranks node by node: a node's ranks are one row of the mesh (dp_shard)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", layout.dp_shard))
        assert local == layout.dp_shard, (
            f"hsdp over {layout.dp_replicate} nodes of {layout.dp_shard} processes, but this node runs {local}"
        )
    mesh = layout.fsdp_mesh
    policy = mixed_precision_policy(spec)
    _check_quantized_storage(model, policy.param_dtype)
    offload = offload_policy(spec, ctx.device)
    reshard = spec.reshard_after_forward
    if layout.ep_enabled:
        _shard_experts_units(model, layout, reshard, policy, offload)
    blocks = [  # fully_shard returns the module it sharded in place, typed as an FSDPModule
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
        for block in decoder_blocks(model)
    ]
    # The root (embeddings, final norm, head) is needed again as soon as backward starts: never reshard it.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=offload)
    # Explicit prefetch: gather block i+1's parameters while block i computes (i-1 in backward).
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0 and reshard:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])
    return model


def _shard_experts_units(model: torch.nn.Module, layout: Any, reshard: bool, policy: Any, offload: Any) -> None:
    """Expert parallelism: each experts module (its weights DTensors on the ep mesh,
    finetune/train/parallel/expert_parallel.py) an FSDP2 unit of its own over the expert mesh (what ep leaves of
    dp_shard), before its block's unit takes the block's other weights over the whole of dp_shard.

    An expert's gradient on its ep rank already sums every ep rank's tokens; FSDP2 sums it over the expert's
    replicas and divides by the whole data-parallel degree (its default would divide by the expert mesh's
    size alone), as the dense weights are divided, with plain sums on the wire (gloo has no pre-scaled sum).
    """
    from torch.distributed.fsdp import fully_shard

    from finetune.train.parallel.expert_parallel import EP_ATTR

    mesh = layout.expert_fsdp_mesh
    for module in [m for m in model.modules() if hasattr(m, EP_ATTR)]:
        unit: Any = fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy,
                                offload_policy=offload)
        unit.set_gradient_divide_factor(float(layout.dp))
        if mesh.size() > 1:  # over one rank FSDP2 divides while copying, and a forced sum would divide again
            unit.set_force_sum_reduction_for_comms(True)


def _check_quantized_storage(model: torch.nn.Module, param_dtype: torch.dtype | None) -> None:
    """4-bit codes must never be cast by the mixed precision policy.

    FSDP2 leaves integer storage (uint8) alone and shards it like any parameter; codes packed into a float
    dtype (``bnb_4bit_quant_storage``) are safe only when that dtype is the policy's compute dtype.
    bitsandbytes restores each weight's quantization state after FSDP's all-gather (its
    ``fix_4bit_weight_quant_state_from_module``).
    """
    if param_dtype is None:
        return
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if w is None or type(w).__name__ != "Params4bit":
            continue
        # a pinned quantization.compute_dtype other than the run's is refused by the capability table
        assert not (w.dtype.is_floating_point and w.dtype != param_dtype), (
            f"the 4-bit weights of {name} are stored as {w.dtype} but FSDP computes in {param_dtype}"
        )


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (zero2 / fsdp)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def has_dtensors(model: torch.nn.Module) -> bool:
    """Whether some parameter of ``model`` is a DTensor (tensor parallelism, FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside a DDP wrapper (FSDP2 shards in place, so there is nothing to unwrap)."""
    return getattr(model, "module", model)


def no_sync(model: torch.nn.Module, enabled: bool, *, every_micro_batch: bool = False) -> Any:
    """Skip gradient synchronisation for a non-final micro-batch (DDP's no_sync, FSDP2's gradient sync flag).

    DDP decides in forward, so its context wraps the forward. FSDP2 decides in backward, which runs after the
    context exits: the flag is set here and stays set until the next call, and the loop calls this for every
    micro-batch (``enabled=False`` on the last), so the final backward always reduces.

    ``every_micro_batch`` (the execution spec's ``sync_every_micro_batch``: FSDP2's strategies) keeps FSDP2's
    reduce-scatter on for every micro-batch, so that no unit keeps its unsharded gradient past its backward;
    under hsdp only the all-reduce across the replicas waits for the last micro-batch (the partial sums stay
    sharded until then).
    """
    wrapped: Any = model  # an FSDPModule or a DistributedDataParallel, told apart by their methods
    if hasattr(wrapped, "set_requires_gradient_sync"):
        if every_micro_batch:
            wrapped.set_requires_gradient_sync(True)
            wrapped.set_requires_all_reduce(not enabled)
        else:
            wrapped.set_requires_gradient_sync(not enabled)
        return contextlib.nullcontext()
    if enabled and hasattr(wrapped, "no_sync"):
        return wrapped.no_sync()
    return contextlib.nullcontext()


def full_state_dict(model: torch.nn.Module, ctx: DistContext) -> dict[str, Any] | None:
    """The full (unsharded) state dict on rank 0 for sharded strategies; None means "the module's own".

    Every rank must call this under FSDP: it all-gathers each parameter (to CPU, rank 0 keeps the result;
    other ranks get an empty dict).
    """
    if not ctx.distributed or not (is_sharded(model) or has_dtensors(model)):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

