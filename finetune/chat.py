"""``finetune chat``: talk to what a run trained, in the terminal or over a file of prompts.

What it loads (:func:`inspect_dir`): a run's output.dir (its full model, its PEFT adapter over the base the
run trained on, 4-bit for a QLoRA run, or its bottleneck adapters), a ``finetune merge`` output, or any Hugging
Face model directory. With several ``--adapter DIR`` the base is loaded once and each adapter is a named peft
adapter on it (``load_adapter`` / ``set_adapter``); every adapter must have been trained on that base, which is
checked from the saved recipes and configs before any weight is read.

How a turn becomes a prompt (:class:`PromptFormat`) follows the run: a chat-format run renders the conversation
with its chat template (the recipe's ``data.chat_template`` or the tokenizer's), an instruction-format run
builds the prompt its evaluation built (``finetune.train.data.formats.Encoder``, so a greedy answer here is
the run's greedy eval answer), a text run continues raw text. A directory without a recipe uses the
tokenizer's chat template when it has one, else raw text.

Generation is :func:`finetune.generation.greedy_tokens`, the loop evaluation runs, with a sampling rule and a
per-step callback that streams tokens and stops once every row has ended.

Order of work: every input is checked (directories, bases, the prompt file, each row's tokens) before the
model loads, so bad input costs one sentence and writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from finetune.adapters import BOTTLENECK_CONFIG, BOTTLENECK_WEIGHTS
from finetune.errors import UserError
from finetune.locate import locate_model
from finetune.merge import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MERGE_MARKER, find_base
from finetune.safetensors_stream import SAFE_INDEX, SAFE_SINGLE

#: ``/adapter`` names that run the base with every adapter disabled.
BASE_NAMES = ("base", "none")
#: Config keys that do not change what a base model computes (compared when two adapters name a base).
_CONFIG_NOISE = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache"}
#: Bases up to this size are compared byte by byte when two adapters name different directories.
_HASHED_BASE_BYTES = 2 * 2**30
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
HELP = (
    "/adapter [NAME]  list the adapters, or switch to one (/adapter base: the base without adapters)\n"
    "/system [TEXT]   set the system prompt (chat templates), or clear it\n"
    "/reset           forget the conversation\n"
    "/quit            leave (or Ctrl-D)\n"
    "type \\n for a line break, e.g. Reverse the letters.\\nabc"
)


@dataclass
class ChatOptions:
    """What ``finetune chat`` was asked (the CLI's flags)."""

    target: str | None = None
    adapters: list[str] = field(default_factory=list)
    base: str | None = None
    use: str | None = None
    prompt: str | None = None
    input: Path | None = None
    output: Path | None = None
    system: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    batch_size: int = 8
    device: str | None = None


# --------------------------------------------------------------------------------------------------
# What a directory holds
# --------------------------------------------------------------------------------------------------


@dataclass
class Target:
    """A directory chat can load and what surrounds it.

    ``kind``: ``model`` (a Hugging Face model directory: a full run's output, a merge, any model), ``peft``
    (a PEFT adapter: LoRA, QLoRA, prefix) or ``bottleneck``. ``recipe`` / ``plan``: the run's saved recipe and
    plan (for a merge, those of the adapter it folded), None for a bare directory.
    """

    path: Path
    kind: Literal["model", "peft", "bottleneck"]
    name: str
    recipe: dict[str, Any] | None = None
    plan: dict[str, Any] | None = None
    adapter_config: dict[str, Any] = field(default_factory=dict)
    flag: str = "RUN_OR_MODEL"  # the argument that named it, for messages

    @property
    def quantized_base(self) -> bool:
        """Whether the run trained on a 4/8-bit base (QLoRA)."""
        from finetune.merge import _quantized_base

        return _quantized_base(self.recipe)

    @property
    def peft_type(self) -> str:
        """The adapter's peft type (LORA, PREFIX_TUNING, ...); ``BOTTLENECK`` for bottleneck adapters."""
        return "BOTTLENECK" if self.kind == "bottleneck" else str(self.adapter_config.get("peft_type", "LORA"))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not readable JSON ({err}); the directory is damaged") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} does not hold a JSON object; the directory is damaged")
    return data


