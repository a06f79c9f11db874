"""One inference loader: what a run left (or any model), with its tokenizer and prompt format, ready to answer.

    select(target, adapters, base)         -> Selection   # every check that needs no weights
    selection.tokenizers()                 -> {name: tokenizer}
    load(selection, device=..., trust_remote_code=...) -> Session
    generate(session, prompts, ...)        -> answers      # greedy or sampled, streamed piece by piece
    load_baseline(selection, session, ...) -> Session      # the model a run started from

What it loads (the directories as :func:`finetune.storage.rundir.read_run` reads them): a run's output.dir (its full
model, its PEFT adapter over the base the run trained on, 4-bit for a QLoRA run, or its bottleneck adapters), a
``finetune merge`` output, or any Hugging Face model directory or hub id in the local cache. With several
adapters the base is loaded once and each adapter is a named peft adapter on it (``load_adapter`` /
``set_adapter``); every adapter must have been trained on that base, which is checked from the saved recipes and
configs before any weight is read (:func:`settle_base`).

The model is loaded as the run evaluated it: the weights in the run's dtypes (the base in its frozen dtype,
4-bit with the run's quantization settings for QLoRA), under its autocast, generation stopping at the
tokenizer's end of sequence. How a turn becomes a prompt (:class:`PromptFormat`) follows the run: a chat-format
run renders the conversation with its chat template (the recipe's ``data.chat_template`` or the tokenizer's), an
instruction-format run builds the prompt its evaluation built (``finetune.train.data.formats.Encoder``, so a
greedy answer is the run's greedy eval answer), a text run continues raw text. A directory without a recipe uses
the tokenizer's chat template when it has one, else raw text.

Generation is :func:`finetune.model.generation.greedy_tokens`, the loop evaluation runs, with a sampling rule and a
per-step callback that streams text and stops once every row has ended.

``trust_remote_code`` is an argument of :func:`load` and :meth:`Selection.tokenizers`: the user's choice, never
read from the directory being opened. Heavy imports happen inside the functions.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from finetune.errors import UserError
from finetune.recipe.locate import check_remote_code, needs_remote_code, remote_code_refused
from finetune.storage.rundir import BaseRef, RunDir, find_base, read_json, read_run
from finetune.storage.safetensors_stream import SAFE_INDEX, read_weight_map

#: Adapter names that mean the base with every adapter disabled.
BASE_NAMES = ("base", "none")
#: Config keys that do not change what a base model computes (compared when two adapters name a base).
_CONFIG_NOISE = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache"}
#: Bases up to this size are compared byte by byte when two adapters name different directories.
_HASHED_BASE_BYTES = 2 * 2**30
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")


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
        return sorted({d / f for f in read_weight_map(d / SAFE_INDEX).values()})
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
    ca = {k: v for k, v in read_json(a / "config.json").items() if k not in _CONFIG_NOISE}
    cb = {k: v for k, v in read_json(b / "config.json").items() if k not in _CONFIG_NOISE}
    for key in sorted(set(ca) | set(cb)):
        if ca.get(key) != cb.get(key):
            return f"their configs differ ({key}: {ca.get(key)} in {a}, {cb.get(key)} in {b})"
    fa, fb = _safetensors_files(a), _safetensors_files(b)
    if sum(f.stat().st_size for f in fa) <= _HASHED_BASE_BYTES:
        same = [f.stat().st_size for f in fa] == [f.stat().st_size for f in fb] and _digest(fa) == _digest(fb)
    else:
        from finetune.storage.safetensors_stream import shard_map

        sa, sb = shard_map(a)[1], shard_map(b)[1]
        same = {k: (v.shape, v.dtype) for k, v in sa.items()} == {k: (v.shape, v.dtype) for k, v in sb.items()}
    return None if same else f"their weights differ ({a} and {b})"


def build_random(run: RunDir, config_dir: Path, trust_remote_code: bool = False, flag: str = "--base DIR") -> Any:
    """The weights a random-init run drew from its config in ``config_dir`` and ``train.seed`` (a transformers
    PreTrainedModel on the CPU); model code of its own runs only on the user's ``trust_remote_code``."""
    from finetune.recipe.schema import RecipeError
    from finetune.train.model.quantize import build_random_base

    check_remote_code(config_dir, trust_remote_code)  # before transformers reads any of it
    try:
        loaded = run.loaded_recipe(trust_remote_code)
    except RecipeError as err:
        raise UserError(f"{run.path / 'recipe.yaml'} is not a valid recipe ({err}); pass {flag}") from None
    try:
        return build_random_base(loaded, str(config_dir))
    except ValueError as err:
        if needs_remote_code(err):
            raise remote_code_refused(config_dir, "--trust-remote-code") from None
        raise


