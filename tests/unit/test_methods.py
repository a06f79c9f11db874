"""Prefix tuning, bottleneck adapters, DoRA and 8-bit QLoRA: exact inventories, one storage rule with the
trainer, save/load with the base untouched, exact resume, bad input in one sentence (validate and run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from finetune.cli import app
from finetune.commands.run import LaunchOptions, launch
from finetune.model.adapters import BOTTLENECK_CONFIG, BOTTLENECK_WEIGHTS, load_bottlenecks
from finetune.plan.flowchart import plan_for_run
from finetune.recipe.schema import recipe_from_dict
from finetune.train.checkpoint import checkpointer as ck
from finetune.train.model.build import build_model, check_model_storage, stored_bytes_by_dtype
from tests.support import RECIPES, TINY_MODEL, tiny_recipe, write_recipe

TINY = json.loads((TINY_MODEL / "config.json").read_text())
LAYERS, HIDDEN = TINY["num_hidden_layers"], TINY["hidden_size"]
KV_WIDTH = TINY["num_key_value_heads"] * TINY["head_dim"]  # what a layer's prefix keys (and values) hold per token


def _loaded(tmp_path: Path, **sections: object):
    raw = {
        "model": {"path": str(TINY_MODEL), "init": "random"},
        "data": {"train": str(RECIPES / "data/reverse/train.jsonl"), "max_seq_len": 32},
        "train": {"global_batch_size": 4, "micro_batch_size": 2},
        "precision": "fp32",
        "distributed": {"strategy": "single"},
        "output": {"dir": str(tmp_path / "run")},
    }
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v
    return recipe_from_dict(raw)


def _trainable(tmp_path: Path, **sections: object) -> tuple[int, int]:
    """(planned, built) trainable values; the built model is checked against the plan's storage as a run does."""
    loaded = _loaded(tmp_path, **sections)
    plan = plan_for_run(loaded, nproc=1, nnodes=1, device="cpu")
    model = build_model(loaded, plan.execution, torch.device("cpu"))
    assert stored_bytes_by_dtype(model) == plan.model["param_bytes_by_dtype"]
    check_model_storage(model, plan.execution, plan.model["param_bytes_by_dtype"])
    return plan.model["trainable"], sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_prefix_inventory_is_layers_x_2_x_tokens_x_kv_width(tmp_path: Path) -> None:
    planned, built = _trainable(tmp_path, method="prefix", prefix={"num_virtual_tokens": 8})
    assert planned == built == 8 * LAYERS * 2 * KV_WIDTH
    # with the reparametrisation MLP: embedding [tokens, kv] -> Linear(kv, h) -> tanh -> Linear(h, layers*2*kv)
    h = 32
    planned, built = _trainable(
        tmp_path, method="prefix", prefix={"num_virtual_tokens": 8, "projection": True, "projection_hidden": h}
    )
    assert planned == built == 8 * KV_WIDTH + (KV_WIDTH * h + h) + (h * LAYERS * 2 * KV_WIDTH + LAYERS * 2 * KV_WIDTH)


