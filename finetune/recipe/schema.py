"""The recipe: the YAML schema, loading with line numbers, ``--set`` overrides and file checks.

Everything a run does is decided by a :class:`Recipe`. The key names are the public interface.
A recipe is loaded with :func:`load_recipe`, which reports *every* problem at once as a
:class:`RecipeError` whose lines name the key path, the YAML line, and a "did you mean" for typos.

This module imports no torch/transformers: ``finetune validate`` and ``--help`` stay instant.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from finetune.errors import UserError
from finetune.recipe.locate import (
    DataLocation,
    ModelLocation,
    hub_offline,
    locate_data,
    locate_model,
    looks_like_hub_id,
    resolve_input_path,
    shipped_recipes_dir,
)

# --------------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------------


#: Upper bounds of the schema's numbers: far above any real run, so that a typo's huge value (or a number meant
#: for another key) is refused with the key named instead of overflowing later (a timedelta, a seed, a loop).
MAX_STEPS = 10**9  # optimizer steps, and intervals counted in steps
MAX_TOKENS = 2**24  # tokens of one sequence, samples of one batch
MAX_WIDTH = 2**20  # a width of the model (a rank, a bottleneck, virtual tokens)
MAX_PROCESSES = 2**16  # processes, GPUs, nodes, parallel degrees
MAX_SECONDS = 30 * 24 * 3600.0  # a timeout: 30 days
MAX_SEED = 2**32 - 1  # numpy's seeds are 32-bit

#: A count of at least 1 and at most ``le``.
Steps = Annotated[int, Field(gt=0, le=MAX_STEPS)]
Width = Annotated[int, Field(gt=0, le=MAX_WIDTH)]
Processes = Annotated[int, Field(gt=0, le=MAX_PROCESSES)]
Batch = Annotated[int, Field(gt=0, le=MAX_TOKENS)]


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, values are checked on assignment, and no number
    may be infinite or NaN (``.inf`` and ``.nan`` are valid YAML floats)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(Section):
    path: str = Field(
        description="A local Hugging Face model directory, a Hub id (org/name: taken from the local cache, else "
        "downloaded, config + tokenizer + safetensors only, unless HF_HUB_OFFLINE=1 or --offline), or the name "
        "of a built-in model in recipes/models (e.g. tiny-llama). Relative paths are looked up next to "
        "the recipe first, then in the current directory."
    )
    init: Literal["pretrained", "random"] = Field(
        "pretrained",
        description="pretrained: load the weights from `path`; random: build the model from its config.json "
        "with weights initialised from train.seed (nothing is downloaded).",
    )
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Storage dtype of the frozen base weights. auto: fp32 for full fine-tuning (fp32 master "
        "weights), the compute dtype for a frozen LoRA base.",
    )
    revision: Union[str, None] = Field(
        None,
        description="The Hub revision (a commit hash, branch or tag) a Hub id in model.path is downloaded at and "
        "read from the cache at; a commit hash pins the exact files. Unset: the main branch.",
    )
    trust_remote_code: bool = Field(
        False, description="Run model code shipped with the checkpoint. Off unless you trust its author."
    )
    allow_pickle: bool = Field(
        False,
        description="Download a Hub model whose weights are only pickles (.bin/.pt); unpickling can run code.",
    )
    attn_implementation: Literal["auto", "sdpa", "eager", "flex_attention"] = Field(
        "auto",
        description="Attention kernel used for training and planned for by `finetune plan`. flex_attention: "
        "torch's FlexAttention with a block-sparse document mask for packed rows (no T x T mask) on a GPU; on CPU, "
        "where torch has no flex backward, the same mask is evaluated densely by sdpa. auto: flex_attention for "
        "packed rows (data.packing) on GPUs, where sdpa would need a (B, 1, T, T) mask and lose its flash kernel; "
        "sdpa otherwise (eager for an architecture without sdpa).",
    )


class LoraConfig(Section):
    r: int = Field(
        8, ge=1, le=MAX_WIDTH,
        description="Rank of the low-rank update B·A; at most the smallest dimension of the targeted weights "
        "(validate checks it against the model).",
    )
    alpha: float = Field(16.0, gt=0, le=1e6, description="Scale of the update: ΔW = (alpha / r)·B·A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input.")
    target_modules: Union[list[str], Literal["all-linear"], None] = Field(
        None,
        description="Module names that get adapters (e.g. [q_proj, v_proj]) or `all-linear`; unset: peft's choice "
        "for the architecture (q_proj, v_proj for Llama; c_attn for GPT-2), all-linear where it has none. On a "
        "mixture of experts, all-linear and `experts` (or gate_up_proj, down_proj) adapt the fused expert weights, "
        "one rank-r pair per expert; the router (gate, router) only when named.",
    )
    use_dora: bool = Field(
        False, description="DoRA: a trained magnitude per output feature times the LoRA-updated direction (peft)."
    )
    use_rslora: bool = Field(False, description="Rank-stabilised LoRA: scale the update by alpha / sqrt(r) instead of alpha / r.")
    init: Literal["default", "gaussian", "pissa", "olora"] = Field(
        "default",
        description="Initialisation (peft's init_lora_weights): default (Kaiming-uniform A, zero B), gaussian, "
        "pissa (A, B from the weight's top singular vectors) or olora (from its QR decomposition). pissa and "
        "olora move that part out of the base weight while training; the saved adapter is converted to a plain "
        "LoRA of rank 2r on the original base (merge and PeftModel.from_pretrained use the untouched base).",
    )
    dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="Storage dtype of the adapters, and so of their gradients and AdamW state: fp32 (full-precision "
        "adapters beside the 16-bit base), or bf16, the compute dtype, as litgpt's bf16-true and torchtune's bf16 "
        "keep them (half the adapters' memory; needs precision bf16). fp16 adapters are refused: no loss scaler "
        "takes fp16 gradients.",
    )


class PrefixConfig(Section):
    num_virtual_tokens: int = Field(
        20, ge=1, le=MAX_WIDTH, description="Trained key/value positions put before every sequence, in every layer."
    )
    projection: bool = Field(
        False, description="Reparametrise the prefix through a 2-layer MLP (trained, discarded at save: peft's)."
    )
    projection_hidden: Union[Width, None] = Field(
        None, description="Width of the projection MLP (default: the model's key/value width)."
    )
    init: Literal["random", "text"] = Field(
        "random",
        description="Start of the prefix: random (peft's draw) or text (Li & Liang: every layer's keys/values of "
        "init_text's tokens as the frozen base computes them; the tokens are repeated or cut to num_virtual_tokens).",
    )
    init_text: Union[str, None] = Field(
        None, description="The text whose keys/values start the prefix (init: text), e.g. a task instruction."
    )


class PromptConfig(Section):
    num_virtual_tokens: int = Field(
        20, ge=1, description="Trained embedding vectors put before every sequence's tokens (the input only)."
    )
    init: Literal["random", "text"] = Field(
        "random",
        description="Start of the virtual tokens: random (peft's draw, one N(0, 1) vector each) or text (Lester et "
        "al.: the frozen base's own embeddings of init_text's tokens, repeated or cut to num_virtual_tokens).",
    )
    init_text: Union[str, None] = Field(
        None, description="The text whose token embeddings start the virtual tokens (init: text), e.g. a task "
        "instruction.",
    )


class AdapterConfig(Section):
    size: Union[Width, None] = Field(
        None, description="Bottleneck width of each adapter; unset: hidden size / reduction_factor."
    )
    reduction_factor: float = Field(16.0, gt=0, le=MAX_WIDTH, description="hidden size / bottleneck width (when size is unset).")
    non_linearity: Literal["relu", "gelu", "silu", "tanh"] = Field("relu", description="Between down and up projection.")
    placement: Literal["both", "attention", "mlp"] = Field(
        "both", description="After the attention and the MLP of every layer (both: Houlsby), or one of them."
    )
    train_norms: bool = Field(
        True,
        description="Also train the layer norms before the adapted sublayers, as Houlsby et al. do (a gain "
        "saved with the adapters; the base is untouched).",
    )
    embeddings: bool = Field(
        False,
        description="Also a bottleneck on the token embeddings' output, before layer 0 (not in Houlsby et al.): "
        "reaches tokens whose embeddings the base never trained, which layer 0's attention reads; it may need a "
        "lower lr than the layer adapters alone (recipes/quickstart-adapter.yaml uses 3e-3).",
    )


class QuantizationConfig(Section):
    bits: Literal[4, 8] = Field(4, description="4: NF4/FP4 weights (QLoRA); 8: LLM.int8 weights.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    double_quant: bool = Field(True, description="Quantize the quantization constants too (saves ~0.4 bit/param).")
    compute_dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="dtype the 4-bit weights are dequantized to for matmuls; auto follows `precision`."
    )


class DataColumnsConfig(Section):
    text: str = Field("text", description="Column of the text format (continued pre-training).")
    instruction: str = Field("instruction", description="Column of the instruction (instruction format).")
    input: str = Field(
        "input", description="Column of the optional input (instruction format); missing or empty: no input line."
    )
    output: str = Field("output", description="Column of the expected answer (instruction format).")
    messages: str = Field(
        "messages",
        description="Column of the conversation (chat format): a list of {role, content} messages; assistant "
        "messages may hold tool_calls and reasoning_content (or thinking), tool messages a tool_call_id.",
    )
    tools: str = Field(
        "tools",
        description="Column of the function schemas a conversation's assistant may call (chat format; optional): "
        'a list of {"type": "function", "function": {"name", "description", "parameters"}}.',
    )
    input_ids: str = Field("input_ids", description="Column of the token ids (tokenized format).")
    prompt: str = Field(
        "prompt", description="Column of the prompt (preference format): a string, or a list of {role, content} messages."
    )
    chosen: str = Field(
        "chosen", description="Column of the preferred completion (preference format): a string or an assistant message."
    )
    rejected: str = Field(
        "rejected", description="Column of the dispreferred completion (preference format): a string or an assistant "
        "message."
    )
    labels: str = Field(
        "labels", description="Column of the labels, -100 where the loss does not count (tokenized format; optional)."
    )


#: The largest mixture weight (weights are relative: a bound only keeps the arithmetic exact).
MAX_WEIGHT = 1e6


class TrainSource(Section):
    path: Union[str, list[str]] = Field(
        description="A .jsonl/.json/.csv/.parquet file, a glob, a directory or a Hugging Face dataset, as data.train "
        "takes one (a list of them: one source)."
    )
    weight: float = Field(
        gt=0, le=MAX_WEIGHT, allow_inf_nan=False,
        description="The source's share of the training samples, relative to the other sources' weights.",
    )


def _source_problem(i: int, entry: Any) -> str | None:
    """Why entry ``i`` of a data.train mixture is not a ``{path, weight}`` source (one sentence), or None."""
    if not isinstance(entry, dict):
        return f"source {i} is {entry!r}; in a mixture every source is {{path: ..., weight: ...}}"
    unknown = sorted(set(entry) - {"path", "weight"})
    if unknown:
        return f"source {i}: unknown key `{unknown[0]}`; a source of a mixture has path and weight"
    path = entry.get("path")
    paths = path if isinstance(path, list) else [path]
    if not paths or not all(isinstance(p, str) and p for p in paths):
        return f"source {i}: path must be a file, glob, directory or dataset name (got {path!r})"
    w = entry.get("weight")
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or not 0 < w <= MAX_WEIGHT:
        return (
            f"source {i} (`{path}`): weight {w!r} is not a number above 0 and at most {MAX_WEIGHT:g}; give each "
            "source a positive weight (relative to the others: 3 and 1 draw three samples of the first per one "
            "of the second)"
        )
    return None


@dataclass(frozen=True)
class TrainSpec:
    """One path of data.train: the recipe key naming it, the path, its source (the index of its data.train entry)
    and that source's weight (None: data.train is not a mixture, the sources are concatenated)."""

    key: str
    spec: str
    source: int
    weight: float | None


