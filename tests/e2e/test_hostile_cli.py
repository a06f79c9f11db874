"""Hostile and careless inputs through the commands a user types (``finetune run``, ``validate``, ``plan``,
``eval``), in this process: each refusal is exit 2 with one sentence naming the key, the file and line or the
path; every input, and any output.dir that existed, has the same SHA-256 before and after; a planted payload
leaves no marker file.

One short run (``module`` fixture: one step, the hostile rows skipped and counted) is shared: its output.dir is
the one a second run finds held, and the model ``finetune eval`` opens.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from finetune.cli import app
from finetune.train.checkpoint.lock import LOCK_NAME
from tests.support import RECIPES, micro_model_dir, tiny_recipe, write_recipe

GOOD = (RECIPES / "data/reverse/train.jsonl").read_text().splitlines()[:15]
#: A line of a .jsonl file that no reader may crash on, and what the sentence about it says.
HOSTILE_LINES = {
    "not UTF-8": (b'{"instruction": "R\xffv", "input": "ab", "output": "ba"}',
                  "not valid UTF-8 (byte 0xff at column 19); save the file as UTF-8"),
    "an integer of 5000 digits": (b'{"instruction": "Rev", "output": "ba", "n": ' + b"7" * 5000 + b"}",
                                  "holds an integer too long to read (over 4300 digits); write it as a string"),
    "JSON nested 10^5 deep": (b'{"instruction": "Rev", "output": "ba", "n": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                              "nested too deeply to read (lists or objects inside each other thousands of levels deep)"),
    "a lone surrogate": (b'{"instruction": "Rev \\udc80", "input": "ab", "output": "ba"}',
                         "holds \\udc80, half of a UTF-16 pair, which is no character; fix its escape"),
}
CSV_FIELD = "a CSV field over 128 KiB"
KINDS = [*sorted(HOSTILE_LINES), CSV_FIELD]
FIX = "fix the data, or set data.on_bad_row: skip to leave bad rows out"
#: What a run that stopped before training leaves in a new output.dir: its recipe and plan, and the emptied lock.
RUN_FILES = {"recipe.yaml", "plan.json", LOCK_NAME}


def hashes(*roots: Path) -> dict[str, str]:
    """SHA-256 of every file under ``roots`` (a root may be a file), but the lock file, whose record a run
    writes and empties."""
    found = {}
    for root in roots:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            if f.name != LOCK_NAME:
                found[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return found


def invoke(*args: str) -> tuple[int, list[str]]:
    """The command's exit code and its non-empty lines (stdout and stderr together)."""
    res = CliRunner().invoke(app, list(args))
    assert "Traceback" not in res.output, res.output
    return res.exit_code, [ln for ln in res.output.splitlines() if ln.strip()]


def errors(lines: list[str]) -> list[str]:
    return [ln for ln in lines if ln.startswith("error")]


def hostile_file(d: Path, kind: str) -> tuple[Path, int]:
    """A data file of good rows with the hostile one at its line 3 (for the CSV, the row that starts there)."""
    if kind == CSV_FIELD:
        rows = [json.loads(x) for x in GOOD]
        cells = [f"{r['instruction']},{r.get('input', '')},{r['output']}".replace("\n", " ") for r in rows]
        f = d / "long-field.csv"
        f.write_text("\n".join(["instruction,input,output", cells[0], 'Rev,"' + "x" * (200 * 1024) + '",ba', *cells[1:]])
                     + "\n")
        return f, 3
    f = d / f"{kind.replace(' ', '-').replace('^', '')}.jsonl"
    f.write_bytes(b"\n".join([GOOD[0].encode(), GOOD[1].encode(), HOSTILE_LINES[kind][0],
                              *(g.encode() for g in GOOD[2:])]) + b"\n")
    return f, 3


def says(kind: str) -> str:
    if kind == CSV_FIELD:
        return ("field `input` is 200 KiB, over the 128 KiB a CSV field may hold (csv's field_size_limit); write "
                "long texts as .jsonl")
    return HOSTILE_LINES[kind][1]


def one_step(out: Path, train: str | list[str], **data: object) -> dict:
    """A recipe for one step of the tiny model on ``train`` (no evaluation, no checkpoint before the end)."""
    return tiny_recipe(out, data={"train": train, "eval": None, "max_seq_len": 48, **data},
                       train={"max_steps": 1, "global_batch_size": 4, "micro_batch_size": 4})


