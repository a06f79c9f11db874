"""End to end through the real CLI on the tiny model: full and LoRA; outputs reload with the same logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.commands.run import prepare
from finetune.plan.flowchart import plan_for_run
from finetune.train.trainer import train_rank
from tests.support import tiny_recipe, write_recipe

PROBE = torch.tensor([[5, 80, 81, 82, 83, 12, 40, 41, 42, 43, 44, 45]])

pytestmark = pytest.mark.slow  # every test trains through the CLI or the trainer


def _cli_run(recipe_path: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(recipe_path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _in_process(recipe_path: Path):
    loaded = prepare(str(recipe_path), [])
    plan = plan_for_run(loaded, nproc=1, nnodes=1, device="cpu")
    return train_rank(loaded, plan)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_full_finetune_cli_outputs_reload_with_same_logits(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    proc = _cli_run(write_recipe(tmp_path / "cli.yaml", tiny_recipe(out)))
    assert "final eval: loss" in proc.stdout and "AutoModelForCausalLM.from_pretrained" in proc.stdout
    for name in ("model.safetensors", "config.json", "tokenizer.json", "recipe.yaml", "plan.json", "metrics.jsonl"):
        assert (out / name).is_file(), name
    rows = _metrics(out)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all({"lr", "tokens", "tokens_per_s"} <= set(r) for r in steps)
    # CPU has no peak FLOPS: no MFU in the summary or the metrics (a GPU run prints and logs it)
    assert "MFU" not in proc.stdout and "throughput:" not in proc.stdout
    assert not any("mfu" in r for r in rows)
    assert rows[-1]["eval_loss"] > 0 and 0.0 <= rows[-1]["eval_exact_match"] <= 1.0
    # Training is deterministic on CPU in fp32: the same recipe in this process gives the same model,
    # so the reloaded CLI output must give this in-memory model's logits.
    result = _in_process(write_recipe(tmp_path / "mem.yaml", tiny_recipe(tmp_path / "mem")))
    assert result.losses == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        want = result.model.eval()(PROBE).logits
        got = reloaded(PROBE).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # and the model moved: it is not the random init
    fresh = _in_process(write_recipe(tmp_path / "zero.yaml", tiny_recipe(tmp_path / "zero", train={"max_steps": 1, "lr": 1e-12})))
    with torch.no_grad():
        assert (fresh.model.eval()(PROBE).logits - want).abs().max() > 1e-3


def test_lora_cli_adapter_reloads_with_peft_and_same_logits(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    lora = {"method": "lora", "train": {"lr": 1e-2}, "lora": {"r": 4, "alpha": 8}}
    _cli_run(write_recipe(tmp_path / "cli.yaml", tiny_recipe(out, **lora)))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and sorted(cfg["target_modules"]) == ["q_proj", "v_proj"]
    assert (out / "adapter_model.safetensors").is_file() and (out / "base" / "model.safetensors").is_file()
    result = _in_process(write_recipe(tmp_path / "mem.yaml", tiny_recipe(tmp_path / "mem", **lora)))
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(out / "base")
    reloaded = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        want = result.model.eval()(PROBE).logits
        got = reloaded(PROBE).logits
        base_only = AutoModelForCausalLM.from_pretrained(out / "base")(PROBE).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got - base_only).abs().max() > 1e-4  # the adapter changed the model
    trainable = [n for n, p in result.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_gradient_accumulation_matches_a_bigger_micro_batch(tmp_path: Path) -> None:
    runs = {}
    for micro in (2, 4):
        recipe = tiny_recipe(tmp_path / f"m{micro}", train={"micro_batch_size": micro, "global_batch_size": 4, "max_steps": 5})
        recipe["data"].pop("eval")
        runs[micro] = _in_process(write_recipe(tmp_path / f"m{micro}.yaml", recipe))
    assert runs[2].losses == pytest.approx(runs[4].losses, rel=1e-5)
    a, b = runs[2].model.state_dict(), runs[4].model.state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5)
    assert runs[2].losses[0] != runs[2].losses[-1]


@pytest.mark.parametrize("packing", [True, False])
def test_logged_tokens_are_the_real_tokens_not_padding(tmp_path: Path, packing: bool) -> None:
    """metrics.jsonl `tokens` sums the tokens of the rows trained on, without the padding of micro-batches."""
    from transformers import AutoTokenizer

    from finetune.train.data import load_data
    from finetune.train.data.batches import BatchStream
    from tests.support import TINY_MODEL

    out = tmp_path / "run"
    recipe = tiny_recipe(out, data={"packing": packing}, eval={"every": 0})
    path = write_recipe(tmp_path / "r.yaml", recipe)
    _in_process(path)
    logged = [r["tokens"] for r in _metrics(out) if "loss" in r]
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    stream = BatchStream(load_data(prepare(str(path), []), tok).train, 8, 0, tok.pad_token_id)
    real, padded, expected = 0, 0, []
    for step in range(4):
        epoch, at = divmod(step, stream.steps_per_epoch)
        rows = stream.rank_rows(epoch, at, rank=0, world_size=1)
        real += sum(len(r.input_ids) for r in rows)
        padded += sum(mb["input_ids"].numel() for mb in stream.micro_batches(epoch, at, rank=0, world_size=1,
                                                                              micro_batch_size=4))
        expected.append(real)
    assert logged == expected
    assert padded > real  # the micro-batches do carry padding that must not be counted


def test_relative_glob_from_another_directory_validates_and_runs(tmp_path: Path) -> None:
    """The recipe lives in one directory, the data under the current one: `validate` and `run` resolve the
    relative glob the same way (once, in finetune.recipe.locate), so a recipe that validates also runs."""
    import shutil

    from tests.support import RECIPES

    here = tmp_path / "work"
    (here / "data").mkdir(parents=True)
    shutil.copy(RECIPES / "data/reverse/train.jsonl", here / "data" / "part-1.jsonl")
    recipe = tiny_recipe(tmp_path / "out", train={"max_steps": 1, "global_batch_size": 4, "micro_batch_size": 4})
    recipe["data"] = {"train": "data/*.jsonl", "max_seq_len": 48}
    recipe["eval"] = {"at_start": False, "max_samples": 4, "max_new_tokens": 2}
    path = write_recipe((tmp_path / "recipes").mkdir() or tmp_path / "recipes" / "r.yaml", recipe)
    for command in ("validate", "run"):
        proc = subprocess.run(
            [sys.executable, "-m", "finetune", command, str(path)], capture_output=True, text=True, cwd=here, timeout=600
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = (tmp_path / "out" / "recipe.yaml").read_text()
    assert str(here / "data" / "*.jsonl") in saved  # the glob that matched, made absolute
