"""``finetune chat``: talk to what a run trained, in the terminal or over a file of prompts.

What it loads, how it is prompted and how it generates are the inference loader's (:mod:`finetune.inference`):
a run's output.dir (its full model, its adapter over the base the run trained on), a ``finetune merge`` output
or any Hugging Face model directory; with several ``--adapter DIR`` the base is loaded once and ``/adapter``
switches between them. The prompt follows the run's data format (chat template, instruction prompt or raw
text), so a greedy answer here is the run's greedy eval answer.

Order of work: every input is checked (directories, bases, the prompt file, each row's tokens) before the
model loads, so bad input costs one sentence and writes nothing.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.inference import BASE_NAMES, Selection, Session, device_of, generate, load, select

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
    trust_remote_code: bool = False  # the user's flag: run the model's own code (never read from a directory)


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
        selection = select(opts.target, opts.adapters, opts.base, Path(scratch), opts.use,
                           trust_remote_code=opts.trust_remote_code)
        device = device_of(opts.device)
        # the prompts' token ids before any weight is read: a bad row costs nothing
        start_name = selection.names[0] if opts.use is None or opts.use in BASE_NAMES else opts.use
        fmt = _format(selection, start_name, opts.trust_remote_code)
        encoded = None
        if rows is not None:
            encoded = [fmt.row(row, f"--input {where}", opts.system) for where, row in rows]
        elif opts.prompt is not None:
            encoded = [(fmt.turn(_typed(opts.prompt), [], opts.system), None)]
        _check_lengths(selection.max_positions(), opts, encoded, rows)
        session = load(selection, device=device, trust_remote_code=opts.trust_remote_code)
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
            _answers(session, [encoded[0][0]], opts, generator, stream=_echo)
            _echo("\n")
            return 0
        return _interactive(session, opts, generator)


def _format(selection: Selection, name: str, trust_remote_code: bool) -> Any:
    """The prompt format of adapter ``name`` (the whole model's for ""), before any weight is loaded."""
    from finetune.inference import prompt_format

    return prompt_format(selection.run(name), selection.tokenizers(trust_remote_code)[name])


def _answers(session: Session, prompts: list[list[int]], opts: ChatOptions, generator: Any,
             stream: Any = None) -> list[str]:
    """The answers' texts to ``prompts`` as ``opts`` asks (temperature, top-p, length)."""
    return [a.text for a in generate(
        session, prompts, max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, top_p=opts.top_p,
        generator=generator, stream=stream,
    )]


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
        answers += _answers(session, [ids for ids, _ in encoded[i : i + opts.batch_size]], opts, generator)
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
            answer = _answers(session, [ids], opts, generator, stream=_echo)[0]
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
