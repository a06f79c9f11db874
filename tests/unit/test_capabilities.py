"""The capability table: one sentence per refused cell, the same from validate, plan and run, before anything
loads; the planner never chooses a refused cell; the guide's support matrix is the table's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from finetune.cli import app
from finetune.model.methods import METHOD_TYPES, LoRA, PrefixTuning
from finetune.recipe.capabilities import TABLE, Cell, first_refusal, refusals, support_matrix_markdown
from finetune.recipe.schema import recipe_from_dict
from finetune.spec import Method
from tests.support import ROOT, tiny_recipe, write_recipe


def test_the_guides_support_matrix_is_generated_from_the_table() -> None:
    guide = (ROOT / "docs" / "guide.md").read_text()
    found = re.search(r"<!-- support-matrix:start -->\n(.*?)<!-- support-matrix:end -->", guide, re.S)
    assert found, "docs/guide.md has no support matrix block"
    assert found.group(1) == support_matrix_markdown(), "the guide's matrix is stale: run python -m finetune.recipe.capabilities"


def test_every_rule_has_a_distinct_name_and_names_real_recipe_keys() -> None:
    from finetune.recipe.schema import Recipe

    assert len({r.name for r in TABLE}) == len(TABLE)
    for rule in TABLE:
        for key in rule.keys:
            section, _, leaf = key.partition(".")
            field = Recipe.model_fields.get(section)
            assert field is not None, f"{rule.name}: no recipe section {section}"
            if leaf:
                assert leaf in field.annotation.model_fields, f"{rule.name}: no recipe key {key}"


@pytest.mark.parametrize("method", ["full", "lora", "qlora", "prefix", "adapter", "prompt"])
@pytest.mark.parametrize("strategy", ["single", "ddp", "zero1", "zero2", "fsdp"])
def test_plain_methods_train_under_every_strategy(method: str, strategy: str) -> None:
    """A method with its defaults is refused under no strategy (the matrix's plain rows are all yes)."""
    processes = 1 if strategy == "single" else 2
    for optimizer in ("adamw", "adamw8bit", "paged_adamw8bit"):
        for precision in ("fp32", "bf16", "fp16", "bf16-pure"):
            cell = Cell(method=method, strategy=strategy, processes=processes, optimizer=optimizer, precision=precision)
            assert first_refusal(cell) is None, str(first_refusal(cell))


def test_unknown_values_fire_no_rule_and_known_ones_do() -> None:
    # the process count is unknown while distributed.nproc is auto: nothing that needs it fires
    auto = Cell(method="prefix", prefix_init="text", prefix_init_text="Reverse it.", strategy="fsdp", processes=None)
    assert refusals(auto) == []
    two = auto.with_(processes=2)
    assert [r.rule.name for r in refusals(two)] == ["prefix-text-sharded"]
    assert str(refusals(two)[0]).startswith("prefix.init: text runs the whole base over prefix.init_text")
    # the method is unknown under method: auto: the ladder's candidates are checked one by one
    assert refusals(Cell(method=None, quant_bits=8, strategy="fsdp", processes=2)) == []
    assert [r.rule.name for r in refusals(Cell(method="qlora", quant_bits=8, strategy="fsdp", processes=2))] == [
        "int8-sharded"
    ]


def test_method_objects_answer_what_callers_used_to_branch_on() -> None:
    assert {m for m in METHOD_TYPES} == set(Method)
    lora = LoRA(LoRA.adapter_spec())
    assert lora.merges and lora.merge_refusal() is None and lora.seeded_init == "default"
    pissa = LoRA(LoRA.adapter_spec(recipe_from_dict(tiny_recipe(Path("/tmp/x"), lora={"init": "pissa"})).recipe.lora))
    assert pissa.decomposes and pissa.seeded_init is None
    prefix = PrefixTuning(PrefixTuning.adapter_spec())
    assert not prefix.recomputable and "extra attention positions" in (prefix.merge_refusal() or "")
    assert not Method.FULL.adapters and Method.QLORA.quantized and not Method.LORA.quantized
    assert prefix.supports(Cell(strategy="ddp", processes=2, packing=True)) == (
        "data.packing: packed rows would all attend to one prefix across documents; set data.packing: false for "
        "method: prefix"
    )
    assert lora.supports(Cell(strategy="ddp", processes=2, packing=True)) is None


def test_bottleneck_defaults_are_stated_once() -> None:
    """adapter.train_norms: the recipe's default is the spec's (the method class builds one from the other)."""
    from finetune.recipe.schema import AdapterConfig
    from finetune.spec import AdapterSpec, adapter_spec

    default = AdapterConfig().train_norms
    assert adapter_spec("adapter").train_norms == default
    assert AdapterSpec(kind="bottleneck").train_norms == default


QLORA8_FSDP = {
    "method": "qlora",
    "quantization": {"bits": 8},
    "distributed": {"strategy": "fsdp", "nproc": 2},
}
SENTENCE = (
    "quantization.bits: 8 (LLM.int8) keeps its scales beside each weight, which distributed.strategy fsdp replaces "
    "with shards; use quantization.bits: 4 (NF4 shards under zero2 and fsdp), or strategy ddp (or zero1) for 8-bit"
)


@pytest.mark.parametrize("command", ["validate", "plan", "run"])
def test_validate_plan_and_run_refuse_with_the_same_sentence_before_anything_loads(
    tmp_path: Path, command: str
) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "out", **QLORA8_FSDP))
    res = CliRunner().invoke(app, [command, str(recipe)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    assert lines[0].startswith("error: ") and lines[0].endswith(SENTENCE), lines[0]
    assert not (tmp_path / "out").exists()


def test_a_process_count_given_at_launch_is_checked_by_the_planner(tmp_path: Path) -> None:
    """distributed.nproc auto: validate cannot know the processes; run refuses before any worker starts."""
    sections = {"method": "prefix", "prefix": {"init": "text", "init_text": "Reverse it."},
                "distributed": {"strategy": "fsdp"}}
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "out", **sections))
    assert CliRunner().invoke(app, ["validate", str(recipe)]).exit_code == 0
    res = CliRunner().invoke(app, ["run", str(recipe), "--nproc", "2"])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (
        "error: prefix.init: text runs the whole base over prefix.init_text on each process, which "
        "distributed.strategy fsdp on 2 processes shards; use strategy ddp (or single), or prefix.init: random"
    )
    assert not (tmp_path / "out").exists()