@pytest.fixture(scope="module")
def skipped(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One `finetune run` over a .jsonl with every hostile line and a CSV with the long field, under
    ``on_bad_row: skip``: the five bad rows are counted and left out, and the run trains and saves."""
    d = tmp_path_factory.mktemp("skipped")
    lines = [GOOD[0].encode()] + [HOSTILE_LINES[k][0] for k in sorted(HOSTILE_LINES)] + [g.encode() for g in GOOD[1:]]
    jsonl = d / "hostile.jsonl"
    jsonl.write_bytes(b"\n".join(lines) + b"\n")
    csv, _ = hostile_file(d, CSV_FIELD)
    out = d / "run"
    recipe = write_recipe(d / "skip.yaml", one_step(out, [str(jsonl), str(csv)], on_bad_row="skip",
                                                    cache_dir=str(d / "cache")))
    before = hashes(jsonl, csv, recipe)
    code, lines_out = invoke("run", str(recipe))
    assert code == 0, "\n".join(lines_out[-30:])
    return {"dir": d, "out": out, "recipe": recipe, "lines": lines_out, "inputs": before}


# ------------------------------------------------------------------------------------------------ data rows


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_row_stops_finetune_run_at_its_file_and_line(tmp_path: Path, kind: str) -> None:
    f, line = hostile_file(tmp_path, kind)
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", one_step(out, str(f), cache_dir=str(tmp_path / "cache")))
    before = hashes(f, recipe)
    code, lines = invoke("run", str(recipe))
    assert code == 2, "\n".join(lines[-30:])
    assert errors(lines) == [f"error: {f}:{line}: {says(kind)}; {FIX}"], lines
    assert hashes(f, recipe) == before
    assert {p.name for p in out.iterdir()} == RUN_FILES  # no weights, checkpoint or metrics


def test_hostile_rows_under_skip_are_counted_and_the_run_trains(skipped: dict) -> None:
    lines, d = skipped["lines"], skipped["dir"]
    header = next(ln for ln in lines if ln.startswith("parameters:"))
    assert "train 30, train_samples 30" in header and "skipped_bad_rows 5" in header, header  # 15 good rows each
    note = next(ln for ln in lines if ln.startswith("data: 5 bad rows were skipped"))
    assert note == (f"data: 5 bad rows were skipped (data.on_bad_row: skip); the first: {d / 'hostile.jsonl'}:2: "
                    f"{says(sorted(HOSTILE_LINES)[0])}")
    assert errors(lines) == []
    assert (skipped["out"] / "model.safetensors").is_file()
    assert hashes(d / "hostile.jsonl", d / "long-field.csv", skipped["recipe"]) == skipped["inputs"]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama's tokenizer (264 tokens) on a config of 300 embedding rows: ids 264..299 are the model's."""
    return micro_model_dir(tmp_path_factory.mktemp("wide"), vocab_size=300)


def test_ids_and_labels_beyond_the_models_embeddings_stop_finetune_run_or_are_skipped(
    tmp_path: Path, wide_model: Path
) -> None:
    """Tokenized rows: 280 is beyond the tokenizer but a row of this model's embeddings; 300 is beyond them, as
    a label (an index error in the loss, on a GPU a device assert) or an input id. Each stops the run at its
    line; under skip both are counted and the run trains on the rest."""
    good = [json.loads(x) for x in (RECIPES / "data/uppercase-tokenized/train.jsonl").read_text().splitlines()[:6]]
    ids = good[0]["input_ids"]
    label_row = {"input_ids": ids, "labels": [-100] * (len(ids) - 1) + [300]}
    id_row = {"input_ids": [1, 300, *ids[2:]]}
    model = {"path": str(wide_model), "init": "random"}
    said = {"labels": f"field `labels[{len(ids) - 1}]`", "ids": "field `input_ids[1]`"}
    for name, bad in (("labels", label_row), ("ids", id_row)):
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in [good[0], {"input_ids": [1, 280, *ids[2:]]}, bad, *good[1:]]))
        out = tmp_path / f"out-{name}"
        recipe = write_recipe(tmp_path / f"{name}.yaml", {**one_step(out, str(f), format="tokenized",
                                                                     cache_dir=str(tmp_path / "cache")), "model": model})
        before = hashes(f, recipe, wide_model)
        code, lines = invoke("run", str(recipe))
        assert code == 2, "\n".join(lines[-30:])
        assert errors(lines) == [f"error: {f}:3: {said[name]}: token id 300 is not in the model's embeddings of 300; "
                                 f"{FIX}"], lines
        assert hashes(f, recipe, wide_model) == before
        assert {p.name for p in out.iterdir()} == RUN_FILES
    both = tmp_path / "both.jsonl"
    both.write_text("".join(json.dumps(r) + "\n" for r in [good[0], label_row, {"input_ids": [1, 280, *ids[2:]]}, id_row,
                                                           *good[1:]]))
    skip = write_recipe(tmp_path / "skip.yaml", {**one_step(tmp_path / "out-skip", str(both), format="tokenized",
                                                            on_bad_row="skip", cache_dir=str(tmp_path / "cache")),
                                                 "model": model})
    code, lines = invoke("run", str(skip))
    assert code == 0, "\n".join(lines[-30:])
    header = next(ln for ln in lines if ln.startswith("parameters:"))
    assert "train 7, train_samples 7" in header and "skipped_bad_rows 2" in header, header
    assert next(ln for ln in lines if "bad rows were skipped" in ln) == (
        f"data: 2 bad rows were skipped (data.on_bad_row: skip); the first: {both}:2: {said['labels']}: token id 300 "
        "is not in the model's embeddings of 300"
    )