class DataConfig(Section):
    train: Union[str, list[Union[str, TrainSource]]] = Field(
        description="Training data: a .jsonl/.json/.csv/.parquet file, a glob, a directory, a Hugging Face "
        "dataset, or a list of them (concatenated); or a mixture: a list of {path, weight} sources, each "
        "drawn in proportion to its weight (train.seed chooses the rows)."
    )
    eval: Union[str, None] = Field(
        None,
        description="Held-out data for eval loss and exact match (optional): a file, glob or directory, or, when "
        "data.train is a Hugging Face dataset, the name of another of its splits (e.g. validation).",
    )
    split: str = Field("train", description="Split of a Hugging Face dataset given by name in data.train.")
    eval_fraction: Union[float, None] = Field(
        None, gt=0, lt=1, description="Hold out this fraction of data.train (chosen by train.seed) instead of data.eval."
    )
    format: Literal["instruction", "text", "chat", "tokenized", "preference"] = Field(
        "instruction",
        description="How rows become tokens: text (a text column), instruction (instruction/input/output), chat "
        "(a list of messages rendered with the chat template), tokenized (input_ids and optional labels), "
        "preference (prompt, chosen, rejected: strings, or messages rendered with the chat template; for "
        "train.objective dpo, simpo or orpo).",
    )
    columns: DataColumnsConfig = Field(
        default_factory=DataColumnsConfig, description="Column (field) names of each format, e.g. columns.output: answer."
    )
    chat_template: Union[str, None] = Field(
        None,
        description="Chat format: a Jinja chat template, or the path of a .jinja file, used instead of the "
        "tokenizer's (required when the tokenizer has none).",
    )
    max_seq_len: int = Field(512, ge=8, le=MAX_TOKENS, description="Longer samples are truncated (or dropped with drop_long).")
    drop_long: bool = Field(False, description="Drop samples longer than max_seq_len instead of truncating them.")
    packing: bool = Field(
        False,
        description="Pack several samples into each max_seq_len row, position ids restarting at each sample so "
        "attention never crosses samples; train.global_batch_size then counts packed rows.",
    )
    train_on_prompt: bool = Field(
        False, description="Count the prompt tokens in the loss too (default: completion-only loss)."
    )
    reasoning: Literal["train", "mask", "drop"] = Field(
        "train",
        description="Chat format: what happens to an assistant message's reasoning (reasoning_content or thinking): "
        "train (in the loss), mask (kept in the context, out of the loss) or drop (removed before the chat "
        "template renders the conversation).",
    )
    assistant_turns: Literal["all", "last"] = Field(
        "all",
        description="Chat format: which assistant messages are in the loss: all, or only the last one (the earlier "
        "ones stay in the context). Tool results and the other roles never are.",
    )
    on_bad_row: Literal["error", "skip"] = Field(
        "error",
        description="error: stop before training at the first bad row (file, line, field); skip: leave bad rows "
        "out and report how many.",
    )
    num_proc: Union[Processes, None] = Field(
        None, le=256,
        description="Processes that tokenize a data set before training (datasets.map, with a progress bar; the "
        "result is cached). Default: one per CPU core the run may use, at most 8 and one per 10,000 rows (a smaller "
        "set is tokenized in one). A stream (data.streaming) is tokenized in the training process as it is read.",
    )
    streaming: bool = Field(
        False,
        description="Read and tokenize the .jsonl training data while training, row by row through a shuffle "
        "buffer (data.shuffle_buffer rows), instead of all of it before the first step; needs train.max_steps.",
    )
    shuffle_buffer: int = Field(
        10_000, ge=1, le=10_000_000,
        description="data.streaming: the rows held to shuffle the stream (each step draws from them at random, "
        "train.seed); more mixes better and holds more in memory.",
    )
    cache_dir: Union[str, None] = Field(
        None, description="Where tokenized data is cached (default: the Hugging Face datasets cache)."
    )

    @field_validator("train", mode="before")
    @classmethod
    def _mixture(cls, value: Any) -> Any:
        """A list with a ``{path, weight}`` entry is a mixture: every entry is one, each checked here."""
        if not isinstance(value, list) or not any(isinstance(v, dict) for v in value):
            return value
        for i, entry in enumerate(value):
            problem = _source_problem(i, entry)
            if problem:
                raise ValueError(problem)
        return value

    def train_specs(self) -> list[TrainSpec]:
        """Every path data.train names, in order, with its key, source and weight."""
        if isinstance(self.train, str):
            return [TrainSpec("data.train", self.train, 0, None)]
        out = []
        for i, entry in enumerate(self.train):
            if isinstance(entry, str):
                out.append(TrainSpec(f"data.train.{i}", entry, i, None))
            else:
                paths = entry.path if isinstance(entry.path, list) else [entry.path]
                out += [TrainSpec(f"data.train.{i}", p, i, entry.weight) for p in paths]
        return out

    def describe_train(self) -> str:
        """data.train in words: its paths, each with its weight in a mixture."""
        return ", ".join(f"{t.spec} (weight {t.weight:g})" if t.weight is not None else t.spec for t in self.train_specs())

    @property
    def mixture(self) -> bool:
        """data.train is a list of {path, weight} sources."""
        return isinstance(self.train, list) and any(isinstance(e, TrainSource) for e in self.train)

    def set_train_specs(self, specs: list[list[str]]) -> None:
        """Write back each data.train entry's paths (``specs[i]``: entry i's), keeping the shape and weights."""
        if isinstance(self.train, str):
            several: list[Union[str, TrainSource]] = list(specs[0])
            self.train = specs[0][0] if len(specs[0]) == 1 else several
            return
        entries: list[Union[str, TrainSource]] = []
        for entry, paths in zip(self.train, specs, strict=True):
            if isinstance(entry, TrainSource):
                entries.append(TrainSource(path=paths[0] if len(paths) == 1 else paths, weight=entry.weight))
            else:
                entries += paths
        self.train = entries

    @model_validator(mode="after")
    def _one_eval_source(self) -> DataConfig:
        if self.eval is not None and self.eval_fraction is not None:
            raise ValueError("both `data.eval` and `data.eval_fraction` are set; choose one")
        return self

    @model_validator(mode="after")
    def _chat_loss(self) -> DataConfig:
        chosen = [
            (f"data.{key}", value)
            for key, value, default in (("reasoning", self.reasoning, "train"), ("assistant_turns", self.assistant_turns, "all"))
            if value != default
        ]
        if chosen and self.format != "chat":
            key, value = chosen[0]
            raise ValueError(
                f"`{key}: {value}` chooses what a conversation trains on, but data.format is {self.format}; set "
                f"data.format: chat, or remove {key}"
            )
        if chosen and self.train_on_prompt:
            key, value = chosen[0]
            raise ValueError(
                f"data.train_on_prompt trains every token, so `{key}: {value}` would change nothing; remove one of them"
            )
        return self