def test_the_walk_never_chooses_a_refused_cell() -> None:
    """8-bit QLoRA with strategy auto on 2 GPUs: zero2 and fsdp are ruled out with the table's sentence; the
    walk takes ddp (with activation checkpointing) where it would otherwise have sharded."""
    res = CliRunner().invoke(app, [
        "plan", "--model", "llama-3.1-8b", "--method", "qlora", "--set", "quantization.bits=8", "--gpus", "2",
        "--gpu-memory", "12GiB", "--json",
    ])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    assert {c["strategy"] for c in plan["candidates"]} <= {"ddp", "zero1"}
    assert plan["chosen"]["strategy"] == "ddp" and plan["chosen"]["activation_checkpointing"]
    ruled = [w for w in plan["walk"] if "is ruled out" in w]
    assert [w.split(" is ruled out")[0] for w in ruled[:2]] == ["QLoRA under ZeRO-2", "QLoRA under FSDP"]
    assert all("quantization.bits: 8 (LLM.int8) keeps its scales beside each weight" in w for w in ruled[:2])


def test_expert_parallelism_is_refused_where_it_cannot_run() -> None:
    """distributed.ep: a mixture under zero2/fsdp trains (full and LoRA on the experts); QLoRA's NF4 experts, a
    dense model, a replicating strategy and a degree that does not divide the ranks or the experts are refused."""
    moe = {"experts": True, "expert_lora": True, "num_experts": 8, "ep": 2, "strategy": "fsdp", "processes": 4}
    assert first_refusal(Cell(method="full", **moe)) is None
    assert first_refusal(Cell(method="lora", **moe)) is None
    found = first_refusal(Cell(method="qlora", **moe))
    assert found is not None and found.rule.name == "ep-qlora" and str(found).startswith("distributed.ep: 2 with")
    assert first_refusal(Cell(method="full", **{**moe, "experts": False})).rule.name == "ep-dense"
    assert first_refusal(Cell(method="full", **{**moe, "strategy": "ddp"})).rule.name == "ep-strategy"
    assert first_refusal(Cell(method="full", **{**moe, "processes": 6, "ep": 4})).rule.name == "ep-shard-ranks"
    assert first_refusal(Cell(method="full", **{**moe, "num_experts": 6, "ep": 4})).rule.name == "ep-experts"
