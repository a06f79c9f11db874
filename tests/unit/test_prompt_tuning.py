"""Prompt tuning (method: prompt): the planner counts and traces the virtual tokens the trainer injects, the loss
gives their positions no target, greedy generation puts them where training does, a text init copies the base's
own embeddings, and a run saves a PEFT adapter that PeftModel.from_pretrained loads and merge refuses."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from finetune.cli import app
from finetune.model.methods import PromptTuning, inject
from finetune.objectives.loss import (
    IGNORE_INDEX,
    before_virtual_tokens,
    causal_lm_loss,
    shifted_labels,
    target_rows,
)
from finetune.plan.flowchart import plan_for_run
from finetune.recipe.schema import recipe_from_dict
from finetune.spec import AdapterSpec
from finetune.train.model.build import build_model, check_model_storage, stored_bytes_by_dtype
from tests.support import RECIPES, TINY_MODEL, tiny_recipe, write_recipe

TINY = json.loads((TINY_MODEL / "config.json").read_text())
HIDDEN = TINY["hidden_size"]


def _loaded(tmp_path: Path, **prompt: object):
    return recipe_from_dict({
        "model": {"path": str(TINY_MODEL), "init": "random"},
        "method": "prompt",
        "prompt": prompt,
        "data": {"train": str(RECIPES / "data/reverse/train.jsonl"), "max_seq_len": 32, "packing": False},
        "train": {"global_batch_size": 4, "micro_batch_size": 2},
        "precision": "fp32",
        "distributed": {"strategy": "single"},
        "output": {"dir": str(tmp_path / "run")},
    })


def _tiny_prompted(tokens: int, scale: float = 0.05) -> torch.nn.Module:
    """The tiny Llama (random weights) with ``tokens`` virtual tokens of norm a real embedding's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = inject(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL)),
                   AdapterSpec(kind="prompt", num_virtual_tokens=tokens))
    with torch.no_grad():
        model.prompt_encoder["default"].embedding.weight.mul_(scale)
    return model


def test_the_plan_counts_the_virtual_tokens_the_trainer_builds(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path, num_virtual_tokens=12)
    plan = plan_for_run(loaded, nproc=1, nnodes=1, device="cpu")
    assert plan.execution.adapter.kind == "prompt" and plan.execution.adapter.num_virtual_tokens == 12
    model = build_model(loaded, plan.execution, torch.device("cpu"))
    trained = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {"prompt_encoder.default.embedding.weight": 12 * HIDDEN}
    assert plan.model["trainable"] == 12 * HIDDEN
    assert stored_bytes_by_dtype(model) == plan.model["param_bytes_by_dtype"]
    check_model_storage(model, plan.execution, plan.model["param_bytes_by_dtype"])
    assert plan.chosen.method == "prompt" and plan.walk[1].startswith("Prompt tuning under one process needs")


def test_virtual_positions_have_no_target_and_the_head_rows_follow() -> None:
    shifted = torch.tensor([[5, 6, IGNORE_INDEX], [7, IGNORE_INDEX, IGNORE_INDEX]])
    rows = (shifted != IGNORE_INDEX).reshape(-1).nonzero().squeeze(1)  # [0, 1, 3]
    padded, moved = before_virtual_tokens(shifted, rows, 2)
    assert padded.tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 5, 6, IGNORE_INDEX],
                               [IGNORE_INDEX, IGNORE_INDEX, 7, IGNORE_INDEX, IGNORE_INDEX]]
    assert moved is not None and moved.tolist() == (padded != IGNORE_INDEX).reshape(-1).nonzero().squeeze(1).tolist()
    assert before_virtual_tokens(shifted, None, 2)[1] is None