#: What early stopping can watch: an evaluation's columns of metrics.jsonl, by their prefix (the held-out data's
#: eval_loss and eval_exact_match, and dpo's eval_rewards/*, eval_logps/*; the retain set's retain_*).
EARLY_STOPPING_PREFIXES = ("eval_", "retain_")


def metric_mode(metric: str) -> Literal["min", "max"] | None:
    """Whether a lower (``min``) or a higher (``max``) value of an evaluation's ``metric`` is better, when its
    name says so (a loss; an exact match, accuracy or margin); None otherwise."""
    if metric.endswith("loss"):
        return "min"
    if metric.endswith(("exact_match", "accuracy", "margin")):
        return "max"
    return None


class EarlyStoppingConfig(Section):
    metric: str = Field(
        "eval_loss",
        description="The evaluation's figure to watch, as metrics.jsonl names it: eval_loss, eval_exact_match, "
        "retain_loss, retain_exact_match, or dpo's eval_rewards/accuracy, eval_rewards/margin, ...",
    )
    patience: int = Field(
        3, ge=1, le=10**9, description="Stop after this many evaluations in a row without an improvement."
    )
    min_delta: float = Field(
        0.0, ge=0.0, le=1e9, allow_inf_nan=False,
        description="An improvement is a change beyond the best value so far by more than this, in the better "
        "direction.",
    )
    mode: Literal["auto", "min", "max"] = Field(
        "auto",
        description="min: lower is better; max: higher is better; auto: from the metric's name (a loss: min; an "
        "exact match, accuracy or margin: max).",
    )
    final_model: Literal["best", "last"] = Field(
        "best",
        description="What the run saves as its model: the best evaluation's checkpoint (best) or the weights of its "
        "last step (last). The best checkpoint is kept and named either way (checkpoints/best.json).",
    )

    @model_validator(mode="after")
    def _known_metric(self) -> EarlyStoppingConfig:
        if not self.metric.startswith(EARLY_STOPPING_PREFIXES):
            raise ValueError(
                f"metric `{self.metric}` is not an evaluation's figure; use eval_loss, eval_exact_match, retain_loss "
                "or another eval_* / retain_* column of metrics.jsonl"
            )
        if self.mode == "auto" and metric_mode(self.metric) is None:
            raise ValueError(
                f"cannot tell whether a higher or a lower {self.metric} is better; set train.early_stopping.mode: "
                "min or max"
            )
        return self

    @property
    def better(self) -> Literal["min", "max"]:
        """The direction of an improvement (``mode``, or what the metric's name says)."""
        mode = self.mode if self.mode != "auto" else metric_mode(self.metric)
        assert mode is not None, "the schema refuses a metric whose direction is unknown"
        return mode


class TrainConfig(Section):
    epochs: float = Field(
        1.0, gt=0, le=1e6, description="Passes over the training data (ignored when max_steps is set)."
    )
    max_steps: Union[Steps, None] = Field(None, description="Optimizer steps to run; overrides epochs.")
    global_batch_size: int = Field(8, ge=1, le=MAX_TOKENS, description="Samples per optimizer step, over all processes.")
    micro_batch_size: Union[Batch, Literal["auto"]] = Field(
        "auto", description="Samples per forward pass per process; auto: the largest that fits (planner)."
    )
    lr: float = Field(2e-5, gt=0, le=10.0, description="Peak learning rate of AdamW.")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Linear warmup from 0 to lr over this many steps.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Floor of the decay, as a fraction of lr.")
    weight_decay: float = Field(
        0.0, ge=0.0, le=10.0, description="Decoupled weight decay (not on norms and biases)."
    )
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.999), description="AdamW betas: the decay rates of the first and second moments, each in [0, 1)."
    )
    optimizer: Literal["auto", "adamw", "adamw8bit", "paged_adamw8bit"] = Field(
        "auto",
        description="auto: adamw, unless nothing fits without smaller optimizer state (the planner then picks "
        "adamw8bit, then paged_adamw8bit); adamw: torch's fused kernel; adamw8bit: bitsandbytes' 8-bit state "
        "(1 byte per value and moment, blockwise scales; under zero2/fsdp each rank updates its own shards); "
        "paged_adamw8bit: the same in CUDA unified memory, paged to the host under pressure (on CPU it is "
        "adamw8bit). Not with tensor parallelism.",
    )
    offload: Literal["auto", "none", "optimizer", "parameters"] = Field(
        "auto",
        description="Keep the training state in host memory instead of on the GPUs (FSDP2's CPU offload; 2 or more "
        "processes). optimizer: with zero2, each rank's parameter, gradient and optimizer-state shards live on the "
        "host and the optimizer steps there, while the gathered compute copy stays on the GPU from forward to "
        "backward (ZeRO-Offload); parameters: with fsdp, the same with each unit copied up for its forward and its "
        "backward. auto: none, unless nothing fits on the GPUs otherwise (the planner then offloads the least that "
        "fits).",
    )
    max_grad_norm: Union[Annotated[float, Field(ge=0, le=1e9)], None] = Field(
        1.0, description="Clip the global gradient norm to this; 0 or null: no clipping (a negative norm is refused)."
    )
    activation_checkpointing: Union[bool, Literal["auto"]] = Field(
        "auto", description="Recompute each decoder block in backward; auto: only when the planner needs it."
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder block (after activation checkpointing, before sharding) under "
        "every strategy and load path; the run header says so. Not with tensor parallelism.",
    )
    seed: int = Field(
        0, ge=0, le=MAX_SEED, description="Seeds weights (init: random), data order, dropout (0 to 2^32 - 1)."
    )
    objective: Literal["sft", "dpo", "simpo", "orpo", "grpo"] = Field(
        "sft",
        description="sft: next-token loss on the completions; dpo, simpo, orpo: preference tuning on "
        "data.format: preference pairs (the `dpo` section sets beta, the loss, the reference, SimPO's gamma and "
        "ORPO's lambda); grpo: reinforcement learning with verifiable rewards on the prompts of instruction or "
        "chat rows (their answers are the reference answers; the `grpo` section sets the sampling, the loss and "
        "the rewards), train.global_batch_size counting completions.",
    )
    router_aux_loss_coef: Union[Annotated[float, Field(ge=0.0, le=1.0e3)], Literal["auto"]] = Field(
        "auto",
        description="A mixture of experts' load-balancing loss, added to the loss times this coefficient "
        "(per target token, as the loss is normalised; logged as aux_loss beside the cross-entropy); auto: the "
        "model config's router_aux_loss_coef (Qwen3-MoE, Mixtral and gpt-oss define the loss; DeepSeek-V3 "
        "balances its experts without one); 0: off.",
    )
    on_nonfinite: Literal["auto", "stop", "skip"] = Field(
        "auto",
        description="A NaN/inf loss or gradient norm: stop (name the step and the last good checkpoint, exit 3), "
        "or skip (no update for that step; counted and reported); auto: skip under fp16 loss scaling, where "
        "overflow steps are expected, stop otherwise.",
    )
    max_consecutive_skips: int = Field(
        25,
        ge=1,
        le=MAX_STEPS,
        description="Under on_nonfinite skip (or auto's skip): this many non-finite steps in a row stop the run "
        "(exit 3, no save, no upload), since nothing has been learned since the last good step. fp16 loss "
        "scaling skips a few steps at the start while it finds its scale.",
    )
    early_stopping: Union[EarlyStoppingConfig, None] = Field(
        None,
        description="Stop when the evaluation stops improving (needs eval.every and held-out data): metric, "
        "patience, min_delta, mode, final_model. The best evaluation's checkpoint is kept whatever output.keep "
        "says, and named in checkpoints/best.json and the run's summary; null: train every step.",
    )


#: Seconds a collective of the training process group may wait (distributed.timeout): NCCL's own default is 600.
DEFAULT_TIMEOUT_S = 1800
#: Seconds the other ranks may wait while one rank tokenises or finishes a checkpoint (distributed.wait_timeout).
DEFAULT_WAIT_TIMEOUT_S = 6 * 3600


