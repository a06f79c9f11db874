"""Expert parallelism (``distributed.ep: 2``) with fsdp on 2 gloo processes, through ``finetune run``: a tiny
Qwen3-MoE (8 experts, 4 per ep rank) trains as one process does, full fine-tuning in fp32 and LoRA on the
experts' fused weights, and the run's plan says ``ep: 2``; so does a tiny Llama 4 (4 experts, top-1), whose
experts finetune puts behind transformers' experts interface, under full fine-tuning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.commands.run import LaunchOptions, launch
from tests.support import LOSS_RTOL, RECIPES, arch_model_dir, finetune_run, max_rel, step_rows, write_recipe

pytestmark = pytest.mark.dist

FULL_STEPS, LORA_STEPS = 6, 3


def ep_recipe(model_dir: Path, out: Path, method: str, ep: int) -> dict:
    """Global batch 8 in micro-batches of 2, a load-balancing coefficient large enough to move the router."""
    return {
        "model": {"path": str(model_dir), "init": "random"},
        "method": method,
        "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"},
        "data": {"train": str(RECIPES / "data/reverse/train.jsonl"), "max_seq_len": 48},
        "train": {"max_steps": FULL_STEPS if method == "full" else LORA_STEPS, "global_batch_size": 8,
                  "micro_batch_size": 2, "lr": 3e-3 if method == "full" else 1e-2, "seed": 0,
                  "router_aux_loss_coef": 0.05},
        "precision": "fp32",
        "distributed": {"strategy": "single" if ep == 1 else "fsdp", "ep": ep},
        "eval": {"every": 0},
        "output": {"dir": str(out), "log_every": 1},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Path]:
    """Full fine-tuning and LoRA (the Qwen3-MoE), full fine-tuning (Llama 4), each on one process (in this
    process) and under fsdp with ep 2 on 2."""
    root = tmp_path_factory.mktemp("expert-parallel")
    model_dir = arch_model_dir(root / "qwen3_moe", "qwen3_moe")
    llama4_dir = arch_model_dir(root / "llama4_text", "llama4_text")
    out = {}
    for method in ("full", "lora", "llama4"):
        for ep in (1, 2):
            d = root / f"{method}-ep{ep}"
            if method == "llama4":
                recipe = ep_recipe(llama4_dir, d, "full", ep)
                recipe["train"]["router_aux_loss_coef"] = "auto"  # Llama 4 defines no load-balancing loss
            else:
                recipe = ep_recipe(model_dir, d, method, ep)
            path = write_recipe(root / f"{method}-ep{ep}.yaml", recipe)
            if ep == 1:
                assert launch(str(path), [], LaunchOptions(nproc=1)) == 0
            else:
                proc = finetune_run(path, "--nproc", "2")
                assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
            out[(method, ep)] = d
    return out


def test_full_fine_tuning_under_ep_matches_one_process(runs: dict) -> None:
    one, two = step_rows(runs[("full", 1)]), step_rows(runs[("full", 2)])
    assert len(one) == len(two) == FULL_STEPS
    # the gradient norm holds the experts' gradients (summed over the ep ranks' tokens, divided as the dense
    # weights' are): a wrong reduction of them moves it while AdamW's losses barely move
    for key in ("loss", "grad_norm", "aux_loss", "expert_load"):
        assert max_rel([r[key] for r in two], [r[key] for r in one]) < LOSS_RTOL, key
    plan = json.loads((runs[("full", 2)] / "plan.json").read_text())
    assert plan["execution"]["ep"] == 2 and plan["chosen"]["ep"] == 2
    # the saved model is whole: every expert, as one process trained them
    a = load_file(str(runs[("full", 1)] / "model.safetensors"))
    b = load_file(str(runs[("full", 2)] / "model.safetensors"))
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert b[key].shape == a[key].shape and b[key].shape[0] == 8
    torch.testing.assert_close(b[key], a[key], atol=1e-4, rtol=1e-3)


def test_lora_on_the_experts_under_ep_matches_one_process(runs: dict) -> None:
    one, two = runs[("lora", 1)], runs[("lora", 2)]
    for key in ("loss", "grad_norm"):
        assert max_rel([r[key] for r in step_rows(two)], [r[key] for r in step_rows(one)]) < LOSS_RTOL, key
    a, b = load_file(str(one / "adapter_model.safetensors")), load_file(str(two / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(".experts.base_layer.lora_A" in k for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=1e-3)


def test_llama4_under_ep_matches_one_process(runs: dict) -> None:
    one, two = step_rows(runs[("llama4", 1)]), step_rows(runs[("llama4", 2)])
    assert len(one) == len(two) == FULL_STEPS and "aux_loss" not in one[0]
    for key in ("loss", "grad_norm", "expert_load"):
        assert max_rel([r[key] for r in two], [r[key] for r in one]) < LOSS_RTOL, key
    a = load_file(str(runs[("llama4", 1)] / "model.safetensors"))
    b = load_file(str(runs[("llama4", 2)] / "model.safetensors"))
    key = "model.layers.0.feed_forward.experts.gate_up_proj"  # experts x hidden x 2*ffn
    assert b[key].shape == a[key].shape == (4, 64, 64)
    torch.testing.assert_close(b[key], a[key], atol=1e-4, rtol=1e-3)