def test_adapter_inventory_is_the_bottleneck_matrices(tmp_path: Path) -> None:
    one = lambda size: 2 * HIDDEN * size + size + HIDDEN  # noqa: E731  down (with bias) + up (with bias)
    planned, built = _trainable(tmp_path, method="adapter")
    # reduction factor 16, after attention and MLP; a gain on each adapted sublayer's input and the head's
    assert planned == built == LAYERS * 2 * (one(HIDDEN // 16) + HIDDEN) + HIDDEN
    planned, built = _trainable(
        tmp_path, method="adapter", precision="bf16", adapter={"size": 8, "placement": "mlp", "train_norms": False}
    )
    assert planned == built == LAYERS * one(8)
    planned, built = _trainable(tmp_path, method="adapter", adapter={"size": 8, "embeddings": True})
    assert planned == built == LAYERS * 2 * (one(8) + HIDDEN) + HIDDEN + one(8)  # one more, on the embeddings


def test_dora_inventory_adds_one_magnitude_per_output_feature(tmp_path: Path) -> None:
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    plain, _ = _trainable(tmp_path, method="lora", lora=lora)
    planned, built = _trainable(tmp_path, method="lora", lora={**lora, "use_dora": True, "use_rslora": True})
    assert planned == built == plain + LAYERS * (HIDDEN + KV_WIDTH)  # q_proj: hidden outputs, v_proj: kv


@pytest.mark.slow  # trains through launch()
def test_bottlenecks_save_and_load_onto_an_untouched_base(tmp_path: Path) -> None:
    out = tmp_path / "run"
    recipe = write_recipe(
        tmp_path / "a.yaml",
        tiny_recipe(
            out, method="adapter", adapter={"size": 16, "embeddings": True}, train={"max_steps": 3, "lr": 1e-2},
            eval={"every": 0},
        ),
    )
    assert launch(str(recipe), []) == 0
    saved = load_file(out / BOTTLENECK_WEIGHTS)
    # (attn, mlp) x (down, up) x (weight, bias) + (attn, mlp) x gain, the LM head's gain, the embeddings' bottleneck
    assert len(saved) == LAYERS * 2 * 5 + 1 + 4 and all("bottleneck_" in k for k in saved)
    assert saved["bottleneck_head.gain"].abs().max() > 0  # the norms were trained too
    assert saved["model.bottleneck_embed.up.weight"].abs().max() > 0  # trained from zero
    config = json.loads((out / BOTTLENECK_CONFIG).read_text())
    assert (config["size"], config["embeddings"]) == (16, True)
    assert not (out / "model.safetensors").exists() and not (out / "adapter_model.safetensors").exists()
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 7]])
    base = AutoModelForCausalLM.from_pretrained(out / "base").eval()
    with torch.no_grad():
        before = base(ids).logits
        adapted = load_bottlenecks(AutoModelForCausalLM.from_pretrained(out / "base"), out).eval()
        after = adapted(ids).logits
    assert (after - before).abs().max() > 1e-3  # the trained adapters change the model (up starts at zero)
    for k, v in saved.items():
        assert torch.equal(adapted.state_dict()[k], v)


@pytest.mark.slow  # two trainings through launch()
@pytest.mark.parametrize("method", ["prefix", "adapter"])
def test_exact_resume(tmp_path: Path, method: str) -> None:
    """Stopped after a checkpoint at step 3 and resumed: the same losses and trained weights, to the bit."""

    def recipe(name: str) -> Path:
        out = tmp_path / name
        r = tiny_recipe(
            out, method=method, prefix={"num_virtual_tokens": 4, "projection": True},
            data={"eval": None}, train={"max_steps": 6, "lr": 5e-3},
            output={"dir": str(out), "log_every": 1, "save_every": 3, "keep": 3},
        )
        return write_recipe(tmp_path / f"{name}.yaml", r)

    assert launch(str(recipe("ref")), []) == 0
    ckpt = tmp_path / "ref" / "checkpoints" / "step-3"
    assert launch(str(recipe("resumed")), [], LaunchOptions(resume=str(ckpt))) == 0

    def losses(name: str) -> list[tuple[int, float]]:
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in rows if "loss" in r]

    assert losses("resumed") == losses("ref")[3:]
    ref = ck.read_weights(tmp_path / "ref" / "checkpoints" / "step-6")  # the checkpoint's (sharded) weights
    got = ck.read_weights(tmp_path / "resumed" / "checkpoints" / "step-6")
    assert ref.keys() == got.keys() and len(ref) > 0
    assert all(torch.equal(ref[k], got[k]) for k in ref)


@pytest.mark.slow  # trains through the CLI
def test_qlora_8_bit_trains_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "int8"
    recipe = write_recipe(
        tmp_path / "q8.yaml",
        tiny_recipe(
            out, method="qlora", quantization={"bits": 8}, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]},
            train={"max_steps": 4, "lr": 5e-3}, eval={"every": 0},
        ),
    )
    res = CliRunner().invoke(app, ["run", str(recipe)])
    assert res.exit_code == 0, res.output
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(losses) == 4 and losses[-1] < losses[0]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["execution"]["quant"]["bits"] == 8 and plan["execution"]["quant"]["storage_dtype"] == "int8"
    assert len(load_file(out / "adapter_model.safetensors")) == LAYERS * 2 * 2