def base_directory(run: RunDir, ref: BaseRef, scratch: Path, trust_remote_code: bool = False) -> Path:
    """The directory of ``ref``'s weights: ``ref.path``, or for a random-init run the fp32 weights its seed
    draws (as the run drew them), saved once under ``scratch``."""
    if not ref.rebuild:
        return ref.path
    out = scratch / f"base-{hashlib.sha256(str(run.path.resolve()).encode()).hexdigest()[:12]}"
    if (out / "config.json").is_file():
        return out
    random_base: Any = build_random(run, ref.path, trust_remote_code)  # a transformers PreTrainedModel
    random_base.save_pretrained(out, safe_serialization=True)
    return out


def _own_base(run: RunDir, scratch: Path, trust_remote_code: bool = False) -> Path | None:
    """The base ``run`` was trained on, from its recipe or its config (None when neither says where it is)."""
    try:
        return base_directory(run, find_base(run), scratch, trust_remote_code)
    except UserError:
        return None


@dataclass
class Base:
    """The model directory every adapter goes onto, and the run whose settings load it."""

    path: Path
    quantized: RunDir | None  # the QLoRA run whose quantization settings load it 4-bit (None: 16/32-bit)
    run: RunDir  # the first adapter's run: its plan sets the dtypes and autocast
    rebuilt: bool = False  # the weights were redrawn from a random init's seed into a temporary directory


