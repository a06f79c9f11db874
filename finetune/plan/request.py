"""What to plan: the recipe's choices (``auto``: the planner picks) and the model's config, as a
:class:`Request` the planner (finetune/plan/flowchart.py) walks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.recipe.capabilities import reference_setting
from finetune.recipe.schema import LoadedRecipe


@dataclass
class Request:
    """What to plan: the recipe's choices ("auto" = let the planner pick) and the model's config."""

    config: Any
    source: str
    method: str = "auto"
    strategy: str = "auto"
    precision: str = "auto"
    micro_batch_size: int | None = None
    checkpointing: bool | None = None
    global_batch_size: int = 8
    seq_len: int = 512
    packed: bool = False
    lora: Any = None
    prefix: Any = None  # the recipe's prefix section (method prefix)
    adapter: Any = None  # the recipe's adapter section (method adapter)
    prompt: Any = None  # the recipe's prompt section (method prompt)
    model_dtype: str = "auto"  # model.dtype: the frozen base's storage (lora)
    quantization: Any = None  # the recipe's quantization section (qlora); None: its defaults
    attn_implementation: str = "sdpa"  # model.attn_implementation (a recipe's default is auto: settle resolves it)
    optimizer: str = "auto"  # train.optimizer (auto: adamw unless nothing fits without 8-bit state)
    offload: str = "auto"  # train.offload (auto: none unless nothing fits without it)
    compile: bool = False  # train.compile: every decoder block compiled
    tp: int | str = 1  # distributed.tp: a degree, or auto (the walk tries TP when FSDP alone does not fit)
    sequence_parallel: bool = True  # distributed.sequence_parallel: with tp > 1, the residual stream split over the sequence
    ep: int = 1  # distributed.ep: a mixture's experts split over ep ranks of the data-parallel shard dimension
    pp: int | str = 1  # distributed.pp: a degree, or auto (the walk tries PP when FSDP with TP does not fit)
    pp_schedule: str = "1f1b"  # distributed.pp_schedule: gpipe | 1f1b | interleaved-1f1b
    pp_stages_per_rank: int | None = None  # distributed.pp_stages_per_rank (None: the schedule's default)
    pp_layers: tuple[int, ...] | None = None  # distributed.pp_layers (None: a split balanced by cost)
    for_run: bool = False  # a real run: impossible batch settings are errors, not adjustments
    eval_batch_size: int | None = None  # None: auto (the largest that fits)
    eval_max_new_tokens: int = 32
    steps: int | None = None  # optimizer steps of the job when known (train.max_steps), for its time
    objective: str = "sft"  # train.objective: dpo/simpo/orpo run every micro-batch's pairs (2 rows a sample)
    reference: str = "model"  # dpo.reference: model (a frozen copy under full fine-tuning) or precomputed
    reference_config: Any = None  # dpo.reference_model's config (None: the reference is the policy's start)
    aux_loss_coef: float | str = "auto"  # train.router_aux_loss_coef: a mixture of experts' load-balancing loss
    # grpo: tokens sampled per completion (grpo.max_completion_length; 0: not grpo), optimizer steps per batch
    # of completions (grpo.num_iterations: above 1 the old policy's log-probs are kept)
    completion_len: int = 0
    num_iterations: int = 1


def request_from_recipe(loaded: LoadedRecipe) -> Request:
    """A :class:`Request` from a validated recipe (model config from its path, the catalog or the cache)."""
    from finetune.plan.config import planning_config

    r = loaded.recipe
    assert loaded.inputs is not None, "load_recipe resolves the inputs"
    config, source = planning_config(loaded.inputs.model, r.model.trust_remote_code)
    mbs = r.train.micro_batch_size
    ac = r.train.activation_checkpointing
    return Request(
        config=config,
        source=source,
        method=r.method,
        strategy=r.distributed.strategy,
        precision=r.precision,
        micro_batch_size=None if mbs == "auto" else int(mbs),
        checkpointing=None if ac == "auto" else bool(ac),
        global_batch_size=r.train.global_batch_size,
        seq_len=r.data.max_seq_len,
        packed=r.data.packing,
        lora=r.lora,
        prefix=r.prefix,
        adapter=r.adapter,
        prompt=r.prompt,
        model_dtype=r.model.dtype,
        quantization=r.quantization,
        attn_implementation=r.model.attn_implementation,
        eval_batch_size=None if r.eval.batch_size == "auto" else int(r.eval.batch_size),
        eval_max_new_tokens=r.eval.max_new_tokens,
        optimizer=r.train.optimizer,
        offload=r.train.offload,
        tp=r.distributed.tp,
        sequence_parallel=r.distributed.sequence_parallel,
        ep=r.distributed.ep,
        pp=r.distributed.pp,
        pp_schedule=r.distributed.pp_schedule,
        pp_stages_per_rank=r.distributed.pp_stages_per_rank,
        pp_layers=None if r.distributed.pp_layers is None else tuple(r.distributed.pp_layers),
        compile=r.train.compile,
        steps=r.train.max_steps,
        objective=r.train.objective,
        reference=reference_setting(r),
        reference_config=reference_config(loaded),
        aux_loss_coef=r.train.router_aux_loss_coef,
        completion_len=r.grpo.max_completion_length if r.train.objective == "grpo" else 0,
        num_iterations=r.grpo.num_iterations,
    )


def reference_config(loaded: LoadedRecipe) -> Any:
    """The config of ``dpo.reference_model`` when a dpo run names one (its weights are counted from it), else
    None."""
    from finetune.plan.config import planning_config
    from finetune.recipe.locate import locate_model

    r = loaded.recipe
    if not r.dpo.reference_model or r.train.objective != "dpo":
        return None
    config, _ = planning_config(locate_model(r.dpo.reference_model, loaded.base_dir), r.model.trust_remote_code)
    return config