BAD = {
    "prefix-tokens": (
        {"method": "prefix", "prefix": {"num_virtual_tokens": 0}},
        "prefix.num_virtual_tokens: Input should be greater than or equal to 1 (got 0)",
    ),
    "adapter-size": (
        {"method": "adapter", "adapter": {"size": 512}},
        f"adapter.size: 512 is wider than the model's hidden size {HIDDEN}",
    ),
    "dora-full": (
        {"method": "full", "lora": {"use_dora": True}},
        "lora.use_dora: DoRA is a kind of LoRA but method is full; set method: lora or qlora",
    ),
    "bits-3": ({"method": "qlora", "quantization": {"bits": 3}}, "quantization.bits: Input should be 4 or 8 (got 3)"),
    "prefix-checkpointing": (
        {"method": "prefix", "train": {"activation_checkpointing": True}},
        "train.activation_checkpointing: transformers drops the key/value cache",
    ),
    "prefix-text-without-text": (
        {"method": "prefix", "prefix": {"init": "text"}},
        "prefix.init_text: is empty, but prefix.init: text starts the prefix from a text's keys and values",
    ),
    "prefix-text-with-projection": (
        {"method": "prefix", "prefix": {"init": "text", "init_text": "Answer in JSON.", "projection": True}},
        "prefix.init: init: text sets the prefix's keys and values themselves, which the projection MLP",
    ),
    "prefix-text-sharded": (
        {"method": "prefix", "prefix": {"init": "text", "init_text": "Reverse it"},
         "distributed": {"strategy": "fsdp", "nproc": 2}},
        "prefix.init: text runs the whole base over prefix.init_text on each process, which distributed.strategy "
        "fsdp on 2 processes shards",
    ),
    "pissa-qlora": (
        {"method": "qlora", "lora": {"init": "pissa"}},
        "lora.init: pissa rewrites the base weights, which QLoRA keeps quantized",
    ),
    "olora-dora": (
        {"method": "lora", "lora": {"init": "olora", "use_dora": True}},
        "lora.init: olora with DoRA cannot be saved as an adapter of the original base",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_method_settings_are_one_sentence_from_validate_and_run(tmp_path: Path, case: str) -> None:
    sections, message = BAD[case]
    recipe = write_recipe(tmp_path / "bad.yaml", tiny_recipe(tmp_path / "out", **sections))
    for command in (["validate", str(recipe)], ["run", str(recipe)]):
        res = CliRunner().invoke(app, command)
        assert res.exit_code == 2, res.output
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.output, res.output
    assert not (tmp_path / "out").exists()  # refused before anything ran


@pytest.mark.parametrize("method", ["prefix", "adapter", "prompt"])
def test_plan_method_flag(method: str) -> None:
    res = CliRunner().invoke(
        app, ["plan", str(RECIPES / "quickstart.yaml"), "--method", method, "--gpus", "1", "--gpu-memory", "16GiB",
              "--json"],
    )
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    assert plan["chosen"]["method"] == method
    assert plan["execution"]["adapter"]["kind"] == {"prefix": "prefix", "adapter": "bottleneck", "prompt": "prompt"}[method]
    assert 0 < plan["model"]["trainable"] < plan["model"]["parameters"] / 10


def test_method_ladder_is_full_lora_qlora_4_bit_and_8_bit_only_when_pinned(tmp_path: Path) -> None:
    """A model too big for the GPU: the walk goes full -> LoRA -> QLoRA on a 4-bit NF4 base; with
    quantization.bits: 8 pinned, QLoRA's base is LLM.int8."""
    args = ["plan", "--model", "llama-3.1-8b", "--gpus", "1", "--gpu-memory", "16GiB", "--seq-len", "512", "--json"]
    walk = " ".join(json.loads(CliRunner().invoke(app, args).output)["walk"])
    assert "trying LoRA" in walk and "trying QLoRA" in walk and "NF4 4-bit base weights" in walk
    assert "8-bit" not in walk
    recipe = write_recipe(
        tmp_path / "r.yaml", tiny_recipe(tmp_path / "o", method="auto", quantization={"bits": 8})
    )
    args = ["plan", str(recipe), "--model", "llama-3.1-8b", "--gpus", "1", "--gpu-memory", "16GiB", "--json"]
    res = CliRunner().invoke(app, args)
    walk = " ".join(json.loads(res.output)["walk"])
    assert "trying QLoRA" in walk and "LLM.int8 8-bit base weights" in walk


def test_prefix_generation_sees_the_positions_training_sees() -> None:
    """Every greedy step of a prefix-tuned model gives the logits of the training forward (no position_ids) over
    the prompt and the tokens before it, for a left-padded batch: evaluation and training put the prompt at the
    same positions after the prefix (peft offsets position_ids by the virtual tokens itself; adding them again
    moved every logit by ~0.2 here)."""
    import contextlib

    from peft import PrefixTuningConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.model.generation import greedy_tokens, left_padded

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL)).eval()
    model = get_peft_model(base, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)).eval()
    with torch.no_grad():
        model.prompt_encoder["default"].embedding.weight.normal_(0, 1.0)  # a prefix that moves the logits
    steps: list[torch.Tensor] = []
    model.register_forward_hook(lambda _m, _a, out: steps.append(out.logits[:, -1].clone()))
    prompts = [torch.randint(3, 200, (10,)).tolist(), torch.randint(3, 200, (7,)).tolist()]
    ids, mask = left_padded(prompts, 0)
    out = greedy_tokens(model, ids, mask, 4, contextlib.nullcontext).tolist()
    generated = torch.stack(steps, dim=1)  # (B, steps, V)
    for i, (prompt, row) in enumerate(zip(prompts, out, strict=True)):
        seq = torch.tensor([prompt + row])
        with torch.no_grad():
            logits = model(input_ids=seq, attention_mask=torch.ones_like(seq), use_cache=False).logits
            with model.disable_adapter():
                plain = model(input_ids=seq, attention_mask=torch.ones_like(seq), use_cache=False).logits
        trained = logits[0, len(prompt) - 1 : -1]
        torch.testing.assert_close(generated[i], trained, atol=1e-4, rtol=0)
        assert (plain[0, len(prompt) - 1 : -1] - trained).abs().max() > 0.1  # the prefix does reach attention