def settle_base(adapters: list[RunDir], base: str | None, scratch: Path, trust_remote_code: bool = False) -> Base:
    """The one base of ``adapters`` (``base``: the model directory the user named) after checking that every
    adapter was trained on it, that they can share one peft model and one quantization (``trust_remote_code``:
    the user's, for a random init rebuilt from a config that names its own code)."""
    first = adapters[0]
    if len(adapters) > 1:
        for t in adapters:
            if t.peft_type != "LORA":
                kind = "bottleneck" if t.kind == "bottleneck" else str(t.peft_type).lower().replace("_", "-")
                raise UserError(
                    f"--adapter {t.name} is a {kind} adapter; only LoRA adapters share one base: give it alone"
                )
        if len({t.quantized_base for t in adapters}) > 1:
            q = next(t for t in adapters if t.quantized_base)
            plain = next(t for t in adapters if not t.quantized_base)
            raise UserError(
                f"--adapter {q.name} was trained on a 4-bit base (qlora) and --adapter {plain.name} on a 16-bit one; "
                "every adapter goes onto one base: give them separately"
            )
        settings = {
            json.dumps((t.recipe or {}).get("quantization"), sort_keys=True) for t in adapters if t.quantized_base
        }
        if len(settings) > 1:
            raise UserError(
                "--adapter: the qlora adapters were trained on differently quantized bases (quantization settings "
                "differ); give them separately"
            )
    rebuilt = False
    if base is not None:
        where = read_run(base, "--base")
        if where.kind != "model":
            raise UserError(f"--base {base} holds an adapter, not a model; give the base model directory")
        path = where.path
    else:
        ref = find_base(first)
        path, rebuilt = base_directory(first, ref, scratch, trust_remote_code), ref.rebuild
    for t in adapters:
        own = _own_base(t, scratch, trust_remote_code) if (base is not None or t is not first) else path
        if own is None:
            continue  # a bare adapter whose config names no local base: its shapes are checked as it loads
        why = base_difference(own, path)
        if why is not None:
            raise UserError(
                f"{t.flag} {t.name} was trained on the base {own}, not on {path}: {why}; give adapters of one base"
            )
    return Base(path, first if first.quantized_base else None, first, rebuilt)


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
        """A few words for a session's first line."""
        return {
            "chat": "the chat template, with the conversation",
            "instruction": "the run's instruction prompt (each turn stands alone, as in its evaluation)",
            "text": "raw text (each turn is continued on its own)",
        }[self.kind]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a conversation ending with a user turn, ready for the assistant's answer."""
        return self._ids(self.encoder.render(messages, add_generation_prompt=True))

    def text(self, text: str) -> list[int]:
        """Token ids of a text to continue as it is (a completion's prompt): the run's BOS, then the text."""
        return list(self.encoder.bos_prefix) + self._ids(text)

    def turn(self, text: str, history: list[dict[str, str]], system: str | None) -> list[int]:
        """Token ids of the prompt for a typed ``text`` after ``history`` (chat only)."""
        if self.kind == "chat":
            start = [{"role": "system", "content": system}] if system else []
            return self.render([*start, *history, {"role": "user", "content": text}])
        if self.kind == "instruction":
            c = self.columns
            return list(self.encoder.encode({c["instruction"]: text, c["output"]: ""}).prompt_ids)
        return self.text(text)

    def conversation(self, messages: list[dict[str, Any]], where: str) -> list[int]:
        """Token ids of a conversation of ``{role, content}`` messages ending with a user turn: through the chat
        template, or (instruction and text formats, which know no conversation) its last user turn alone, after
        the system message when there is one."""
        if self.kind == "chat":
            return self.render(messages)
        if not messages or messages[-1].get("role") != "user":
            raise UserError(f"{where}: the last message must be the user's, whose turn is answered")
        system = next((m["content"] for m in messages if m.get("role") == "system"), None)
        return self.turn(str(messages[-1].get("content", "")), [], system)

    def row(self, row: dict[str, Any], where: str, system: str | None) -> tuple[list[int], str | None]:
        """Token ids of one row and the answer it expects (None when it names none).

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


def prompt_format(run: RunDir, tokenizer: Any) -> PromptFormat:
    """How ``run`` was trained to be prompted: its data format, else the tokenizer's chat template, else raw
    text."""
    from finetune.recipe.schema import DataColumnsConfig
    from finetune.train.data import resolve_chat_template
    from finetune.train.data.formats import Encoder

    data = (run.recipe or {}).get("data") or {}
    columns = DataColumnsConfig.model_validate(data.get("columns") or {}).model_dump()
    fmt = data.get("format") if run.recipe is not None else None
    template = None
    if fmt == "chat":
        template = resolve_chat_template(loaded_recipe(run), tokenizer)
    elif fmt is None and getattr(tokenizer, "chat_template", None):
        fmt, template = "chat", tokenizer.chat_template
    kind: Literal["chat", "instruction", "text"] = (
        "chat" if fmt == "chat" else "instruction" if fmt == "instruction" else "text"
    )
    reasoning = str(data.get("reasoning", "train")) if fmt == "chat" else "train"
    encoder = Encoder(tokenizer, "instruction" if kind == "instruction" else "chat" if kind == "chat" else "text",
                      columns, 1 << 30, chat_template=template, reasoning=reasoning)
    return PromptFormat(kind, tokenizer, encoder, columns)


def loaded_recipe(run: RunDir) -> Any:
    """The run's recipe as a LoadedRecipe whose relative paths resolve next to the run (:meth:`RunDir.loaded_recipe`);
    one sentence when it does not validate."""
    from finetune.recipe.schema import RecipeError

    try:
        return run.loaded_recipe()
    except RecipeError as err:
        raise UserError(
            f"{run.path / 'recipe.yaml'} is not a valid recipe ({err}); the run directory is damaged"
        ) from None


def load_tokenizer(d: Path, fallback: Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer a run saved beside its model or adapter (else ``fallback``'s, the base's), with a pad
    token (its end-of-sequence token when it has none)."""
    from transformers import AutoTokenizer

    has = [p for p in (d, fallback) if (p / "tokenizer_config.json").is_file() or (p / "tokenizer.json").is_file()]
    if not has:
        raise UserError(f"{d} has no tokenizer, nor has {fallback}; save the tokenizer beside the model")
    try:
        tok = AutoTokenizer.from_pretrained(str(has[0]), local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as err:
        if needs_remote_code(err):
            raise remote_code_refused(has[0], "--trust-remote-code") from None
        raise
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


# --------------------------------------------------------------------------------------------------
# What to load
# --------------------------------------------------------------------------------------------------


@dataclass
class Selection:
    """What to load, every input checked: adapters over their base, or one whole model."""

    adapters: list[RunDir]
    base: Base | None
    model: RunDir | None
    _tokenizers: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """The adapters' names ([""] for a whole model)."""
        return [a.name for a in self.adapters] or [""]

    @property
    def model_dir(self) -> Path:
        """The directory whose config the model is built from (the whole model's, or the base's)."""
        if self.model is not None:
            return self.model.path
        assert self.base is not None, "a selection holds adapters with their base, or a model"
        return self.base.path

    def run(self, name: str) -> RunDir:
        """The directory of adapter ``name`` ("" or a base name: the whole model, or the first adapter)."""
        for a in self.adapters:
            if a.name == name:
                return a
        if self.model is not None:
            return self.model
        return self.adapters[0]

    def tokenizers(self, trust_remote_code: bool = False) -> dict[str, Any]:
        """Each adapter's tokenizer by name (``""`` for a whole model), read once."""
        if not self._tokenizers:
            if self.model is not None:
                self._tokenizers[""] = load_tokenizer(self.model.path, self.model.path, trust_remote_code)
            else:
                for a in self.adapters:
                    self._tokenizers[a.name] = load_tokenizer(a.path, self.model_dir, trust_remote_code)
        return self._tokenizers

    def max_positions(self) -> int | None:
        """The positions the model reads (``max_position_embeddings``), None when its config does not say."""
        value = read_json(self.model_dir / "config.json").get("max_position_embeddings")
        return int(value) if isinstance(value, int) else None


def select(target: str | None, adapters: list[str], base: str | None, scratch: Path,
           use: str | None = None, flag: str = "RUN_OR_MODEL", trust_remote_code: bool = False) -> Selection:
    """Resolve what to load (``target``: RUN_OR_MODEL; ``adapters``: ``[NAME=]DIR`` each; ``base``: the base
    model the user named; ``use``: the adapter to start with): adapters over their base, or a whole model.
    Every check that needs no weights, each a sentence naming its argument (``flag``: the name of
    ``target``'s); a random-init base is redrawn into ``scratch`` (its config's own code run only on the
    user's ``trust_remote_code``)."""
    specs: list[tuple[str | None, str, str]] = []  # (name, dir, flag)
    model: RunDir | None = None
    if target is not None:
        t = read_run(target, flag)
        if t.kind == "model":
            if adapters:
                if base is not None:
                    raise UserError("RUN_OR_MODEL and --base both name the base; give one of them")
                base = target
            else:
                model = t
        else:
            specs.append((None, target, flag))
    for spec in adapters:
        name, d = parse_adapter(spec)
        specs.append((name, d, "--adapter"))
    if model is not None:
        if base is not None:
            raise UserError(f"--base is for adapters; {target} is a whole model")
        check_remote_code(model.path, trust_remote_code)  # before transformers reads any of it
        return Selection([], None, model)
    if not specs:
        raise UserError("give RUN_OR_MODEL (a run's output.dir, a merged or any Hugging Face model) or --adapter DIR")
    runs: list[RunDir] = []
    for name, d, flag in specs:
        t = read_run(d, flag, name)
        if t.kind == "model":
            raise UserError(f"{flag} {d} is a whole model, not an adapter; give it as RUN_OR_MODEL (or --base)")
        if t.name in BASE_NAMES:
            raise UserError(f"{flag} {d}: `{t.name}` names the base; name it otherwise with NAME=DIR")
        if any(a.name == t.name for a in runs):
            raise UserError(f"{flag} {d}: two adapters are named `{t.name}`; name them with NAME=DIR")
        runs.append(t)
    settled = settle_base(runs, base, scratch, trust_remote_code)
    check_remote_code(settled.path, trust_remote_code)
    if use is not None and use not in BASE_NAMES and use not in [a.name for a in runs]:
        known = ", ".join(a.name for a in runs)
        raise UserError(f"--use {use} is not an adapter here; the adapters are {known} (or base)")
    return Selection(runs, settled, None)


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
    switchable: bool  # peft adapters that can be switched and disabled
    description: str  # what was loaded where, and how long it took
    max_positions: int | None
    label: str = ""  # what it is: "DIR (full model)", "DIR (lora adapter over BASE)"
    autocast_dtype: Any = None  # the torch dtype of the run's autocast (None: none)
    active: str | None = None  # the adapter in use; None: the base (adapters disabled) or a plain model
    last_format: str = ""

    def fmt(self, name: str | None = None) -> PromptFormat:
        """The prompt format of adapter ``name`` (default: the active one; the base keeps the last adapter's)."""
        if name is not None and name in self.formats:
            return self.formats[name]
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


def device_of(option: str | None, flag: str = "--device") -> Any:
    """The torch device ``option`` names (default: cuda when there is one, else the CPU)."""
    import torch

    if option is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(option)
    except RuntimeError:
        raise UserError(f"{flag} {option} is not a torch device (cpu, cuda, cuda:1, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{flag} {option}: this machine has no CUDA device; leave {flag} out to run on the CPU")
    return device


def _autocast(run: RunDir, device: Any) -> tuple[Callable[[], Any], Any]:
    """The run's autocast (evaluation ran under it) and its dtype, else none."""
    spec = run.execution
    if spec is None or run.autocast_dtype is None:
        return nullcontext, None
    from finetune.train.precision import autocast_factory
    from finetune.units import torch_dtype

    return autocast_factory(spec, device), torch_dtype(run.autocast_dtype)


def _load_model(path: Path, dtype: Any, device: Any, trust: bool, quantization: Any = None) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True, "trust_remote_code": trust,
                              "device_map": {"": device}}
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    from finetune.model.kernels import use_experts_kernel

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except ValueError as err:
        if needs_remote_code(err):
            raise remote_code_refused(path, "--trust-remote-code") from None
        raise
    return use_experts_kernel(model, device, dtype).eval()


