"""`finetune data RECIPE`: what a run would train on, read by the trainer's own loader, with the trained tokens
marked; in-process through the CLI's Typer app (the command the console script runs), and once as a subprocess."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from finetune.cli import app
from tests.support import RECIPES, TINY_MODEL, write_jsonl, write_recipe
from tests.unit.test_data_chat import ROW, TEMPLATE

ARGUMENTS = '{"name": "reverse", "arguments": {"word": "abc"}}'


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A chat recipe over two agent rows (a tool call and reasoning, then the answer) and a third that goes on."""
    d = tmp_path_factory.mktemp("agent")
    longer = copy.deepcopy(ROW)
    longer["messages"] += [
        {"role": "user", "content": "Capitals?"},
        {"role": "assistant", "content": "CBA", "thinking": "Upper case."},
    ]
    write_jsonl(d / "train.jsonl", [ROW, longer, ROW])
    return write_recipe(d / "agent.yaml", {
        "model": {"path": str(TINY_MODEL), "init": "random"},
        "method": "full",
        "data": {"train": "train.jsonl", "format": "chat", "chat_template": str(TEMPLATE), "max_seq_len": 1024,
                 "cache_dir": str(d / "cache")},
        "output": {"dir": str(d / "out")},
    })


def data_json(recipe: Path, *args: str) -> dict:
    out = CliRunner().invoke(app, ["data", str(recipe), "--json", *args])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def trained_text(row: dict) -> str:
    """The trained characters of a --json row, in order."""
    return "".join(row["text"][a:b] for a, b in row["trained"])


def untrained_text(row: dict) -> str:
    text, at, out = row["text"], 0, []
    for a, b in row["trained"]:
        out.append(text[at:a])
        at = b
    return "".join(out) + text[at:]


def test_the_call_trains_and_the_reasoning_follows_data_reasoning(recipe):
    """The call's function name and arguments are among the trained tokens; the reasoning is trained (train),
    in the text but not trained (mask), or not in the text at all (drop)."""
    for reasoning in ("train", "mask", "drop"):
        report = data_json(recipe, "--show", "1", "--set", f"data.reasoning={reasoning}")
        (row,) = report["rows"]
        assert ARGUMENTS in trained_text(row)
        assert "<tool_response>\ncba\n</tool_response>" in untrained_text(row)  # a tool's result never trains
        if reasoning == "train":
            assert "<think>\nUse the tool.\n</think>" in trained_text(row)
        elif reasoning == "mask":
            assert "Use the tool." in untrained_text(row) and "Use the tool." not in trained_text(row)
            assert "<think>\n" in trained_text(row)
        else:
            assert "Use the tool." not in row["text"] and "<think>" not in row["text"]
        assert report["reasoning"] == reasoning


def test_json_fields_count_what_trains(recipe):
    report = data_json(recipe, "--show", "3")
    t, (src,) = report["train"], report["sources"]
    rows = report["rows"]
    assert [r["where"] for r in rows] == [f"{recipe.parent / 'train.jsonl'}:{i}" for i in (1, 2, 3)]
    assert t["samples"] == 3 and t["tokens"] == sum(r["tokens"] for r in rows)
    assert t["trained_tokens"] == sum(r["trained_tokens"] for r in rows) == src["trained_tokens"]
    for r in rows:  # character spans and token spans say the same
        assert r["trained_tokens"] == sum(b - a for a, b in r["trained_token_spans"]) > 0
        assert r["text"].endswith("<|im_end|></s>\n")
    assert (src["key"], src["rows"], src["rows_used"], src["bad"], src["dropped"]) == ("data.train", 3, 3, 0, 0)
    assert (t["truncated"], t["dropped"], t["bad_rows"], report["packing"]) == (0, 0, 0, None)
    assert report["format"] == "chat" and report["chat_template"] == f"data.chat_template `{TEMPLATE}`"
    width = 2 * rows[0]["tokens"]  # the two short conversations fill a packed row, the longer one another
    packed = data_json(recipe, "--show", "0", "--set", "data.packing=true", "--set", f"data.max_seq_len={width}")
    assert packed["packing"] == {"rows": 2, "padding_fraction": round(1 - t["tokens"] / (2 * width), 4)}
    assert packed["rows"] == []


def test_last_assistant_turn_only(recipe):
    """data.assistant_turns: last trains the final answer of each conversation and nothing before it."""
    rows = data_json(recipe, "--show", "2", "--set", "data.assistant_turns=last")["rows"]
    assert [trained_text(r) for r in rows] == ["cba<|im_end|></s>", "<think>\nUpper case.\n</think>\n\nCBA<|im_end|></s>"]


def test_bad_rows_are_named_or_counted(recipe, tmp_path):
    bad = copy.deepcopy(ROW)
    bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{word: abc}"
    f = write_jsonl(tmp_path / "bad.jsonl", [ROW, bad])
    args = ["data", str(recipe), "--set", f"data.train={f}", "--set", f"data.cache_dir={tmp_path}"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2
    assert (
        f"{f}:2: field `messages[1].tool_calls[0].function.arguments`: not valid JSON (Expecting property name "
        "enclosed in double quotes at column 2)"
    ) in " ".join(out.stderr.split())
    skipped = data_json(recipe, *args[2:], "--set", "data.on_bad_row=skip")
    assert skipped["train"]["bad_rows"] == skipped["sources"][0]["bad"] == 1
    assert skipped["bad_rows"][0].startswith(f"{f}:2: field `messages[1].tool_calls[0].function.arguments`")


@pytest.mark.slow  # a CLI subprocess
def test_the_real_cli_marks_trained_tokens_in_plain_text(recipe, finetune_cmd):
    """Not a terminal: the trained text between [[ and ]]; the counts come first."""
    res = subprocess.run(
        [*finetune_cmd, "data", str(recipe), "--show", "1", "--set", "data.reasoning=mask"],
        capture_output=True, text=True, timeout=300, cwd=RECIPES,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[1].startswith("train: 3 samples,") and "truncated 0, dropped 0, bad rows 0" in lines[1]
    assert "trained tokens between [[ and ]]" in lines
    assert f"<|im_start|>assistant\n[[<think>\n]]Use the tool.[[\n</think>\n\n<tool_call>\n{ARGUMENTS}" in res.stdout
    assert "<tool_response>\ncba\n</tool_response><|im_end|>\n<|im_start|>assistant\n[[cba<|im_end|></s>]]" in res.stdout
