"""Pipeline parallelism (``distributed.pp``): the decoder layers run as stages on ``pp`` ranks, driven by a
``torch.distributed.pipelining`` schedule (GPipe, 1F1B or interleaved 1F1B).

Stages keep their names. A rank's stage model is the whole model with the decoder layers it does not own
removed (the layer list becomes a dict keyed by each layer's index), the input embeddings kept on the first
stage only, the final norm and the output head on the last only (torchtitan's approach): a weight keeps its
fully qualified name (``model.layers.7.self_attn.q_proj.weight``) on whichever stage holds it, so the
optimizer's, the checkpoint's and the final save's names are those of one process, and a DCP checkpoint
saved on one pipeline layout loads on another. A rank of the interleaved schedule holds its stages (one
every ``pp`` stages: looped placement) in one such model; each stage is a view that runs its layers.

One device mesh ``(pp, dp, tp)``, pp outermost and tp innermost (the ranks of a TP group are neighbours,
inside one node): tensor parallelism over ``tp`` and FSDP2 (zero2/fsdp) over ``dp`` apply to each stage
model as to a whole one, then the schedule sends the hidden states between the ``pp`` ranks of the same
``(dp, tp)`` position. With sequence parallelism (``distributed.sequence_parallel``, the default with tp) each
stage runs it as a whole model does (finetune.train.parallel.apply_sequence_parallel): the first stage's
embeddings output this tp rank's rows, a stage sends its rows ``(B, T/tp, H)`` as a plain tensor and the next
wraps them back into the sequence-sharded DTensor, and the last stage's final norm, head and loss run on the
rank's rows (:class:`finetune.loss.SequenceShard`, the loss summed over tp). The rows are padded to a multiple
of ``tp`` so the shards are even.

The step: the gradient-accumulation micro-batches are the pipeline's micro-batches, padded to
``data.max_seq_len`` (rounded up to a multiple of ``tp`` under sequence parallelism: a stage's receive buffers
have one shape for the whole run). The last stage computes
each micro-batch's summed token loss (the fused head) and scales it by ``dp / global target tokens``, the
count every rank knows before the step (every rank has the batch's labels), with the schedule's own
scaling off (``scale_grads=False``): gradients are exactly one process's. The summed loss is broadcast from
the last stage to the others for logging; the gradient norm is reduced over every stage.

Evaluation runs forward only, batch by batch through the stages with point-to-point sends (any batch
shape, attention masks included); exact match generates greedily without a KV cache, one pipeline
forward per new token.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from finetune import attention
from finetune.adapters import base_model_of
from finetune.errors import UserError
from finetune.loss import (
    FUSED_HEAD,
    IGNORE_INDEX,
    LOSS_CHUNK_BYTES,
    SEQUENCE_SHARD,
    SequenceShard,
    _ChunkedCrossEntropy,
    fusable_head,
    fused_head,
    known_documents,
    shifted_labels,
)
from finetune.recipe import LoadedRecipe
from finetune.spec import ExecSpec
from finetune.train.distributed import DistContext


@dataclass
class PipelineContext(DistContext):
    """:class:`DistContext` on a ``(pp, dp, tp)`` mesh: the ``pp`` ranks of one data-parallel position read the
    same batch, so data-parallel indices and sums skip both the tp and the pp dimension."""

    pp: int = 1

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (the middle dimension of the mesh)."""
        return (self.rank // self.tp) % self.dp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas (processes / (pp x tp))."""
        return self.world_size // (self.tp * self.pp)

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline index (the outermost dimension)."""
        return self.rank // (self.world_size // self.pp)

    def data_sum(self, value: float | torch.Tensor, *, on_device: bool = False) -> torch.Tensor:
        """Sum a per-replica value over the data-parallel replicas (every rank of a replica holds it)."""
        return self.all_reduce_sum(value, on_device=on_device) / (self.tp * self.pp)


def pipeline_context(ctx: DistContext, spec: ExecSpec) -> PipelineContext:
    """``ctx`` as a rank of ``spec``'s ``(pp, dp, tp)`` mesh."""
    return PipelineContext(ctx.rank, ctx.world_size, ctx.local_rank, ctx.device, tp=spec.tp, pp=spec.pp)


def stage_layers(spec: ExecSpec) -> list[range]:
    """The decoder layers of each stage, in stage order (``spec.pp_layers`` counts them)."""
    out, start = [], 0
    for n in spec.pp_layers:
        out.append(range(start, start + n))
        start += n
    return out


def local_stages(spec: ExecSpec, pp_rank: int) -> list[int]:
    """The stages ``pp_rank`` runs: one every ``pp`` stages (looped placement; one stage without interleaving)."""
    return list(range(pp_rank, len(spec.pp_layers), spec.pp))


# -- the stage model ---------------------------------------------------------------------------------------


def _decoder(model: torch.nn.Module) -> tuple[Any, Any]:
    """(the causal LM, its decoder) under any peft wrapper."""
    base: Any = base_model_of(model)
    return base, getattr(base, base.base_model_prefix)


def check_stageable(model: torch.nn.Module) -> None:
    """One sentence naming ``distributed.pp`` when the model cannot be cut into stages."""
    from finetune.capabilities import stage_problem

    base, decoder = _decoder(model)
    problem = stage_problem(base.config)  # the stage forward reproduces Llama's family's decoder forward
    if problem is not None:
        raise UserError(problem)
    assert isinstance(decoder.layers, torch.nn.ModuleList), "a decoder's layers are a ModuleList"


def prune_to_stages(model: torch.nn.Module, layers: list[int], first: bool, last: bool) -> None:
    """Keep only ``layers`` of the decoder (keyed by their index: the names stay the whole model's), the input
    embeddings when this rank runs the first stage, the final norm and the head when it runs the last."""
    base, decoder = _decoder(model)
    kept = torch.nn.ModuleDict({str(i): decoder.layers[i] for i in layers})
    decoder.layers = kept
    if not first:
        decoder.embed_tokens = None
    if not last:
        decoder.norm = None
        base.lm_head = None


def _mask_and_positions(
    decoder: Any, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
) -> tuple[Any, Any, torch.Tensor]:
    """The causal mask, the rotary embeddings and the positions of a stage's input, as the decoder's own forward
    computes them (training rows: no mask, positions 0..T-1, the causal kernel)."""
    from transformers.masking_utils import create_causal_mask

    from finetune.versions import kv_cache_kwarg

    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    unpacked = known_documents({}) if attention_mask is None else contextlib.nullcontext()
    with unpacked:
        mask = create_causal_mask(
            config=decoder.config, inputs_embeds=hidden, attention_mask=attention_mask, position_ids=position_ids,
            **kv_cache_kwarg(None),
        )
    return mask, decoder.rotary_emb(hidden, position_ids=position_ids), position_ids


def head_loss(base: Any, norm: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of the head over ``norm(hidden)`` against the shifted ``targets`` (the
    fused head where the model allows it, as :func:`finetune.loss.causal_lm_loss`). Under sequence parallelism
    the final norm hands the fused head this tp rank's rows and the loss is summed over the tp ranks
    (:class:`finetune.loss.SequenceShard`, as ``causal_lm_loss`` runs it); an unfused head gets the whole
    sequence."""
    head = fusable_head(base)
    if head is not None and FUSED_HEAD:
        shard: SequenceShard | None = getattr(head, SEQUENCE_SHARD, None)
        if shard is not None:
            start, end = shard.bounds(targets.shape[1])
            with shard.rows(), fused_head(head, targets[:, start:end], None, shard.group):
                return shard.total(head(norm(hidden)))
        with fused_head(head, targets):
            return head(norm(hidden))
    logits = base.get_output_embeddings()(norm(hidden))
    rows = max(1, LOSS_CHUNK_BYTES // (4 * logits.shape[-1]))
    return _ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), rows)


class StageRunner:
    """What a rank's stage model computes for each of its stages (its forward is patched to :meth:`forward`)."""

    def __init__(
        self, model: torch.nn.Module, spec: ExecSpec, stages: list[int], autocast: Callable[[], Any],
        tp_mesh: Any = None,
    ) -> None:
        self.model, self.stages, self.autocast = model, stages, autocast
        self.layers = stage_layers(spec)
        self.n_stages = len(self.layers)
        self.tp_mesh = tp_mesh  # under sequence parallelism: the stages pass each tp rank's rows

    def run(
        self, stage: int, x: torch.Tensor, labels: torch.Tensor | None = None, *,
        attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
        last_logits: bool = False, length: int | None = None,
    ) -> torch.Tensor:
        """Stage ``stage`` on ``x`` (token ids on the first stage, hidden states after): the hidden states, or on
        the last stage the summed loss against ``labels`` (the last position's logits with ``last_logits``).

        Under sequence parallelism the hidden states in and out are this tp rank's rows of the sequence, a plain
        ``(B, rows, H)`` tensor; ``length``: the whole sequence's (the rows times tp when not given)."""
        from torch.distributed.tensor import DTensor, Shard

        base, decoder = _decoder(self.model)
        if not getattr(self.model, attention.MARK, False):
            attention.enable(self.model)
        with self.autocast():
            if stage == 0:
                hidden = decoder.embed_tokens(x)  # under sequence parallelism: a Shard(1) DTensor
            elif self.tp_mesh is not None:
                b, rows, h = x.shape
                t = rows * self.tp_mesh.size() if length is None else length
                hidden = DTensor.from_local(
                    x, self.tp_mesh, [Shard(1)], run_check=False, shape=torch.Size((b, t, h)), stride=(t * h, h, 1)
                )
            else:
                hidden = x
            mask, rotary, positions = _mask_and_positions(decoder, hidden, attention_mask, position_ids)
            for i in self.layers[stage]:
                hidden = decoder.layers[str(i)](
                    hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions
                )
            if stage < self.n_stages - 1:
                return hidden.to_local() if isinstance(hidden, DTensor) else hidden
            if last_logits:  # the final norm hands the head the whole sequence (SequenceShard)
                return base.get_output_embeddings()(decoder.norm(hidden)[:, -1:]).float()[:, 0]
            assert labels is not None, "the last stage's loss needs the labels"
            return head_loss(base, decoder.norm, hidden, labels)


class _VirtualStage(torch.nn.Module):
    """One stage of a rank that runs several (interleaved 1F1B): calls the rank's stage model for its stage.
    It holds no parameters of its own (the model is not registered as a child)."""

    def __init__(self, model: torch.nn.Module, stage: int) -> None:
        super().__init__()
        object.__setattr__(self, "_stage_model", model)
        self.stage = stage

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        model: Any = self.__dict__["_stage_model"]
        return model(x, labels, stage=self.stage)


def _patch_forward(model: torch.nn.Module, runner: StageRunner) -> None:
    """The stage model's ``forward(x, labels=None, *, stage=None)``: one of its stages (the only one without
    ``stage``). Set on the instance, so FSDP2's hooks (registered on the module) run around it."""

    def forward(self: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor | None = None, *, stage: int | None = None,
                **kw: Any) -> torch.Tensor:
        return runner.run(runner.stages[0] if stage is None else stage, x, labels, **kw)

    model.forward = types.MethodType(forward, model)


# -- building and wrapping ---------------------------------------------------------------------------------


def build_mesh(spec: ExecSpec, ctx: DistContext) -> Any:
    """The ``(pp, dp, tp)`` device mesh of the run (pp outermost, tp innermost)."""
    from torch.distributed.device_mesh import init_device_mesh

    assert ctx.world_size == spec.world_size, "the launcher starts the plan's processes"
    return init_device_mesh(ctx.device.type, (spec.pp, spec.dp, spec.tp), mesh_dim_names=("pp", "dp", "tp"))


def build_stage_model(
    loaded: LoadedRecipe, spec: ExecSpec, ctx: PipelineContext, mesh: Any, base_dir: Path | None
) -> tuple[torch.nn.Module, list[int], tuple[int, int]]:
    """This rank's stage model: built on meta, cut to its stages, tensor-parallel over ``tp``, sharded over
    ``dp`` (zero2/fsdp), then this rank's tensors alone loaded (finetune/train/load.py). Returns the model, its
    stages and the whole model's (trainable, total) parameter counts.

    ``base_dir``: rank 0 of an adapter run from a random init writes the whole seeded base there.
    """
    from finetune.train.load import build_on_meta, materialize
    from finetune.train.model import count_parameters
    from finetune.train.parallel import _fully_shard, apply_activation_checkpointing, apply_tensor_parallel

    model = build_on_meta(loaded, spec, ctx.device)
    check_stageable(model)
    counts = count_parameters(model)
    n_layers = len(_decoder(model)[1].layers)
    if sum(spec.pp_layers) != n_layers:
        raise UserError(
            f"distributed.pp_layers: the stages hold {sum(spec.pp_layers)} decoder layers but the model has "
            f"{n_layers}; give {len(spec.pp_layers)} counts that add up to {n_layers}"
        )
    stages = local_stages(spec, ctx.pp_rank)
    layers = stage_layers(spec)
    if spec.checkpointing:  # on the whole model (its input-embedding hook), before the layers are cut
        apply_activation_checkpointing(model)
    prune_to_stages(
        model, [i for s in stages for i in layers[s]], first=0 in stages, last=len(layers) - 1 in stages
    )
    if spec.tensor_parallel:
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=spec.sequence_parallel, pipeline_stage=True)
    if spec.strategy.uses_fsdp:
        model = _fully_shard(model, spec, ctx, mesh["dp"])
    materialize(model, loaded, spec, ctx.device, None)
    if base_dir is not None:
        _write_seeded_base(loaded, spec, base_dir)
    return model, stages, counts


def _write_seeded_base(loaded: LoadedRecipe, spec: ExecSpec, base_dir: Path) -> None:
    """The whole seeded random base (``model.init: random`` of an adapter run), for merge and reloading: built
    on this rank alone, without moving the run's random generators."""
    from finetune.train.load import _seeded_model
    from finetune.train.model import save_pretrained_base

    with torch.random.fork_rng(devices=[]):
        save_pretrained_base(_seeded_model(loaded, spec), base_dir)


# -- the pipeline: the step, the gradient norm, evaluation, the final save -----------------------------------


def stage_meta_args(spec: ExecSpec, stage: int, n_stages: int, rows: int, width: int, hidden: int) -> dict[str, Any]:
    """``input_args`` and ``output_args`` of (virtual) stage ``stage`` for torch's ``PipelineStage``, as meta
    tensors of one micro-batch of ``rows`` rows and ``width`` columns: token ids into the first stage, hidden
    states between stages (this tp rank's ``width / tp`` rows of the sequence under sequence parallelism) in the
    residual stream's dtype (FSDP2's compute dtype, else the stored weights'), the summed loss out of the last.
    Given both, the stages skip the schedule's shape inference on the first step, whose ``autograd.grad`` the
    memory probe's module hooks refuse on CPU."""
    tokens = width // spec.tp if spec.sequence_parallel else width
    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[
        spec.fsdp_param_dtype or spec.base_dtype(False)])
    states = torch.empty((rows, tokens, hidden), dtype=dtype, device="meta", requires_grad=True)  # gradients back
    ids = torch.empty((rows, width), dtype=torch.long, device="meta")
    loss = torch.empty((), dtype=torch.float32, device="meta")
    return {
        "input_args": ids if stage == 0 else states,
        "output_args": loss if stage == n_stages - 1 else states,
    }