def _stop_at_eos(model: Any, tokenizer: Any) -> None:
    """Generation stops at the tokenizer's end-of-sequence token and pads with its pad token, as the run's
    own evaluation does (for generate() callers such as lm-eval)."""
    config = getattr(model, "generation_config", None)
    if config is not None:
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id


def load(selection: Selection, *, device: Any = None, trust_remote_code: bool = False) -> Session:
    """Load the model (and adapters) onto ``device`` (a torch device; default: cuda when there is one) as the
    run evaluated it: the weights in the run's dtypes (4-bit with its quantization settings for QLoRA), under its
    autocast. ``trust_remote_code``: the user's choice, for the model's and tokenizer's code."""
    from finetune.units import torch_dtype

    device = device if device is not None else device_of(None)
    tokenizers = selection.tokenizers(trust_remote_code)
    start = time.perf_counter()
    if selection.model is not None:
        t = selection.model
        dtype = torch_dtype(t.model_dtype) if t.model_dtype else "auto"
        model = _load_model(t.path, dtype, device, trust_remote_code)
        _stop_at_eos(model, tokenizers[""])
        autocast, autocast_dtype = _autocast(t, device)
        return Session(model, device, autocast, {"": prompt_format(t, tokenizers[""])}, [], False,
                       f"loaded {t.path} on {device} in {time.perf_counter() - start:.1f}s",
                       selection.max_positions(), t.describe(), autocast_dtype)
    base = selection.base
    assert base is not None, "select returns a base with the adapters"
    adapters = selection.adapters
    if base.quantized is not None:
        from finetune.train.model.quantize import (
            bnb_config,
            disable_cpu_packed_inference,
            int8_frozen_matmuls,
        )

        compute = torch_dtype(base.quantized.compute_dtype)
        quant = bnb_config(loaded_recipe(base.quantized).recipe, compute)
        model = int8_frozen_matmuls(disable_cpu_packed_inference(
            _load_model(base.path, compute, device, trust_remote_code, quant)))
    else:
        dtype = torch_dtype(base.run.base_dtype) if base.run.base_dtype else "auto"
        model = _load_model(base.path, dtype, device, trust_remote_code)
    names = [a.name for a in adapters]
    try:
        if adapters[0].kind == "bottleneck":
            from finetune.model.adapters import load_bottlenecks

            model = load_bottlenecks(model, adapters[0].path)
        else:
            from peft import PeftModel

            from finetune.model.experts import peft_as_targeted

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
    _stop_at_eos(model, tokenizers[names[0]])
    formats = {a.name: prompt_format(a, tokenizers[a.name]) for a in adapters}
    four_bit = " (4-bit)" if base.quantized is not None else ""
    over = "its seeded random init (rebuilt)" if base.rebuilt else str(base.path)
    autocast, autocast_dtype = _autocast(base.run, device)
    session = Session(
        model, device, autocast, formats, names, adapters[0].kind == "peft",
        f"loaded {', '.join(names)} on the base {base.path}{four_bit} on {device} "
        f"in {time.perf_counter() - start:.1f}s",
        selection.max_positions(), f"{adapters[0].path} ({adapters[0].method} adapter over {over})",
        autocast_dtype, last_format=names[0],
    )
    session.use(names[0])
    return session