class DistributedConfig(Section):
    strategy: Literal["auto", "single", "ddp", "zero1", "zero2", "fsdp", "hsdp"] = Field(
        "auto",
        description="auto: the planner picks; single: one process; ddp/zero1/zero2/fsdp: data parallel; hsdp: "
        "FSDP's sharding inside each node and replicas across nodes (a 2-D mesh: the parameters' all-gathers and "
        "the gradients' reduce-scatters stay on the fast link inside a node, and only a gradient all-reduce of "
        "each node's shard crosses the network; 2 or more nodes).",
    )
    nproc: Union[Processes, Literal["auto"]] = Field(
        "auto", description="Processes per node; auto: one per visible GPU, 1 on CPU."
    )
    tp: Union[Processes, Literal["auto"]] = Field(
        1,
        description="Tensor-parallel degree inside a node (each block's linears split over tp ranks; the "
        "strategy shards over the rest); auto: the planner uses TP only when FSDP alone does not fit.",
    )
    ep: Processes = Field(
        1,
        description="Expert-parallel degree of a mixture of experts: each routed expert lives on one of ep ranks "
        "(E/ep experts each) and tokens reach it by all-to-all; ep borrows its ranks from the data-parallel shard "
        "dimension (it divides the zero2/fsdp processes and the experts), FSDP shards the experts over the "
        "processes ep leaves and every other weight over all of them. Each rank then gathers only its experts for "
        "a block and sends its routed tokens instead.",
    )
    pp: Union[Processes, Literal["auto"]] = Field(
        1,
        description="Pipeline-parallel degree: the decoder layers split into stages over pp ranks (the first stage "
        "also holds the embeddings, the last the final norm, the head and the loss), the outermost dimension of "
        "the (pp, dp, tp) mesh, so stages sit on different nodes and TP inside one; the gradient-accumulation "
        "micro-batches are the pipeline's micro-batches; auto: the planner uses it only when nothing else fits.",
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = Field(
        "1f1b",
        description="The pipeline's schedule: gpipe (all forwards, then all backwards: every micro-batch's "
        "activations in flight), 1f1b (one forward, one backward: at most pp micro-batches in flight) or "
        "interleaved-1f1b (several stages per rank, a smaller bubble for more point-to-point traffic).",
    )
    pp_stages_per_rank: Optional[Processes] = Field(
        None,
        description="Pipeline stages each pp rank runs; default 1, and 2 with interleaved-1f1b (which needs 2 or "
        "more).",
    )
    pp_layers: Optional[list[Steps]] = Field(
        None,
        description="Decoder layers of each pipeline stage, in order (pp x stages per rank numbers summing to the "
        "model's layers); default: a split balanced by each stage's cost, the embeddings and the head counted.",
    )
    pp_buckets: int = Field(
        4,
        ge=1,
        le=8,
        description="Row widths a pipeline's micro-batches are padded to: N gives N widths, max_seq_len halved N-1 "
        "times, and each step is padded to the narrowest that holds its longest row (fewer padded tokens through "
        "the stages; the stages keep static shapes, one width's buffers at a time, and the plan stays the full "
        "width's); 1 pads every step to data.max_seq_len. Without a pipeline every micro-batch is padded to its "
        "own longest row already.",
    )
    sequence_parallel: bool = Field(
        True,
        description="With distributed.tp above 1: the norms, dropout and residual stream between the blocks' "
        "linears are split over the sequence on the tp ranks (all-gather before, reduce-scatter after, in place "
        "of one all-reduce), so those activations are divided by tp; the head and the loss run on each rank's "
        "positions.",
    )
    timeout: float = Field(
        DEFAULT_TIMEOUT_S,
        gt=0,
        le=MAX_SECONDS,
        description="Seconds one collective of the training step (all-reduce, all-gather, barrier) may wait for "
        "the other ranks before the run stops with an error (NCCL's watchdog on GPUs); torch's NCCL default "
        "is 600.",
    )
    wait_timeout: float = Field(
        DEFAULT_WAIT_TIMEOUT_S,
        gt=0,
        le=MAX_SECONDS,
        description="Seconds the other ranks may wait while one rank works alone: local rank 0 tokenising the "
        "data, rank 0 finishing a checkpoint (fsync, rename, prune) or writing the final model. They wait in "
        "a gloo group of their own, which NCCL's watchdog does not watch.",
    )


class DpoConfig(Section):
    """Preference tuning (train.objective dpo, simpo, orpo)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, allow_inf_nan=False, populate_by_name=True, serialize_by_alias=True
    )

    beta: float = Field(
        0.1, gt=0, le=1e3, description="DPO: the strength of the KL pull towards the reference (IPO: its tau); SimPO: the "
        "reward scale (2.0 in its paper)."
    )
    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid",
        description="dpo's loss: sigmoid (-log sigmoid(beta x margin), the DPO paper's) or ipo (the squared distance "
        "of the length-normalised margin from 1/(2 beta)).",
    )
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="dpo sigmoid: the assumed fraction of flipped labels (conservative DPO)."
    )
    reference: Literal["model", "precomputed"] = Field(
        "model",
        description="dpo's reference policy: model (full fine-tuning: a frozen copy of the starting weights, held and "
        "sharded like the policy's; adapter methods: the base with the adapters switched off, at no memory cost) "
        "or precomputed (its log-probabilities computed in one pass before training and kept with the data: no "
        "reference in memory during training; cached beside the tokenized data, so a run on the same data and "
        "reference reads them back).",
    )
    reference_model: Union[str, None] = Field(
        None,
        description="dpo with method: full: the model directory of the reference policy (default: the policy's "
        "starting weights), e.g. the SFT model while the policy starts from it, or another run's output.dir. It "
        "must share the policy's tokenizer and architecture; with reference: precomputed its log-probabilities "
        "are the ones computed before training. Adapter methods compare with their base.",
    )
    gamma: float = Field(0.5, ge=0.0, le=1e3, description="simpo: the target reward margin (gamma) of SimPO's loss.")
    lambda_: float = Field(
        0.1, gt=0, le=1e3, alias="lambda", description="orpo: the weight of the odds-ratio term beside the chosen completion's "
        "next-token loss."
    )


class RewardConfig(Section):
    """One of grpo's rewards (finetune/objectives/rewards.py)."""

    type: Literal["exact_match", "regex", "json", "length", "python"] = Field(
        description="exact_match: 1 when the completion equals the row's answer; regex: 1 when it matches `pattern` "
        "(a format check); json: 1 when it parses as JSON; length: -|characters - target| / target (a penalty); "
        "python: the number `function` of `file` returns (needs grpo.trust_reward_code).",
    )
    weight: float = Field(1.0, ge=-1000.0, le=1000.0, description="Its weight in the completion's reward (a weighted sum).")
    name: Union[str, None] = Field(
        None, description="Its name in metrics.jsonl (reward/NAME); default: the type, or the python function's name."
    )
    pattern: Union[str, None] = Field(None, description="regex: the pattern the whole completion must match.")
    target: Union[int, None] = Field(None, ge=1, le=100_000, description="length: the length in characters (no penalty).")
    file: Union[str, None] = Field(None, description="python: the .py file defining the function (relative to the recipe).")
    function: Union[str, None] = Field(
        None,
        description="python: the function's name, called as function(prompt=..., completion=..., answer=...) "
        "(answer: the reference answer or None) for one number.",
    )

    @model_validator(mode="after")
    def _fields_of_type(self) -> RewardConfig:
        needs = {"regex": ("pattern",), "length": ("target",), "python": ("file", "function")}.get(self.type, ())
        missing = [k for k in needs if getattr(self, k) is None]
        if missing:
            raise ValueError(f"a `{self.type}` reward needs `{missing[0]}`")
        return self


class GrpoConfig(Section):
    """Reinforcement learning with verifiable rewards (train.objective: grpo)."""

    num_generations: int = Field(
        8, ge=2, le=256, description="Completions sampled per prompt (the group whose rewards are compared); "
        "train.global_batch_size must be a multiple of it.",
    )
    max_completion_length: int = Field(32, ge=1, le=32_768, description="Tokens generated per completion at most.")
    temperature: float = Field(
        1.0, gt=0.0, le=10.0, description="Sampling temperature of the completions (the loss's log-probabilities are "
        "of the logits divided by it, as the sampling's)."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: the most likely tokens reaching this mass.")
    beta: float = Field(
        0.0, ge=0.0, le=10.0, description="Weight of the KL to the reference policy (the starting weights: a frozen "
        "copy under full fine-tuning, the base with its adapters off for adapter methods); 0: no reference."
    )
    epsilon: float = Field(0.2, gt=0.0, lt=1.0, description="Clipping of the policy ratio below: 1 - epsilon.")
    epsilon_high: Union[float, None] = Field(
        None, gt=0.0, le=10.0, description="Clipping of the ratio above: 1 + epsilon_high (DAPO's clip-higher); "
        "default: epsilon."
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = Field(
        "dapo",
        description="How token losses are averaged: grpo (each completion's mean, then the mean over completions), "
        "dr_grpo (their sum over completions x max_completion_length), dapo (their sum over the batch's "
        "completion tokens), as TRL's GRPOTrainer.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantages are rewards minus their group's mean, divided by the group's standard deviation "
        "(group), the batch's (batch), or not divided (none: Dr. GRPO's).",
    )
    num_iterations: int = Field(
        1, ge=1, le=64, description="Optimizer steps on each batch of completions (after the first, the ratio is "
        "to the log-probabilities of the policy that sampled them)."
    )
    rewards: list[RewardConfig] = Field(
        default_factory=list, description="The rewards, summed with their weights (at least one for grpo)."
    )
    trust_reward_code: bool = Field(
        False, description="Allow `python` rewards, which import and run the recipe's own Python file."
    )

    @model_validator(mode="after")
    def _rewards(self) -> GrpoConfig:
        names = [r.name or (r.function if r.type == "python" else r.type) for r in self.rewards]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"two rewards are named `{dup}`; give each a distinct `name`")
        if any(r.type == "python" for r in self.rewards) and not self.trust_reward_code:
            raise ValueError(
                "a `python` reward runs the recipe's own code; set grpo.trust_reward_code: true to allow it"
            )
        return self


class EvalConfig(Section):
    every: int = Field(0, ge=0, le=MAX_STEPS, description="Evaluate every N optimizer steps (0: only at the end).")
    at_start: bool = Field(True, description="Also evaluate before the first step, to show what training changed.")
    max_new_tokens: int = Field(32, ge=1, le=MAX_TOKENS, description="Greedy generation length for exact match.")
    max_samples: Union[Steps, None] = Field(None, description="Evaluate on at most this many eval rows.")
    batch_size: Union[Batch, Literal["auto"]] = Field(
        "auto",
        description="Rows per eval forward pass and per generation batch; auto: the largest (up to 64) whose "
        "logits and KV cache fit beside the model states (the planner traces both).",
    )
    retain: Union[str, None] = Field(
        None,
        description="Data the model should keep doing well on (a .jsonl/.json/.csv/.parquet file, glob or "
        "directory): its loss, and its exact match where the rows have answers, are measured before training "
        "and at every evaluation, so a rise shows forgetting. Rows of the text (text), instruction "
        "(instruction, input, output) or chat (messages) format, told apart by their fields (data.columns); "
        "instruction and chat rows have answers. Shipped: recipes/data/retain/.",
    )


class OutputConfig(Section):
    dir: str = Field(
        "runs/run",
        description="Where the model/adapter, recipe.yaml, plan.json and metrics go. It must not be, contain or "
        "lie inside an input (model.path, dpo.reference_model, the data, the recipe file); one run at a time "
        "holds it (a lock file, .finetune.lock).",
    )
    log_every: int = Field(10, ge=1, le=MAX_STEPS, description="Write a metrics.jsonl line every N steps.")
    save_every: int = Field(0, ge=0, le=MAX_STEPS, description="Checkpoint every N steps (0: only the final save).")
    keep: int = Field(2, ge=1, le=MAX_STEPS, description="How many checkpoints to keep.")
    push_to_hub: Union[str, None] = Field(
        None,
        description="Upload the final model or adapter to this Hub repository (org/name) with a model card holding "
        "the recipe, the plan and the final metrics (rank 0, after the final save; HF_TOKEN authenticates). Only "
        "the files the run wrote are uploaded.",
    )
    push_private: bool = Field(
        True,
        description="Create the output.push_to_hub repository as private (an existing repository keeps its "
        "visibility); false: public.",
    )
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="Also log metrics.jsonl's rows, the recipe and the plan to these (rank 0; wandb offline and "
        "MLflow in output.dir/mlruns unless WANDB_MODE / MLFLOW_TRACKING_URI say otherwise).",
    )
    max_shard_size: str = Field(
        "5GiB",
        pattern=r"^\s*[0-9]*\.?[0-9]+\s*[KMGTkmgt]?i?[Bb]?\s*$",
        description="Largest safetensors file of a full fine-tune's final model, e.g. 5GiB or 500MiB; a bigger "
        "model is written in several files with model.safetensors.index.json.",
    )

    @field_validator("dir")
    @classmethod
    def _dir_named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("is empty, which would mean the current directory; name a directory, e.g. runs/run")
        return value

    @field_validator("max_shard_size")
    @classmethod
    def _shard_size_positive(cls, value: str) -> str:
        if not any(ch in "123456789" for ch in value.split(".")[0] + value.partition(".")[2]):
            raise ValueError("is no size; write e.g. 5GiB or 500MiB")
        return value


class HardwareConfig(Section):
    gpus: Union[Processes, Literal["auto"]] = Field(
        "auto", description="GPUs per node `finetune plan` plans for; auto: the visible ones (runs use the real ones)."
    )
    gpu_memory: Union[str, None] = Field(None, description="Memory per GPU, e.g. 80GiB; default: the visible GPU's.")
    gpu_type: Union[str, None] = Field(
        None,
        description="e.g. h100, a100, l4, v100 (sets memory and bf16 support; in a GPU run, the peak FLOPS its MFU "
        "is measured against, default: the GPU recognised from its device name).",
    )
    nodes: int = Field(1, ge=1, le=MAX_PROCESSES, description="Number of nodes.")
    interconnect: Union[str, None] = Field(
        None, description="nvlink, pcie, infiniband, ethernet or a bandwidth like 200GB/s (communication time)."
    )


class Recipe(Section):
    """A whole fine-tuning recipe."""

    model: ModelConfig
    method: Literal["full", "lora", "qlora", "prefix", "adapter", "prompt", "auto"] = Field(
        "full",
        description="full: train every weight; lora: adapters on a frozen base; qlora: adapters on a 4-bit base; "
        "prefix: trained key/value prefixes (prefix tuning); adapter: bottleneck adapters after attention and MLP; "
        "prompt: trained virtual token embeddings before the input (prompt tuning); "
        "auto: full, else lora, else qlora, the first the planner finds fits.",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="Adapter settings (lora and qlora).")
    prefix: PrefixConfig = Field(default_factory=PrefixConfig, description="Prefix tuning settings (method prefix).")
    adapter: AdapterConfig = Field(default_factory=AdapterConfig, description="Bottleneck adapter settings (method adapter).")
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="Prompt tuning settings (method prompt).")
    quantization: QuantizationConfig = Field(
        default_factory=QuantizationConfig, description="Base-weight quantization (qlora)."
    )
    data: DataConfig
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation settings.")
    dpo: DpoConfig = Field(
        default_factory=DpoConfig, description="Preference tuning settings (train.objective dpo, simpo, orpo)."
    )
    grpo: GrpoConfig = Field(
        default_factory=GrpoConfig, description="Reinforcement learning settings (train.objective: grpo)."
    )
    precision: Literal["auto", "fp32", "bf16", "fp16", "bf16-pure"] = Field(
        "auto",
        description="fp32; bf16/fp16: mixed precision with fp32 master weights (fp16 with loss scaling); "
        "bf16-pure: weights, gradients and optimizer state in bf16; auto: bf16 where supported, else fp16 on "
        "GPU, fp32 on CPU.",
    )
    distributed: DistributedConfig = Field(default_factory=DistributedConfig, description="Processes and sharding.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Periodic evaluation.")
    output: OutputConfig = Field(default_factory=OutputConfig, description="Outputs and checkpoints.")
    hardware: HardwareConfig = Field(
        default_factory=HardwareConfig, description="The machine `finetune plan` plans for (runs use the real one)."
    )

    @model_validator(mode="after")
    def _early_stopping_evaluates(self) -> Recipe:
        es = self.train.early_stopping
        if es is None:
            return self
        if not self.eval.every:
            raise ValueError(
                "train.early_stopping: it compares evaluations during training, but eval.every is 0 (one evaluation, "
                "at the end); set eval.every, e.g. eval.every: 100"
            )
        if es.metric.startswith("retain_") and self.eval.retain is None:
            raise ValueError(
                f"train.early_stopping.metric: {es.metric} is measured on eval.retain, which the recipe does not "
                "set; set eval.retain or watch eval_loss"
            )
        if es.metric.startswith("eval_") and self.data.eval is None and self.data.eval_fraction is None:
            raise ValueError(
                f"train.early_stopping.metric: {es.metric} is measured on held-out data, which the recipe does not "
                "have; set data.eval or data.eval_fraction"
            )
        return self

    @model_validator(mode="after")
    def _grpo_batch(self) -> Recipe:
        if self.train.objective != "grpo":
            return self
        if not self.grpo.rewards:
            raise ValueError("train.objective: grpo learns from rewards but grpo.rewards is empty; add one, e.g. "
                             "`- {type: exact_match}`")
        g, n = self.train.global_batch_size, self.grpo.num_generations
        if g % n:
            raise ValueError(
                f"train.global_batch_size: {g} completions are not whole groups of grpo.num_generations: {n}; make "
                "it a multiple of it"
            )
        return self


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