def _run_files(d: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The recipe and plan a run saved in ``d`` (None where it saved none)."""
    recipe = plan = None
    if (d / "recipe.yaml").is_file():
        try:
            data = yaml.safe_load((d / "recipe.yaml").read_text())
        except yaml.YAMLError as err:
            raise UserError(f"{d / 'recipe.yaml'} is not valid YAML ({err}); the run directory is damaged") from None
        recipe = data if isinstance(data, dict) else None
    if (d / "plan.json").is_file():
        plan = _read_json(d / "plan.json")
    return recipe, plan


def _has_weights(d: Path) -> bool:
    return (d / SAFE_SINGLE).is_file() or (d / SAFE_INDEX).is_file() or any(d.glob("*.safetensors"))


def inspect_dir(value: str, flag: str, name: str | None = None) -> Target:
    """What ``value`` (a path, or a hub id in the local cache) holds, or one sentence naming ``flag`` and
    what to give instead."""
    d = Path(os.path.expanduser(value))
    if not d.exists():
        location = locate_model(value, Path.cwd())
        if location.has_weights:
            d = Path(location.path)
        else:
            raise UserError(
                f"{flag} {value} does not exist; give a run's output.dir, a `finetune merge` output or a Hugging "
                "Face model directory"
            )
    if not d.is_dir():
        raise UserError(f"{flag} {value} is a file; give a run's output.dir, an adapter or a model directory")
    label = name or d.resolve().name
    if (d / ADAPTER_CONFIG).is_file():
        if not any((d / w).is_file() for w in ADAPTER_WEIGHTS):
            raise UserError(
                f"{flag} {value} has {ADAPTER_CONFIG} but no adapter_model.safetensors; the adapter is incomplete"
            )
        recipe, plan = _run_files(d)
        return Target(d, "peft", label, recipe, plan, _read_json(d / ADAPTER_CONFIG))
    if (d / BOTTLENECK_CONFIG).is_file():
        if not (d / BOTTLENECK_WEIGHTS).is_file():
            raise UserError(
                f"{flag} {value} has {BOTTLENECK_CONFIG} but no {BOTTLENECK_WEIGHTS}; the adapter is incomplete"
            )
        recipe, plan = _run_files(d)
        return Target(d, "bottleneck", label, recipe, plan, _read_json(d / BOTTLENECK_CONFIG))
    if (d / "config.json").is_file():
        if not _has_weights(d):
            raise UserError(
                f"{flag} {value} has a config.json but no safetensors weights; give a trained model (a model.init: "
                "random config has no weights to talk to)"
            )
        recipe, plan = _run_files(d)
        if recipe is None and (d / MERGE_MARKER).is_file():  # a merge: the run it folded says how it was prompted
            folded = Path(str(_read_json(d / MERGE_MARKER).get("adapter", "")))
            if folded.is_dir():
                recipe, _ = _run_files(folded)
        return Target(d, "model", label, recipe, plan)
    if (d / "recipe.yaml").is_file():
        raise UserError(
            f"{flag} {value} is a run directory without a trained model or adapter yet; give it once the run has "
            "finished (its final save writes the model or adapter there)"
        )
    raise UserError(
        f"{flag} {value} is neither a run nor a model directory (no {ADAPTER_CONFIG}, {BOTTLENECK_CONFIG} or "
        "config.json); give a run's output.dir, a `finetune merge` output or a Hugging Face model directory"
    )


def parse_adapter(spec: str) -> tuple[str | None, str]:
    """``NAME=DIR`` or ``DIR`` -> (name or None, dir)."""
    left, eq, right = spec.partition("=")
    if eq and _NAME.match(left) and right:
        return left, right
    return None, spec


# --------------------------------------------------------------------------------------------------
# The base the adapters share
# --------------------------------------------------------------------------------------------------


def _safetensors_files(d: Path) -> list[Path]:
    if (d / SAFE_INDEX).is_file():
        index = _read_json(d / SAFE_INDEX)
        return sorted({d / f for f in index.get("weight_map", {}).values()})
    return sorted(d.glob("*.safetensors"))


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def base_difference(a: Path, b: Path) -> str | None:
    """Why model directories ``a`` and ``b`` are not the same base (None: they are).

    The same directory is the same base; otherwise the configs must agree on everything that changes what the
    model computes, and the weights must be equal bytes (up to 2 GiB; larger bases are compared by their
    tensors' names, shapes and dtypes).
    """
    if a.resolve() == b.resolve():
        return None
    ca = {k: v for k, v in _read_json(a / "config.json").items() if k not in _CONFIG_NOISE}
    cb = {k: v for k, v in _read_json(b / "config.json").items() if k not in _CONFIG_NOISE}
    for key in sorted(set(ca) | set(cb)):
        if ca.get(key) != cb.get(key):
            return f"their configs differ ({key}: {ca.get(key)} in {a}, {cb.get(key)} in {b})"
    fa, fb = _safetensors_files(a), _safetensors_files(b)
    if sum(f.stat().st_size for f in fa) <= _HASHED_BASE_BYTES:
        same = [f.stat().st_size for f in fa] == [f.stat().st_size for f in fb] and _digest(fa) == _digest(fb)
    else:
        from finetune.safetensors_stream import shard_map

        sa, sb = shard_map(a)[1], shard_map(b)[1]
        same = {k: (v.shape, v.dtype) for k, v in sa.items()} == {k: (v.shape, v.dtype) for k, v in sb.items()}
    return None if same else f"their weights differ ({a} and {b})"


def _own_base(t: Target, scratch: Path) -> Path | None:
    """The base ``t`` was trained on, from its run or its config (None when neither says where it is)."""
    try:
        return find_base(t.path, t.recipe, t.adapter_config, None, scratch)
    except UserError:
        return None


@dataclass
class Base:
    """The model directory every adapter goes onto, and how to load it."""

    path: Path
    quantized: Target | None  # the QLoRA run whose quantization settings load it 4-bit (None: 16/32-bit)
    plan: dict[str, Any] | None  # the plan of the run whose execution spec sets dtypes and autocast
    recipe: dict[str, Any] | None


def settle_base(adapters: list[Target], base: str | None, scratch: Path) -> Base:
    """The one base of ``adapters`` (``base``: the model directory the user named) after checking that every
    adapter was trained on it, that they can share one peft model and one quantization."""
    first = adapters[0]
    if len(adapters) > 1:
        for t in adapters:
            if t.kind == "bottleneck" or t.peft_type != "LORA":
                kind = "bottleneck" if t.kind == "bottleneck" else t.peft_type.lower().replace("_", "-")
                raise UserError(
                    f"--adapter {t.name} is a {kind} adapter; only LoRA adapters share one base in chat: give it alone"
                )
        if len({t.quantized_base for t in adapters}) > 1:
            q = next(t for t in adapters if t.quantized_base)
            plain = next(t for t in adapters if not t.quantized_base)
            raise UserError(
                f"--adapter {q.name} was trained on a 4-bit base (qlora) and --adapter {plain.name} on a 16-bit one; "
                "chat loads every adapter onto one base: give them in separate sessions"
            )
        settings = {
            json.dumps((t.recipe or {}).get("quantization"), sort_keys=True) for t in adapters if t.quantized_base
        }
        if len(settings) > 1:
            raise UserError(
                "--adapter: the qlora adapters were trained on differently quantized bases (quantization settings "
                "differ); give them in separate sessions"
            )
    if base is not None:
        where = inspect_dir(base, "--base")
        if where.kind != "model":
            raise UserError(f"--base {base} holds an adapter, not a model; give the base model directory")
        path = where.path
    else:
        path = find_base(first.path, first.recipe, first.adapter_config, None, scratch)
    for t in adapters:
        own = _own_base(t, scratch) if (base is not None or t is not first) else path
        if own is None:
            continue  # a bare adapter whose config names no local base: its shapes are checked as it loads
        why = base_difference(own, path)
        if why is not None:
            raise UserError(
                f"{t.flag} {t.name} was trained on the base {own}, not on {path}: {why}; give adapters of one base"
            )
    return Base(path, first if first.quantized_base else None, first.plan, first.recipe)


# --------------------------------------------------------------------------------------------------
# How a turn becomes a prompt
# --------------------------------------------------------------------------------------------------


@dataclass
class PromptFormat:
    """A model's prompt layout: ``chat`` (a chat template over the conversation), ``instruction`` (the run's
    instruction prompt, as its evaluation builds it: each turn stands alone) or ``text`` (raw text)."""

    kind: Literal["chat", "instruction", "text"]
    tokenizer: Any
    encoder: Any  # finetune.train.data.formats.Encoder
    columns: dict[str, str]

    @property
    def multi_turn(self) -> bool:
        """Whether earlier turns are part of the prompt."""
        return self.kind == "chat"

    def describe(self) -> str:
        """A few words for the session's first line."""
        return {
            "chat": "the chat template, with the conversation",
            "instruction": "the run's instruction prompt (each turn stands alone, as in its evaluation)",
            "text": "raw text (each turn is continued on its own)",
        }[self.kind]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation ending with a user turn, ready for the assistant's answer."""
        return self._ids(self.encoder.render(messages, add_generation_prompt=True))

    def turn(self, text: str, history: list[dict[str, str]], system: str | None) -> list[int]:
        """Token ids of the prompt for a typed ``text`` after ``history`` (chat only)."""
        if self.kind == "chat":
            start = [{"role": "system", "content": system}] if system else []
            return self.render([*start, *history, {"role": "user", "content": text}])
        if self.kind == "instruction":
            c = self.columns
            return list(self.encoder.encode({c["instruction"]: text, c["output"]: ""}).prompt_ids)
        return list(self.encoder.bos_prefix) + self._ids(text)

    def row(self, row: dict[str, Any], where: str, system: str | None) -> tuple[list[int], str | None]:
        """Token ids of one ``--input`` row and the answer it expects (None when it names none).

        A row is ``{"prompt": TEXT}`` (one typed turn), or a row of the run's own data format: instruction
        columns (the prompt the run's evaluation built) or a ``messages`` conversation (up to its last assistant
        turn, whose content is the expected answer, as the run's evaluation does; or ending with a user turn).
        """
        from finetune.train.data.formats import BadRow

        c = self.columns
        if "prompt" in row:
            if not isinstance(row["prompt"], str):
                raise UserError(f"{where}: `prompt` must be a string")
            return self.turn(row["prompt"], [], system), None
        try:
            if self.kind == "instruction" and c["instruction"] in row:
                expected = row.get(c["output"])
                filled = {**row, c["output"]: expected if isinstance(expected, str) else ""}
                return list(self.encoder.encode(filled).prompt_ids), expected if isinstance(expected, str) else None
            if self.kind == "chat" and c["messages"] in row:
                return self._conversation(row, where)
        except BadRow as err:
            raise UserError(f"{where}: {err}") from None
        wanted = {
            "instruction": (
                f"a `prompt` string or the run's instruction columns (`{c['instruction']}`, `{c['input']}`)"
            ),
            "chat": f"a `prompt` string or a `{c['messages']}` list of {{role, content}}",
            "text": "a `prompt` string",
        }[self.kind]
        raise UserError(f"{where}: expected {wanted}; the row has {', '.join(map(repr, row)) or 'no keys'}")

    def _conversation(self, row: dict[str, Any], where: str) -> tuple[list[int], str | None]:
        """A conversation row (tool calls, tool results, tools and reasoning as training reads them): up to its last
        assistant message, whose content is the expected answer unless that message calls tools or reasons."""
        from finetune.train.data.chat import read_conversation
        from finetune.train.data.rows import BadRow

        try:
            conv = read_conversation(
                row, self.columns["messages"], self.columns.get("tools", "tools"), reasoning=self.encoder.reasoning,
                need_assistant=False,
            )
        except BadRow as err:
            raise UserError(f"{where}: {err}") from None
        msgs = conv.messages

        def prompt(messages: list[dict[str, Any]]) -> list[int]:
            return self._ids(self.encoder.render(messages, tools=conv.tools, add_generation_prompt=True))

        if msgs[-1]["role"] == "assistant":
            final = msgs[-1]
            plain = not set(final) & {"tool_calls", "reasoning_content"}
            return prompt(msgs[:-1]), final["content"] if plain else None
        return prompt(msgs), None


def prompt_format(t: Target, tokenizer: Any) -> PromptFormat:
    """How ``t`` was trained to be prompted: its run's data format, else the tokenizer's chat template, else
    raw text."""
    from finetune.recipe import DataColumnsConfig
    from finetune.train.data import resolve_chat_template
    from finetune.train.data.formats import Encoder

    data = (t.recipe or {}).get("data") or {}
    columns = DataColumnsConfig.model_validate(data.get("columns") or {}).model_dump()
    fmt = data.get("format") if t.recipe is not None else None
    template = None
    if fmt == "chat":
        template = resolve_chat_template(_loaded(t), tokenizer)
    elif fmt is None and getattr(tokenizer, "chat_template", None):
        fmt, template = "chat", tokenizer.chat_template
    kind: Literal["chat", "instruction", "text"] = (
        "chat" if fmt == "chat" else "instruction" if fmt == "instruction" else "text"
    )
    reasoning = str(data.get("reasoning", "train")) if fmt == "chat" else "train"
    encoder = Encoder(tokenizer, "instruction" if kind == "instruction" else "chat" if kind == "chat" else "text",
                      columns, 1 << 30, chat_template=template, reasoning=reasoning)
    return PromptFormat(kind, tokenizer, encoder, columns)


def _loaded(t: Target) -> Any:
    """The run's recipe as a LoadedRecipe whose relative paths resolve next to the run."""
    from finetune.recipe import RecipeError, recipe_from_dict

    try:
        return recipe_from_dict(t.recipe or {}, base_dir=t.path)
    except RecipeError as err:
        raise UserError(
            f"{t.path / 'recipe.yaml'} is not a valid recipe ({err}); the run directory is damaged"
        ) from None


def load_tokenizer(d: Path, fallback: Path, trust_remote_code: bool) -> Any:
    """The tokenizer a run saved beside its model or adapter (else the base's), with a pad token."""
    from transformers import AutoTokenizer

    source = d if (d / "tokenizer_config.json").is_file() else fallback
    tok = AutoTokenizer.from_pretrained(str(source), local_files_only=True, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


# --------------------------------------------------------------------------------------------------
# The prompt file
# --------------------------------------------------------------------------------------------------


def read_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The rows of an ``--input`` JSONL file, each with its ``file:line``; one sentence for a missing file or a
    line that is not a JSON object."""
    if not path.is_file():
        raise UserError(f"--input {path} does not exist; give a .jsonl file with one JSON object per line")
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(
                f"--input {where}: not valid JSON ({err.msg} at column {err.colno}); each line is one JSON object"
            ) from None
        if not isinstance(row, dict):
            raise UserError(f"--input {where}: expected a JSON object per line, got {type(row).__name__}")
        rows.append((where, row))
    if not rows:
        raise UserError(f"--input {path} holds no rows; give one JSON object per line")
    return rows


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


@dataclass
class Session:
    """A loaded model, its adapters by name and how each is prompted."""

    model: Any
    device: Any
    autocast: Callable[[], Any]
    formats: dict[str, PromptFormat]  # adapter name -> format ("" for a plain model)
    adapters: list[str]  # peft adapter names ([] for a plain model)
    switchable: bool  # peft adapters that /adapter can switch and disable
    description: str
    max_positions: int | None
    active: str | None = None  # the adapter in use; None: the base (adapters disabled) or a plain model
    last_format: str = ""

    def fmt(self) -> PromptFormat:
        """The prompt format of the active adapter (the base keeps the last adapter's)."""
        return self.formats[self.active if self.active is not None else self.last_format]

    def use(self, name: str | None) -> None:
        """Make ``name`` the active adapter (None: the base)."""
        if name is not None and self.switchable:
            self.model.set_adapter(name)
        self.active = name
        if name is not None:
            self.last_format = name

    @contextmanager
    def running(self) -> Iterator[None]:
        """The active adapter for one generation (peft's disable_adapter for the base)."""
        if self.adapters and self.active is None:
            with self.model.disable_adapter():
                yield
        else:
            yield


def _execution(plan: dict[str, Any] | None) -> Any:
    from finetune.spec import ExecSpec

    if plan and plan.get("execution"):
        try:
            return ExecSpec.from_dict(plan["execution"])
        except (KeyError, TypeError, ValueError):
            return None
    return None


def _device(option: str | None) -> Any:
    import torch

    if option is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(option)
    except RuntimeError:
        raise UserError(f"--device {option} is not a torch device (cpu, cuda, cuda:1, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {option}: this machine has no CUDA device; leave --device out to run on the CPU")
    return device


def _autocast(spec: Any, device: Any) -> Callable[[], Any]:
    """The run's autocast (evaluation ran under it), else none."""
    if spec is None:
        return nullcontext
    from finetune.train.precision import autocast_factory

    return autocast_factory(spec, device)


def _load_model(path: Path, dtype: Any, device: Any, trust: bool, quantization: Any = None) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True, "trust_remote_code": trust,
                              "device_map": {"": device}}
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    from finetune.kernels import use_experts_kernel

    return use_experts_kernel(AutoModelForCausalLM.from_pretrained(str(path), **kwargs), device, dtype).eval()


def _max_positions(model_dir: Path) -> int | None:
    value = _read_json(model_dir / "config.json").get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def _trust(t: Target) -> bool:
    return bool(((t.recipe or {}).get("model") or {}).get("trust_remote_code", False))


def prepare(opts: ChatOptions, scratch: Path) -> tuple[list[Target], Base | None, Target | None]:
    """Resolve what to load: (adapters, their base) or a plain model; every check that needs no weights."""
    specs: list[tuple[str | None, str, str]] = []  # (name, dir, flag)
    model_target: Target | None = None
    if opts.target is not None:
        t = inspect_dir(opts.target, "RUN_OR_MODEL")
        if t.kind == "model":
            if opts.adapters:
                if opts.base is not None:
                    raise UserError("RUN_OR_MODEL and --base both name the base; give one of them")
                opts.base = opts.target
            else:
                model_target = t
        else:
            specs.append((None, opts.target, "RUN_OR_MODEL"))
    for spec in opts.adapters:
        name, d = parse_adapter(spec)
        specs.append((name, d, "--adapter"))
    if model_target is not None:
        if opts.base is not None:
            raise UserError(f"--base is for adapters; {opts.target} is a whole model")
        return [], None, model_target
    if not specs:
        raise UserError("give RUN_OR_MODEL (a run's output.dir, a merged or any Hugging Face model) or --adapter DIR")
    adapters: list[Target] = []
    for name, d, flag in specs:
        t = inspect_dir(d, flag, name)
        t.flag = flag
        if t.kind == "model":
            raise UserError(f"{flag} {d} is a whole model, not an adapter; give it as RUN_OR_MODEL (or --base)")
        if t.name in BASE_NAMES:
            raise UserError(f"{flag} {d}: `{t.name}` names the base in /adapter; name it otherwise with NAME=DIR")
        if any(a.name == t.name for a in adapters):
            raise UserError(f"{flag} {d}: two adapters are named `{t.name}`; name them with NAME=DIR")
        adapters.append(t)
    base = settle_base(adapters, opts.base, scratch)
    if opts.use is not None and opts.use not in BASE_NAMES and opts.use not in [a.name for a in adapters]:
        known = ", ".join(a.name for a in adapters)
        raise UserError(f"--use {opts.use} is not an adapter here; the adapters are {known} (or base)")
    return adapters, base, None


def load(adapters: list[Target], base: Base | None, model_target: Target | None, opts: ChatOptions,
         tokenizers: dict[str, Any]) -> Session:
    """Load the model (and adapters) onto the device, as the run evaluated it: the base in the run's frozen
    dtype (4-bit with its quantization settings for QLoRA), under its autocast."""
    from finetune.units import torch_dtype

    device = _device(opts.device)
    start = time.perf_counter()
    if model_target is not None:
        spec = _execution(model_target.plan)
        dtype = torch_dtype(spec.fsdp_param_dtype or spec.trainable_dtype) if spec is not None else "auto"
        model = _load_model(model_target.path, dtype, device, _trust(model_target))
        formats = {"": prompt_format(model_target, tokenizers[""])}
        what = f"{model_target.path}"
        return Session(model, device, _autocast(spec, device), formats, [], False,
                       f"loaded {what} on {device} in {time.perf_counter() - start:.1f}s",
                       _max_positions(model_target.path))
    assert base is not None, "prepare returns a base with the adapters"
    spec = _execution(base.plan)
    trust = _trust(adapters[0])
    if base.quantized is not None:
        from finetune.train.quantize import bnb_config, disable_cpu_packed_inference, int8_frozen_matmuls

        assert spec is not None and spec.quant is not None, "a qlora run's plan holds its quantization"
        compute = torch_dtype(spec.quant.compute_dtype)
        quant = bnb_config(_loaded(base.quantized).recipe, compute)
        model = int8_frozen_matmuls(disable_cpu_packed_inference(_load_model(base.path, compute, device, trust, quant)))
    else:
        dtype = torch_dtype(spec.frozen_dtype) if spec is not None and spec.frozen_dtype else "auto"
        model = _load_model(base.path, dtype, device, trust)
    names = [a.name for a in adapters]
    try:
        if adapters[0].kind == "bottleneck":
            from finetune.adapters import load_bottlenecks

            model = load_bottlenecks(model, adapters[0].path)
        else:
            from peft import PeftModel

            from finetune.experts import peft_as_targeted

            with peft_as_targeted():  # each adapter's targets as saved (peft_as_targeted says why)
                model = PeftModel.from_pretrained(model, str(adapters[0].path), adapter_name=names[0])
                for a in adapters[1:]:
                    model.load_adapter(str(a.path), adapter_name=a.name)
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise UserError(
            f"the adapter does not fit the base {base.path} ({first}); give the base it was trained on with --base"
        ) from None
    if base.quantized is None:  # a 4-bit model stays where loading put it (bitsandbytes refuses .to)
        model = model.to(device)
    model.eval()
    formats = {a.name: prompt_format(a, tokenizers[a.name]) for a in adapters}
    four_bit = " (4-bit)" if base.quantized is not None else ""
    session = Session(
        model, device, _autocast(spec, device), formats, names, adapters[0].kind == "peft",
        f"loaded {', '.join(names)} on the base {base.path}{four_bit} on {device} "
        f"in {time.perf_counter() - start:.1f}s",
        _max_positions(base.path), last_format=names[0],
    )
    session.use(names[0])
    return session


# --------------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------------


def generate(session: Session, prompts: list[list[int]], opts: ChatOptions, generator: Any,
             stream: Callable[[str], None] | None = None) -> list[str]:
    """Answers to a batch of prompts (token ids) from the active adapter: greedy or sampled, each cut at the
    end-of-sequence token and decoded as evaluation decodes (special tokens skipped, whitespace trimmed).
    ``stream``: called with each new piece of the first row's text as it is generated."""
    import torch

    from finetune.generation import greedy_tokens, left_padded, sampler

    tok = session.fmt().tokenizer
    eos = tok.eos_token_id
    ids, mask = left_padded(prompts, tok.pad_token_id)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    first: list[int] = []
    shown = [""]

    def on_step(nxt: torch.Tensor) -> bool:
        step = nxt[:, 0].cpu()
        if stream is not None and not bool(done[0]) and int(step[0]) != eos:
            first.append(int(step[0]))
            text = tok.decode(first, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # a character whose bytes have not all come yet
                stream(text[len(shown[0]):])
                shown[0] = text
        if eos is not None:
            done.logical_or_(step == eos)
        return bool(done.all())

    with session.running():
        out = greedy_tokens(session.model, ids.to(session.device), mask.to(session.device), opts.max_new_tokens,
                            session.autocast, pick=sampler(opts.temperature, opts.top_p, generator), on_step=on_step)
    answers = []
    for row in out.tolist():
        row = row[: row.index(eos)] if eos in row else row
        answers.append(tok.decode(row, skip_special_tokens=True).strip())
    return answers


def _room(session: Session, opts: ChatOptions) -> int | None:
    return None if session.max_positions is None else session.max_positions - opts.max_new_tokens


# --------------------------------------------------------------------------------------------------
# The three forms
# --------------------------------------------------------------------------------------------------


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _echo(text: str) -> None:
    """Print a piece of a streamed answer now."""
    sys.stdout.write(text)
    sys.stdout.flush()


def _typed(text: str) -> str:
    """A typed line: ``\\n`` is a line break."""
    return text.replace("\\n", "\n")


def run_chat(opts: ChatOptions) -> int:
    """``finetune chat``: check everything, load, then answer ``--prompt``, the ``--input`` file, or the
    terminal's turns. Returns the exit code."""
    if opts.input is not None and opts.output is None:
        raise UserError("--input needs --output FILE for the answers")
    if opts.output is not None and opts.input is None:
        raise UserError("--output needs --input FILE (one prompt per line); --prompt prints its answer")
    if opts.prompt is not None and opts.input is not None:
        raise UserError("--prompt and --input both give prompts; give one of them")
    if not 0 < opts.top_p <= 1:
        raise UserError(f"--top-p {opts.top_p} must be in (0, 1]")
    if opts.output is not None:
        if not opts.output.parent.is_dir():
            raise UserError(
                f"--output {opts.output}: the directory {opts.output.parent} does not exist; create it first"
            )
        if opts.input is not None and opts.output.resolve() == opts.input.resolve():
            raise UserError("--output is the --input file; write the answers to another file")
    rows = read_rows(opts.input) if opts.input is not None else None
    with tempfile.TemporaryDirectory(prefix="finetune-chat-") as scratch:
        adapters, base, model_target = prepare(opts, Path(scratch))
        tokenizers = _tokenizers(adapters, base, model_target)
        # the prompts' token ids before any weight is read: a bad row costs nothing
        names = [a.name for a in adapters] or [""]
        start_name = names[0] if opts.use is None or opts.use in BASE_NAMES else opts.use
        target_of = {a.name: a for a in adapters}
        first = target_of[start_name] if adapters else model_target
        assert first is not None, "prepare returns adapters or a model"
        fmt = prompt_format(first, tokenizers[start_name])
        encoded = None
        if rows is not None:
            encoded = [fmt.row(row, f"--input {where}", opts.system) for where, row in rows]
        elif opts.prompt is not None:
            encoded = [(fmt.turn(_typed(opts.prompt), [], opts.system), None)]
        model_dir = model_target.path if model_target is not None else base.path if base is not None else None
        assert model_dir is not None, "prepare returns adapters with their base, or a model"
        _check_lengths(_max_positions(model_dir), opts, encoded, rows)
        session = load(adapters, base, model_target, opts, tokenizers)
        if opts.use is not None:
            session.use(start_name)
            if opts.use in BASE_NAMES:
                session.use(None)
        import torch

        generator = torch.Generator().manual_seed(opts.seed)
        _say(session.description)
        if rows is not None and encoded is not None:
            return _answer_file(session, opts, rows, encoded, generator)
        if encoded is not None:
            generate(session, [encoded[0][0]], opts, generator, stream=_echo)
            _echo("\n")
            return 0
        return _interactive(session, opts, generator)


def _tokenizers(adapters: list[Target], base: Base | None, model_target: Target | None) -> dict[str, Any]:
    if model_target is not None:
        return {"": load_tokenizer(model_target.path, model_target.path, _trust(model_target))}
    assert base is not None, "prepare returns a base with the adapters"
    return {a.name: load_tokenizer(a.path, base.path, _trust(a)) for a in adapters}


def _check_lengths(max_positions: int | None, opts: ChatOptions, encoded: list[tuple[list[int], str | None]] | None,
                   rows: list[tuple[str, dict[str, Any]]] | None) -> None:
    """Every prompt must leave ``--max-new-tokens`` of the model's positions for its answer."""
    if encoded is None or max_positions is None:
        return
    room = max_positions - opts.max_new_tokens
    for i, (ids, _) in enumerate(encoded):
        if len(ids) > room:
            where = f"--input {rows[i][0]}" if rows is not None else "--prompt"
            raise UserError(
                f"{where}: the prompt is {len(ids)} tokens and the model reads {max_positions} positions, "
                f"{opts.max_new_tokens} of them kept for the answer (--max-new-tokens); shorten it or lower "
                "--max-new-tokens"
            )


def _answer_file(session: Session, opts: ChatOptions, rows: list[tuple[str, dict[str, Any]]],
                 encoded: list[tuple[list[int], str | None]], generator: Any) -> int:
    """Answer every row in batches of ``--batch-size``; write them all at once (nothing on failure)."""
    assert opts.output is not None, "checked by run_chat"
    answers: list[str] = []
    for i in range(0, len(encoded), opts.batch_size):
        answers += generate(session, [ids for ids, _ in encoded[i : i + opts.batch_size]], opts, generator)
    tmp = opts.output.with_name(f".{opts.output.name}.writing")
    with tmp.open("w", encoding="utf-8") as fh:
        for (_, row), answer in zip(rows, answers, strict=True):
            fh.write(json.dumps({**row, "answer": answer}, ensure_ascii=False) + "\n")
    os.replace(tmp, opts.output)
    expected = [(want, got) for (_, want), got in zip(encoded, answers, strict=True) if want is not None]
    note = ""
    if expected:
        hits = sum(want.strip() == got for want, got in expected)
        note = f"; exact match {100 * hits / len(expected):.1f}% of the {len(expected)} rows with an expected answer"
    _say(f"wrote {len(answers)} answers to {opts.output}{note}")
    return 0


def _interactive(session: Session, opts: ChatOptions, generator: Any) -> int:
    """The terminal chat: each line is a turn (streamed answer), or a /command."""
    if sys.stdin.isatty():
        with suppress(ImportError):
            import readline  # noqa: F401  (line editing and arrow-key history for input())
    history: list[dict[str, str]] = []
    system = opts.system
    _say(f"prompt format: {session.fmt().describe()}")
    _say("/help lists the commands; /quit or Ctrl-D leaves")
    while True:
        label = (session.active or "base") if session.adapters else ""
        try:
            line = input(f"{label}> " if label else "> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command, _, arg = text[1:].partition(" ")
            if command in ("quit", "exit", "q"):
                return 0
            reply = _command(session, command, arg.strip())
            if command == "system":
                system = arg.strip() or None
            if command == "reset":
                history.clear()
            print(reply, flush=True)
            continue
        fmt = session.fmt()
        turn = _typed(text)
        kept = history if fmt.multi_turn else []
        ids = fmt.turn(turn, kept, system)
        room = _room(session, opts)
        while room is not None and len(ids) > room and kept:
            kept = kept[2:]  # the oldest exchange goes first
            ids = fmt.turn(turn, kept, system)
        if room is not None and len(ids) > room:
            print(f"(this turn is {len(ids)} tokens; the model reads {room} besides the answer)", flush=True)
            continue
        if len(kept) < len(history) and fmt.multi_turn:
            print("(the oldest turns no longer fit in the model's positions and are left out)", flush=True)
        try:
            answer = generate(session, [ids], opts, generator, stream=_echo)[0]
        except KeyboardInterrupt:
            print("\n(interrupted)", flush=True)
            continue
        print(flush=True)
        if fmt.multi_turn:
            history[:] = [*kept, {"role": "user", "content": turn}, {"role": "assistant", "content": answer}]


def _command(session: Session, command: str, arg: str) -> str:
    """What a /command does (its reply line); /quit is the caller's."""
    if command == "help":
        return HELP
    if command == "reset":
        return "(the conversation is forgotten)"
    if command == "system":
        kind = session.fmt().kind
        note = "" if kind == "chat" else f" (the prompt format here is {kind}: it has no system prompt)"
        return ("(system prompt set)" if arg else "(system prompt cleared)") + note
    if command == "adapter":
        if not session.adapters:
            return "(no adapters: this is a whole model; pass --adapter DIR to load adapters onto a base)"
        if not arg:
            marks = [("* " if n == session.active else "  ") + n for n in session.adapters]
            marks.append(("* " if session.active is None else "  ") + "base (adapters disabled)")
            return "\n".join(marks)
        if arg in BASE_NAMES:
            if not session.switchable:
                return "(bottleneck adapters cannot be disabled; load the base as RUN_OR_MODEL to compare)"
            session.use(None)
            return "(the base, adapters disabled)"
        if arg not in session.adapters:
            return f"(no adapter `{arg}`; the adapters are {', '.join(session.adapters)}, or base)"
        session.use(arg)
        return f"(adapter {arg})"
    return f"(unknown command /{command}; /help lists them)"
