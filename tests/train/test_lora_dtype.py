"""``lora.dtype: bf16``: LoRA's adapters, their gradients and AdamW's moments in the compute dtype, planned and
built alike; refused where it cannot train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune.plan.memory import Setup, candidate_memory
from finetune.plan.shapes import build_inventory
from finetune.recipe.capabilities import Cell, first_refusal
from finetune.recipe.schema import LoraConfig, recipe_from_dict
from finetune.spec import execution_spec
from tests.support import TINY_MODEL, finetune_run, step_rows, tiny_recipe, write_recipe

LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def _states(dtype: str) -> tuple[int, int, int, int]:
    """(adapter values, parameter bytes, gradient bytes, optimizer bytes) one GPU holds under bf16 LoRA."""
    from transformers import AutoConfig

    lora = LoraConfig(**LORA, dtype=dtype)
    spec = execution_spec("lora", "single", "bf16", checkpointing=False, lora=lora)
    inv = build_inventory(AutoConfig.from_pretrained(TINY_MODEL), str(TINY_MODEL), spec.adapter)
    mem, _ = candidate_memory(inv, None, Setup(spec, 1, 1, 1, "cuda"))
    return inv.n_adapter, mem.params, mem.grads, mem.optimizer


def test_bf16_adapters_halve_the_adapters_and_their_state_in_the_plan() -> None:
    values, params32, grads32, opt32 = _states("fp32")
    same, params16, grads16, opt16 = _states("bf16")
    assert same == values > 0
    assert params32 - params16 == 2 * values  # 4 -> 2 bytes per adapter value; the frozen bf16 base unchanged
    assert (grads16, opt16) == (grads32 // 2, opt32 // 2) == (2 * values, 4 * values)


def test_lora_dtype_is_in_the_execution_spec_and_its_refusals_are_one_sentence() -> None:
    spec = execution_spec("lora", "single", "bf16", checkpointing=False, lora=LoraConfig(dtype="bf16"))
    assert (spec.trainable_dtype, spec.adapter.dtype) == ("bf16", "bf16")
    assert execution_spec("lora", "single", "bf16", checkpointing=False).trainable_dtype == "fp32"  # the default
    prefix = execution_spec("prefix", "single", "bf16", checkpointing=False, lora=LoraConfig(dtype="bf16"))
    assert prefix.trainable_dtype == "fp32"  # lora.dtype is LoRA's
    refusals = {  # (method, precision, lora.dtype): the sentence
        ("lora", "bf16", "fp16"): "lora.dtype: fp16 adapters cannot train here",
        ("lora", "fp16", "fp16"): "lora.dtype: fp16 adapters cannot train here",
        ("lora", "fp32", "bf16"): "lora.dtype: bf16 keeps the adapters in the compute dtype, but precision fp32 "
                                  "computes in fp32; set precision: bf16",
        ("qlora", "fp16", "bf16"): "lora.dtype: bf16 keeps the adapters in the compute dtype, but precision fp16",
        ("full", "bf16", "bf16"): "lora.dtype: bf16 is the storage dtype of LoRA's adapters, but method is full",
    }
    for (method, precision, dtype), sentence in refusals.items():
        lora = LoraConfig(dtype=dtype)
        found = first_refusal(Cell.of(method=method, strategy="single", processes=1, tp=1, precision=precision,
                                      lora=lora))
        assert found is not None and str(found).startswith(sentence), (method, precision, dtype, found)
    pissa = Cell.of(method="lora", strategy="single", processes=1, tp=1, precision="bf16",
                    lora=LoraConfig(dtype="bf16", init="pissa"))
    assert str(first_refusal(pissa)).startswith("lora.dtype: bf16 adapters cannot start from pissa")
    for precision in ("bf16", "bf16-pure", "auto"):  # auto: decided by the planner, refused there if not bf16
        ok = Cell.of(method="lora", strategy="fsdp", processes=2, tp=1, precision=precision,
                     lora=LoraConfig(dtype="bf16"))
        assert first_refusal(ok) is None


def test_validate_names_the_key_and_the_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from finetune.cli import app

    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "out", method="lora", lora={"dtype": "bf16"}))
    out = CliRunner().invoke(app, ["validate", str(recipe)])
    assert out.exit_code == 2, out.output
    text = " ".join(out.output.split())
    line = next(i for i, x in enumerate(recipe.read_text().splitlines(), 1) if x.strip().startswith("dtype: bf16"))
    assert f"{recipe}:{line}: lora.dtype: bf16 keeps the adapters in the compute dtype, but precision fp32 computes " \
           "in fp32" in text
    assert "Traceback" not in out.output
    assert recipe_from_dict(tiny_recipe(tmp_path, method="lora")).recipe.lora.dtype == "fp32"


@pytest.mark.slow  # a 3-step LoRA run with the memory probe, then a merge (about 40 s on 2 cores)
def test_bf16_adapters_train_save_merge_and_measure_half(tmp_path: Path) -> None:
    """Through the CLI: bf16 precision with lora.dtype bf16 trains (the loss falls over 3 steps at lr 1e-2), the
    built adapters are bf16 (the run checks every tensor against the plan's inventory at start), the probe
    measures the plan's bf16 parameters and gradients, the adapter is saved in bf16, and the merged model
    computes what the base plus the saved adapter computes."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from finetune.plan.types import Plan
    from tests.e2e.test_merge_e2e import IDS, finetune_merge

    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(
        out, method="lora", precision="bf16", lora={**LORA, "dtype": "bf16"},
        train={"max_steps": 3, "lr": 1e-2, "warmup_steps": 0}, eval={"every": 0},
    ))
    proc = finetune_run(recipe, "--measure-memory")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    losses = [r["loss"] for r in step_rows(out)]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    plan = Plan.from_dict(json.loads((out / "plan.json").read_text()))
    assert plan.execution is not None and plan.execution.trainable_dtype == "bf16"
    measured = json.loads((out / "memory.json").read_text())
    values, got, want = plan.model["trainable"], measured["by_category"], measured["predicted_by_category"]
    # the adapters and their gradients as the probe measured them: 2 bytes a value (fp32 adapters: 4), beside the
    # bf16 base; AdamW's two moments planned at 2 x 2 bytes a value
    assert got["params"] == want["params"] == plan.model["param_bytes_by_dtype"]["bf16"]
    assert got["grads"] == want["grads"] == 2 * values
    assert want["optimizer"] == 2 * 2 * values
    assert abs(measured["error"]) <= 0.05, measured["error"]
    saved = load_file(out / "adapter_model.safetensors")
    assert saved and all(t.dtype == torch.bfloat16 for t in saved.values())
    finetune_merge(str(out), "--out", str(tmp_path / "merged"), "--dtype", "fp32", cwd=tmp_path)
    base = AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, out).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        want, got = adapted(torch.tensor(IDS)).logits, merged(torch.tensor(IDS)).logits
    assert (got - want).abs().max().item() < 1e-4