def load_baseline(selection: Selection, *, device: Any = None, trust_remote_code: bool = False) -> tuple[Session, list[str]]:
    """The model the selection's run started from, with notes on it: an adapter's base, a full run's
    ``model.path`` (redrawn from its config and ``train.seed`` for ``model.init: random``). One sentence naming
    ``--baseline`` when it cannot be found."""
    import tempfile

    device = device if device is not None else device_of(None)
    if selection.model is not None:
        t = selection.model
        if t.init == "random" and t.model_path:
            from finetune.recipe.locate import locate_model

            location = locate_model(t.model_path, t.path)
            config_dir = Path(location.path)
            if not location.has_weights or not (config_dir / "config.json").is_file():
                raise UserError(
                    f"--baseline: the config of {t.path}'s random init (model.path `{t.model_path}`) is not a local "
                    "directory; give --baseline MODEL"
                )
            tok = selection.tokenizers(trust_remote_code)[""]
            from finetune.model.kernels import use_experts_kernel

            model = build_random(t, config_dir, trust_remote_code, "--baseline MODEL").to(device)
            use_experts_kernel(model, device)
            model.eval()
            _stop_at_eos(model, tok)
            fmt = prompt_format(t, tok)
            seed = ((t.recipe or {}).get("train") or {}).get("seed", 0)
            return Session(model, device, nullcontext, {"": fmt}, [], False, f"built {config_dir}", None,
                           f"{config_dir} (full model)"), [f"the random init of {config_dir} from train.seed {seed}"]
        if t.model_path is None:
            raise UserError(
                f"--baseline: {t.path} is not a finetune run, so its base model is unknown; give --baseline MODEL"
            )
        base_path = t.model_path
    else:
        assert selection.base is not None, "a selection holds adapters with their base, or a model"
        if selection.base.rebuilt:
            raise UserError(
                f"--baseline: the base of {selection.adapters[0].path} was rebuilt from its seed and not kept; give "
                "--baseline MODEL"
            )
        base_path = str(selection.base.path)
    with tempfile.TemporaryDirectory(prefix="finetune-baseline-") as scratch:
        chosen = select(base_path, [], None, Path(scratch), flag="--baseline", trust_remote_code=trust_remote_code)
    session = load(chosen, device=device, trust_remote_code=trust_remote_code)
    notes = []
    mine = selection.tokenizers(trust_remote_code)[selection.names[0]]
    if chosen.tokenizers(trust_remote_code)[""].get_vocab() != mine.get_vocab():
        notes.append(f"the base's own tokenizer ({base_path}) differs from the run's")
    return session, notes


