"""Preference tuning without training: the preference format (labels, chat prompts, bad rows), the losses'
values, the capability table's refusals and the planner's DPO terms."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

from finetune.errors import UserError
from tests.support import TINY_MODEL, write_jsonl

X = -100
EOS = 2


def ids(text: str) -> list[int]:
    """Token ids of ASCII text under the tiny byte-level tokenizer."""
    return [{" ": 223, "\n": 201}.get(c, ord(c) - 30) for c in text]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_MODEL)


def _pairs(tmp_path, tok, rows, **data):
    from finetune.recipe.schema import recipe_from_dict
    from finetune.train.data.preference import load_preference_data

    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    raw = {"model": {"path": str(TINY_MODEL)}, "train": {"seed": 0, "objective": "dpo"},
           "data": {"train": str(path), "format": "preference", "max_seq_len": 64, "cache_dir": str(tmp_path / "c"), **data}}
    return load_preference_data(recipe_from_dict(raw, base_dir=tmp_path), tok)


def test_preference_rows_label_only_the_completions(tmp_path, tok) -> None:
    data = _pairs(tmp_path, tok, [{"prompt": "Rev: ab\n", "chosen": "ba", "rejected": "ab"}])
    (pair,) = data.train
    prompt = ids("Rev: ab\n")  # the tiny tokenizer adds no BOS
    assert pair.input_ids == [*prompt, *ids("ba"), EOS]
    assert pair.labels == [X] * len(prompt) + [*ids("ba"), EOS]
    assert pair.rejected_ids == [*prompt, *ids("ab"), EOS]
    assert pair.rejected_labels == [X] * len(prompt) + [*ids("ab"), EOS]


def test_chat_prompt_renders_with_the_template(tmp_path, tok) -> None:
    row = {"prompt": [{"role": "user", "content": "Rev: ab"}], "chosen": [{"role": "assistant", "content": "ba"}],
           "rejected": {"role": "assistant", "content": "ab"}}
    (pair,) = _pairs(tmp_path, tok, [row]).train
    text = tok.decode(pair.input_ids)
    assert text.startswith("User: Rev: ab\nAssistant: ba")
    scored = [t for t, y in zip(pair.input_ids, pair.labels, strict=True) if y != X]
    assert scored == [*ids("ba"), EOS]  # the assistant's content and its end-of-turn token only
    assert [t for t, y in zip(pair.rejected_ids, pair.rejected_labels, strict=True) if y != X] == [*ids("ab"), EOS]


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"prompt": "p", "chosen": "a"}, "field `rejected`: missing"),
        ({"prompt": "p", "chosen": "same", "rejected": "same"}, "field `rejected`: is the same text as chosen"),
        ({"chosen": "a", "rejected": "b"}, "field `prompt`: missing"),
        ({"prompt": "p", "chosen": 3, "rejected": "b"}, "field `chosen`: expected a string or an assistant message"),
    ],
)
def test_bad_preference_row_names_file_line_and_field(tmp_path, tok, row, says) -> None:
    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    with pytest.raises(UserError) as err:
        _pairs(tmp_path, tok, [good, row])
    assert f"pairs.jsonl:2: {says}" in str(err.value)


def test_pairs_all_too_long_say_which_key_to_raise(tmp_path, tok) -> None:
    long = {"prompt": "Reverse the letters of this word please:\n", "chosen": "ba", "rejected": "ab"}
    with pytest.raises(UserError) as err:
        _pairs(tmp_path, tok, [long, long], max_seq_len=8)
    assert "no usable preference pairs" in str(err.value)
    assert "all 2 were longer than data.max_seq_len=8" in str(err.value)


def test_losses_at_known_values() -> None:
    from finetune.objectives.preference import PreferenceSettings, pair_losses

    logps = torch.tensor([-2.0, -6.0])  # one pair: chosen -2, rejected -6
    counts = torch.tensor([2, 3])
    ref = torch.tensor([[-3.0, -5.0]])
    loss, f = pair_losses(PreferenceSettings("dpo", beta=0.5), logps, counts, ref)
    assert float(loss) == pytest.approx(-math.log(1 / (1 + math.exp(-0.5 * (1 - -1)))))
    assert float(f["rewards/chosen"]) == pytest.approx(0.5) and float(f["rewards/rejected"]) == pytest.approx(-0.5)
    assert float(f["rewards/accuracy"]) == 1.0 and float(f["rewards/margin"]) == pytest.approx(1.0)
    loss, _ = pair_losses(PreferenceSettings("dpo", beta=0.5, loss_type="ipo"), logps, counts, ref)
    assert float(loss) == pytest.approx((1 / 2 - -1 / 3 - 1) ** 2)
    loss, _ = pair_losses(PreferenceSettings("simpo", beta=2.0, gamma=0.5), logps, counts, None)
    assert float(loss) == pytest.approx(-math.log(1 / (1 + math.exp(-(2.0 * (-1 - -2) - 0.5)))))
    loss, f = pair_losses(PreferenceSettings("orpo", lam=0.1), logps, counts, None)
    odds = (-1 - math.log1p(-math.exp(-1))) - (-2 - math.log1p(-math.exp(-2)))
    assert float(loss) == pytest.approx(1.0 - 0.1 * math.log(1 / (1 + math.exp(-odds))))
    _, f = pair_losses(PreferenceSettings("dpo"), logps, counts, logps.view(1, 2))  # the policy is its reference
    assert float(f["rewards/accuracy"]) == 0.5  # a tie counts one half


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"train": {"objective": "dpo"}},
         "train.objective: dpo learns from chosen/rejected pairs but data.format is instruction"),
        ({"data": {"format": "preference"}}, "data.format: preference rows (prompt, chosen, rejected) need a "
         "preference objective but train.objective is sft"),
        ({"train": {"objective": "dpo"}, "data": {"format": "preference", "packing": True}},
         "data.packing: dpo scores each chosen completion against its own rejected one"),
        ({"train": {"objective": "dpo", "offload": "optimizer"}, "data": {"format": "preference"},
          "distributed": {"strategy": "zero2", "nproc": 2}},
         "dpo.reference: model keeps a frozen copy of the weights on the GPUs"),
    ],
)
def test_refused_preference_cells_one_sentence(tmp_path, changes, says) -> None:
    from finetune.recipe.capabilities import Cell, refusals
    from finetune.recipe.schema import recipe_from_dict
    from tests.support import tiny_recipe

    raw = tiny_recipe(tmp_path / "out")
    for k, v in changes.items():
        raw.setdefault(k, {}).update(v)
    found = refusals(Cell.of_recipe(recipe_from_dict(raw, base_dir=tmp_path).recipe))
    assert [str(f) for f in found if says in str(f)], [str(f) for f in found]


@pytest.mark.slow  # traces the model on fake tensors (seconds)
def test_plan_counts_pairs_and_the_reference_copy(tmp_path) -> None:
    """dpo's micro-batch of B pairs traces 2B rows; reference: model adds the frozen copy (fp32 here, every base
    weight), precomputed adds nothing."""
    from dataclasses import replace

    from finetune.plan.candidates import evaluate
    from finetune.plan.hardware import detect_hardware
    from finetune.plan.request import request_from_recipe
    from finetune.plan.setting import settle
    from finetune.plan.types import Config
    from finetune.recipe.schema import recipe_from_dict
    from tests.support import tiny_recipe

    def plan(objective: str, reference: str = "model", data_format: str = "instruction"):
        raw = tiny_recipe(tmp_path / "out", train={"objective": objective}, dpo={"reference": reference},
                          data={"format": data_format})
        req = replace(request_from_recipe(recipe_from_dict(raw, base_dir=tmp_path)), for_run=True)
        s = settle(req, detect_hardware(device="cpu", gpus=1, nodes=1, nproc=1))
        acts = s.profile(s.exec_spec("full", "single", False)).at(s.inv.num_layers, 4)["first"].grads_and_acts
        return evaluate(s, Config("full", "single", 4, False)).memory, acts, s.inv.storage(s.exec_spec("full", "single", False))

    sft, sft_acts, storage = plan("sft")
    model, _, _ = plan("dpo", "model", "preference")
    pre, pre_acts, _ = plan("dpo", "precomputed", "preference")
    assert model.params - sft.params == storage.param_bytes  # the frozen copy: every weight, fp32 like the policy
    assert pre.params == sft.params
    assert 1.9 < pre_acts / sft_acts < 2.6  # twice the rows, and their logits kept for the log-softmax


@pytest.mark.slow  # two fake-tensor traces (seconds)
def test_pairs_trace_keeps_per_layer_what_the_same_rows_of_sft_keep() -> None:
    """A micro-batch of B pairs runs 2B rows through the decoder without an attention mask, as the trainer sends
    them: each layer keeps what an SFT micro-batch of 2B rows keeps (the causal kernel, no (B, 1, T, T) mask)."""
    from transformers import AutoConfig

    from finetune.plan.activations import TraceSpec, trace_windows

    config = AutoConfig.from_pretrained(TINY_MODEL)

    def layer(objective: str, batch: int) -> int:
        spec = TraceSpec(method="full", checkpointing=False, seq_len=64, packed=False, objective=objective,
                         reference="model")
        return trace_windows(config, spec, 2, batch).layer_acts

    assert layer("dpo", 2) == layer("sft", 4)


@pytest.mark.slow  # one real DPO step with the memory probe, and its plan (a minute on 2 cores)
def test_dpo_plan_within_5_percent_of_the_measured_peak(tmp_path) -> None:
    """The planner's peak for LoRA dpo with the base as reference (micro-batch 8 pairs of 128-token rows) is
    within 5% of the peak the trainer's probe measures in the real step."""
    import sys

    from tests.support import ROOT

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import plan_accuracy
    finally:
        sys.path.pop(0)
    name = "llama lora fp32 mb8 dpo"
    (arch, change, nproc), = [(a, c, n) for cname, a, c, n in plan_accuracy.CONFIGS if cname == name]
    r = plan_accuracy.run_one(name, arch, change, nproc, tmp_path)
    assert "predicted" in r, r
    assert abs(r["error"]) <= 0.05, r