@dataclass
class Problem:
    """One thing wrong with a recipe: where (key path, file, line) and what to do."""

    key: str
    message: str
    file: str | None = None
    line: int | None = None

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = f"{self.file}:{self.line}: " if self.line else f"{self.file}: "
        return f"{where}{self.key}: {self.message}"


@dataclass
class RecipeError(Exception):
    """Every problem found in a recipe; ``str()`` gives one line per problem."""

    problems: list[Problem] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(str(p) for p in self.problems)


# --------------------------------------------------------------------------------------------------
# YAML with line numbers
# --------------------------------------------------------------------------------------------------


def _yaml_layout(text: str, file: str) -> tuple[dict[tuple[str, ...], int], list[Problem]]:
    """One walk of the YAML document: the 1-based line where each key path is written (the last, when a key
    is written twice), and one problem per key written twice in the same mapping (YAML keeps the last
    silently, so a stray line could replace a whole section)."""
    lines: dict[tuple[str, ...], int] = {}
    problems: list[Problem] = []
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return lines, problems

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for k, v in node.value:
                key, line = str(k.value), k.start_mark.line + 1
                if key in first:
                    problems.append(Problem(
                        ".".join((*path, key)),
                        f"written twice (lines {first[key]} and {line}); keep one of them",
                        file, line,
                    ))
                first.setdefault(key, line)
                lines[(*path, key)] = line
                walk(v, (*path, key))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                lines[(*path, str(i))] = v.start_mark.line + 1
                walk(v, (*path, str(i)))

    walk(root, ())
    return lines, problems


