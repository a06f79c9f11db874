"""Careless and hostile recipes: every number bounded (no inf, no NaN, nothing absurdly large), and an output.dir
that would write over an input refused by validate, plan and run alike, before anything is written.

Each refusal is exit 2 with one sentence naming the key (and the file and line), and the files that existed are
unchanged (their hashes before and after).
"""

from __future__ import annotations

import hashlib
import os
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from finetune.cli import app
from finetune.recipe.schema import Recipe, RecipeError, check_files, load_recipe
from tests.support import RECIPES, TINY_MODEL, micro_model_dir, tiny_recipe, write_recipe


def _numeric(annotation: object) -> bool:
    """Whether a field takes a number (an int or float, alone or in a union; not a bool, a Literal or a list)."""
    if annotation in (int, float):
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_numeric(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _numeric(typing.get_args(annotation)[0])
    return False


def _numeric_keys(cls: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    keys = []
    for name, info in cls.model_fields.items():
        ann = info.annotation
        key = f"{prefix}{info.alias or name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _numeric_keys(ann, f"{key}.")
        elif _numeric(ann):
            keys.append(key)
    return keys


NUMERIC_KEYS = _numeric_keys()


def test_the_schema_has_the_numbers_this_test_walks() -> None:
    assert {"train.lr", "train.max_grad_norm", "train.epochs", "distributed.timeout", "lora.r", "train.seed",
            "train.max_consecutive_skips", "dpo.lambda", "hardware.nodes", "train.router_aux_loss_coef"} <= set(NUMERIC_KEYS)
    assert len(NUMERIC_KEYS) >= 40


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1.0e+30", "-1.0e+30"])
def test_no_number_of_the_schema_takes_an_infinite_nan_or_absurd_value(tmp_path: Path, value: str) -> None:
    """Every numeric key of the schema, whatever its section: refused, with the key named."""
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "out"))
    accepted = []
    for key in NUMERIC_KEYS:
        try:
            load_recipe(path, [f"{key}={value}"])
        except RecipeError as err:
            assert [p.key for p in err.problems] == [f"--set {key}"], (key, str(err))
        else:
            accepted.append(key)
    assert accepted == []


def test_max_grad_norm_zero_is_no_clipping_and_a_negative_one_is_refused(tmp_path: Path) -> None:
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "out"))
    assert load_recipe(path, ["train.max_grad_norm=0"]).recipe.train.max_grad_norm == 0
    with pytest.raises(RecipeError) as info:
        load_recipe(path, ["train.max_grad_norm=-0.5"])
    assert [p.key for p in info.value.problems] == ["--set train.max_grad_norm"]