def _reference_dirs(root):
    """A reference with weights (a file named as safetensors suffices for the checks: they read no weights), and
    one broken copy per check: another vocabulary size, another token map, another architecture, no weights."""
    import json
    import shutil

    good = root / "ref"
    shutil.copytree(TINY_MODEL, good)
    (good / "model.safetensors").write_bytes(b"")
    dirs = {"good": good}
    for name, change in (("vocab", {"vocab_size": 300}), ("arch", {"model_type": "mistral"})):
        d = dirs[name] = root / name
        shutil.copytree(good, d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
    tok = dirs["tokenizer"] = root / "tokenizer"
    shutil.copytree(good, tok)
    data = json.loads((tok / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap their ids: the same size, another map
    (tok / "tokenizer.json").write_text(json.dumps(data))
    dirs["no-weights"] = TINY_MODEL
    dirs["missing"] = root / "nowhere"
    return dirs


@pytest.mark.parametrize(
    ("which", "method", "says"),
    [
        ("vocab", "full", "dpo.reference_model: {path} has a vocabulary of 300 tokens but model.path has 264; the "
         "reference must share the policy's tokenizer"),
        ("tokenizer", "full", "dpo.reference_model: the tokenizer files of {path} map tokens to other ids than "
         "model.path's; the reference must share the policy's tokenizer"),
        ("arch", "full", "dpo.reference_model: {path} is a `mistral` model but model.path is a `llama` model; the "
         "reference must be of the policy's architecture"),
        ("no-weights", "full", "dpo.reference_model: {path} holds no weights"),
        ("missing", "full", "dpo.reference_model: `{path}` is not a model directory (no config.json there)"),
        ("good", "lora", "dpo.reference_model: method: lora compares the policy with its own base (the adapters "
         "switched off), not with another model; remove dpo.reference_model, or use method: full"),
    ],
    ids=["vocab", "tokenizer", "architecture", "no-weights", "not-a-model", "adapter-method"],
)
def test_reference_model_mismatch_is_one_sentence_from_validate_and_run(tmp_path, which, method, says) -> None:
    """A dpo.reference_model that cannot be the policy's reference: `finetune validate` and `finetune run` both
    exit 2 with one sentence naming the key, and the run writes nothing."""
    from typer.testing import CliRunner

    from finetune.cli import app
    from tests.support import RECIPES, tiny_recipe, write_recipe

    ref = _reference_dirs(tmp_path)[which]
    out = tmp_path / "out"
    raw = tiny_recipe(out, method=method, train={"objective": "dpo"}, dpo={"reference_model": str(ref)},
                      data={"train": str(RECIPES / "data/reverse-preference/eval.jsonl"), "format": "preference"})
    raw["data"].pop("eval")
    recipe = write_recipe(tmp_path / "dpo.yaml", raw)
    want = " ".join(says.format(path=ref).split())
    runner = CliRunner()
    for command in ("validate", "run"):
        res = runner.invoke(app, [command, str(recipe)])
        assert res.exit_code == 2, (command, res.output)
        assert want in " ".join(res.output.split()), (command, res.output)
        assert "Traceback" not in res.output
        assert not out.exists()


def test_precomputed_cache_key_follows_the_rows_and_the_weights(tmp_path) -> None:
    """The cached reference log-probs are named by the pairs' rows and the reference's weights: the same inputs
    give the same file; another seed of a random init, rewritten weights, another reference_model, other rows or
    another precision another one."""
    import os
    import shutil

    from finetune.recipe.schema import recipe_from_dict
    from finetune.spec import execution_spec
    from finetune.train.data.preference import PreferenceExample
    from finetune.train.model.reference import ReferenceCache
    from tests.support import tiny_recipe

    pairs = [PreferenceExample([5, 6, 7], [X, 6, 7], rejected_ids=[5, 8], rejected_labels=[X, 8])]
    other_rows = [PreferenceExample([5, 6, 7], [X, 6, 7], rejected_ids=[5, 9], rejected_labels=[X, 9])]
    refs = _reference_dirs(tmp_path)
    twin = tmp_path / "twin"
    shutil.copytree(refs["good"], twin)

    def path(rows=pairs, precision="fp32", **changes):
        raw = tiny_recipe(tmp_path / "out", train={"objective": "dpo", "seed": 0}, dpo={"reference": "precomputed"},
                          data={"format": "preference", "cache_dir": str(tmp_path / "cache")})
        for k, v in changes.items():
            raw[k].update(v)
        loaded = recipe_from_dict(raw, base_dir=tmp_path)
        spec = execution_spec(
            "full", "single", precision, checkpointing=False, objective="dpo", reference="precomputed"
        )
        return ReferenceCache.of(loaded, spec, rows).path

    start = path()
    assert start == path() and start.parent == tmp_path / "cache"
    assert path(train={"seed": 1}) != start  # the random init drawn with another seed
    assert path(rows=other_rows) != start
    assert path(precision="bf16") != start
    pretrained = path(model={"path": str(refs["good"]), "init": "pretrained"})
    assert pretrained == path(model={"path": str(refs["good"]), "init": "pretrained"}) != start
    weights = refs["good"] / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # weights rewritten
    assert path(model={"path": str(refs["good"]), "init": "pretrained"}) != pretrained
    assert path(dpo={"reference_model": str(refs["good"])}) != path(dpo={"reference_model": str(twin)})


@pytest.mark.slow  # builds two inventories on the meta device (seconds)
def test_plan_counts_the_reference_model_from_its_own_config(tmp_path) -> None:
    """dpo.reference_model's frozen copy is counted from its config: a 2-layer reference beside the 4-layer policy
    adds the 2-layer model's parameters (fp32), not the policy's."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.plan.hardware import detect_hardware
    from finetune.plan.memory import reference_bytes
    from finetune.plan.request import request_from_recipe
    from finetune.plan.setting import settle
    from finetune.recipe.schema import recipe_from_dict
    from tests.support import micro_model_dir, tiny_recipe

    ref = micro_model_dir(tmp_path / "ref", num_hidden_layers=2)
    (ref / "model.safetensors").write_bytes(b"")
    raw = tiny_recipe(tmp_path / "out", train={"objective": "dpo"}, data={"format": "preference"},
                      dpo={"reference_model": str(ref)})
    req = request_from_recipe(recipe_from_dict(raw, base_dir=tmp_path))
    s = settle(req, detect_hardware(device="cpu", gpus=1, nodes=1, nproc=1))
    spec = s.exec_spec("full", "single", False)
    with torch.device("meta"):
        two = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ref))
        four = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL))
    assert json.loads((ref / "config.json").read_text())["num_hidden_layers"] == 2
    assert reference_bytes(s.inv, spec) == 4 * sum(p.numel() for p in two.parameters())
    assert reference_bytes(s.inv, spec) < 4 * sum(p.numel() for p in four.parameters())