def test_finetune_validate_reads_no_rows_and_finetune_data_does(tmp_path: Path) -> None:
    """``validate`` checks the recipe and that its files exist; ``finetune data`` (and ``run``) read the rows."""
    f, line = hostile_file(tmp_path, "JSON nested 10^5 deep")
    recipe = write_recipe(tmp_path / "r.yaml", one_step(tmp_path / "out", str(f), cache_dir=str(tmp_path / "cache")))
    code, lines = invoke("validate", str(recipe))
    assert code == 0 and lines == [f"{recipe}: ok (method full, model {tiny_recipe(tmp_path)['model']['path']}, "
                                   f"data {f})"], lines
    code, lines = invoke("data", str(recipe))
    assert code == 2 and errors(lines) == [f"error: {f}:{line}: {says('JSON nested 10^5 deep')}; {FIX}"], lines
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ output.dir


def _weights(d: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    micro_model_dir(d)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(d / "model.safetensors"))
    return d


def _over_the_reference(tmp: Path) -> tuple[dict, list[Path], str, Path]:
    policy, reference = _weights(tmp / "policy"), _weights(tmp / "reference")
    r = tiny_recipe(reference, model={"path": str(policy), "init": "pretrained"},
                    data={"train": str(RECIPES / "data/reverse-preference/train.jsonl"), "eval": None,
                          "format": "preference", "max_seq_len": 48},
                    train={"objective": "dpo"}, dpo={"reference_model": str(reference)})
    return r, [policy, reference], "is the reference model (dpo.reference_model)", reference


def _over_the_template(tmp: Path) -> tuple[dict, list[Path], str, Path]:
    template = tmp / "templates" / "chat.jinja"
    template.parent.mkdir()
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}")
    r = tiny_recipe(template.parent, data={"train": str(RECIPES / "data/reverse-chat/train.jsonl"), "eval": None,
                                           "format": "chat", "chat_template": str(template), "max_seq_len": 48})
    return r, [template], "contains the chat template (data.chat_template)", template.parent


def _over_the_recipe(tmp: Path) -> tuple[dict, list[Path], str, Path]:
    (tmp / "mine").mkdir()
    return tiny_recipe(tmp / "mine"), [], "contains the recipe file", tmp / "mine"


@pytest.mark.parametrize("case", ["reference", "template", "recipe"])
def test_output_dir_over_an_input_is_refused_by_validate_plan_and_run(tmp_path: Path, case: str) -> None:
    """output.dir at a dpo reference model, around a chat template, around the recipe file itself: validate, plan
    and ``run --overwrite`` refuse it in the same sentence, and every file there is unchanged."""
    build = {"reference": _over_the_reference, "template": _over_the_template, "recipe": _over_the_recipe}[case]
    r, inputs, relation, out = build(tmp_path)
    path = write_recipe((out if case == "recipe" else tmp_path) / "r.yaml", r)
    line = path.read_text().splitlines().index("output:") + 2  # output.dir, the line under output:
    before = hashes(out, path, *inputs)
    for args in (["validate", str(path)], ["plan", str(path)], ["run", str(path), "--overwrite"]):
        code, lines = invoke(*args)
        assert code == 2, (args, lines)
        assert len(lines) == 1 and lines[0].startswith(f"error: {path}:{line}: output.dir: {out} {relation} "), lines
        assert lines[0].endswith(": the run would write over or delete it; choose an output.dir apart from every "
                                 "input"), lines
        assert hashes(out, path, *inputs) == before, args
    assert not (out / LOCK_NAME).exists()