def _trained_bytes(tmp_path: Path, dtype: str) -> dict[str, int]:
    """One optimizer step of the trainer (in this process, bf16 precision, LoRA in ``dtype``): the bytes of the
    adapters, of the gradients backward gave them, and of AdamW's state after the step, beside the plan's."""
    from finetune.plan.flowchart import chosen_memory, plan_for_run
    from finetune.recipe.schema import load_recipe
    from finetune.train.parallel.distributed import DistContext
    from finetune.train.trainer import Trainer

    recipe = write_recipe(tmp_path / f"{dtype}.yaml", tiny_recipe(
        tmp_path / dtype, method="lora", precision="bf16", lora={**LORA, "dtype": dtype},
        train={"max_steps": 1, "warmup_steps": 0}, eval={"every": 0},
    ))
    loaded = load_recipe(str(recipe))
    plan = plan_for_run(loaded, nproc=1, nnodes=1, device="cpu")
    trainer = Trainer(loaded, plan, DistContext(0, 1, 0, torch.device("cpu")))
    trainer.setup()
    adapters = [p for p in trainer.model.parameters() if p.requires_grad]
    grads: dict[int, int] = {}
    for p in adapters:  # the gradient as backward left it, before the optimizer frees it
        p.register_post_accumulate_grad_hook(lambda p: grads.__setitem__(id(p), p.grad.nbytes))
    trainer.train_step()
    state = [v for s in trainer.optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]  # AdamW's moments (its step counter is a scalar)
    return {
        "values": sum(p.numel() for p in adapters), "planned_values": plan.model["trainable"],
        "params": sum(p.nbytes for p in adapters), "grads": sum(grads.values()),
        "optimizer": sum(t.nbytes for t in state), "planned_optimizer": chosen_memory(loaded, plan, device="cpu").optimizer,
        "grads_seen": len(grads), "tensors": len(adapters),
    }