def test_the_loss_is_the_real_tokens_cross_entropy() -> None:
    """The fused head's summed loss (with the trainer's target rows, and without) equals peft's own forward's
    cross-entropy over the real tokens' logits; the virtual tokens' positions count nothing."""
    model = _tiny_prompted(5).train()
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX  # a prompt without targets
    batch = {"input_ids": ids, "labels": labels}
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        assert logits.shape[1] == 5 + 9  # peft puts the virtual tokens first
        want = torch.nn.functional.cross_entropy(
            logits[:, 5:].reshape(-1, logits.shape[-1]).float(), shifted_labels(batch).reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="sum",
        )
        plain, n = causal_lm_loss(model, batch)
        rows = target_rows(batch)
        assert rows is not None
        known, _ = causal_lm_loss(model, {**batch, "target_rows": rows})
    assert int(n) == 2 * 6  # labels 3..8 of each row
    torch.testing.assert_close(plain, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(known, want, rtol=1e-5, atol=1e-5)


def test_generation_sees_the_positions_training_sees() -> None:
    """Every greedy step of a left-padded batch (KV cache) gives the logits of peft's training forward over the
    unpadded row (virtual tokens at 0..P-1, the row after them); without the override peft drops the positions
    and prepends the virtual tokens at every cached step."""
    from finetune.model.generation import greedy_tokens, left_padded

    model = _tiny_prompted(4).eval()
    steps: list[torch.Tensor] = []
    model.register_forward_hook(lambda _m, _a, out: steps.append(out.logits[:, -1].clone()))
    prompts = [torch.randint(3, 200, (10,)).tolist(), torch.randint(3, 200, (6,)).tolist()]
    ids, mask = left_padded(prompts, 0)
    out = greedy_tokens(model, ids, mask, 4, contextlib.nullcontext).tolist()
    generated = torch.stack(steps, dim=1)  # (B, steps, V)
    assert "forward" not in vars(model)  # the override is gone
    for i, (prompt, row) in enumerate(zip(prompts, out, strict=True)):
        seq = torch.tensor([prompt + row])
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, 4:]
            with model.disable_adapter():
                plain = model(input_ids=seq).logits[0]
        trained = logits[len(prompt) - 1 : -1]
        torch.testing.assert_close(generated[i], trained, atol=1e-4, rtol=0)
        assert (plain[len(prompt) - 1 : -1] - trained).abs().max() > 0.05  # the virtual tokens do steer


@pytest.mark.parametrize("text", ["Reverse", "Reverse the letters of the word, then write them out."])
def test_init_text_starts_from_the_bases_own_embeddings(tmp_path: Path, text: str) -> None:
    from finetune.model.adapters import init_prompt_from_text, prefix_text_ids
    from finetune.train.model.build import load_tokenizer

    tokens = 8
    loaded = _loaded(tmp_path, num_virtual_tokens=tokens, init="text", init_text=text)
    plan = plan_for_run(loaded, nproc=1, nnodes=1, device="cpu")
    assert plan.execution.adapter.prompt_init_text == text
    model = build_model(loaded, plan.execution, torch.device("cpu"))
    tok = load_tokenizer(loaded)
    own = tok(text, add_special_tokens=False)["input_ids"]
    ids = prefix_text_ids(text, tok, tokens, "prompt")
    assert len(own) != tokens and ids == [own[i % len(own)] for i in range(tokens)]
    weight = model.prompt_encoder["default"].embedding.weight
    drawn = weight.detach().clone()
    init_prompt_from_text(model, ids)
    table = model.get_base_model().get_input_embeddings().weight
    assert torch.equal(weight.detach(), table[torch.tensor(ids)].detach())
    assert not torch.equal(drawn, weight.detach()) and weight.requires_grad


