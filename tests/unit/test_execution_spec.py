"""The execution spec is the one answer to "how is this tensor stored": the planner counts it, the trainer builds it.

Each case plans a recipe, builds the trainer's model from the plan's execution spec and compares every
parameter's dtype and the bytes per dtype with the planner's inventory (the same check every rank runs at
run start). A wrong expectation must fail the check.
"""

from __future__ import annotations

import pytest
import torch

from finetune.plan.flowchart import plan_for_run
from finetune.recipe.schema import recipe_from_dict
from finetune.spec import Method, Strategy, execution_spec
from finetune.train.model.build import build_model, check_model_storage, stored_bytes_by_dtype
from tests.support import RECIPES, TINY_MODEL


def _loaded(tmp_path, **sections):
    raw = {
        "model": {"path": str(TINY_MODEL), "init": "random"},
        "data": {"train": str(RECIPES / "data/reverse/train.jsonl"), "max_seq_len": 32},
        "train": {"global_batch_size": 4, "micro_batch_size": 2},
        "distributed": {"strategy": "single"},
        "output": {"dir": str(tmp_path / "run")},
    }
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v
    return recipe_from_dict(raw)


CASES = {
    "full-fp32": {"method": "full", "precision": "fp32"},
    "full-bf16-pure": {"method": "full", "precision": "bf16-pure"},
    "lora-bf16": {"method": "lora", "precision": "bf16"},
    "lora-bf16-base-fp32": {"method": "lora", "precision": "bf16", "model": {"dtype": "fp32"}},
    "lora-fp32-base-fp16": {"method": "lora", "precision": "fp32", "model": {"dtype": "fp16"}},
    "qlora-nf4-bf16": {"method": "qlora", "precision": "bf16"},
    "qlora-nf4-compute-fp32": {"method": "qlora", "precision": "bf16", "quantization": {"compute_dtype": "fp32"}},
    "qlora-int8": {"method": "qlora", "precision": "fp32", "quantization": {"bits": 8}},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_built_model_matches_the_plans_execution_spec(tmp_path, case):
    loaded = _loaded(tmp_path, **CASES[case])
    plan = plan_for_run(loaded, nproc=1, nnodes=1, device="cpu")
    spec = plan.execution
    model = build_model(loaded, spec, torch.device("cpu"))
    expected = plan.model["param_bytes_by_dtype"]
    assert stored_bytes_by_dtype(model) == expected
    check_model_storage(model, spec, expected)
    wrong = {**expected, spec.trainable_dtype: expected[spec.trainable_dtype] + 2}
    with pytest.raises(AssertionError, match="bytes per dtype"):
        check_model_storage(model, spec, wrong)


def test_planner_honours_model_dtype_compute_dtype_and_8_bits(tmp_path):
    """model.dtype, quantization.compute_dtype and quantization.bits change the planned parameter bytes exactly
    as they change what the trainer stores (issue: the planner assumed the compute dtype and NF4)."""

    def planned(**sections) -> dict[str, int]:
        plan = plan_for_run(_loaded(tmp_path, **sections), nproc=1, nnodes=1, device="cpu")
        return plan.model["param_bytes_by_dtype"]

    auto = planned(method="lora", precision="bf16")
    fp32_base = planned(method="lora", precision="bf16", model={"dtype": "fp32"})
    assert fp32_base["fp32"] - auto["fp32"] == 2 * auto["bf16"]  # every frozen value: 2 more bytes
    nf4 = planned(method="qlora", precision="bf16")
    int8 = planned(method="qlora", precision="bf16", quantization={"bits": 8})
    assert int8["int8"] == 2 * nf4["uint8"]  # 1 byte per weight instead of a half
    fp32_compute = planned(method="qlora", precision="bf16", quantization={"compute_dtype": "fp32"})
    assert "bf16" not in fp32_compute and fp32_compute["fp32"] > nf4["fp32"]


def test_qlora_under_zero2_and_fsdp_stores_shardable_codes():
    """One rule for FSDP2, ZeRO-2 included: 4-bit codes stored in the compute dtype so fully_shard can shard
    them; uint8 codes would not shard, and a planned QLoRA/zero2 run would break."""
    for strategy in ("zero2", "fsdp"):
        spec = execution_spec("qlora", strategy, "bf16", checkpointing=False, world_size=2)
        assert spec.quant.storage_dtype == "bf16" and spec.quant.shardable and spec.fsdp_param_dtype == "bf16"
    for strategy in ("single", "ddp", "zero1"):
        spec = execution_spec("qlora", strategy, "bf16", checkpointing=False, world_size=2)
        assert spec.quant.storage_dtype == "uint8" and spec.autocast


def test_enums_are_their_names():
    assert Strategy("zero2").uses_fsdp and not Strategy.ZERO2.reshards_after_forward and Strategy.FSDP.reshards_after_forward
    assert Strategy.ZERO1.shards_optimizer and Strategy.ZERO1.replicates and not Strategy.DDP.shards_optimizer
    assert Method.QLORA.quantized and Method.LORA.adapters and not Method.FULL.adapters
    assert {"fsdp": 1}[Strategy.FSDP] == 1 and f"{Strategy.ZERO2}" == "zero2" and Strategy.DDP == "ddp"
    spec = execution_spec("full", "fsdp", "fp16", checkpointing=True, world_size=4)
    assert type(spec).from_dict(spec.to_dict()) == spec
    assert (spec.loss_scaling, spec.autocast, spec.reduce_dtype, spec.trainable_dtype) == (True, False, "fp32", "fp32")