@pytest.mark.slow  # two trainers built and stepped once in this process
def test_bf16_adapters_halve_what_the_trainer_holds(tmp_path: Path) -> None:
    """Measured on the trainer's own tensors after a real step: bf16 adapters take half the bytes of fp32 ones,
    and so do their gradients and AdamW's two moments (2 x 2 bytes a value against 2 x 4), the state the plan
    counts."""
    fp32, bf16 = _trained_bytes(tmp_path, "fp32"), _trained_bytes(tmp_path, "bf16")
    for got in (fp32, bf16):
        assert got["values"] == got["planned_values"] > 0 and got["grads_seen"] == got["tensors"]
        assert got["optimizer"] == got["planned_optimizer"]
    assert fp32["values"] == bf16["values"]
    values = bf16["values"]
    assert (fp32["params"], fp32["grads"], fp32["optimizer"]) == (4 * values, 4 * values, 8 * values)
    assert (bf16["params"], bf16["grads"], bf16["optimizer"]) == (2 * values, 2 * values, 4 * values)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_plan_says_the_adapters_dtype_and_what_the_other_would_cost(tmp_path: Path, dtype: str) -> None:
    """The plan's sentence about the adapters (walk.AdapterStorage): their values, the dtype they are kept in,
    the bytes of the adapters, their gradients and AdamW's two moments in that dtype, and in the other; fp32
    adapters under bf16 compute are pointed at lora.dtype: bf16."""
    from finetune.plan.flowchart import plan_for_run
    from finetune.recipe.schema import load_recipe
    from finetune.units import fmt_bytes

    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(
        tmp_path / "out", method="lora", precision="bf16", lora={**LORA, "dtype": dtype}, eval={"every": 0},
    ))
    plan = plan_for_run(load_recipe(str(recipe)), nproc=1, nnodes=1, device="cpu")
    (step,) = [s for s in plan.steps if s["kind"] == "AdapterStorage"]
    values = plan.model["trainable"]
    size = {"fp32": 4, "bf16": 2}
    other = "bf16" if dtype == "fp32" else "fp32"
    assert (step["dtype"], step["values"], step["compute"]) == (dtype, values, "bf16")
    assert step["state_bytes"] == 4 * size[dtype] * values  # adapters, gradients, two moments
    assert step["other_bytes"] == 4 * size[other] * values
    head = (f"LoRA's adapters ({values / 1e6:.2f}M values) are kept in {dtype} (lora.dtype), with their gradients "
            f"and the optimizer state: {fmt_bytes(step['state_bytes'])} before sharding")
    tail = {"fp32": f"; lora.dtype: bf16 keeps them in the compute dtype ({fmt_bytes(step['other_bytes'])}).",
            "bf16": f", the compute dtype (fp32 adapters: {fmt_bytes(step['other_bytes'])})."}[dtype]
    assert head + tail in plan.walk