def _section_fields(path: tuple[str, ...]) -> list[str]:
    """Field names allowed at ``path`` in the schema (for "did you mean")."""
    cls: Any = Recipe
    for part in path:
        f = cls.model_fields.get(part) if hasattr(cls, "model_fields") else None
        if f is None:
            return []
        ann = f.annotation
        models = [a for a in (get_args(ann) or (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) != 1:  # a section, or an optional one (train.early_stopping)
            return []
        cls = models[0]
    return list(cls.model_fields) if hasattr(cls, "model_fields") else []


def suggest(word: str, choices: list[str]) -> str:
    """A hint for a mistyped ``word``: "did you mean `x`?" for the closest of ``choices``, else the choices."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close:  # abbreviations and spelled-out names: `rank` for `r`, `lr_scheduler` for `lr_schedule`
        close = [c for c in choices if word.startswith(c) or c.startswith(word) or c in word.split("_")][:1]
    if close:
        return f"did you mean `{close[0]}`?"
    return f"allowed keys: {', '.join(choices)}" if choices else ""


# --------------------------------------------------------------------------------------------------
# Overrides
# --------------------------------------------------------------------------------------------------


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> list[Problem]:
    """Apply ``a.b=value`` overrides to ``raw`` in place (value read as YAML); return the problems."""
    problems: list[Problem] = []
    for item in overrides:
        if "=" not in item:
            problems.append(Problem(f"--set {item}", "expected KEY=VALUE, e.g. --set train.lr=1e-4"))
            continue
        key, _, text = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not all(parts):
            problems.append(Problem(f"--set {item}", "the key has an empty part; write e.g. train.lr"))
            continue
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as exc:
            problems.append(Problem(f"--set {key}", f"the value is not valid YAML ({exc.problem})"))
            continue
        node = raw
        for i, part in enumerate(parts[:-1]):
            allowed = _section_fields(tuple(parts[:i]))
            if part not in allowed:
                problems.append(Problem(f"--set {key}", f"unknown key `{part}`; {suggest(part, allowed)}"))
                break
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        else:
            allowed = _section_fields(tuple(parts[:-1]))
            if parts[-1] not in allowed:
                problems.append(Problem(f"--set {key}", f"unknown key `{parts[-1]}`; {suggest(parts[-1], allowed)}"))
                continue
            node[parts[-1]] = value
    return problems


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    """Where the recipe's inputs are, resolved once (see finetune.recipe.locate)."""

    model: ModelLocation
    train: list[DataLocation]
    eval: DataLocation | None
    retain: DataLocation | None = None  # eval.retain


@dataclass
class LoadedRecipe:
    """A validated recipe, where it came from, and the line of each key (for later error messages)."""

    recipe: Recipe
    path: Path | None
    lines: dict[tuple[str, ...], int]
    overrides: list[str]
    inputs: Inputs | None = None  # model.path and data specs, resolved once by load_recipe

    @property
    def base_dir(self) -> Path:
        """Directory relative input paths are looked up in first."""
        return self.path.parent if self.path else Path.cwd()

    def where(self, key: str) -> tuple[str | None, int | None]:
        """(file, line) of a dotted key, or of the ``--set`` that set it."""
        for ov in self.overrides:
            if ov.split("=", 1)[0].strip() == key:
                return ("--set", None)
        line = self.lines.get(tuple(key.split(".")))
        return (str(self.path) if self.path else None, line)

    def problem(self, key: str, message: str) -> Problem:
        """A :class:`Problem` for ``key`` located in the recipe file."""
        f, line = self.where(key)
        return Problem(key, message, f, line)

    def resolve_input(self, value: str) -> Path:
        """Resolve a relative input path: next to the recipe, then the current directory."""
        return resolve_input_path(value, self.base_dir)


#: A recipe-wide rule's sentence starts with the dotted key it is about (``train.early_stopping: ...``).
_NAMED_KEY = re.compile(r"^([a-z_]+(?:\.[a-z_]+)+): ")


def _validate(raw: Any, file: str | None, lines: dict[tuple[str, ...], int], overrides: list[str]) -> Recipe:
    if not isinstance(raw, dict):
        raise RecipeError([Problem("(top)", "a recipe is a YAML mapping of sections (model:, data:, ...)", file, 1)])
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        problems = []
        overridden = {ov.split("=", 1)[0].strip() for ov in overrides}
        for err in exc.errors():
            loc = tuple(str(x) for x in err["loc"])
            # pydantic appends union members ('int', "literal['auto']") to the location: keep only
            # field names inside sections and list indices inside a leaf field.
            clean: list[str] = []
            for part in loc:
                if _section_fields(tuple(clean)) or part.isdigit():
                    clean.append(part)
                else:
                    break
            key = ".".join(clean) or "(top)"
            etype = err["type"]
            if etype == "extra_forbidden":
                allowed = _section_fields(tuple(clean[:-1]))
                msg = f"unknown key; {suggest(clean[-1], allowed)}"
            elif etype == "missing":
                msg = "is required but missing"
            else:
                msg = err["msg"].removeprefix("Value error, ")  # a validator's own sentence
                if "input" in err and not isinstance(err["input"], (dict, list)):
                    msg = f"{msg} (got {err['input']!r})"
                named = _NAMED_KEY.match(msg) if not clean else None
                if named:  # a rule between sections names the key it is about first: placed on that key's line
                    clean, msg = named.group(1).split("."), msg[named.end() :]
                    key = named.group(1)
            line = None
            for n in range(len(clean), 0, -1):
                if tuple(clean[:n]) in lines:
                    line = lines[tuple(clean[:n])]
                    break
            if key in overridden:
                problems.append(Problem(f"--set {key}", msg))
            else:
                problems.append(Problem(key, msg, file, line))
        # one line per (key, message): union members can repeat the same complaint
        seen: set[str] = set()
        unique = []
        for p in problems:
            if str(p) not in seen:
                seen.add(str(p))
                unique.append(p)
        # for a union, keep only the first complaint of each key
        by_key: dict[str, Problem] = {}
        for p in unique:
            by_key.setdefault(p.key, p)
        raise RecipeError(list(by_key.values())) from None


def load_recipe(
    path: str | os.PathLike[str], overrides: list[str] | None = None, *, fetch: bool = False
) -> LoadedRecipe:
    """Read, override and validate a recipe file, and resolve its inputs into ``LoadedRecipe.inputs``, the one
    record every later check and command reads; raise :class:`RecipeError` listing every problem.

    ``fetch`` (a run): the hub ids it names that are neither local nor cached are downloaded during resolution
    (finetune.recipe.locate.fetch_hub_inputs), so the record holds where they landed."""
    overrides = list(overrides or [])
    p = Path(path)
    if not p.is_file():
        shipped = shipped_recipes_dir() / p
        if not p.suffix and (shipped.with_suffix(".yaml")).is_file():
            p = shipped.with_suffix(".yaml")
        elif shipped.is_file():
            p = shipped
        else:
            raise RecipeError([Problem("(file)", f"recipe file {path} does not exist; `finetune recipes ls` lists the shipped ones")])
    text = p.read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else None
        raise RecipeError([Problem("(yaml)", f"not valid YAML: {getattr(exc, 'problem', exc)}", str(p), line)]) from None
    if raw is None:
        raw = {}
    lines, duplicates = _yaml_layout(text, str(p))
    if duplicates:
        raise RecipeError(duplicates)
    problems = apply_overrides(raw, overrides) if isinstance(raw, dict) else []
    try:
        recipe = _validate(raw, str(p), lines, overrides)
    except RecipeError as exc:
        raise RecipeError(problems + exc.problems) from None
    if problems:
        raise RecipeError(problems)
    loaded = resolve_inputs(LoadedRecipe(recipe, p.resolve(), lines, overrides))
    if fetch:
        from finetune.recipe.locate import fetch_hub_inputs

        if fetch_hub_inputs(loaded):  # downloaded: resolved again where the files now are
            resolve_inputs(loaded)
    return loaded


def recipe_with_overrides(raw: dict[str, Any], overrides: list[str]) -> LoadedRecipe:
    """A recipe built in memory (``finetune plan --model``) with ``--set`` overrides applied and checked
    exactly as for a recipe file; raise :class:`RecipeError` listing every problem."""
    raw = copy.deepcopy(raw)
    problems = apply_overrides(raw, overrides)
    try:
        recipe = _validate(raw, None, {}, overrides)
    except RecipeError as exc:
        raise RecipeError(problems + exc.problems) from None
    if problems:
        raise RecipeError(problems)
    return resolve_inputs(LoadedRecipe(recipe, None, {}, list(overrides)))


def recipe_from_dict(raw: dict[str, Any], base_dir: Path | None = None) -> LoadedRecipe:
    """Validate a recipe given as a dict (for tests and for recipes saved in output directories)."""
    recipe = _validate(raw, None, {}, [])
    loaded = LoadedRecipe(recipe, None, {}, [])
    if base_dir is not None:
        loaded.path = base_dir / "recipe.yaml"
    return resolve_inputs(loaded)


def resolve_inputs(loaded: LoadedRecipe) -> LoadedRecipe:
    """Resolve ``model.path``, ``data.train`` and ``data.eval`` once (finetune.recipe.locate) and write what was found
    back as absolute paths, so the saved recipe is self-describing and every later reader sees the same files."""
    r = loaded.recipe
    base = loaded.base_dir
    model = locate_model(r.model.path, base, r.model.revision)
    if model.kind == "dir":
        r.model.path = model.path
    specs = r.data.train_specs()
    train = [locate_data(t.spec, base) for t in specs]
    absolute: list[list[str]] = [[] for _ in range(max(t.source for t in specs) + 1)]
    for t, where in zip(specs, train, strict=True):
        absolute[t.source].append(where.target if where.kind == "files" else where.value)
    r.data.set_train_specs(absolute)
    held = None
    if r.data.eval:
        held = locate_data(r.data.eval, base, split_of=train[0] if len(train) == 1 else None)
        r.data.eval = held.target if held.kind == "files" else held.value
    retain = None
    if r.eval.retain:
        retain = locate_data(r.eval.retain, base)
        r.eval.retain = retain.target if retain.kind == "files" else retain.value
    if r.dpo.reference_model:  # absolute, as model.path, so the saved recipe names the same directory
        ref = locate_model(r.dpo.reference_model, base)
        if ref.kind == "dir":
            r.dpo.reference_model = ref.path
    loaded.inputs = Inputs(model, train, held, retain)
    return loaded


def check_files(loaded: LoadedRecipe) -> list[Problem]:
    """The problems with the inputs a recipe names (model, data, chat template), from their resolution."""
    r = loaded.recipe
    inputs = loaded.inputs or resolve_inputs(loaded).inputs
    assert inputs is not None
    problems: list[Problem] = []
    model_problem = inputs.model.problem()
    if model_problem:
        problems.append(loaded.problem("model.path", model_problem))
    elif inputs.model.kind in ("dir", "hub-cache"):
        from finetune.storage.safetensors_stream import SAFE_INDEX, read_weight_map

        index = Path(inputs.model.path) / SAFE_INDEX
        if index.is_file():
            try:
                read_weight_map(index)
            except UserError as err:
                problems.append(loaded.problem("model.path", str(err)))
    for spec, t in zip(r.data.train_specs(), inputs.train, strict=True):
        key = spec.key
        if t.kind == "missing" and not (looks_like_hub_id(t.value) and not hub_offline()):  # run downloads it
            problems.append(loaded.problem(key, f"no data found at `{t.value}` (looked next to the recipe and in the current directory)"))
    if inputs.eval is not None and inputs.eval.kind == "missing" and not _later_from_hub(loaded, inputs.eval.value):
        problems.append(loaded.problem("data.eval", f"no data found at `{inputs.eval.value}`"))
    if inputs.retain is not None and inputs.retain.kind == "missing":
        problems.append(loaded.problem(
            "eval.retain", f"no data found at `{inputs.retain.value}` (looked next to the recipe and in the "
            "current directory); give a local .jsonl/.json/.csv/.parquet file, e.g. one of recipes/data/retain/"
        ))
    problems += check_method(loaded, inputs)
    if r.dpo.reference_model and r.train.objective == "dpo":
        from finetune.recipe.reference_model import reference_model_problem

        ref_problem = reference_model_problem(r.dpo.reference_model, loaded.base_dir, inputs.model)
        if ref_problem:
            problems.append(loaded.problem("dpo.reference_model", ref_problem))
    template = r.data.chat_template
    if template and "{" not in template and not loaded.resolve_input(template).is_file():
        problems.append(
            loaded.problem("data.chat_template", f"no template file at `{template}` (a template itself contains {{%)")
        )
    return problems + output_problems(loaded)


def run_inputs(loaded: LoadedRecipe) -> list[tuple[str, Path]]:
    """(what, path) of every local file or directory the run reads: the model, the reference model, the data
    (each file, and the directory or file a spec names), the retain set, a chat template file, grpo's python
    reward files."""
    r = loaded.recipe
    inputs = loaded.inputs or resolve_inputs(loaded).inputs
    assert inputs is not None
    found: list[tuple[str, Path]] = []
    if inputs.model.kind in ("dir", "hub-cache"):
        found.append(("the model (model.path)", Path(inputs.model.path)))
    if r.dpo.reference_model:
        ref = locate_model(r.dpo.reference_model, loaded.base_dir)
        if ref.kind in ("dir", "hub-cache"):
            found.append(("the reference model (dpo.reference_model)", Path(ref.path)))
    specs: list[tuple[str, DataLocation | None]] = [
        ("data.train" if isinstance(r.data.train, str) else f"data.train.{i}", t) for i, t in enumerate(inputs.train)
    ]
    specs += [("data.eval", inputs.eval), ("eval.retain", inputs.retain)]
    for key, location in specs:
        if location is None or location.kind != "files":
            continue
        if not any(ch in location.target for ch in "*?["):
            found.append((f"the data ({key})", Path(location.target)))
        with contextlib.suppress(UserError):  # no files: reported by check_files
            found += [(f"the data file of {key}", f) for f in location.files(key)]
    template = r.data.chat_template
    if template and "{" not in template:
        found.append(("the chat template (data.chat_template)", loaded.resolve_input(template)))
    if r.train.objective == "grpo":  # a python reward's file, relative to the recipe as the rewards read it
        for i, reward in enumerate(r.grpo.rewards):
            if reward.type == "python" and reward.file:
                path = Path(reward.file) if Path(reward.file).is_absolute() else loaded.base_dir / reward.file
                found.append((f"the reward function's file (grpo.rewards.{i}.file)", path))
    return found


def output_problems(loaded: LoadedRecipe) -> list[Problem]:
    """``output.dir`` refused when it is, contains or lies inside an input of the run (compared as real paths,
    symlinks resolved): ``--overwrite`` would delete it, a save would replace it, and a directory of data would
    read the run's own files back. The recipe file may be the run's own saved copy (``output.dir/recipe.yaml``,
    which resume commands name) when it holds exactly what the run writes there."""
    from finetune.recipe.locate import path_overlap

    out = Path(os.path.expanduser(loaded.recipe.output.dir))
    checked = run_inputs(loaded)
    if loaded.path is not None:
        copy_of_run = Path(os.path.realpath(loaded.path)) == Path(os.path.realpath(out / "recipe.yaml"))
        if not (copy_of_run and Path(loaded.path).read_text() == recipe_to_yaml(loaded.recipe)):
            checked.append(("the recipe file", Path(loaded.path)))
    for what, path in checked:
        relation = path_overlap(out, path)
        if relation is not None:
            return [loaded.problem(
                "output.dir",
                f"{out} {relation} {what} {path}: the run would write over or delete it; choose an output.dir "
                "apart from every input",
            )]
    return []


def _later_from_hub(loaded: LoadedRecipe, value: str) -> bool:
    """Whether ``run`` will download this data.eval: a dataset id, or a split of a data.train dataset id."""
    if hub_offline():
        return False
    train = loaded.recipe.data.train
    return looks_like_hub_id(value) or (isinstance(train, str) and looks_like_hub_id(train) and "/" not in value)


def check_method(loaded: LoadedRecipe, inputs: Inputs) -> list[Problem]:
    """Settings that contradict each other (every row of the capability table, finetune/recipe/capabilities.py, that
    refuses what the recipe pins) or the model: one problem each, naming the key."""
    from finetune.recipe.capabilities import Cell, refusals

    r = loaded.recipe
    problems = [loaded.problem(found.key, found.message) for found in refusals(Cell.of_recipe(r))]
    pp = r.distributed.pp
    if pp == 1 and r.distributed.pp_layers is not None:
        problems.append(loaded.problem(
            "distributed.pp_layers",
            "set without a pipeline (distributed.pp is 1); set distributed.pp or remove distributed.pp_layers",
        ))
    if r.method in ("lora", "qlora", "auto") and not inputs.model.problem():
        problems += lora_rank_problems(loaded, inputs)
    pipelined = isinstance(pp, int) and pp > 1
    # rows about a mixture of experts' fused weights concern these settings only (the config is read for them)
    tp = r.distributed.tp
    expert_rows = (r.method in ("lora", "qlora", "auto") and (
        r.lora.use_dora or r.lora.init in ("pissa", "olora") or (isinstance(tp, int) and tp > 1)
        or (r.method == "qlora" and r.quantization.bits == 8)
    )) or r.distributed.ep > 1
    wanted = pipelined or (r.method == "adapter" and r.adapter.size is not None) or expert_rows
    if not wanted or inputs.model.problem():
        return problems
    from finetune.errors import UserError
    from finetune.recipe.locate import model_config

    try:
        config = model_config(inputs.model, r.model.trust_remote_code)[0]
    except (OSError, ValueError, UserError):  # the model's own problem is reported by model.path
        return problems
    if expert_rows:
        from finetune.model.experts import expert_facts, routed_experts

        seen = {(p.key, p.message) for p in problems}
        cell = Cell.of_recipe(r).with_(**expert_facts(config, r.lora.target_modules), num_experts=routed_experts(config))
        problems += [
            loaded.problem(f.key, f.message) for f in refusals(cell) if (f.key, f.message) not in seen
        ]
    hidden = int(config.hidden_size)
    if r.method == "adapter" and r.adapter.size is not None and r.adapter.size > hidden:
        problems.append(loaded.problem(
            "adapter.size",
            f"{r.adapter.size} is wider than the model's hidden size {hidden}: a bottleneck must be narrower; "
            f"use at most {hidden} (e.g. {max(1, hidden // 16)})",
        ))
    if pipelined:
        problems += [loaded.problem(key, message) for key, message in pipeline_problems(r, config)]
    return problems


def lora_targets(target_modules: Any, model_type: str) -> list[str] | str:
    """The modules that get LoRA adapters: the recipe's ``lora.target_modules``; when unset, peft's choice for
    the architecture (q_proj and v_proj for Llama, Qwen2, Mistral, Gemma; c_attn for GPT-2), and every linear
    layer (``all-linear``) for architectures peft has no choice for (Phi-3's fused qkv_proj)."""
    if target_modules is not None:
        return list(target_modules) if isinstance(target_modules, tuple) else target_modules
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    return list(PEFT_DEFAULTS.get(model_type) or []) or "all-linear"


#: Config fields that are (or bound from below) a dimension of some linear layer of the model: a rank at most
#: the smallest of them needs no model built to be checked (:func:`narrowest_lora_target`).
WIDTH_FIELDS = (
    "hidden_size", "intermediate_size", "moe_intermediate_size", "head_dim", "v_head_dim", "qk_rope_head_dim",
    "qk_nope_head_dim", "kv_lora_rank", "q_lora_rank", "n_embd", "num_local_experts", "num_experts",
    "n_routed_experts",
)


def config_width_bound(config: dict[str, Any]) -> int:
    """A lower bound of every linear layer's input and output width, from a config's fields (the text config's
    too); 0 when the config names none of :data:`WIDTH_FIELDS`."""
    values: list[int] = []
    for cfg in (config, config.get("text_config") or {}):
        values += [int(v) for k in WIDTH_FIELDS if isinstance(v := cfg.get(k), int) and v > 0]
        heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
        if isinstance(heads, int) and heads > 0 and isinstance(hidden, int):
            values.append(hidden // heads)  # the head width when head_dim is unset
    return min(values) if values else 0


def narrowest_lora_target(config: Any, target_modules: Any, trust_remote_code: bool = False) -> tuple[str, int, int] | None:
    """(name, in features, out features) of the narrowest layer LoRA would adapt on a model of ``config`` (built
    on the meta device, targets matched by peft itself); None when no layer matches."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        peft_config = PeftLoraConfig(r=1, target_modules=lora_targets(target_modules, config.model_type))
        try:
            adapted = get_peft_model(model, peft_config)
        except ValueError:  # targets the model does not have: `run` names them (peft_inject)
            return None
    widths = [
        (name, int(m.in_features), int(m.out_features))
        for name, m in adapted.named_modules()
        if hasattr(m, "lora_A") and isinstance(getattr(m, "in_features", None), int)
    ]
    if not widths:
        return None
    name, fan_in, fan_out = min(widths, key=lambda w: min(w[1], w[2]))
    return name.removeprefix("base_model.model."), fan_in, fan_out


def _config_facts(location: ModelLocation) -> dict[str, Any] | None:
    """The model's config as a dict, read without transformers (a local config.json or a catalog entry)."""
    import json

    from finetune.recipe.catalog import CATALOG

    if location.kind == "catalog":
        return dict(CATALOG[location.path])
    path = Path(location.path) / "config.json"
    if location.kind not in ("dir", "hub-cache") or not path.is_file():
        return None
    try:
        facts = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return facts if isinstance(facts, dict) else None


def lora_rank_problems(loaded: LoadedRecipe, inputs: Inputs) -> list[Problem]:
    """``lora.r`` above the smallest dimension of a weight it adapts (the update's rank cannot exceed it): one
    problem naming that layer. A rank no wider than the config's smallest width needs no model built."""
    from finetune.recipe.locate import model_config

    r = loaded.recipe
    facts = _config_facts(inputs.model)
    if facts is not None and r.lora.r <= config_width_bound(facts):
        return []
    try:
        config = model_config(inputs.model, r.model.trust_remote_code)[0]
        narrowest = narrowest_lora_target(config, r.lora.target_modules, r.model.trust_remote_code)
    except (OSError, ValueError, UserError):  # the model's own problem is reported by model.path
        return []
    if narrowest is None:
        return []
    name, fan_in, fan_out = narrowest
    width = min(fan_in, fan_out)
    if r.lora.r <= width:
        return []
    return [loaded.problem(
        "lora.r",
        f"{r.lora.r} is above the smallest dimension of `{name}` ({fan_in} in, {fan_out} out), one of the layers "
        f"lora.target_modules adapts: a rank cannot exceed it; use at most {width}",
    )]


def pipeline_problems(r: Recipe, config: Any) -> list[tuple[str, str]]:
    """(key, sentence) for each way a pinned pipeline (``distributed.pp`` above 1) cannot cut ``config``'s model
    as the recipe asks: the model's decoder or tied head, more stages than layers, a ``pp_layers`` split that
    does not add up. What depends on the process count is checked by plan and run."""
    from finetune.recipe.capabilities import INTERLEAVED, pipeline_problem, split_problem, stage_problem

    d = r.distributed
    pp = int(d.pp)
    v = d.pp_stages_per_rank or (2 if d.pp_schedule == INTERLEAVED else 1)
    layers = int(config.num_hidden_layers)
    tp = d.tp if isinstance(d.tp, int) else 1
    found = stage_problem(config) or pipeline_problem(
        pp=pp, tp=tp, world=pp * tp, what="processes", schedule=d.pp_schedule, v=v, num_layers=layers,
        pinned_v=d.pp_stages_per_rank,
    )
    if found is None and d.pp_layers is not None:
        found = split_problem(d.pp_layers, pp * v, layers, pp, v)
    if found is None:
        return []
    key, _, message = found.partition(": ")
    return [(key, message)]


def opened_run_recipe(raw: Any) -> dict[str, Any] | None:
    """A recipe read from a run directory that ``chat``, ``eval`` or ``merge`` opens (a dict; None for anything
    else), with ``model.trust_remote_code`` off: a directory, perhaps received from someone else, never turns
    remote code on; the user's ``--trust-remote-code`` does."""
    if not isinstance(raw, dict):
        return None
    model = raw.get("model")
    if isinstance(model, dict) and model.get("trust_remote_code"):
        raw = {**raw, "model": {**model, "trust_remote_code": False}}
    return raw


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML (saved beside every output)."""
    data = recipe.model_dump(mode="json")
    return yaml.safe_dump(data, sort_keys=False)
