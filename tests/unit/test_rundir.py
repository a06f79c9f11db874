"""The one reader of what a run left (finetune/storage/rundir.py), on real directories of files: what each holds, its
method and dtypes, the base of an adapter, and the sentence for each directory that holds nothing to load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from finetune.errors import UserError
from finetune.spec import execution_spec
from finetune.storage.rundir import adapter_weights, find_base, has_weights, holds, read_outputs, read_run


def model_dir(d: Path, *, weights: bool = True, **config: object) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    if weights:
        (d / "model.safetensors").write_bytes(b"\0" * 8)
    return d


def adapter_dir(d: Path, peft_type: str = "LORA", recipe: dict | None = None, plan: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": peft_type, "r": 4}))
    (d / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    if recipe is not None:
        (d / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    if plan is not None:
        (d / "plan.json").write_text(json.dumps(plan))
    return d


def test_what_each_directory_holds_and_its_method(tmp_path: Path) -> None:
    base = model_dir(tmp_path / "base")
    assert read_run(str(base)).kind == "model" and read_run(str(base)).method is None
    assert read_run(str(adapter_dir(tmp_path / "lora"))).method == "lora"
    assert read_run(str(adapter_dir(tmp_path / "prefix", "PREFIX_TUNING"))).method == "prefix"
    assert read_run(str(adapter_dir(tmp_path / "prompt", "PROMPT_TUNING"))).method == "prompt"
    qlora = read_run(str(adapter_dir(tmp_path / "qlora", recipe={"method": "qlora", "model": {"path": str(base)}})))
    assert qlora.method == "qlora" and qlora.quantized_base and qlora.peft_type == "LORA"
    bottleneck = tmp_path / "bottleneck"
    bottleneck.mkdir()
    (bottleneck / "bottleneck_config.json").write_text("{}")
    (bottleneck / "bottleneck_adapter.safetensors").write_bytes(b"\0" * 8)
    assert read_run(str(bottleneck)).method == "adapter" and read_run(str(bottleneck)).peft_type == "BOTTLENECK"
    # a merge is prompted as the run whose adapter it folded
    merged = model_dir(tmp_path / "merged")
    (merged / "finetune_merge.json").write_text(json.dumps({"adapter": str(tmp_path / "qlora")}))
    m = read_run(str(merged))
    assert m.kind == "model" and m.merged_from == tmp_path / "qlora" and m.recipe == qlora.recipe
    assert m.method is None and not m.quantized_base


def test_weights_are_a_config_with_safetensors_one_file_or_an_index(tmp_path: Path) -> None:
    assert has_weights(model_dir(tmp_path / "single"))
    sharded = model_dir(tmp_path / "sharded", weights=False)
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    assert has_weights(sharded)
    config_only = model_dir(tmp_path / "config-only", weights=False)
    assert not has_weights(config_only)
    with pytest.raises(UserError, match=r"has a config\.json but no safetensors weights"):
        read_run(str(config_only))


@pytest.mark.parametrize(("files", "says"), [
    ({}, "is neither a run nor a model directory: it holds no model"),
    ({"recipe.yaml": "method: lora\n"}, "is a run directory without a trained model or adapter yet"),
    ({"adapter_config.json": "{}"}, "has adapter_config.json but no adapter_model.safetensors"),
    ({"adapter_config.json": "{not json", "adapter_model.safetensors": ""}, "is not readable JSON"),
    ({"recipe.yaml": "a: [", "config.json": "{}", "model.safetensors": ""}, "is not valid YAML"),
])
def test_a_directory_with_nothing_to_load_is_one_sentence(tmp_path: Path, files: dict, says: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(UserError, match=says) as err:
        read_run(str(tmp_path), "--adapter")
    assert "\n" not in str(err.value)


def test_dtypes_come_from_the_plans_execution_spec_then_the_recipe(tmp_path: Path) -> None:
    spec = execution_spec("qlora", "ddp", "bf16", checkpointing=False, world_size=2).to_dict()
    run = read_run(str(adapter_dir(tmp_path / "planned", recipe={"method": "qlora", "precision": "fp32"},
                                   plan={"execution": spec})))
    assert (run.compute_dtype, run.autocast_dtype, run.base_dtype) == ("bf16", "bf16", "bf16")
    fsdp = execution_spec("full", "fsdp", "bf16", checkpointing=False, world_size=2).to_dict()
    full = model_dir(tmp_path / "full")
    (full / "plan.json").write_text(json.dumps({"execution": fsdp}))
    f = read_run(str(full))
    assert (f.model_dtype, f.autocast_dtype) == ("bf16", None)  # FSDP2's parameter dtype, no autocast
    # a plan without an execution spec: the recipe's quantization.compute_dtype, else its precision, else the plan's
    old = adapter_dir(tmp_path / "old", recipe={"method": "qlora", "quantization": {"compute_dtype": "fp16"}})
    assert read_run(str(old)).compute_dtype == "fp16"
    chosen = adapter_dir(tmp_path / "chosen", recipe={"method": "lora"}, plan={"chosen": {"precision": "bf16-pure"}})
    assert read_run(str(chosen)).compute_dtype == "bf16"
    assert read_run(str(adapter_dir(tmp_path / "bare"))).compute_dtype == "fp32"


def test_the_base_of_an_adapter(tmp_path: Path) -> None:
    base = model_dir(tmp_path / "base")
    ref = find_base(read_run(str(adapter_dir(tmp_path / "a", recipe={"method": "lora", "model": {"path": str(base)}}))))
    assert ref.path == base and not ref.rebuild and "model.path" in ref.where
    # a random-init run keeps its base in base/; a qlora one without it is redrawn from its config and seed
    saved = adapter_dir(tmp_path / "r", recipe={"method": "lora", "model": {"path": str(base), "init": "random"}})
    model_dir(saved / "base")
    assert find_base(read_run(str(saved))).path == saved / "base"
    q = adapter_dir(tmp_path / "q", recipe={"method": "qlora", "model": {"path": str(base), "init": "random"}})
    ref = find_base(read_run(str(q)))
    assert ref.rebuild and ref.path == base
    with pytest.raises(UserError, match=r"its base weights .* are missing; pass --base DIR"):
        find_base(read_run(str(q)), rebuild=False)
    quantized = model_dir(tmp_path / "quantized", quantization_config={"bits": 4})
    with pytest.raises(UserError, match="is stored quantized; the 16-bit base is needed"):
        find_base(read_run(str(adapter_dir(tmp_path / "b"))), str(quantized))


def test_what_a_directory_holds_by_its_files_alone(tmp_path: Path) -> None:
    """``holds`` is read_run's answer without reading: merge asks it whether a directory is an adapter."""
    assert holds(model_dir(tmp_path / "model")) == "model" and holds(model_dir(tmp_path / "c", weights=False)) is None
    lora = adapter_dir(tmp_path / "lora")
    assert holds(lora) == "peft" and adapter_weights(lora) == lora / "adapter_model.safetensors"
    (lora / "adapter_model.safetensors").unlink()
    assert holds(lora) == "peft" and adapter_weights(lora) is None  # an incomplete adapter: read_run says so
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bottleneck_config.json").write_text("{}")
    assert holds(tmp_path / "b") == "bottleneck" and holds(tmp_path) is None