# --------------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    """One generated answer: ``text`` decoded as evaluation decodes (special tokens skipped, whitespace
    trimmed), ``raw`` the same untrimmed (what a stream shows, piece by piece), ``finish`` why it ended
    (``stop``: its end-of-sequence token; ``length``: the token limit) and ``tokens`` how many it generated
    (the end-of-sequence token included)."""

    text: str
    raw: str
    finish: Literal["stop", "length"]
    tokens: int


def generate(session: Session, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, generator: Any = None, stream: Callable[[str], None] | None = None,
             name: str | None = None) -> list[Answer]:
    """Answers to a batch of prompts (token ids) from the active adapter: greedy at temperature 0 (the run's
    greedy evaluation), else sampled from ``generator``, each cut at the end-of-sequence token. ``stream``:
    called with each new piece of the first row's text as it is generated; the pieces add up to its
    :attr:`Answer.raw`. ``name``: the adapter whose tokenizer decodes (default: the active one)."""
    import torch

    from finetune.model.generation import greedy_tokens, left_padded, sampler

    tok = session.fmt(name).tokenizer
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

    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    with session.running():
        out = greedy_tokens(session.model, ids.to(session.device), mask.to(session.device), max_new_tokens,
                            session.autocast, pick=sampler(temperature, top_p, generator), on_step=on_step)
    answers = []
    for row in out.tolist():
        ended = eos in row
        kept = row[: row.index(eos)] if ended else row
        raw = tok.decode(kept, skip_special_tokens=True)
        answers.append(Answer(raw.strip(), raw, "stop" if ended else "length", len(kept) + int(ended)))
    if stream is not None and answers and len(answers[0].raw) > len(shown[0]):
        stream(answers[0].raw[len(shown[0]):])  # bytes that never made a whole character
    return answers