@pytest.mark.parametrize(
    ("section", "values", "key", "says"),
    [
        ("train", {"max_grad_norm": -1}, "train.max_grad_norm", "greater than or equal to 0"),  # -1 flips gradients
        ("train", {"max_grad_norm": float("nan")}, "train.max_grad_norm", "finite number"),
        ("train", {"lr": float("inf")}, "train.lr", "finite number"),
        ("distributed", {"timeout": float("inf")}, "distributed.timeout", "finite number"),
        ("train", {"epochs": float("inf")}, "train.epochs", "finite number"),
        ("train", {"betas": [0.9, 1.0]}, "train.betas.1", "less than 1"),
        ("train", {"betas": [-0.1, 0.9]}, "train.betas.0", "greater than or equal to 0"),
        ("train", {"seed": 2**40}, "train.seed", "less than or equal to 4294967295"),
        ("output", {"dir": ""}, "output.dir", "is empty, which would mean the current directory"),
        ("output", {"max_shard_size": "0GiB"}, "output.max_shard_size", "is no size"),
    ],
)
def test_nonsense_numbers_are_one_sentence_with_file_and_line(
    tmp_path: Path, section: str, values: dict, key: str, says: str
) -> None:
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "out", **{section: values}))
    res = CliRunner().invoke(app, ["validate", str(path)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}:") and f": {key}: " in lines[0], res.output
    assert says in lines[0]
    assert "Traceback" not in res.output and not (tmp_path / "out").exists()


def test_lora_rank_beyond_the_narrowest_targeted_layer(tmp_path: Path) -> None:
    """tiny-llama's v_proj is 256 -> 128: rank 129 is refused (the model is built on meta to know it, once the rank
    exceeds the config's smallest width, head_dim 64; a rank within it needs no model built)."""
    ok = tiny_recipe(tmp_path / "out", method="lora", lora={"r": 64, "target_modules": ["q_proj", "v_proj"]})
    assert check_files(load_recipe(write_recipe(tmp_path / "ok.yaml", ok))) == []
    bad = tiny_recipe(tmp_path / "out", method="lora", lora={"r": 129, "target_modules": ["q_proj", "v_proj"]})
    path = write_recipe(tmp_path / "bad.yaml", bad)
    res = CliRunner().invoke(app, ["validate", str(path)])
    line = path.read_text().splitlines().index("  r: 129") + 1
    assert res.exit_code == 2
    assert res.output.strip() == (
        f"error: {path}:{line}: lora.r: 129 is above the smallest dimension of `model.layers.0.self_attn.v_proj` (256 in, "
        "128 out), one of the layers lora.target_modules adapts: a rank cannot exceed it; use at most 128"
    )


# ------------------------------------------------------------------------------------------------ output.dir


def _hashes(*roots: Path) -> dict[str, str]:
    """SHA-256 of every file under ``roots`` (symlinks followed to what they name)."""
    out = {}
    for root in roots:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _copy_model(tmp: Path) -> Path:
    model = micro_model_dir(tmp / "model")
    import torch
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(model / "model.safetensors"))
    return model


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    model = _copy_model(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text((RECIPES / "data/reverse/train.jsonl").read_text())
    return {"model": model, "data": data, "train": data / "train.jsonl"}


def _overlap_cases(tmp: Path, inputs: dict[str, Path]) -> list[tuple[str, dict, str]]:
    link = tmp / "link-to-model"
    if not link.exists():
        os.symlink(inputs["model"], link)
    return [
        ("model itself", {"output": {"dir": str(inputs["model"])}}, "is the model (model.path)"),
        ("a symlink to the model", {"output": {"dir": str(link)}}, "is the model (model.path)"),
        ("inside the model", {"output": {"dir": str(inputs["model"] / "run")}}, "lies inside the model (model.path)"),
        ("above the data", {"output": {"dir": str(tmp)}}, "contains the model (model.path)"),
        ("the data directory", {"output": {"dir": str(inputs["data"])}}, "contains the data (data.train)"),
    ]


def test_output_dir_over_an_input_is_refused_by_validate_plan_and_run(tmp_path: Path, inputs: dict[str, Path]) -> None:
    """A full fine-tune with output.dir at (or around, or inside) its model, its data, through a symlink: refused
    by the three commands in the same sentence; with --overwrite too, and the model and data are unchanged."""
    before = _hashes(inputs["model"], inputs["data"])
    for name, sections, says in _overlap_cases(tmp_path, inputs):
        r = tiny_recipe(tmp_path / "out", model={"path": str(inputs["model"]), "init": "pretrained"},
                        data={"train": str(inputs["train"]), "eval": None, "max_seq_len": 48})
        for k, v in sections.items():
            r.setdefault(k, {}).update(v)
        path = write_recipe(tmp_path / f"{name.replace(' ', '-')}.yaml", r)
        for args in (["validate", str(path)], ["plan", str(path)], ["run", str(path), "--overwrite"]):
            res = CliRunner().invoke(app, args)
            assert res.exit_code == 2, (name, args, res.output)
            lines = [ln for ln in res.output.splitlines() if ln.strip()]
            assert len(lines) == 1 and lines[0].startswith(f"error: {path}:") and ": output.dir: " in lines[0], res.output
            assert says in lines[0] and lines[0].endswith("choose an output.dir apart from every input"), (name, res.output)
    assert _hashes(inputs["model"], inputs["data"]) == before
    assert not (inputs["model"] / "run").exists() and not (inputs["model"] / ".finetune.lock").exists()


def test_output_dir_holding_the_recipe_is_refused_unless_it_is_the_runs_own_copy(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    mine = write_recipe(out / "mine.yaml", tiny_recipe(out))
    problems = [p for p in check_files(load_recipe(mine)) if p.key == "output.dir"]
    assert len(problems) == 1 and f"contains the recipe file {mine}" in problems[0].message
    # the resolved copy a run saves (what `finetune run OUT/recipe.yaml --resume` reads) is the run's own
    from finetune.recipe.schema import recipe_to_yaml

    (out / "recipe.yaml").write_text(recipe_to_yaml(load_recipe(mine).recipe))
    assert [p for p in check_files(load_recipe(out / "recipe.yaml")) if p.key == "output.dir"] == []
    edited = "# my notes on this run\n" + (out / "recipe.yaml").read_text()
    (out / "recipe.yaml").write_text(edited)  # no longer what the run writes there (its comment would be lost)
    assert [p.key for p in check_files(load_recipe(out / "recipe.yaml"))] == ["output.dir"]


def test_output_dir_over_the_reference_model_a_chat_template_or_a_reward_file_is_refused(tmp_path: Path, inputs: dict) -> None:
    from finetune.recipe.schema import output_problems

    reference = _copy_model(tmp_path / "ref")
    r = tiny_recipe(reference, dpo={"reference_model": str(reference)})
    [problem] = output_problems(load_recipe(write_recipe(tmp_path / "ref.yaml", r)))
    assert problem.key == "output.dir" and "is the reference model (dpo.reference_model)" in problem.message
    template = tmp_path / "templates" / "chat.jinja"
    template.parent.mkdir()
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    r = tiny_recipe(template.parent, data={"chat_template": str(template)})
    [problem] = output_problems(load_recipe(write_recipe(tmp_path / "tpl.yaml", r)))
    assert "contains the chat template (data.chat_template)" in problem.message
    # grpo's python reward: its file, relative to the recipe, as the rewards read it
    rewards = tmp_path / "rewards"
    rewards.mkdir()
    (rewards / "mine.py").write_text("def score(prompt, completion, answer):\n    return 0.0\n")
    grpo = {"rewards": [{"type": "python", "file": "rewards/mine.py", "function": "score"}], "trust_reward_code": True}
    r = tiny_recipe(rewards, train={"objective": "grpo"}, grpo=grpo)
    [problem] = output_problems(load_recipe(write_recipe(tmp_path / "grpo.yaml", r)))
    assert "contains the reward function's file (grpo.rewards.0.file)" in problem.message
    assert str(rewards / "mine.py") in problem.message


def test_output_dir_apart_from_every_input_passes(tmp_path: Path) -> None:
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "runs" / "a"))
    assert check_files(load_recipe(path)) == []
    assert TINY_MODEL.is_dir()
