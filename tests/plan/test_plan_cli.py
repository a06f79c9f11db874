"""`finetune plan` through the real CLI: the JSON contract, user errors, and a fast accuracy subset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "buffers", "rollout", "overhead", "total"}
CHOSEN_KEYS = {"method", "strategy", "precision", "micro_batch_size", "grad_accum_steps", "activation_checkpointing",
               "nproc", "memory", "comm_bytes_per_step", "fits"}


def plan(*args: str, env_cache: Path) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, FINETUNE_CACHE=str(env_cache))
    return subprocess.run([sys.executable, "-m", "finetune", "plan", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


@pytest.mark.slow  # a CLI subprocess
def test_json_schema_for_a_catalog_model_on_8_gpus(tmp_path):
    out = plan("--model", "qwen2.5-0.5b", "--gpus", "8", "--gpu-memory", "24GiB", "--seq-len", "1024",
               "--global-batch-size", "64", "--json", env_cache=tmp_path)
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    c = p["chosen"]
    assert set(c) >= CHOSEN_KEYS
    assert set(c["memory"]) == MEMORY_KEYS and all(isinstance(v, int) for v in c["memory"].values())
    assert c["memory"]["total"] == sum(v for k, v in c["memory"].items() if k != "total")
    assert c["memory"]["total"] <= 24 * 2**30 and c["fits"] is True
    assert (c["method"], c["strategy"], c["precision"]) == ("full", "ddp", "bf16")  # 0.5B fits under DDP
    assert c["micro_batch_size"] * c["grad_accum_steps"] * 8 == 64
    assert isinstance(c["comm_bytes_per_step"], int) and c["comm_bytes_per_step"] > 0
    # DDP all-reduce of fp32 gradients: 2 (N-1)/N x 4 bytes x parameters
    assert c["comm_bytes_per_step"] == int(2 * 7 / 8 * 4 * 494_032_768)
    assert p["model"]["parameters"] == 494_032_768
    assert {(x["method"], x["strategy"]) for x in p["candidates"]} >= {("full", s) for s in ("ddp", "zero1", "zero2", "fsdp")}
    assert all(set(x["memory"]) == MEMORY_KEYS and isinstance(x["fits"], bool) for x in p["candidates"])
    ddp = next(line for line in p["walk"] if line.startswith("Full fine-tuning under DDP needs"))
    assert ": fits" in ddp and p["walk"].index(ddp) > p["walk"].index(next(x for x in p["walk"] if x.startswith("Precision")))


@pytest.mark.slow  # a CLI subprocess
def test_recipe_plan_and_user_errors(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from finetune.cli import app

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    monkeypatch.chdir(ROOT)
    runner = CliRunner()
    out = runner.invoke(app, ["plan", "recipes/llama-3.1-8b-lora.yaml", "--json"])
    assert out.exit_code == 0, out.output
    c = json.loads(out.stdout)["chosen"]
    assert (c["method"], c["strategy"], c["precision"]) == ("lora", "single", "bf16") and c["fits"]
    bad = runner.invoke(app, ["plan", "--model", "no-such-model"])
    assert bad.exit_code == 2 and "is not a local model directory, a catalog model" in bad.output
    assert "Traceback" not in bad.output
    bad = runner.invoke(app, ["plan", "--model", "llama-3.2-1b", "--gpu-memory", "lots"])
    assert bad.exit_code == 2 and "cannot read `lots` as a memory size" in bad.output


@pytest.mark.slow
def test_fast_accuracy_subset_within_10_percent():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import plan_accuracy
    finally:
        sys.path.pop(0)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name, arch, change, nproc in plan_accuracy.CONFIGS:
            if name in plan_accuracy.FAST[:1]:
                r = plan_accuracy.run_one(name, arch, change, nproc, Path(tmp))
                assert "predicted" in r, r
                assert abs(r["error"]) <= 0.10, r


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--method", "lorra"], "--method: `lorra` is not one of full, lora, qlora, prefix, adapter, prompt, auto; did you "
                                "mean `lora`?"),
        (["--strategy", "fsdpp"], "--strategy: `fsdpp` is not one of auto, single, ddp, zero1, zero2, fsdp, hsdp; did you "
                                  "mean `fsdp`?"),
        (["--precision", "fp8"], "--precision: `fp8` is not one of auto, fp32, bf16, fp16, bf16-pure"),
        (["--seq-len", "0"], "--seq-len: 0 is not allowed: it must be greater than or equal to 8"),
        (["--micro-batch-size", "0"], "--micro-batch-size: 0 is not allowed: it must be greater than 0"),
        (["--gpus", "0"], "--gpus: 0 is not allowed: it must be greater than 0"),
        (["--gpu-memory", "0GiB"], "--gpu-memory: 0GiB is no memory; write e.g. 80GiB or 24GB"),
    ],
)
def test_bad_flags_get_one_sentence(flags, message):
    """Each flag is checked by the rule of the recipe key it stands for; these were tracebacks (KeyError,
    ZeroDivisionError, a reshape error) or silent nonsense plans."""
    from typer.testing import CliRunner

    from finetune.cli import app

    out = CliRunner().invoke(app, ["plan", "--model", "llama-3.2-1b", *flags])
    assert out.exit_code == 2, out.output
    assert f"error: {message}" in " ".join(out.output.split()), out.output
    assert "Traceback" not in out.output


def test_model_flag_applies_every_set_as_a_recipe_does(tmp_path, monkeypatch):
    """`plan --model M --set train.activation_checkpointing=true` once planned with checkpointing off: the
    overrides were dropped without a recipe file. They now apply (and are checked) as in a recipe."""
    import yaml
    from typer.testing import CliRunner

    from finetune.cli import app

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    runner = CliRunner()
    flags = ["--method", "lora", "--seq-len", "64", "--micro-batch-size", "2", "--global-batch-size", "2"]
    sets = ["--set", "train.activation_checkpointing=true", "--set", "lora.r=4"]
    by_model = runner.invoke(app, ["plan", "--model", "tiny-llama", *flags, *sets, "--gpus", "1", "--json"])
    assert by_model.exit_code == 0, by_model.output
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"path": "tiny-llama"}, "method": "lora", "lora": {"r": 4},
        "data": {"train": "unused.jsonl", "max_seq_len": 64, "packing": True},
        "train": {"micro_batch_size": 2, "global_batch_size": 2, "activation_checkpointing": True},
    }))
    by_recipe = runner.invoke(app, ["plan", str(recipe), "--gpus", "1", "--json"])
    assert by_recipe.exit_code == 0, by_recipe.output
    model_plan, recipe_plan = json.loads(by_model.stdout), json.loads(by_recipe.stdout)
    assert model_plan["chosen"]["activation_checkpointing"] is True
    assert model_plan["chosen"] == recipe_plan["chosen"]
    assert model_plan["model"]["trainable"] == recipe_plan["model"]["trainable"]  # lora.r=4 applied
    bad = runner.invoke(app, ["plan", "--model", "tiny-llama", "--set", "train.activation_checkpointing=maybe"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert "--set train.activation_checkpointing" in bad.output
    bad = runner.invoke(app, ["plan", "--model", "tiny-llama", "--set", "train.checkpointing=true"])
    assert bad.exit_code == 2 and "unknown key `checkpointing`" in bad.output


def _plan_json(args: list[str], cache: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    from typer.testing import CliRunner

    from finetune.cli import app

    monkeypatch.setenv("FINETUNE_CACHE", str(cache))
    out = CliRunner().invoke(app, ["plan", *args, "--json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


#: The catalog's mixtures of experts a user plans by name (qwen3-8b and llama-3.3-70b have tests of their own
#: below): (name, published parameters, hardware on which a configuration fits, so that its blocks are traced:
#: the method it takes there).
PUBLISHED = [
    ("qwen3-30b-a3b", 30.53e9, ["--gpus", "1"], "lora"),
    ("qwen3-235b-a22b", 235.09e9, ["--gpus", "8"], "lora"),
    ("gpt-oss-20b", 20.91e9, ["--gpus", "1"], "lora"),  # attention with sinks: no sdpa in transformers
    ("gpt-oss-120b", 116.83e9, ["--gpus", "1"], "qlora"),
    # multi-head latent attention, an fp32 router, three dense layers before the mixture
    ("deepseek-v3", 671.0e9, ["--gpus", "8", "--nodes", "2"], "qlora"),
]


@pytest.mark.slow  # traces each model's blocks on fake tensors (5-30 s each on a loaded 2-core machine)
@pytest.mark.parametrize(("name", "published", "hardware", "method"), PUBLISHED, ids=[x[0] for x in PUBLISHED])
def test_catalog_models_plan_offline_with_their_published_size(
    name: str, published: float, hardware: list[str], method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`finetune plan --model NAME` with downloads off: the entry's parameter count within 2% of the model
    card's, and a configuration that fits 80 GiB GPUs, its activations traced from the model's own blocks."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p = _plan_json(["--model", name, "--gpu-memory", "80GiB", *hardware], tmp_path, monkeypatch)
    assert p["model"]["source"] == f"catalog:{name}"
    assert abs(p["model"]["parameters"] / published - 1) < 0.02, p["model"]["parameters"]
    c = p["chosen"]
    assert (c["method"], c["fits"]) == (method, True)
    assert c["memory"]["activations"] > 0 and c["memory"]["total"] <= 80 * 2**30


@pytest.mark.slow  # traces an 8B model's block on fake tensors (about 5 s)
def test_qwen3_8b_offline_full_fine_tuning_on_8_gpus(tmp_path, monkeypatch):
    """A 2025 catalog entry planned without weights or network: 8.19B parameters (the model card's), full
    fine-tuning under ZeRO-2 once DDP's replicated model states do not fit 80 GiB."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p = _plan_json(["--model", "Qwen/Qwen3-8B", "--gpus", "8", "--gpu-memory", "80GiB", "--seq-len", "2048",
                    "--global-batch-size", "64"], tmp_path, monkeypatch)
    n = 8_190_735_360
    assert p["model"]["parameters"] == n and abs(n / 8.19e9 - 1) < 0.02
    assert (p["model"]["source"], p["model"]["model_type"], p["model"]["layers"]) == ("catalog:qwen3-8b", "qwen3", 36)
    c = p["chosen"]
    assert (c["method"], c["strategy"], c["precision"], c["nproc"], c["fits"]) == ("full", "zero2", "bf16", 8, True)
    assert c["micro_batch_size"] * c["grad_accum_steps"] * 8 == 64
    m = c["memory"]
    assert m["total"] == sum(v for k, v in m.items() if k != "total") and m["total"] <= 80 * 2**30
    # fp32 master weights and gradients sharded over 8 ranks, AdamW's two fp32 moments too
    assert (m["params"], m["grads"], m["optimizer"]) == (n * 4 // 8, n * 4 // 8, n * 8 // 8)
    # ZeRO-2: fp32 gradients reduce-scattered, bf16 parameters all-gathered, (N-1)/N of each, every micro-batch
    assert c["grad_accum_steps"] > 1
    assert c["comm_bytes_per_step"] == int(7 / 8 * (4 + 2) * n) * c["grad_accum_steps"]
    fit = next(line for line in p["walk"] if line.startswith("Full fine-tuning under DDP needs"))
    assert "ZeRO-2 needs" in fit
    assert not next(x for x in p["candidates"] if x["strategy"] == "ddp")["fits"]


@pytest.mark.slow  # traces a 70B model's block on fake tensors (about 5 s)
def test_llama_3_3_70b_offline_falls_to_qlora_on_one_gpu(tmp_path, monkeypatch):
    """Llama-3.3-70B (70.55B) on one 80 GiB GPU: full fine-tuning and LoRA's bf16 base do not fit, QLoRA does,
    its decoder linears packed two NF4 codes to a byte."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p = _plan_json(["--model", "meta-llama/Llama-3.3-70B-Instruct", "--gpus", "1", "--gpu-memory", "80GiB"],
                   tmp_path, monkeypatch)
    n = 70_553_706_496
    assert p["model"]["parameters"] == n and abs(n / 70.55e9 - 1) < 0.02
    assert (p["model"]["source"], p["model"]["layers"]) == ("catalog:llama-3.3-70b", 80)
    c = p["chosen"]
    assert (c["method"], c["strategy"], c["fits"]) == ("qlora", "single", True)
    h, kv, ffn, vocab, layers = 8192, 1024, 28672, 128256, 80
    by_dtype = p["model"]["param_bytes_by_dtype"]
    assert by_dtype["uint8"] == layers * (2 * h * h + 2 * h * kv + 3 * h * ffn) // 2
    assert by_dtype["bf16"] == 2 * (2 * vocab * h + (2 * layers + 1) * h)  # embeddings, head, norms
    assert by_dtype["fp32"] == p["model"]["trainable"] * 4
    walk = "\n".join(p["walk"])
    assert "LoRA under one process needs" in walk and "trying QLoRA" in walk
