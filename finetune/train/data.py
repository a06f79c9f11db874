"""Training data: rows -> token ids with labels -> a deterministic stream of global batches.

The order of samples is a pure function of (seed, epoch): every process computes the same permutation
and takes its own slice of each global batch, so N processes see exactly the samples one process would.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from finetune.errors import UserError
from finetune.recipe import LoadedRecipe
from finetune.train.loss import IGNORE_INDEX

PROMPT_TEMPLATE = "{instruction}\n{input}\nAnswer: "
PROMPT_TEMPLATE_NO_INPUT = "{instruction}\nAnswer: "


@dataclass
class Example:
    """One tokenized sample: ids, labels (IGNORE_INDEX where the loss does not count)."""

    input_ids: list[int]
    labels: list[int]


@dataclass
class EvalPrompt:
    """A prompt for greedy generation and the exact answer expected."""

    prompt_ids: list[int]
    answer: str


@dataclass
class TaskData:
    """Everything the trainer needs from the data."""

    train: list[Example]
    eval: list[Example] = field(default_factory=list)
    eval_prompts: list[EvalPrompt] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{i}: expected a JSON object per line")
            rows.append(row)
    return rows


def format_instruction(row: dict[str, Any]) -> tuple[str, str]:
    """(prompt, completion) of an instruction row."""
    if row.get("input"):
        return PROMPT_TEMPLATE.format(instruction=row["instruction"], input=row["input"]), str(row["output"])
    return PROMPT_TEMPLATE_NO_INPUT.format(instruction=row["instruction"]), str(row["output"])


def tokenize_instruction(
    tokenizer: Any, prompt: str, completion: str, max_seq_len: int, train_on_prompt: bool
) -> tuple[Example, bool]:
    """Tokenize prompt + completion + eos; completion-only labels; truncate. Returns (example, truncated)."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = p + c
    labels = ids.copy() if train_on_prompt else [IGNORE_INDEX] * len(p) + c
    truncated = len(ids) > max_seq_len
    return Example(ids[:max_seq_len], labels[:max_seq_len]), truncated


def load_data(loaded: LoadedRecipe, tokenizer: Any) -> TaskData:
    """Read and tokenize the recipe's train and eval data."""
    r = loaded.recipe
    if r.data.format != "instruction":
        raise UserError(f"data.format: `{r.data.format}` is not supported yet; use instruction")
    trains = r.data.train if isinstance(r.data.train, list) else [r.data.train]
    stats = {"truncated": 0}

    def examples(rows: list[dict[str, Any]]) -> list[Example]:
        out = []
        for row in rows:
            prompt, completion = format_instruction(row)
            ex, trunc = tokenize_instruction(tokenizer, prompt, completion, r.data.max_seq_len, r.data.train_on_prompt)
            stats["truncated"] += int(trunc)
            out.append(ex)
        return out

    train_rows: list[dict[str, Any]] = []
    for t in trains:
        train_rows += _read_jsonl(loaded.resolve_input(t))
    data = TaskData(train=examples(train_rows))
    if r.data.eval:
        eval_rows = _read_jsonl(loaded.resolve_input(r.data.eval))
        if r.eval.max_samples:
            eval_rows = eval_rows[: r.eval.max_samples]
        data.eval = examples(eval_rows)
        for row in eval_rows:
            prompt, completion = format_instruction(row)
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            data.eval_prompts.append(EvalPrompt(ids, completion))
    stats["train"] = len(data.train)
    stats["eval"] = len(data.eval)
    data.stats = stats
    return data


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch to its longest sample."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class BatchStream:
    """Deterministic global batches: the order is a pure function of (seed, epoch).

    Global batch ``s`` of an epoch holds samples ``order[s*G : (s+1)*G]`` (G = global batch size).
    Rank ``r`` of ``W`` takes the contiguous slice ``[r*G/W, (r+1)*G/W)`` of it and cuts that into
    micro-batches, so the union over ranks is the single-process global batch.
    """

    def __init__(self, examples: list[Example], global_batch_size: int, seed: int, pad_id: int) -> None:
        if len(examples) < global_batch_size:
            raise UserError(
                f"train.global_batch_size: {global_batch_size} is larger than the {len(examples)} training samples; lower it"
            )
        self.examples = examples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.steps_per_epoch = len(examples) // global_batch_size

    def order(self, epoch: int) -> list[int]:
        """The permutation of sample indices for ``epoch``."""
        idx = list(range(len(self.examples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
        return idx

    def micro_batches(
        self, epoch: int, step_in_epoch: int, *, rank: int, world_size: int, micro_batch_size: int
    ) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of global batch ``step_in_epoch`` of ``epoch``."""
        g = self.global_batch_size
        per_rank = g // world_size
        order = self.order(epoch)
        start = step_in_epoch * g + rank * per_rank
        mine = [self.examples[i] for i in order[start : start + per_rank]]
        return [collate(mine[i : i + micro_batch_size], self.pad_id) for i in range(0, per_rank, micro_batch_size)]
