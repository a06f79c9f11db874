"""finetune merge: logits parity with the adapter model, streamed shards vs an in-memory fold, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from finetune.cli import app
from finetune.merge import merge

INPUT_IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 7, 3, 42], [2, 8, 16, 32, 64, 120, 4, 11, 19, 27]])


def tiny_model(arch: str, bias: bool = False, tied: bool = False) -> torch.nn.Module:
    """A ~100k-parameter random model of ``arch`` (llama: nn.Linear; gpt2: Conv1D, always with biases)."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attention_bias=bias, mlp_bias=bias, tie_word_embeddings=tied,
            max_position_embeddings=64,
        )
    else:
        cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if bias:  # random biases, so that a wrong bias treatment shows in the logits
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.05)
    return model


def make_run(tmp: Path, arch: str, targets: list[str], bias: bool = False, tied: bool = False,
             shard: str | None = None, **lora: object) -> tuple[Path, Path, torch.nn.Module]:
    """Save a base model and a PEFT adapter with non-zero B matrices; return (base dir, adapter dir, peft model)."""
    from peft import LoraConfig, get_peft_model

    base = tmp / f"base-{arch}"
    model = tiny_model(arch, bias, tied)
    model.save_pretrained(base, **({"max_shard_size": shard} if shard else {}))
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, **lora)
    peft_model = get_peft_model(model, cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(0, 0.2)
            elif "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.1)
    adapter = tmp / f"adapter-{arch}"
    peft_model.save_pretrained(adapter)
    return base, adapter, peft_model.eval()


def logits_of(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(INPUT_IDS).logits


LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPT2_ALL = ["c_attn", "c_proj", "c_fc"]  # attention qkv, attention out + MLP out (both c_proj), MLP in


@pytest.mark.parametrize(
    ("arch", "bias", "targets"),
    [("llama", False, LLAMA_ALL), ("llama", True, LLAMA_ALL), ("gpt2", True, GPT2_ALL)],
    ids=["llama", "llama-bias", "gpt2-conv1d"],
)
def test_merged_logits_equal_adapter_logits(tmp_path: Path, arch: str, bias: bool, targets: list[str]) -> None:
    base, adapter, peft_model = make_run(tmp_path, arch, targets, bias=bias)
    with torch.no_grad():
        expected = peft_model(INPUT_IDS).logits
        plain = peft_model.get_base_model()
        with peft_model.disable_adapter():
            base_logits = plain(INPUT_IDS).logits
    assert (expected - base_logits).abs().max() > 1e-2  # the adapter really changes the model
    res = merge(adapter, tmp_path / "merged", base=str(base))
    assert res.merged_modules == 2 * len(targets) + (2 if arch == "gpt2" else 0)  # gpt2: c_proj twice per block
    diff = (logits_of(tmp_path / "merged") - expected).abs().max().item()
    assert diff < 1e-4, diff


def test_lora_bias_rslora_and_rank_pattern(tmp_path: Path) -> None:
    """lora_B bias, rsLoRA scaling alpha/sqrt(r) and per-module rank/alpha patterns fold as peft computes."""
    base, adapter, peft_model = make_run(
        tmp_path, "llama", ["q_proj", "down_proj"], bias=True, lora_bias=True, use_rslora=True,
        rank_pattern={"down_proj": 2}, alpha_pattern={"q_proj": 3.0},
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name and name.endswith("bias"):
                p.normal_(0, 0.2)
        expected = peft_model(INPUT_IDS).logits
    peft_model.save_pretrained(adapter)
    merge(adapter, tmp_path / "merged", base=str(base))
    assert (logits_of(tmp_path / "merged") - expected).abs().max().item() < 1e-4


def test_tied_head_lora_and_modules_to_save_untie(tmp_path: Path) -> None:
    """LoRA on the tied lm_head of GPT-2 changes the head but not the input embedding: merge unties them."""
    base, adapter, peft_model = make_run(tmp_path, "gpt2", ["c_attn", "lm_head"], tied=True, modules_to_save=["ln_f"])
    with torch.no_grad():
        expected = peft_model(INPUT_IDS).logits
    res = merge(adapter, tmp_path / "merged", base=str(base))
    assert res.untied == ["lm_head.weight", "transformer.wte.weight"]
    assert res.replaced_tensors == 2  # ln_f weight and bias
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert (logits_of(tmp_path / "merged") - expected).abs().max().item() < 1e-4


def test_tied_embedding_lora_unties(tmp_path: Path) -> None:
    """LoRA on a tied input embedding (lora_embedding_A/B) of Llama: the head keeps the original weights."""
    base, adapter, peft_model = make_run(tmp_path, "llama", ["embed_tokens", "q_proj"], tied=True)
    with torch.no_grad():
        expected = peft_model(INPUT_IDS).logits
    res = merge(adapter, tmp_path / "merged", base=str(base))
    assert res.untied == ["lm_head.weight", "model.embed_tokens.weight"]
    assert (logits_of(tmp_path / "merged") - expected).abs().max().item() < 1e-4


def test_streamed_shards_equal_in_memory_fold(tmp_path: Path) -> None:
    """Several input shards: every output tensor is bit-identical to peft's merge_and_unload, same layout."""
    base, adapter, peft_model = make_run(tmp_path, "llama", LLAMA_ALL, bias=True, shard="100KB")
    index = json.loads((base / "model.safetensors.index.json").read_text())
    in_shards = sorted(set(index["weight_map"].values()))
    assert len(in_shards) >= 3
    folded = {k: v.clone() for k, v in peft_model.merge_and_unload().state_dict().items()}
    merge(adapter, tmp_path / "merged", base=str(base))
    out_index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert out_index["weight_map"] == index["weight_map"]
    seen, total = set(), 0
    for shard in in_shards:
        with safe_open(str(tmp_path / "merged" / shard), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is not a dict
                t = f.get_tensor(k)
                assert torch.equal(t, folded[k]), k
                seen.add(k)
                total += t.numel() * t.element_size()
    assert seen == set(folded)
    assert out_index["metadata"]["total_size"] == total


def test_dtype_bf16_and_tokenizer_copied(tmp_path: Path) -> None:
    base, adapter, _ = make_run(tmp_path, "llama", ["q_proj", "v_proj"])
    (base / "tokenizer_config.json").write_text('{"from": "base"}')
    (adapter / "tokenizer_config.json").write_text('{"from": "run"}')
    merge(adapter, tmp_path / "m32", base=str(base))
    merge(adapter, tmp_path / "m16", base=str(base), dtype="bf16")
    with safe_open(str(tmp_path / "m32" / "model.safetensors"), "pt") as f32, \
            safe_open(str(tmp_path / "m16" / "model.safetensors"), "pt") as f16:
        for k in f32.keys():  # noqa: SIM118
            assert f16.get_tensor(k).dtype == torch.bfloat16
            assert torch.equal(f16.get_tensor(k), f32.get_tensor(k).to(torch.bfloat16)), k
    assert json.loads((tmp_path / "m16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "m16" / "tokenizer_config.json").read_text()) == {"from": "run"}
    assert (tmp_path / "m16" / "generation_config.json").is_file()


# --------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written
# --------------------------------------------------------------------------------------------------


def run_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["merge", *args])
    return result.exit_code, result.output


def assert_nothing_written(parent: Path, before: set[str]) -> None:
    assert {p.name for p in parent.iterdir()} == before


def test_no_adapter(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    before = {p.name for p in tmp_path.iterdir()}
    code, out = run_cli(str(tmp_path / "run"), "--out", str(tmp_path / "merged"))
    assert code == 2
    assert out.strip() == f"error: {tmp_path / 'run'} has no adapter (adapter_config.json + adapter_model.safetensors); " \
        "give the output.dir of a lora/qlora run or a PEFT adapter directory"
    assert_nothing_written(tmp_path, before)


def test_base_not_found(tmp_path: Path) -> None:
    _, adapter, _ = make_run(tmp_path, "llama", ["q_proj"])
    (adapter / "recipe.yaml").write_text("model:\n  path: models/gone\n  init: pretrained\nmethod: lora\n")
    before = {p.name for p in tmp_path.iterdir()}
    code, out = run_cli(str(adapter), "--out", str(tmp_path / "merged"))
    assert code == 2
    assert "cannot find the base model of" in out and "model.path `models/gone`" in out and "--base DIR" in out
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out
    assert_nothing_written(tmp_path, before)


def test_random_init_without_saved_base(tmp_path: Path) -> None:
    _, adapter, _ = make_run(tmp_path, "llama", ["q_proj"])
    (adapter / "recipe.yaml").write_text("model:\n  path: tiny-llama\n  init: random\nmethod: lora\n")
    code, out = run_cli(str(adapter), "--out", str(tmp_path / "merged"))
    assert code == 2 and "was trained from a random init and its base weights" in out
    assert not (tmp_path / "merged").exists()


def test_shape_mismatch(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    _, adapter, _ = make_run(tmp_path, "llama", ["q_proj", "v_proj"])
    other = tmp_path / "other-base"
    cfg = LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(other)
    before = {p.name for p in tmp_path.iterdir()}
    code, out = run_cli(str(adapter), "--out", str(tmp_path / "merged"), "--base", str(other))
    assert code == 2
    assert f"the adapter's update of `model.layers.0.self_attn.q_proj` is 64x64 but the base weight " \
        f"model.layers.0.self_attn.q_proj.weight in {other} is 96x96" in out
    assert_nothing_written(tmp_path, before)


def test_existing_out_needs_force(tmp_path: Path) -> None:
    """--force replaces an empty directory or an earlier merge, never a directory finetune did not write."""
    base, adapter, _ = make_run(tmp_path, "llama", ["q_proj"])
    out_dir = tmp_path / "merged"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("mine")
    before = {p.name for p in tmp_path.iterdir()}
    code, out = run_cli(str(adapter), "--out", str(out_dir), "--base", str(base))
    assert code == 2
    assert out.strip() == f"error: --out {out_dir} already exists; pass --force to replace it"
    assert_nothing_written(tmp_path, before)
    assert (out_dir / "keep.txt").read_text() == "mine"
    code, out = run_cli(str(adapter), "--out", str(out_dir), "--base", str(base), "--force")
    assert code == 2
    assert out.strip() == (
        f"error: --out {out_dir} is not empty and was not written by finetune merge (no finetune_merge.json); "
        "--force only replaces an earlier merge: remove it yourself or choose another directory"
    )
    assert (out_dir / "keep.txt").read_text() == "mine"
    (out_dir / "keep.txt").unlink()
    # an empty directory is replaced
    code, out = run_cli(str(adapter), "--out", str(out_dir), "--base", str(base), "--force")
    assert code == 0, out
    assert (out_dir / "finetune_merge.json").is_file() and (out_dir / "model.safetensors").is_file()
    # and so is an earlier merge
    code, out = run_cli(str(adapter), "--out", str(out_dir), "--base", str(base), "--force")
    assert code == 0, out
    assert "merged 2 adapted modules" in out
    assert (out_dir / "model.safetensors").is_file()
    assert_nothing_written(tmp_path, before)  # no temporary directories left beside --out


@pytest.mark.parametrize("where", ["parent-of-run", "run", "inside-run", "parent-of-base", "inside-base"])
def test_out_overlapping_an_input_is_refused_even_with_force(tmp_path: Path, where: str) -> None:
    """`merge runs/x --out runs --force` once renamed runs/ away and removed it, the run with it."""
    base, adapter, _ = make_run(tmp_path / "work", "llama", ["q_proj"])
    (tmp_path / "models").mkdir()
    base = base.rename(tmp_path / "models" / base.name)  # apart from the adapter, so each check shows alone
    out_dir = {
        "parent-of-run": adapter.parent,
        "run": adapter,
        "inside-run": adapter / "merged",
        "parent-of-base": base.parent,
        "inside-base": base / "merged",
    }[where]
    what = "the adapter directory" if "run" in where else "the base model"
    inp = adapter if "run" in where else base
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, out = run_cli(str(adapter), "--out", str(out_dir), "--base", str(base), "--force")
    assert code == 2, out
    relation = {"parent": "contains", "run": "is", "inside": "lies inside"}[where.split("-")[0]]
    assert out.strip() == (
        f"error: --out {out_dir} {relation} {what} {inp}, an input of the merge; choose a directory outside it"
    )
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == files


@pytest.mark.parametrize(("arch", "targets"), [("llama", LLAMA_ALL), ("gpt2", GPT2_ALL)], ids=["llama", "gpt2-conv1d"])
def test_dora_and_rslora_fold_exactly(tmp_path: Path, arch: str, targets: list[str]) -> None:
    """DoRA (trained magnitude x the LoRA-updated direction, per output row) with rsLoRA scaling folds into the
    base as peft computes it: logits within 1e-4, and through the CLI too."""
    base, adapter, peft_model = make_run(tmp_path, arch, targets, bias=True, use_dora=True, use_rslora=True)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:  # away from its initial ||W||, so a missing rescale shows
                p.mul_(1 + 0.3 * torch.rand_like(p))
        expected = peft_model(INPUT_IDS).logits
        with peft_model.disable_adapter():
            base_logits = peft_model.get_base_model()(INPUT_IDS).logits
    assert (expected - base_logits).abs().max() > 1e-2
    peft_model.save_pretrained(adapter)
    assert json.loads((adapter / "adapter_config.json").read_text())["use_dora"] is True
    res = CliRunner().invoke(app, ["merge", str(adapter), "--out", str(tmp_path / "merged"), "--base", str(base)])
    assert res.exit_code == 0, res.output
    assert (logits_of(tmp_path / "merged") - expected).abs().max().item() < 1e-4


def test_prefix_and_bottleneck_adapters_are_refused_with_the_way_to_load_them(tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    prefix.mkdir()
    (prefix / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    (prefix / "adapter_model.safetensors").write_bytes(b"")
    res = CliRunner().invoke(app, ["merge", str(prefix), "--out", str(tmp_path / "m1")])
    assert res.exit_code == 2
    assert "prefix-tuning adapter" in res.output and "not a change of any weight" in res.output
    assert "PeftModel.from_pretrained" in res.output
    bottleneck = tmp_path / "bottleneck"
    bottleneck.mkdir()
    (bottleneck / "bottleneck_config.json").write_text("{}")
    res = CliRunner().invoke(app, ["merge", str(bottleneck), "--out", str(tmp_path / "m2")])
    assert res.exit_code == 2
    assert "not a linear update of a weight" in res.output and "load_bottlenecks" in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize(("init", "rslora"), [("pissa", False), ("olora", True)])
def test_pissa_and_olora_adapters_are_saved_for_the_original_base(tmp_path: Path, init: str, rslora: bool) -> None:
    """pissa/olora train on base weights with the initial adapter subtracted; the run saves a plain LoRA of
    rank 2r on the original base, so PeftModel on the untouched base and `finetune merge` both give the trained
    model's logits within 1e-4."""
    from peft import PeftModel

    from finetune.model.adapters import LORA_INIT_ATTR
    from finetune.model.methods import inject
    from finetune.spec import AdapterSpec
    from finetune.train.checkpoint.save import _save_plain_lora

    base = tmp_path / "base"
    tiny_model("llama", bias=True).save_pretrained(base)
    spec = AdapterSpec(kind="lora", r=4, alpha=8.0, target_modules=tuple(LLAMA_ALL), init=init, use_rslora=rslora)
    model = inject(tiny_model("llama", bias=True), spec)
    assert getattr(model, LORA_INIT_ATTR)  # the initial adapter, kept for the conversion
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # "training": A and B move away from their decomposed start
                p.add_(torch.randn_like(p) * 0.1)
        expected = model.eval()(INPUT_IDS).logits
        with model.disable_adapter():  # the rewritten base alone is not the original model
            residual = model(INPUT_IDS).logits
    assert (residual - logits_of(base)).abs().max() > 1e-3
    adapter = tmp_path / "adapter"
    _save_plain_lora(model, adapter, {n: p.detach() for n, p in model.named_parameters() if p.requires_grad})
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["init_lora_weights"]) == (8, True)
    assert model.peft_config["default"].r == 4  # the live model's config is left as it was
    from transformers import AutoModelForCausalLM

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    with torch.no_grad():
        assert (reloaded(INPUT_IDS).logits - expected).abs().max().item() < 1e-4
    res = CliRunner().invoke(app, ["merge", str(adapter), "--out", str(tmp_path / "merged"), "--base", str(base)])
    assert res.exit_code == 0, res.output
    assert (logits_of(tmp_path / "merged") - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize(("arch", "init"), [("llama", "pissa"), ("llama", "olora"), ("gpt2", "pissa")])
def test_decompose_is_peft_s_pissa_and_olora_bit_for_bit(arch: str, init: str) -> None:
    """The sharded load decomposes one gathered weight at a time with our function: it gives exactly the A, B
    and residual base weight that peft's own init gives when it injects into the whole model (GPT-2's
    transposed Conv1D weights included)."""
    from finetune.model.adapters import LORA_INIT_ATTR, decompose, subtract_initial
    from finetune.model.methods import inject
    from finetune.spec import AdapterSpec

    targets = GPT2_ALL if arch == "gpt2" else LLAMA_ALL
    original = dict(tiny_model(arch, bias=True).named_parameters())
    spec = AdapterSpec(kind="lora", r=4, alpha=8.0, target_modules=tuple(targets), init=init)
    model = inject(tiny_model(arch, bias=True), spec)
    checked = 0
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A") or not hasattr(module, "get_base_layer"):
            continue
        key = name.removeprefix("base_model.model.") + ".weight"
        transposed = init == "pissa" and module.fan_in_fan_out
        weight, scaling = original[key].detach(), module.scaling["default"]
        a0, b0 = decompose(weight, init, 4, scaling, fan_in_fan_out=transposed)
        residual = subtract_initial(weight, a0, b0, scaling, transposed=transposed)
        assert torch.equal(a0, module.lora_A["default"].weight)
        assert torch.equal(b0, module.lora_B["default"].weight)
        assert torch.equal(residual, module.get_base_layer().weight)
        assert torch.equal(a0, getattr(model, LORA_INIT_ATTR)[f"{name}.lora_A.default.weight"])
        checked += 1
    assert checked == (4 if arch == "gpt2" else 7) * 2  # every adapted linear of both layers (c_proj twice)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_a_decomposing_run_starts_from_the_original_model(tmp_path: Path, init: str) -> None:
    """The trainer's whole-model build keeps peft's decomposition (the seeded default init of other LoRA runs
    must not overwrite A and B): the residual base plus the initial adapter is the original model."""
    from finetune.model.adapters import LORA_INIT_ATTR
    from finetune.recipe.schema import load_recipe
    from finetune.spec import execution_spec
    from finetune.train.model.build import build_model
    from tests.support import tiny_recipe, write_recipe

    lora = {"r": 4, "alpha": 8, "init": init, "target_modules": ["q_proj", "v_proj"]}
    recipe = tiny_recipe(tmp_path / "out", method="lora", lora=lora)
    loaded = load_recipe(write_recipe(tmp_path / "r.yaml", recipe))
    spec = execution_spec("lora", "single", "fp32", checkpointing=False, lora=loaded.recipe.lora)
    model = build_model(loaded, spec, torch.device("cpu"), base_dir=tmp_path / "base").eval()
    initial = getattr(model, LORA_INIT_ATTR)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained.keys() == initial.keys() and all(torch.equal(p, initial[n]) for n, p in trained.items())
    with torch.no_grad():
        start = model(INPUT_IDS).logits
        with model.disable_adapter():
            residual = model(INPUT_IDS).logits
    original = logits_of(tmp_path / "base")
    assert (start - original).abs().max().item() < 1e-4
    assert (residual - original).abs().max().item() > 1e-2  # the base alone was changed
