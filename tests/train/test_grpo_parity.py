"""grpo's loss and gradients against TRL's GRPOTrainer on the same model, fixed completions and advantages.

Both sides start from the same weights and score the same completions: TRL through its own loss method
(``GRPOTrainer._compute_loss`` on its input dict: prompt and completion ids and masks, advantages, the old
policy's and the reference's per-token log-probabilities), ours through :class:`finetune.objectives.grpo.GrpoObjective` on
our rows (prompt + completion, right-padded, labels on the completion), divided by the count the trainer
divides by (:func:`finetune.objectives.grpo.count_of`). The old log-probabilities are perturbed from the policy's, so the
ratio is clipped on some tokens, and the KL term is on.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support import TINY_MODEL

trl = pytest.importorskip("trl", reason="TRL is the reference implementation (pip install -e .[test])")

PROMPT = "Reverse the letters.\nabc\nAnswer: "
COMPLETIONS = ["cba", "cab", "abcabc", "c"]  # one group of 4, of unequal lengths (the masks differ)
ADVANTAGES = [1.2, -0.4, -1.0, 0.2]
MAX_COMPLETION = 8


TEMPERATURE, BETA, EPS, EPS_HIGH = 0.7, 0.05, 0.2, 0.28


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """The model, and one TRL trainer on a copy of it (its loss type is set per test: TRL reads the attribute)."""
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL), dtype=torch.float32)
    d = tmp_path_factory.mktemp("model")
    model.save_pretrained(d)  # TRL builds its reference from a path when beta is not 0
    tok.save_pretrained(d)
    args = GRPOConfig(
        output_dir=str(d / "trl"), report_to=[], use_cpu=True, per_device_train_batch_size=len(COMPLETIONS),
        num_generations=len(COMPLETIONS), max_completion_length=MAX_COMPLETION, bf16=False, fp16=False,
        loss_type="dapo", beta=BETA, temperature=TEMPERATURE, epsilon=EPS, epsilon_high=EPS_HIGH,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
        train_dataset=Dataset.from_list([{"prompt": PROMPT}] * len(COMPLETIONS)), processing_class=tok,
    )
    trainer.current_gradient_accumulation_steps = 1
    return tok, model, trainer


def _tensors(tok):
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    completions = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in COMPLETIONS]
    width = max(len(c) for c in completions)
    ids = torch.full((len(completions), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(completions):
        ids[i, : len(c)] = torch.tensor(c)
        mask[i, : len(c)] = 1
    return torch.tensor([prompt] * len(completions)), ids, mask


def _our_batch(prompt_ids, completion_ids, completion_mask):
    rows = torch.cat([prompt_ids, completion_ids], dim=1)
    labels = rows.clone()
    labels[:, : prompt_ids.shape[1]] = -100
    labels[:, prompt_ids.shape[1] :][completion_mask == 0] = -100
    return {"input_ids": rows, "labels": labels}


def _aligned(values, prompt_len, width):
    """(rows, Lc) completion values at the shifted label positions of (rows, width) rows."""
    out = torch.zeros((values.shape[0], width), dtype=values.dtype)
    out[:, prompt_len - 1 : prompt_len - 1 + values.shape[1]] = values
    return out


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_grpo_loss_and_gradients_match_trl(loss_type: str, setting) -> None:
    from finetune.objectives.grpo import GrpoObjective, GrpoSettings, count_of, token_logps

    tok, base, trainer = setting
    temperature, beta, eps, eps_high = TEMPERATURE, BETA, EPS, EPS_HIGH
    ours = copy.deepcopy(base).train()
    trainer.loss_type = loss_type
    trainer.model.zero_grad(set_to_none=True)
    theirs = trainer.model.train()

    prompt_ids, completion_ids, completion_mask = _tensors(tok)
    batch = _our_batch(prompt_ids, completion_ids, completion_mask)
    p, lc = prompt_ids.shape[1], completion_ids.shape[1]
    with torch.no_grad():
        now, _ = token_logps(ours, batch, temperature)
    now = now[:, p - 1 : p - 1 + lc]
    g = torch.Generator().manual_seed(1)
    old = now + 0.4 * torch.randn(now.shape, generator=g)  # ratios far from 1: some tokens clipped
    ref = now + 0.3 * torch.randn(now.shape, generator=g)
    adv = torch.tensor(ADVANTAGES)

    s = GrpoSettings(
        num_generations=len(COMPLETIONS), max_completion_length=MAX_COMPLETION, temperature=temperature, beta=beta,
        epsilon=eps, epsilon_high=eps_high, loss_type=loss_type,
    )
    objective = GrpoObjective(s)
    width = batch["input_ids"].shape[1]
    mb = {**batch, "advantages": adv, "old_logps": _aligned(old, p, width), "ref_logps": _aligned(ref, p, width)}
    summed, _ = objective(ours, mb)
    count = count_of(s, batch["labels"][:, 1:] != -100)
    ours_loss = summed / count
    figures = objective.take()
    assert float(figures["clip_ratio"]) > 0, "the perturbed old log-probs clip some tokens"

    trl_inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": adv, "old_per_token_logps": old[:, :lc],
        "ref_per_token_logps": ref[:, :lc], "num_items_in_batch": completion_mask.sum(),
    }
    trl_loss = trainer._compute_loss(theirs, trl_inputs)
    assert abs(float(ours_loss) - float(trl_loss)) <= 1e-5 * abs(float(trl_loss)) + 1e-7, (float(ours_loss), float(trl_loss))
    ours_loss.backward()
    trl_loss.backward()
    mine = dict(ours.named_parameters())
    for n, q in theirs.named_parameters():
        g_ours, g_trl = mine[n].grad, q.grad
        assert g_ours is not None and g_trl is not None, n
        # fp32 rounding differs (TRL's fused head): each gradient within 1e-4 of its norm
        assert float((g_ours - g_trl).norm()) <= 1e-4 * float(g_trl.norm()) + 1e-9, (n, float((g_ours - g_trl).norm()))