def test_a_runs_recipe_typed_with_the_users_trust_never_the_directorys(tmp_path: Path) -> None:
    from finetune.recipe.schema import RecipeError
    from tests.support import TINY_MODEL, tiny_recipe

    recipe = tiny_recipe(tmp_path, model={"path": str(TINY_MODEL), "init": "random", "trust_remote_code": True},
                         data={"train": "data/train.jsonl"})
    run = read_run(str(adapter_dir(tmp_path / "run", recipe=recipe)))
    loaded = run.loaded_recipe()
    assert loaded.recipe.model.trust_remote_code is False and loaded.recipe.method == "full"
    assert loaded.base_dir == run.path and loaded.recipe.data.train == "data/train.jsonl"
    assert run.loaded_recipe(trust_remote_code=True).recipe.model.trust_remote_code is True
    broken = read_run(str(adapter_dir(tmp_path / "broken", recipe={**recipe, "train": {"lr": -1}})))
    with pytest.raises(RecipeError) as info:
        broken.loaded_recipe()
    assert [p.key for p in info.value.problems] == ["train.lr"]


def test_a_run_still_training_is_read_for_its_metrics_recipe_plan_and_memory(tmp_path: Path) -> None:
    """What ``finetune report`` draws: a run that has saved no model yet, with a partial last line (killed
    mid-write); then the same directory once it has saved its model and measured its memory."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("# notes\nmethod: full\nmodel: {path: x}\n")
    (run / "plan.json").write_text(json.dumps({"chosen": {"micro_batch_size": 4}}))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    found = read_outputs(str(run))
    assert found.kind == "run" and found.method == "full" and not found.is_adapter and found.peft_type is None
    assert found.metrics() == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]
    assert found.recipe_text.startswith("# notes\n") and found.plan == {"chosen": {"micro_batch_size": 4}}
    assert found.memory == {} and found.describe() == f"{run} (a run that has saved no model yet)"
    model_dir(run)
    (run / "memory.json").write_text(json.dumps({"measured_peak": 123}))
    assert read_outputs(str(run)).kind == "model" and read_outputs(str(run)).memory == {"measured_peak": 123}
    (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(UserError) as info:
        read_outputs(str(run)).metrics()
    assert str(info.value) == f"{run / 'metrics.jsonl'}:2: not a JSON line; the file is damaged"
    with pytest.raises(UserError) as info:
        read_outputs(str(tmp_path / "nowhere"))
    assert str(info.value) == (
        f"RUN_DIR: {tmp_path / 'nowhere'} has no metrics.jsonl; give the output.dir of a `finetune run`"
    )
