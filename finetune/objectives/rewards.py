"""The rewards of grpo's completions (the recipe's ``grpo.rewards``): built-in verifiable checks, and the recipe
author's own Python functions, several at once, each with a weight.

Built-ins, each a number per completion (whitespace-trimmed):

    exact_match  1 when the completion equals the row's reference answer (its output), else 0
    regex        1 when the completion matches ``pattern`` (re.fullmatch), else 0: a format check
    json         1 when the completion parses as JSON, else 0
    length       -|characters - target| / target: a penalty, 0 at ``target`` characters

``python``: ``function`` of the file ``file`` (relative to the recipe), called as
``function(prompt=..., completion=..., answer=...)`` (``answer``: the reference answer or None) for one number. It
runs the recipe's code, so it needs ``grpo.trust_reward_code: true``. A function that raises, or returns
something other than a number, stops the run with one sentence naming the file and the function.

The reward of a completion is the weighted sum of its rewards; :meth:`Rewards.score` also gives each one's
values (metrics.jsonl's ``reward/NAME``). Pure Python: no torch.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import UserError

KINDS = ("exact_match", "regex", "json", "length", "python")


@dataclass
class Reward:
    """One reward: its name (metrics), weight and how a completion is scored."""

    name: str
    weight: float
    score_one: Callable[[str, str, str | None], float]


def _exact(prompt: str, completion: str, answer: str | None) -> float:
    return float(answer is not None and completion.strip() == answer.strip())


def _json(prompt: str, completion: str, answer: str | None) -> float:
    try:
        json.loads(completion.strip())
    except ValueError:
        return 0.0
    return 1.0


def _regex(pattern: str) -> Callable[[str, str, str | None], float]:
    compiled = re.compile(pattern, re.DOTALL)
    return lambda prompt, completion, answer: float(compiled.fullmatch(completion.strip()) is not None)


def _length(target: int) -> Callable[[str, str, str | None], float]:
    return lambda prompt, completion, answer: -abs(len(completion.strip()) - target) / target


def load_function(file: Path, function: str, key: str) -> Callable[..., Any]:
    """``function`` from the Python file ``file`` (``key``: the recipe key naming it, for the message)."""
    if not file.is_file():
        raise UserError(f"{key}.file: no Python file at {file}; give the path of the file that defines `{function}`")
    spec = importlib.util.spec_from_file_location(f"finetune_reward_{file.stem}", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's file: one sentence, not its traceback
        raise UserError(f"{key}: importing {file} raised {type(err).__name__}: {err}; fix the file") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise UserError(f"{key}.function: {file} defines no function `{function}`; name one of its functions")
    return fn


def _python(file: Path, function: str, key: str) -> Callable[[str, str, str | None], float]:
    fn = load_function(file, function, key)

    def score(prompt: str, completion: str, answer: str | None) -> float:
        try:
            value = fn(prompt=prompt, completion=completion, answer=answer)
        except Exception as err:  # the user's function: one sentence naming it, not its traceback
            raise UserError(
                f"{key}: the reward function `{function}` of {file} raised {type(err).__name__}: {err}; fix the "
                "function (it is called as function(prompt=..., completion=..., answer=...) for one number)"
            ) from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(
                f"{key}: the reward function `{function}` of {file} returned {value!r}; it must return a finite number"
            )
        return float(value)

    return score


@dataclass
class Rewards:
    """The run's rewards (``grpo.rewards``)."""

    rewards: list[Reward]
    last_mean: float | None = None  # the mean reward of evaluation's last greedy completions (eval_reward)

    @classmethod
    def of(cls, grpo: Any, base_dir: Path) -> Rewards:
        """From the recipe's ``grpo`` section (files relative to ``base_dir``, the recipe's directory)."""
        out: list[Reward] = []
        for i, r in enumerate(grpo.rewards):
            key = f"grpo.rewards.{i}"
            fn: Callable[[str, str, str | None], float]
            if r.type == "exact_match":
                fn = _exact
            elif r.type == "json":
                fn = _json
            elif r.type == "regex":
                assert r.pattern is not None, "the schema requires a pattern"
                fn = _regex(r.pattern)
            elif r.type == "length":
                assert r.target is not None, "the schema requires a target"
                fn = _length(r.target)
            else:
                assert r.file is not None and r.function is not None, "the schema requires file and function"
                path = Path(r.file) if Path(r.file).is_absolute() else base_dir / r.file
                fn = _python(path, r.function, key)
            out.append(Reward(r.name or (r.function if r.type == "python" else r.type), float(r.weight), fn))
        return cls(out)

    @property
    def names(self) -> list[str]:
        """Each reward's name (metrics.jsonl's ``reward/NAME``)."""
        return [r.name for r in self.rewards]

    def score(
        self, prompts: list[str], completions: list[str], answers: list[str | None]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Each completion's weighted reward, and every reward's own values."""
        each = {r.name: [r.score_one(p, c, a) for p, c, a in zip(prompts, completions, answers, strict=True)]
                for r in self.rewards}
        total = [sum(r.weight * each[r.name][i] for r in self.rewards) for i in range(len(completions))]
        return total, each