@dataclass
class Pipeline:
    """A rank's stages, their schedule and the pp group: what the trainer calls instead of the plain step."""

    model: torch.nn.Module
    spec: ExecSpec
    ctx: PipelineContext
    mesh: Any
    stages: list[int]
    runner: StageRunner
    width: int  # every micro-batch's columns (data.max_seq_len; a multiple of tp under sequence parallelism)
    pad_id: int
    n_microbatches: int
    scaler: Any = None
    schedule: Any = None
    _scale: torch.Tensor | None = None
    _sums: list[torch.Tensor] = field(default_factory=list)

    @property
    def group(self) -> Any:
        """The pp process group of this rank (its ``(dp, tp)`` position's ranks)."""
        return self.mesh["pp"].get_group()

    @property
    def first(self) -> bool:
        return 0 in self.stages

    @property
    def last(self) -> bool:
        return self.runner.n_stages - 1 in self.stages

    @property
    def last_owner(self) -> int:
        """The pp index of the rank that runs the last stage."""
        return (self.runner.n_stages - 1) % self.spec.pp

    def build_schedule(self, rows: int = 1) -> None:
        """The schedule over this rank's stages (scale_grads off: the loss is normalised by the global count),
        each stage given the shapes of its micro-batches of ``rows`` rows (:func:`stage_meta_args`)."""
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        n = self.runner.n_stages
        submods = [self.model] if len(self.stages) == 1 else [_VirtualStage(self.model, s) for s in self.stages]
        config: Any = self.model.config
        stages = [
            PipelineStage(
                m, stage_index=s, num_stages=n, device=self.ctx.device, group=self.group,
                **stage_meta_args(self.spec, s, n, rows, self.width, int(config.hidden_size)),
            )
            for m, s in zip(submods, self.stages, strict=True)
        ]
        kind = self.spec.pp_schedule
        if kind == "interleaved-1f1b":
            if self.n_microbatches % self.spec.pp:
                raise UserError(
                    f"distributed.pp_schedule: interleaved-1f1b needs the micro-batches of a step "
                    f"({self.n_microbatches}, the gradient accumulation) to be a multiple of distributed.pp "
                    f"({self.spec.pp}); change train.global_batch_size or train.micro_batch_size, or use 1f1b"
                )
            self.schedule = ScheduleInterleaved1F1B(list(stages), self.n_microbatches, loss_fn=self._loss, scale_grads=False)
        else:
            cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
            self.schedule = cls(stages[0], self.n_microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        """The last stage's loss of one micro-batch: its summed token loss times ``dp / global tokens``."""
        assert self._scale is not None, "step() sets the scale"
        self._sums.append(output.detach().double())
        loss = output * self._scale.to(output.dtype)
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def _padded(self, micro: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's micro-batches as one batch of ``width`` columns: token ids (pad) and shifted labels
        (ignored), right-padded, so every micro-batch has the shape the stages' buffers were made for."""
        ids, labels = [], []
        for mb in micro:
            if mb.get("position_ids") is not None:
                raise UserError("data.packing: packed rows cannot cross pipeline stages; set data.packing: false")
            x, y = mb["input_ids"], shifted_labels(mb)
            extra = self.width - x.shape[1]
            assert extra >= 0, f"a row of {x.shape[1]} tokens is longer than data.max_seq_len {self.width}"
            ids.append(torch.nn.functional.pad(x, (0, extra), value=self.pad_id))
            labels.append(torch.nn.functional.pad(y, (0, extra), value=IGNORE_INDEX))
        return torch.cat(ids).to(self.ctx.device), torch.cat(labels).to(self.ctx.device)

    def step(self, micro: list[dict[str, torch.Tensor]], global_tokens: torch.Tensor) -> torch.Tensor:
        """Forward and backward the step's micro-batches through the schedule (host copies, as the data gives
        them); returns this replica's summed token loss (float64, on the device) on every stage."""
        assert len(micro) == self.n_microbatches, f"{len(micro)} micro-batches, the schedule runs {self.n_microbatches}"
        ids, labels = self._padded(micro)
        if self.schedule is None:
            self.build_schedule(ids.shape[0] // self.n_microbatches)
        device = ids.device
        self._scale = self.ctx.dp_size / torch.as_tensor(global_tokens, dtype=torch.float64, device=device).clamp(min=1.0)
        self._sums = []
        args = (ids,) if self.first else ()
        self.schedule.step(*args, target=labels, return_outputs=False, labels=labels)
        # the step's micro-batches (the stages have static shapes: no shape-inference loss before them)
        sums = self._sums[-self.n_microbatches :]
        loss_sum = torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64, device=device)
        return self.broadcast_from_last(loss_sum)

    def broadcast_from_last(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the last stage's rank of this rank's pp group holds it (a collective of the group)."""
        t = t.contiguous()
        dist.broadcast(t, group=self.group, group_src=self.last_owner)
        return t

    def clip_grad_norm(
        self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, max_norm: float | None
    ) -> torch.Tensor:
        """Unscale (fp16) and clip the gradient norm over every stage: each rank's squared norms (reduced over
        dp and tp by DTensor), summed over the pp group; returns the norm before clipping (0-d, no host sync)."""
        from torch.distributed.tensor import DTensor

        from finetune.train.gradients import _grads_by_layout

        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            # fp16: an overflow in one stage skips the update on every stage (GradScaler checks its own rank's
            # gradients only), so the stages never fall out of step
            found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            for flag in found.values():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        groups = _grads_by_layout(params)
        squares = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for grads in groups.values():
            n = torch.nn.utils.get_total_norm(grads, 2.0)
            if isinstance(n, DTensor):
                n = n.full_tensor()
            squares = squares + n.double().to(squares.device) ** 2
        dist.all_reduce(squares, group=self.group)
        norm = squares.sqrt()
        if max_norm:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for grads in groups.values():
                for g in grads:
                    local = g.to_local() if isinstance(g, DTensor) else g
                    local.mul_(coef.to(device=local.device, dtype=local.dtype))
        return norm

    # -- forward only (evaluation) ---------------------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        return stage % self.spec.pp

    @torch.no_grad()
    def forward_only(
        self, ids: torch.Tensor, *, labels: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None, last_logits: bool = False,
    ) -> torch.Tensor:
        """One batch through every stage in turn (point-to-point sends of the hidden states, fp32 on the wire:
        this tp rank's rows of them under sequence parallelism); the last stage's output (the summed loss, or the
        last position's logits) on every rank of the group."""
        hidden_size = _decoder(self.model)[0].config.hidden_size
        b, t = ids.shape
        start, end = 0, t
        if self.runner.tp_mesh is not None:  # the rows torch.chunk gives this tp rank (any length)
            start, end = SequenceShard(self.runner.tp_mesh.get_local_rank(), self.spec.tp, None).bounds(t)
        x: torch.Tensor = ids
        out: torch.Tensor | None = None
        for s in range(self.runner.n_stages):
            if s not in self.stages:
                continue
            if s > 0:
                x = torch.empty((b, end - start, hidden_size), dtype=torch.float32, device=self.ctx.device)
                dist.recv(x, group=self.group, group_src=self._peer(s - 1))
            # through the module's call, so FSDP2's hooks gather the stage's parameters
            y = self.model(
                x, labels, stage=s, attention_mask=attention_mask, position_ids=position_ids, last_logits=last_logits,
                length=t,
            )
            if s < self.runner.n_stages - 1:
                dist.send(y.float().contiguous(), group=self.group, group_dst=self._peer(s + 1))
            else:
                out = y
        if out is None:
            shape = (b, _decoder(self.model)[0].config.vocab_size) if last_logits else ()
            out = torch.empty(shape, dtype=torch.float32, device=self.ctx.device)
        return self.broadcast_from_last(out.float())

    def eval_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, target tokens) of an evaluation batch, as :func:`finetune.loss.causal_lm_loss`."""
        shifted = shifted_labels(batch)
        s = self.forward_only(
            batch["input_ids"], labels=shifted, attention_mask=batch.get("attention_mask"),
            position_ids=batch.get("position_ids"),
        )
        return s, (shifted != IGNORE_INDEX).sum()

    def greedy_tokens(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """The (B, max_new_tokens) greedy continuation of a left-padded batch, each new token one pipeline
        forward of the whole sequence (no KV cache)."""
        out = torch.empty((ids.shape[0], 0), dtype=torch.long, device=ids.device)
        for _ in range(max_new_tokens):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = self.forward_only(ids, attention_mask=mask, position_ids=positions, last_logits=True)
            nxt = logits.argmax(-1, keepdim=True).to(ids.device)
            out = torch.cat([out, nxt], dim=1)
            ids = torch.cat([ids, nxt], dim=1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        return out

    # -- the final save --------------------------------------------------------------------------------------
    def named_specs(self, tensors: dict[str, torch.Tensor]) -> list[tuple[int, str, list[int], torch.dtype]]:
        """(owner pp index, name, whole shape, dtype) of every stage's ``tensors``, in stage order (the whole
        model's order), on every rank (shapes are known without gathering)."""
        mine = [(n, list(t.shape), t.dtype) for n, t in tensors.items()]  # a DTensor's shape is its whole shape
        per_rank: list[Any] = [None] * self.spec.pp
        dist.all_gather_object(per_rank, mine, group=self.group)
        order = sorted(range(self.spec.pp), key=lambda r: min(local_stages(self.spec, r)))
        return [(owner, n, shape, dtype) for owner in order for n, shape, dtype in per_rank[owner]]

    def to_main(self, owner: int, name: str, shape: list[int], dtype: torch.dtype, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """One stage's tensor, whole, on global rank 0 (None elsewhere): gathered over its stage's dp x tp
        ranks when it is a DTensor, then sent by the stage's first rank. Every rank calls, in the same order."""
        from finetune.train.save import _whole

        if owner == self.ctx.pp_rank:
            whole = _whole(tensors[name])
            head_of_stage = self.ctx.rank % (self.ctx.world_size // self.spec.pp) == 0  # (dp, tp) = (0, 0)
            if self.ctx.is_main:
                return whole
            if head_of_stage:
                dist.send(whole.to(self.ctx.device).contiguous(), group=self.group, group_dst=0)
            return None
        if self.ctx.is_main:
            buf = torch.empty(shape, dtype=dtype, device=self.ctx.device)
            dist.recv(buf, group=self.group, group_src=owner)
            return buf.cpu()
        return None


def build_pipeline(
    loaded: LoadedRecipe, spec: ExecSpec, ctx: PipelineContext, *, n_microbatches: int, autocast: Callable[[], Any],
    pad_id: int, base_dir: Path | None,
) -> tuple[Pipeline, tuple[int, int]]:
    """This rank's stage model on the run's mesh and its schedule; and the whole model's parameter counts."""
    mesh = build_mesh(spec, ctx)
    model, stages, counts = build_stage_model(loaded, spec, ctx, mesh, base_dir)
    runner = StageRunner(model, spec, stages, autocast, mesh["tp"] if spec.sequence_parallel else None)
    _patch_forward(model, runner)
    width = loaded.recipe.data.max_seq_len
    if spec.sequence_parallel:  # even sequence shards: one receive shape on every tp rank
        width = -(-width // spec.tp) * spec.tp
    pipe = Pipeline(
        model, spec, ctx, mesh, stages, runner, width=width, pad_id=pad_id,
        n_microbatches=n_microbatches,
    )
    return pipe, counts


def save_pipeline_final(
    pipe: Pipeline, tokenizer: Any, out_dir: Path, *, adapters: bool, max_shard_bytes: int
) -> None:
    """The final model (one HF directory, streamed from the stages) or adapter (one PEFT directory), written by
    rank 0 from every stage's tensors; every rank calls."""
    from torch.distributed.fsdp import FSDPModule

    from finetune.train.save import unique_tensors, write_shards

    ctx, model = pipe.ctx, pipe.model
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    for module in model.modules():  # an evaluation leaves the root unit gathered: back to the trained shards
        if isinstance(module, FSDPModule):
            module.reshard()
    hf: Any = model
    if adapters:  # the trained tensors only, each gathered whole on rank 0
        trained: dict[str, torch.Tensor] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        state = {}
        for owner, name, shape, dtype in pipe.named_specs(trained):
            t = pipe.to_main(owner, name, shape, dtype, trained)
            if t is not None:
                state[name] = t
        if ctx.is_main:
            from safetensors.torch import save_file

            hf.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
            # peft keeps only the adapters of the layers this rank's model holds; the file holds every stage's,
            # named as peft names them (without the adapter's name)
            name = f".{hf.active_adapter}."
            renamed = {k.replace(name, "."): v.contiguous() for k, v in state.items()}
            save_file(renamed, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    else:  # streamed: the files are planned from the shapes, then one tensor at a time reaches rank 0
        named = unique_tensors(model)
        where = {name: (owner, shape, dtype) for owner, name, shape, dtype in pipe.named_specs(named)}
        specs = [(name, shape, dtype) for name, (_, shape, dtype) in where.items()]
        write_shards(out_dir, specs, lambda name: pipe.to_main(where[name][0], name, *where[name][1:], named), ctx,
                     max_shard_bytes)
        if ctx.is_main:
            hf.config.save_pretrained(out_dir)
            if getattr(model, "generation_config", None) is not None:
                hf.generation_config.save_pretrained(out_dir)
    if ctx.is_main:
        tokenizer.save_pretrained(out_dir)
    ctx.wait_barrier()
