"""``finetune eval`` through lm-evaluation-harness, on a quickstart-style run.

The slow test trains the tiny model a few steps, takes its greedy answers to half of its held-out prompts
(with the run's own generation code), and trains the same recipe again with those answers as data.eval: the
run's own exact-match evaluation then scores 50%, and ``finetune eval RUN --tasks run`` must score the same
through lm-eval, answer for answer, while ``--baseline`` (the random init the run started from) scores 0%.
The other tests give bad input: one sentence each, exit 2, nothing written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import nullcontext
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

from finetune.commands.run import LaunchOptions, launch
from tests.support import (
    RECIPES,
    TINY_MODEL,
    clean_env,
    max_weight_diff,
    tiny_recipe,
    write_jsonl,
    write_recipe,
)

N_EVAL, MAX_NEW = 12, 6
#: The tests that run `finetune eval` to its evaluation: lm-evaluation-harness is the eval extra.
needs_lm_eval = pytest.mark.skipif(
    find_spec("lm_eval") is None, reason="finetune eval needs lm-evaluation-harness (pip install -e '.[eval]')"
)


def finetune_eval(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`finetune eval ARGS` as a subprocess (the real CLI)."""
    return subprocess.run(
        [sys.executable, "-m", "finetune", "eval", *args], capture_output=True, text=True, timeout=900,
        env=env or clean_env(),
    )


def own_answers(run: Path) -> list[str]:
    """The run's model's greedy answers to its held-out prompts, by the run's own evaluation code."""
    import torch

    from finetune.inference import load, select
    from finetune.recipe.schema import recipe_from_dict
    from finetune.train.data import load_data
    from finetune.train.evaluate import greedy_generate

    loaded = load(select(str(run), [], None, run), device=torch.device("cpu"))
    tok = loaded.fmt().tokenizer
    data = load_data(recipe_from_dict(yaml.safe_load((run / "recipe.yaml").read_text()), base_dir=run), tok)
    gens = greedy_generate(
        loaded.model, [p.prompt_ids for p in data.eval_prompts], MAX_NEW, tok.pad_token_id, tok.eos_token_id,
        torch.device("cpu"), nullcontext,
    )
    return [tok.decode(g, skip_special_tokens=True).strip() for g in gens]


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("harness")
    rows = [json.loads(x) for x in (RECIPES / "data/reverse/eval.jsonl").read_text().splitlines()[:N_EVAL]]
    first_eval = write_jsonl(d / "eval-first.jsonl", rows)

    def recipe(out: Path, eval_file: Path) -> dict:
        return tiny_recipe(
            out, data={"eval": str(eval_file), "cache_dir": str(d / "cache")},
            train={"max_steps": 6, "lr": 3e-3},
            eval={"max_new_tokens": MAX_NEW, "batch_size": N_EVAL, "at_start": False, "max_samples": None},
        )

    # both trainings through the launch() `finetune run` calls, in this process (no interpreter start)
    assert launch(str(write_recipe(d / "first.yaml", recipe(d / "first", first_eval))), [], LaunchOptions(nproc=1)) == 0
    answers = own_answers(d / "first")
    scored = [{**r, "output": answers[i]} if i % 2 == 0 else r for i, r in enumerate(rows)]
    second_eval = write_jsonl(d / "eval-second.jsonl", scored)
    assert launch(str(write_recipe(d / "second.yaml", recipe(d / "second", second_eval))), [], LaunchOptions(nproc=1)) == 0
    # the eval file changes nothing in training: the same weights, so the first run's answers are the second's
    assert max_weight_diff(d / "first" / "model.safetensors", d / "second" / "model.safetensors") == 0.0
    return {"run": d / "second", "answers": answers, "dir": d}