def _holder(out: Path) -> subprocess.Popen:
    """Another process holding ``out``'s lock, as a run still training there does (prints `held` once it does)."""
    code = (
        "import sys; from finetune.train.checkpoint.lock import OutputLock\n"
        f"lock = OutputLock({str(out)!r}); lock.acquire(); print('held', flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_into_a_held_output_dir_changes_nothing_the_first_left(skipped: dict) -> None:
    """What the shared run left (its model, metrics, recipe and plan) while its directory is held: a second
    ``run --overwrite`` (which would clear it) is refused naming the holder, and every file keeps its hash."""
    out = skipped["out"]
    before = hashes(out)
    assert {"model.safetensors", "metrics.jsonl", "recipe.yaml", "plan.json"} <= {Path(p).name for p in before}
    holder = _holder(out)
    try:
        code, lines = invoke("run", str(skipped["recipe"]), "--overwrite")
    finally:
        holder.communicate("")
    assert code == 2
    [error] = lines
    assert error.startswith(
        f"error: output.dir: {out} is in use by another run (pid {holder.pid} on {socket.gethostname()} (this host), "
        "since "
    ) and error.endswith("wait for it to finish or stop it, or choose another output.dir"), error
    assert hashes(out) == before


# ------------------------------------------------------------------------------------------------ task code


def _planted_task(d: Path, marker: Path) -> Path:
    """A task file over a local row whose ``process_docs`` is code beside it, which writes ``marker`` on import."""
    d.mkdir()
    (d / "utils.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n\ndef docs(d):\n    return d\n")
    (d / "rows.jsonl").write_text('{"q": "Reverse the letters.\\nab\\nAnswer: ", "a": "ba"}\n')
    (d / "task.yaml").write_text(textwrap.dedent("""\
        task: planted
        dataset_path: json
        dataset_kwargs: {data_files: {test: rows.jsonl}}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{q}}"
        doc_to_target: "{{a}}"
        process_docs: !function utils.docs
        generation_kwargs: {until: [], do_sample: false, max_gen_toks: 2}
        metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]
        """))
    return d / "task.yaml"


def test_finetune_eval_runs_no_task_code_unless_allowed(skipped: dict, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lm_eval", reason="finetune eval needs the eval extra (pip install -e '.[eval]')")
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # finetune eval sets them in its process
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    marker = tmp_path / "marker"
    task = _planted_task(tmp_path / "task", marker)
    results = tmp_path / "results.json"
    before = hashes(task.parent, skipped["out"])
    code, lines = invoke("eval", str(skipped["out"]), "--tasks", str(task), "-o", str(results))
    assert code == 2
    assert lines == [
        f"error: --tasks {task.resolve()}:8: `!function utils.docs` would run code from beside the task file; pass "
        "--allow-task-code if you trust the task's author, or remove it"
    ], lines
    assert not marker.exists() and not results.exists()
    assert hashes(task.parent, skipped["out"]) == before
    code, lines = invoke("eval", str(skipped["out"]), "--tasks", str(task), "-o", str(results), "--allow-task-code")
    assert code == 0, "\n".join(lines[-20:])
    assert marker.read_text() == "imported"  # the user's word: lm-eval imported it
    assert json.loads(results.read_text())["tasks"]["planted"]["n"] == 1


# ------------------------------------------------------------------------------------------------ nodes


def test_input_fingerprints_tell_a_changed_config_or_data_file(tmp_path: Path) -> None:
    """What one rank per node sends to node 0: the same paths with another config.json or other data bytes (a
    node with stale copies) differ in exactly those entries; the weights' sizes still agree."""
    from finetune.recipe.schema import load_recipe
    from finetune.train.parallel.nodes import input_fingerprints

    model = _weights(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(GOOD) + "\n")
    r = tiny_recipe(tmp_path / "out", model={"path": str(model), "init": "pretrained"},
                    data={"train": str(data), "eval": str(RECIPES / "data/reverse/eval.jsonl")})
    recipe = write_recipe(tmp_path / "r.yaml", r)
    node0 = input_fingerprints(load_recipe(recipe))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_theta": 12345.0}))
    data.write_text("\n".join(GOOD[:-1]) + "\n")
    node1 = input_fingerprints(load_recipe(recipe))
    assert node0.keys() == node1.keys() == {
        "the model's config.json", "the model's model.safetensors", f"the data file {data} (data.train)",
        f"the data file {RECIPES / 'data/reverse/eval.jsonl'} (data.eval)",
    }
    assert {k for k in node0 if node0[k] != node1[k]} == {"the model's config.json", f"the data file {data} (data.train)"}
    assert node0[f"the data file {data} (data.train)"] == hashlib.sha256(
        b"\n".join(g.encode() for g in GOOD) + b"\n").hexdigest()