BAD = {
    "tokens": ({"prompt": {"num_virtual_tokens": 0}},
               "prompt.num_virtual_tokens: Input should be greater than or equal to 1 (got 0)"),
    "text-without-text": ({"prompt": {"init": "text"}},
                          "prompt.init_text: is empty, but prompt.init: text starts the virtual tokens"),
    "packing": ({"data": {"packing": True}}, "data.packing: the virtual tokens go before each row"),
    "text-sharded": (
        {"prompt": {"init": "text", "init_text": "Reverse it"}, "distributed": {"strategy": "zero2", "nproc": 2}},
        "prompt.init: text reads init_text's rows of the base's input embeddings on each process, which "
        "distributed.strategy zero2 on 2 processes shards",
    ),
    "tp": ({"distributed": {"strategy": "fsdp", "nproc": 2, "tp": 2}},
           "distributed.tp: 2 with method prompt is not supported"),
    "pp": ({"distributed": {"strategy": "fsdp", "nproc": 2, "pp": 2}},
           "distributed.pp: 2 with method prompt is not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_prompt_settings_are_one_sentence_from_validate_and_run(tmp_path: Path, case: str) -> None:
    sections, message = BAD[case]
    recipe = tiny_recipe(tmp_path / "out", method="prompt", data={"packing": False})
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value}
    path = write_recipe(tmp_path / "bad.yaml", recipe)
    for command in (["validate", str(path)], ["run", str(path)]):
        res = CliRunner().invoke(app, command)
        assert res.exit_code == 2, res.output
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_merge_refuses_a_prompt_with_the_way_to_load_it(tmp_path: Path) -> None:
    adapter = tmp_path / "prompt"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "PROMPT_TUNING"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    res = CliRunner().invoke(app, ["merge", str(adapter), "--out", str(tmp_path / "merged")])
    assert res.exit_code == 2 and "Traceback" not in res.output
    line = " ".join(res.output.split())
    assert f"{adapter} holds a prompt-tuning adapter: {PromptTuning().merge_refusal()}" in line
    assert not (tmp_path / "merged").exists()


@pytest.fixture(scope="module")
def prompt_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Six steps of prompt tuning from a text init with a checkpoint at step 3 (evaluation at the end), then the
    same run resumed from that checkpoint: (run, resumed)."""
    from finetune.commands.run import LaunchOptions, launch

    root = tmp_path_factory.mktemp("prompt")

    def recipe(name: str) -> Path:
        out = root / name
        r = tiny_recipe(
            out, method="prompt", prompt={"num_virtual_tokens": 6, "init": "text", "init_text": "Reverse it."},
            data={"packing": False}, train={"max_steps": 6, "lr": 3e-2},
            eval={"every": 0, "max_samples": 8, "max_new_tokens": 6},
            output={"dir": str(out), "log_every": 1, "save_every": 3, "keep": 3},
        )
        return write_recipe(root / f"{name}.yaml", r)

    assert launch(str(recipe("run")), []) == 0
    ckpt = root / "run" / "checkpoints" / "step-3"
    assert launch(str(recipe("resumed")), [], LaunchOptions(resume=str(ckpt))) == 0
    return root / "run", root / "resumed"


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two trainings through launch()
def test_a_resumed_run_repeats_the_losses_and_the_prompt_to_the_bit(prompt_run: tuple[Path, Path]) -> None:
    from safetensors.torch import load_file

    from finetune.train.checkpoint import checkpointer as ck

    run, resumed = prompt_run
    losses = [(r["step"], r["loss"]) for r in _rows(run) if "loss" in r]
    assert [(r["step"], r["loss"]) for r in _rows(resumed) if "loss" in r] == losses[3:]
    assert losses[-1][1] < losses[0][1]
    ref, got = (ck.read_weights(d / "checkpoints" / "step-6") for d in prompt_run)
    assert ref.keys() == got.keys() and len(ref) == 1 and all(torch.equal(ref[k], got[k]) for k in ref)
    saved, again = (load_file(d / "adapter_model.safetensors") for d in prompt_run)
    assert list(saved) == ["prompt_embeddings"] and torch.equal(saved["prompt_embeddings"], again["prompt_embeddings"])


@pytest.mark.slow  # the run of the module fixture
def test_the_saved_prompt_loads_with_peft_and_generates_as_the_run_evaluated(prompt_run: tuple[Path, Path]) -> None:
    """PeftModel.from_pretrained on the saved base gives the run's greedy answers (its final exact match), and
    the virtual tokens it loads are the trained ones; `finetune merge` refuses the run with one sentence."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from finetune.model.generation import greedy_tokens, left_padded
    from finetune.recipe.schema import load_recipe
    from finetune.train.data import load_data
    from finetune.train.model.build import load_tokenizer

    run, _ = prompt_run
    config = json.loads((run / "adapter_config.json").read_text())
    assert (config["peft_type"], config["num_virtual_tokens"]) == ("PROMPT_TUNING", 6)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run / "base"), str(run)).eval()
    trained = load_file(run / "adapter_model.safetensors")["prompt_embeddings"]
    assert torch.equal(model.get_prompt(batch_size=1)[0], trained)
    loaded = load_recipe(str(run / "recipe.yaml"))
    tok = load_tokenizer(loaded)
    prompts = load_data(loaded, tok).eval_prompts[:8]
    ids, mask = left_padded([p.prompt_ids for p in prompts], tok.pad_token_id)
    out = greedy_tokens(model, ids, mask, 6, contextlib.nullcontext).tolist()
    texts = [tok.decode(r[: r.index(tok.eos_token_id)] if tok.eos_token_id in r else r, skip_special_tokens=True)
             for r in out]
    exact = sum(t.strip() == p.answer.strip() for t, p in zip(texts, prompts, strict=True)) / len(prompts)
    final = [r for r in _rows(run) if "eval_exact_match" in r][-1]
    assert exact == final["eval_exact_match"]
    res = CliRunner().invoke(app, ["merge", str(run), "--out", str(run.parent / "merged")])
    assert res.exit_code == 2 and "prompt-tuning adapter" in res.output and "Traceback" not in res.output


@pytest.mark.slow  # one training step through the real CLI
def test_the_plan_accuracy_row_of_prompt_tuning_is_within_5_percent(tmp_path: Path) -> None:
    """scripts/plan_accuracy.py's prompt tuning row (16 virtual tokens before each of 16 rows of 128 tokens,
    fp32): the planner's first-step prediction against the trainer's measured peak (MemTracker)."""
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "scripts"))
    try:
        import plan_accuracy
    finally:
        sys.path.pop(0)
    name, arch, change, nproc = next(c for c in plan_accuracy.CONFIGS if c[0] == "llama prompt fp32 mb16")
    r = plan_accuracy.run_one(name, arch, change, nproc, tmp_path)
    assert "predicted" in r, r
    assert r["chosen"]["method"] == "prompt" and abs(r["error"]) <= 0.05, r