def test_int8_training_matmul_keeps_no_input_and_matches_bitsandbytes() -> None:
    """bitsandbytes' CPU LLM.int8 training path keeps every quantized layer's input until backward although
    QLoRA's weight is frozen; ours computes the same output and input gradient bit for bit and frees it."""
    import weakref

    import bitsandbytes as bnb

    from finetune.train.model.quantize import int8_frozen_matmuls

    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 48)

    def int8_layer() -> torch.nn.Module:
        q = bnb.nn.Linear8bitLt(64, 48, bias=True, has_fp16_weights=False)
        q.load_state_dict(dense.state_dict())
        return q.to("cpu").train()

    x = torch.randn(4, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    results = []
    for layer in (int8_layer(), int8_frozen_matmuls(int8_layer())):
        h = x * 1  # an activation, as a layer's input is
        kept = weakref.ref(h)
        out = layer(h)
        del h
        results.append((out.detach(), kept() is not None))
        out.float().square().sum().backward()
        results[-1] += (x.grad.clone(),)
        x.grad = None
    (theirs, theirs_kept, theirs_grad), (ours, ours_kept, ours_grad) = results
    assert torch.equal(ours, theirs) and torch.equal(ours_grad, theirs_grad)
    assert theirs_kept and not ours_kept


@pytest.mark.parametrize("text", ["Reverse the word", "Reverse the word and write it in capitals, please."])
def test_prefix_init_text_puts_the_bases_own_keys_and_values_in_the_prefix(tmp_path: Path, text: str) -> None:
    """With prefix.init: text, what peft hands every layer as its prefix cache is exactly the frozen base's own
    keys and values of the text's tokens, repeated (short text) or cut (long text) to the virtual tokens."""
    from finetune.model.adapters import init_prefix_from_text, prefix_text_ids
    from finetune.train.model.build import load_tokenizer
    from finetune.versions import output_cache

    tokens = 8
    loaded = _loaded(
        tmp_path, method="prefix", prefix={"num_virtual_tokens": tokens, "init": "text", "init_text": text}
    )
    plan = plan_for_run(loaded, nproc=1, nnodes=1, device="cpu")
    assert plan.execution.adapter.prefix_init_text == text
    model = build_model(loaded, plan.execution, torch.device("cpu"))
    tok = load_tokenizer(loaded)
    ids = prefix_text_ids(text, tok, tokens)
    own = tok(text, add_special_tokens=False)["input_ids"]
    assert len(own) != tokens and ids == [own[i % len(own)] for i in range(tokens)]
    before = model.get_prompt(batch_size=1)
    init_prefix_from_text(model, ids)
    prompt = model.get_prompt(batch_size=1)  # peft's cache of the prefix, as the forward receives it
    with torch.no_grad():
        ref = output_cache(model.get_base_model()(input_ids=torch.tensor([ids]), use_cache=True))
    assert len(prompt.layers) == len(ref.layers) == LAYERS
    for got, want, old in zip(prompt.layers, ref.layers, before.layers, strict=True):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        assert not torch.equal(old.keys, want.keys)  # peft's random draw was replaced