@pytest.mark.slow
@needs_lm_eval
def test_eval_scores_what_the_run_scored(scored_run: dict, tmp_path: Path) -> None:
    run = scored_run["run"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    own = [r["eval_exact_match"] for r in rows if r.get("eval_exact_match") is not None][-1]
    assert own == 0.5  # half the answers are the model's own greedy answers; the true reversals it misses
    out = tmp_path / "results.json"
    done = finetune_eval(str(run), "--tasks", "run", "--baseline", "--output", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    run_task = result["tasks"]["run"]
    assert run_task["n"] == N_EVAL
    assert run_task["metrics"]["exact_match"] == own
    assert run_task["baseline"]["exact_match"] == 0.0
    assert run_task["difference"]["exact_match"] == 0.5
    # answer for answer: lm-eval's generations are the run's greedy generations
    samples = sorted(result["samples"]["model"]["run"], key=lambda s: s["doc_id"])
    assert [s["response"].strip() for s in samples] == scored_run["answers"]
    table = next(line for line in done.stdout.splitlines() if "exact_match" in line)
    assert table.split()[::2][:1] == ["run"] and "50.0%" in table and "0.0%" in table and "+50.0%" in table
    assert "random init" in done.stdout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face model directory: the tiny model's random init, saved with its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL)).save_pretrained(d)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(d)
    return d


def _refused(done: subprocess.CompletedProcess, out: Path, starts: str) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {starts}"), done.stderr
    assert not out.exists()
    return lines[0]


@needs_lm_eval
def test_a_directory_without_a_model_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    out = tmp_path / "r.json"
    line = _refused(finetune_eval(str(tmp_path / "notes"), "--tasks", "run", "-o", str(out)), out, "RUN_OR_MODEL ")
    assert "holds no model" in line and "give a run's output.dir" in line


def test_without_lm_eval_says_how_to_install_it(tmp_path: Path, model_dir: Path) -> None:
    """lm-eval absent: its import fails (a None entry in sys.modules makes ``import lm_eval`` raise)."""
    out = tmp_path / "r.json"
    code = (
        "import sys; sys.modules['lm_eval'] = None; from finetune.cli import main; "
        f"sys.argv = ['finetune', 'eval', {str(model_dir)!r}, '--tasks', 'hellaswag', '-o', {str(out)!r}]; main()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=300)
    line = _refused(done, out, "finetune eval needs lm-evaluation-harness")
    assert "pip install 'lm-eval>=" in line


@pytest.mark.slow
@needs_lm_eval
def test_a_task_whose_data_is_not_local_is_refused(tmp_path: Path, model_dir: Path) -> None:
    task = tmp_path / "remote.yaml"
    task.write_text(yaml.safe_dump({
        "task": "remote_rows", "dataset_path": "finetune-tests/not-in-the-cache", "test_split": "test",
        "output_type": "generate_until", "doc_to_text": "q", "doc_to_target": "a",
        "metric_list": [{"metric": "exact_match"}],
    }))
    out = tmp_path / "r.json"
    line = _refused(finetune_eval(str(model_dir), "--tasks", str(task), "-o", str(out)), out, "--tasks remote_rows:")
    assert "(finetune-tests/not-in-the-cache) is not in the local Hugging Face datasets cache" in line


@pytest.mark.slow
@needs_lm_eval
def test_run_task_of_a_plain_model_is_refused(tmp_path: Path, model_dir: Path) -> None:
    out = tmp_path / "r.json"
    line = _refused(finetune_eval(str(model_dir), "--tasks", "run", "-o", str(out)), out, "--tasks run:")
    assert "is not a finetune run (no recipe.yaml)" in line


@pytest.mark.slow
@needs_lm_eval
def test_an_unknown_task_is_refused(tmp_path: Path, model_dir: Path) -> None:
    out = tmp_path / "r.json"
    line = _refused(finetune_eval(str(model_dir), "--tasks", "hellaswagg", "-o", str(out)), out, "--tasks hellaswagg:")
    assert "lm-eval has no task of that name; did you mean `hellaswag`" in line


@pytest.mark.slow
@needs_lm_eval
def test_a_yaml_task_over_a_local_file(tmp_path: Path, model_dir: Path) -> None:
    """A user's task file with a relative data file next to it: read, generated greedily, scored."""
    write_jsonl(tmp_path / "rows.jsonl", [{"q": "Reverse the letters.\nabc\nAnswer: ", "a": "cba"}] * 2)
    task = tmp_path / "rows.yaml"
    task.write_text(yaml.safe_dump({
        "task": "local_rows", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "rows.jsonl"}},
        "test_split": "test", "output_type": "generate_until", "doc_to_text": "q", "doc_to_target": "a",
        "generation_kwargs": {"until": [], "do_sample": False, "max_gen_toks": 3},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }))
    out = tmp_path / "r.json"
    done = finetune_eval(str(model_dir), "--tasks", str(task), "-o", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tasks"]["local_rows"] == {"n": 2, "metrics": {"exact_match": 0.0}}
    assert result["baseline"] is None and len(result["samples"]["model"]["local_rows"]) == 2
