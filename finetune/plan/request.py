"""What to plan: the recipe's choices (``auto``: the planner picks) and the model's config, as a
:class:`Request` the planner (finetune/plan/flowchart.py) walks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.recipe import LoadedRecipe


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
    model_dtype: str = "auto"  # model.dtype: the frozen base's storage (lora)
    quantization: Any = None  # the recipe's quantization section (qlora); None: its defaults
    attn_implementation: str = "sdpa"
    optimizer: str = "auto"  # train.optimizer (auto: adamw unless nothing fits without 8-bit state)
    offload: str = "auto"  # train.offload (auto: none unless nothing fits without it)
    compile: bool = False  # train.compile: every decoder block compiled
    tp: int | str = 1  # distributed.tp: a degree, or auto (the walk tries TP when FSDP alone does not fit)
    for_run: bool = False  # a real run: impossible batch settings are errors, not adjustments
    eval_batch_size: int | None = None  # None: auto (the largest that fits)
    eval_max_new_tokens: int = 32
    steps: int | None = None  # optimizer steps of the job when known (train.max_steps), for its time
    objective: str = "sft"  # train.objective: dpo/simpo/orpo run every micro-batch's pairs (2 rows a sample)
    reference: str = "model"  # dpo.reference: model (a frozen copy under full fine-tuning) or precomputed


def request_from_recipe(loaded: LoadedRecipe) -> Request:
    """A :class:`Request` from a validated recipe (model config from its path, the catalog or the cache)."""
    from finetune.locate import model_config

    r = loaded.recipe
    assert loaded.inputs is not None, "load_recipe resolves the inputs"
    config, source = model_config(loaded.inputs.model, r.model.trust_remote_code)
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
        model_dtype=r.model.dtype,
        quantization=r.quantization,
        attn_implementation=r.model.attn_implementation,
        eval_batch_size=None if r.eval.batch_size == "auto" else int(r.eval.batch_size),
        eval_max_new_tokens=r.eval.max_new_tokens,
        optimizer=r.train.optimizer,
        offload=r.train.offload,
        tp=r.distributed.tp,
        compile=r.train.compile,
        steps=r.train.max_steps,
        objective=r.train.objective,
        reference=r.dpo.reference,
    )
