"""Pipeline parallelism (``distributed.pp``): the builder of a rank's stage model and its schedule.

The decoder layers run as stages on ``pp`` ranks, driven by a ``torch.distributed.pipelining`` schedule (GPipe,
1F1B or interleaved 1F1B). :func:`build_pipeline` (torchtitan's ``pipeline_llm``) builds, on the layout's meshes
(finetune/train/parallel/layout.py), this rank's model part and the schedule over its stages, and returns them as a
:class:`Pipeline`; the trainer does the rest as for one model: its step differs in one branch (the schedule runs
the micro-batches: finetune.train.gradients.pipeline_step, with the loss scaled as every step's is), its
clipping reduces the gradient norm over the pp group too, its evaluation calls the stages' forward
(:class:`StagedForward`) where it would call the model, and the final save gathers every stage's tensors
(finetune.train.checkpoint.save). Nothing here steps, clips, evaluates, computes a loss of its own or saves.

Stages keep their names. A rank's stage model is the whole model with the decoder layers it does not own
removed (the layer list becomes a dict keyed by each layer's index), the input embeddings kept on the first
stage only, the final norm and the output head on the last only (torchtitan's approach): a weight keeps its
fully qualified name (``model.layers.7.self_attn.q_proj.weight``) on whichever stage holds it, so the
optimizer's, the checkpoint's and the final save's names are those of one process, and a DCP checkpoint
saved on one pipeline layout loads on another. A rank of the interleaved schedule holds its stages (one
every ``pp`` stages: looped placement) in one such model; each stage is a view that runs its layers.

The layout's pp dimension is outermost and tp innermost (the ranks of a TP group are neighbours, inside one
node): tensor parallelism over ``tp`` and FSDP2 (zero2/fsdp) over ``dp_shard`` apply to each stage model as to
a whole one, then the schedule sends the hidden states between the ``pp`` ranks of the same ``(dp, tp)``
position. With sequence parallelism (``distributed.sequence_parallel``, the default with tp) each stage runs it
as a whole model does (finetune.train.parallel.parallelize.apply_sequence_parallel): the first stage's embeddings output
this tp rank's rows, a stage sends its rows ``(B, T/tp, H)`` as a plain tensor and the next wraps them back into
the sequence-sharded DTensor, and the last stage's final norm, head and loss run on the rank's rows
(:func:`finetune.objectives.loss.loss_head`, the loss summed over tp).

The stages have static shapes (no shape inference at run time): the step's micro-batches are padded to one
width (:meth:`Pipeline.pad`): the narrowest of ``distributed.pp_buckets`` widths (halving from
``data.max_seq_len``, each rounded up to a multiple of ``tp`` under sequence parallelism) that holds the step's
longest row; the schedule is built for a shape when it first runs, and again when
the shape changes, so one shape's receive buffers exist at a time and the planner's worst case (full rows)
bounds every step. The last stage's forward returns each micro-batch's summed token loss (the fused head), which
the schedule's ``loss_fn`` (the trainer's) scales by ``dp / global target tokens`` with the schedule's own
scaling off (``scale_grads=False``): gradients are exactly one process's.

Evaluation runs forward only, batch by batch through the stages with point-to-point sends (any batch shape,
attention masks included); generation then runs without a KV cache, one pipeline forward per new token.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from finetune.errors import UserError
from finetune.model import attention
from finetune.model.adapters import base_model_of
from finetune.objectives.loss import IGNORE_INDEX, known_documents, loss_head, sequence_bounds
from finetune.recipe.schema import LoadedRecipe
from finetune.spec import ExecSpec
from finetune.train.parallel.distributed import DistContext


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
    from finetune.recipe.capabilities import stage_problem

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
            with loss_head(base, labels) as finish:  # the fused head, on this tp rank's rows under SP
                return finish(base.get_output_embeddings()(decoder.norm(hidden)))


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


# -- building --------------------------------------------------------------------------------------------


def build_stage_model(
    loaded: LoadedRecipe, spec: ExecSpec, ctx: DistContext, base_dir: Path | None
) -> tuple[torch.nn.Module, list[int], tuple[int, int]]:
    """This rank's stage model: built on meta, cut to its stages, tensor-parallel over the layout's ``tp``,
    sharded over its ``dp_shard`` (zero2/fsdp), then this rank's tensors alone loaded (finetune/train/model/load.py).
    Returns the model, its stages and the whole model's (trainable, total) parameter counts.

    ``base_dir``: rank 0 of an adapter run from a random init writes the whole seeded base there.
    """
    from finetune.train.model.build import count_parameters
    from finetune.train.model.load import build_on_meta, materialize, write_seeded_base
    from finetune.train.parallel.parallelize import (
        apply_activation_checkpointing,
        apply_fsdp,
        apply_tensor_parallel,
    )

    layout = ctx.layout
    assert (layout.pp, layout.tp) == (spec.pp, spec.tp), "the context is laid out as the spec says"
    model = build_on_meta(loaded, spec, ctx.device)
    check_stageable(model)
    counts = count_parameters(model)
    n_layers = len(_decoder(model)[1].layers)
    if sum(spec.pp_layers) != n_layers:
        raise UserError(
            f"distributed.pp_layers: the stages hold {sum(spec.pp_layers)} decoder layers but the model has "
            f"{n_layers}; give {len(spec.pp_layers)} counts that add up to {n_layers}"
        )
    stages = local_stages(spec, layout.pp_rank)
    layers = stage_layers(spec)
    if spec.checkpointing:  # on the whole model (its input-embedding hook), before the layers are cut
        apply_activation_checkpointing(model)
    prune_to_stages(
        model, [i for s in stages for i in layers[s]], first=0 in stages, last=len(layers) - 1 in stages
    )
    if spec.tensor_parallel:
        apply_tensor_parallel(model, layout.tp_mesh, sequence_parallel=spec.sequence_parallel, pipeline_stage=True)
    if spec.strategy.uses_fsdp:
        model = apply_fsdp(model, spec, ctx)
    materialize(model, loaded, spec, ctx.device, None)
    if base_dir is not None:
        write_seeded_base(loaded, spec, base_dir)
    return model, stages, counts


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


def row_buckets(max_seq_len: int, buckets: int, multiple: int = 1) -> tuple[int, ...]:
    """The widths the stages' micro-batches are padded to, narrowest first: ``max_seq_len`` halved
    ``buckets - 1`` times, each rounded up to a multiple of ``multiple`` (tp under sequence parallelism, so the
    sequence shards are even); the widest holds every row."""
    widths = {-(-max(1, -(-max_seq_len // 2**k)) // multiple) * multiple for k in range(max(1, buckets))}
    return tuple(sorted(widths))


class StageSchedule:
    """torch's schedule over this rank's stages for micro-batches of one shape (rows x width).

    :meth:`for_shape` builds the schedule (a ``PipelineStage`` per stage with that shape's static arguments, so no
    shape inference runs) when a shape first runs and again when it changes: one shape's receive buffers at a time.
    ``loss_fn``: what the schedule calls on the last stage with each micro-batch's output (its summed loss) and
    backwards (the trainer's scaled loss).
    """

    def __init__(
        self, model: torch.nn.Module, spec: ExecSpec, stages: list[int], n_stages: int, *, device: torch.device,
        group: Any, n_microbatches: int, loss_fn: Callable[..., torch.Tensor],
    ) -> None:
        self.model, self.spec, self.stages, self.n_stages = model, spec, stages, n_stages
        self.device, self.group, self.n_microbatches, self.loss_fn = device, group, n_microbatches, loss_fn
        self.shape: tuple[int, int] | None = None
        self.schedule: Any = None

    def for_shape(self, rows: int, width: int) -> Any:
        """The schedule of micro-batches of ``rows`` rows and ``width`` columns (``n_microbatches`` of them)."""
        if self.shape == (rows, width):
            return self.schedule
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        self.schedule = None  # the previous shape's stages and buffers go before the new ones exist
        submods = [self.model] if len(self.stages) == 1 else [_VirtualStage(self.model, s) for s in self.stages]
        config: Any = self.model.config
        stages = [
            PipelineStage(
                m, stage_index=s, num_stages=self.n_stages, device=self.device, group=self.group,
                **stage_meta_args(self.spec, s, self.n_stages, rows, width, int(config.hidden_size)),
            )
            for m, s in zip(submods, self.stages, strict=True)
        ]
        kind, n = self.spec.pp_schedule, self.n_microbatches
        if kind == "interleaved-1f1b":
            self.schedule = ScheduleInterleaved1F1B(list(stages), n, loss_fn=self.loss_fn, scale_grads=False)
        else:
            cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
            self.schedule = cls(stages[0], n, loss_fn=self.loss_fn, scale_grads=False)
        self.shape = (rows, width)
        return self.schedule


@dataclass
class StagedOutput:
    """What the stages' forward gives a generation step: the last position's logits (B, 1, V), no cache."""

    logits: torch.Tensor
    cache: Any = None


class StagedForward:
    """The stages' forward outside the schedule (evaluation): one batch through every stage in turn, with
    point-to-point sends of the hidden states (fp32 on the wire; this tp rank's rows of them under sequence
    parallelism), and the last stage's output on every rank of the pp group.

    Called as a causal LM is (``input_ids``, ``attention_mask``, ``position_ids``), it gives the last position's
    logits (:class:`StagedOutput`: what greedy generation reads, without a KV cache); :meth:`with_targets` gives
    the summed loss against shifted targets, computed by the last stage's forward (finetune.objectives.loss.loss_head).
    """

    def __init__(self, pipe: Pipeline, ctx: DistContext) -> None:
        self.pipe, self.ctx = pipe, ctx
        self.config: Any = _decoder(pipe.model)[0].config

    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None, **_: Any,
    ) -> StagedOutput:
        logits = self._run(input_ids, None, attention_mask, position_ids, last_logits=True)
        return StagedOutput(logits[:, None])

    def with_targets(
        self, input_ids: torch.Tensor, targets: torch.Tensor, attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """What the last stage's forward gives with the batch's ``targets`` (its shifted labels): the summed
        next-token loss, on every rank."""
        return self._run(input_ids, targets, attention_mask, position_ids, last_logits=False)

    @torch.no_grad()
    def _run(
        self, ids: torch.Tensor, targets: torch.Tensor | None, attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None, *, last_logits: bool,
    ) -> torch.Tensor:
        pipe, layout, device = self.pipe, self.ctx.layout, self.ctx.device
        b, t = ids.shape
        start, end = 0, t
        if pipe.sequence_parallel:  # the rows torch.chunk gives this tp rank (any length)
            start, end = sequence_bounds(t, layout.tp_rank, layout.tp)
        x: torch.Tensor = ids
        out: torch.Tensor | None = None
        for s in range(pipe.n_stages):
            if s not in pipe.stages:
                continue
            if s > 0:
                x = torch.empty((b, end - start, int(self.config.hidden_size)), dtype=torch.float32, device=device)
                dist.recv(x, group=layout.pp_group, group_src=(s - 1) % layout.pp)
            # through the module's call, so FSDP2's hooks gather the stage's parameters
            y = pipe.model(
                x, targets, stage=s, attention_mask=attention_mask, position_ids=position_ids,
                last_logits=last_logits, length=t,
            )
            if s < pipe.n_stages - 1:
                dist.send(y.float().contiguous(), group=layout.pp_group, group_dst=(s + 1) % layout.pp)
            else:
                out = y
        if out is None:
            shape = (b, int(self.config.vocab_size)) if last_logits else ()
            out = torch.empty(shape, dtype=torch.float32, device=device)
        return self.ctx.from_last_stage(out.float())


@dataclass
class Pipeline:
    """What :func:`build_pipeline` returns: this rank's model part (one stage model holding every stage the rank
    runs; the interleaved schedule's stages are views of it) and the schedule over its stages."""

    model: torch.nn.Module
    stages: list[int]
    n_stages: int
    schedule: StageSchedule
    widths: tuple[int, ...]  # the micro-batches' widths, narrowest first (the widest: data.max_seq_len's)
    pad_id: int
    sequence_parallel: bool

    @property
    def first(self) -> bool:
        """This rank runs the first stage (it takes the token ids)."""
        return 0 in self.stages

    @property
    def last(self) -> bool:
        """This rank runs the last stage (it computes the loss)."""
        return self.n_stages - 1 in self.stages

    def pad(self, micro: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """The step's micro-batches as the stages take them: token ids (pad) and labels (ignored) right-padded
        to one width, the narrowest of :attr:`widths` that holds the step's longest row (every rank reading this
        batch slice picks the same one)."""
        longest = max(mb["input_ids"].shape[1] for mb in micro)
        fits = [w for w in self.widths if w >= longest]
        assert fits, f"a row of {longest} tokens is longer than data.max_seq_len {self.widths[-1]}"
        width = fits[0]
        out = []
        for mb in micro:
            if mb.get("position_ids") is not None:
                raise UserError("data.packing: packed rows cannot cross pipeline stages; set data.packing: false")
            extra = width - mb["input_ids"].shape[1]
            out.append({
                "input_ids": torch.nn.functional.pad(mb["input_ids"], (0, extra), value=self.pad_id),
                "labels": torch.nn.functional.pad(mb["labels"], (0, extra), value=IGNORE_INDEX),
            })
        return out


def build_pipeline(
    loaded: LoadedRecipe, spec: ExecSpec, ctx: DistContext, *, n_microbatches: int, autocast: Callable[[], Any],
    loss_fn: Callable[..., torch.Tensor], pad_id: int, base_dir: Path | None,
) -> tuple[Pipeline, StagedForward, tuple[int, int]]:
    """This rank's stage model on the layout's meshes and the schedule over its stages (``loss_fn``: the
    schedule's, called on the last stage with each micro-batch's summed loss); the stages' forward for
    evaluation; and the whole model's parameter counts."""
    if spec.pp_schedule == "interleaved-1f1b" and n_microbatches % spec.pp:
        raise UserError(
            f"distributed.pp_schedule: interleaved-1f1b needs the micro-batches of a step ({n_microbatches}, the "
            f"gradient accumulation) to be a multiple of distributed.pp ({spec.pp}); change "
            "train.global_batch_size or train.micro_batch_size, or use 1f1b"
        )
    layout = ctx.layout
    model, stages, counts = build_stage_model(loaded, spec, ctx, base_dir)
    runner = StageRunner(model, spec, stages, autocast, layout.tp_mesh if spec.sequence_parallel else None)
    _patch_forward(model, runner)
    schedule = StageSchedule(
        model, spec, stages, runner.n_stages, device=ctx.device, group=layout.pp_group,
        n_microbatches=n_microbatches, loss_fn=loss_fn,
    )
    d = loaded.recipe.distributed
    widths = row_buckets(loaded.recipe.data.max_seq_len, d.pp_buckets, spec.tp if spec.sequence_parallel else 1)
    pipe = Pipeline(model, stages, runner.n_stages, schedule, widths, pad_id, spec.sequence_parallel)
    return pipe, StagedForward(pipe, ctx), counts
