"""LoRA and QLoRA on a mixture's experts through the real CLI, on tiny Qwen3-MoE models (fp32 on CPU, as the
quickstart runs; bf16 for the memory comparison): what is saved, resumed and merged, and what NF4 experts save."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.commands.run import LaunchOptions, launch
from tests.support import arch_model_dir, clean_env, tiny_recipe, write_recipe

pytestmark = pytest.mark.slow
LAYERS = 2
ROUTERS = (".mlp.gate.", ".mlp.router.")


def _losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """LoRA all-linear on a tiny Qwen3-MoE (4 experts, top-2), 4 steps with a checkpoint at 2, merged by the
    CLI; and the run resumed from its step-2 checkpoint."""
    tmp = tmp_path_factory.mktemp("experts-lora")
    model = arch_model_dir(tmp / "model", "qwen3_moe", num_experts=4)
    out = tmp / "run"
    recipe = tiny_recipe(
        out, model={"path": str(model), "init": "random"}, method="lora",
        lora={"r": 4, "alpha": 8, "target_modules": "all-linear"},
        data={"eval": None}, train={"max_steps": 4, "lr": 1e-2}, output={"save_every": 2, "keep": 3},
    )
    path = write_recipe(tmp / "lora.yaml", recipe)
    assert launch(str(path), []) == 0
    merged = subprocess.run(
        [sys.executable, "-m", "finetune", "merge", str(out), "--out", str(tmp / "merged")],
        capture_output=True, text=True, timeout=600, env=clean_env(),
    )
    assert merged.returncode == 0, merged.stderr[-3000:]
    resumed = tmp / "resumed"
    recipe["output"]["dir"] = str(resumed)
    again = write_recipe(tmp / "resumed.yaml", recipe)
    assert launch(str(again), [], LaunchOptions(resume=str(out / "checkpoints" / "step-2"))) == 0
    return {"out": out, "merged": tmp / "merged", "resumed": resumed}


def test_lora_all_linear_saves_every_layers_expert_adapters_and_none_for_the_router(lora_run: dict) -> None:
    out = lora_run["out"]
    saved = load_file(str(out / "adapter_model.safetensors"))
    config = json.loads((out / "adapter_config.json").read_text())
    prefix = "base_model.model.model.layers"
    for layer in range(LAYERS):
        for where in ("experts", "experts.base_layer"):  # down_proj's wrapper around gate_up_proj's
            a = saved[f"{prefix}.{layer}.mlp.{where}.lora_A.weight"]
            b = saved[f"{prefix}.{layer}.mlp.{where}.lora_B.weight"]
            assert a.shape[0] == b.shape[1] == 4 * 4  # experts x r
            assert b.abs().sum() > 0  # trained
    assert not [k for k in saved if any(r in k for r in ROUTERS)]
    assert config["target_parameters"] == [
        f"model.layers.{i}.mlp.experts.{w}" for i in range(LAYERS) for w in ("down_proj", "gate_up_proj")
    ]
    assert not [m for m in config["target_modules"] if "experts" in m or m.endswith(".gate")]


def test_merge_changes_every_expert_weight_and_computes_what_the_adapter_does(lora_run: dict) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, merged = lora_run["out"], lora_run["merged"]
    base, folded = load_file(str(out / "base" / "model.safetensors")), load_file(str(merged / "model.safetensors"))
    experts = [k for k in base if ".mlp.experts." in k]  # the checkpoint keeps one tensor per expert
    assert len(experts) == LAYERS * 4 * 3
    assert [k for k in experts if torch.equal(base[k], folded[k])] == []
    assert all(torch.equal(base[k], folded[k]) for k in base if ".mlp.gate." in k)
    ids = torch.tensor([[1, 70, 71, 72, 40, 101, 102, 103, 104, 2], [1, 80, 90, 100, 110, 120, 33, 44, 55, 2]])
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32), str(out)
    ).eval()
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_resume_continues_the_expert_adapters_exactly(lora_run: dict) -> None:
    out, resumed = lora_run["out"], lora_run["resumed"]
    assert _losses(resumed) == _losses(out)[2:]
    a, b = load_file(str(out / "adapter_model.safetensors")), load_file(str(resumed / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


#: The other mixtures of tests/support.py: what each checkpoint calls its router (transformers' save_pretrained
#: writes Mixtral and DeepSeek-V3 one tensor per expert, as the Hub's checkpoints; gpt-oss and Llama 4 keep them
#: fused)
OTHERS = {"mixtral": ".block_sparse_moe.gate.", "gpt_oss": ".mlp.router.", "deepseek_v3": ".mlp.gate.",
          "llama4_text": ".feed_forward.router."}


@pytest.fixture(scope="module")
def other_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """LoRA all-linear on tiny Mixtral, gpt-oss, DeepSeek-V3 and Llama 4 models, 3 steps each, saved and merged
    through the CLI (in this process)."""
    from typer.testing import CliRunner

    from finetune.cli import app

    tmp = tmp_path_factory.mktemp("experts-lora-others")
    found = {}
    for arch in OTHERS:
        out = tmp / arch
        recipe = tiny_recipe(
            out, model={"path": str(arch_model_dir(tmp / f"{arch}-model", arch)), "init": "random"}, method="lora",
            lora={"r": 4, "alpha": 8, "target_modules": "all-linear"}, data={"eval": None},
            train={"max_steps": 3, "lr": 1e-2},
        )
        assert launch(str(write_recipe(tmp / f"{arch}.yaml", recipe)), []) == 0
        merged = CliRunner().invoke(app, ["merge", str(out), "--out", str(tmp / f"{arch}-merged")])
        assert merged.exit_code == 0, merged.output
        found[arch] = {"out": out, "merged": tmp / f"{arch}-merged"}
    return found


@pytest.mark.parametrize("arch", list(OTHERS))
def test_other_mixtures_save_merge_and_compute_what_the_adapter_does(other_runs: dict, arch: str) -> None:
    """Every mixture layer's fused expert weights get trained adapters and the router none; the merged model
    changes every expert weight of the base checkpoint, no router, and computes the adapter's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from finetune.model import llama4
    from finetune.model.experts import peft_as_targeted

    out, merged, router = other_runs[arch]["out"], other_runs[arch]["merged"], OTHERS[arch]
    block = "feed_forward" if arch == "llama4_text" else "mlp"
    saved = load_file(str(out / "adapter_model.safetensors"))
    config = json.loads((out / "adapter_config.json").read_text())
    moe_layers = range(1 if arch == "deepseek_v3" else 0, LAYERS)  # DeepSeek-V3's first layer is dense
    assert config["target_parameters"] == [
        f"model.layers.{i}.{block}.experts.{w}" for i in moe_layers for w in ("down_proj", "gate_up_proj")
    ]
    for layer in moe_layers:
        for where in ("experts", "experts.base_layer"):
            b = saved[f"base_model.model.model.layers.{layer}.{block}.{where}.lora_B.weight"]
            assert b.abs().sum() > 0
    assert not [k for k in saved if router.replace(".block_sparse_moe.", ".mlp.") in k]
    base, folded = load_file(str(out / "base" / "model.safetensors")), load_file(str(merged / "model.safetensors"))
    experts = [k for k in base if ".experts." in k and not k.endswith("_bias")]
    assert len(experts) == {"mixtral": 2 * 4 * 3, "gpt_oss": 2 * 2, "deepseek_v3": 8 * 3, "llama4_text": 2 * 2}[arch]
    assert [k for k in experts if torch.equal(base[k], folded[k])] == []
    routers = [k for k in base if router in k]
    assert routers and all(torch.equal(base[k], folded[k]) for k in routers)
    ids = torch.tensor([[1, 70, 71, 72, 40, 101, 102, 103, 104, 2], [1, 80, 90, 100, 110, 120, 33, 44, 55, 2]])
    base_model = AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    llama4.adopt(base_model)  # Llama 4's experts say their layout to peft (see tests/unit/test_experts.py)
    with peft_as_targeted():  # DeepSeek-V3's adapter as saved (see tests/unit/test_experts.py)
        adapted = PeftModel.from_pretrained(base_model, str(out)).eval()
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def memory_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """LoRA and QLoRA in bf16 on a Qwen3-MoE whose experts hold 95% of the weights (4 layers, 16 experts of
    ffn 128), the same data and steps, each with --measure-memory."""
    tmp = tmp_path_factory.mktemp("experts-memory")
    model = arch_model_dir(tmp / "model", "qwen3_moe", num_hidden_layers=4, num_experts=16, moe_intermediate_size=128)
    found = {}
    for method in ("lora", "qlora"):
        recipe = tiny_recipe(
            tmp / method, model={"path": str(model), "init": "random"}, method=method, precision="bf16",
            lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}, train={"max_steps": 2},
            data={"eval": None},
        )
        path = write_recipe(tmp / f"{method}.yaml", recipe)
        assert launch(str(path), [], LaunchOptions(measure_memory=True)) == 0  # the CLI's --measure-memory
        found[method] = json.loads((tmp / method / "memory.json").read_text())
        found[f"{method}_plan"] = json.loads((tmp / method / "plan.json").read_text())
    return found


def test_qlora_peak_is_below_loras_by_most_of_what_nf4_saves_on_the_experts(memory_runs: dict) -> None:
    experts = memory_runs["qlora_plan"]["model"]["experts"]
    assert experts["values"] == 4 * 2 * 16 * 3 * 64 * 128 // 2 and experts["quantized"] == experts["tensors"] == 8
    assert experts["values"] / memory_runs["qlora_plan"]["model"]["parameters"] > 0.9
    nf4_saves = experts["values"] * 2 - experts["stored_bytes"]  # bf16 against NF4 with its constants
    assert 1.45 < nf4_saves / experts["values"] < 1.5
    saved = memory_runs["lora"]["measured_peak"] - memory_runs["qlora"]["measured_peak"]
    assert saved >= 0.7 * nf4_saves, (saved, nf4_saves)
    assert abs(memory_runs["qlora"]["error"]) < 0.08  # the plan of NF4 experts (their routed dequantizations traced)
