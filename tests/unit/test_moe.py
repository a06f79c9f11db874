"""Mixtures of experts as the planner and the trainer know them: the inventory of real MoE configs and of the tiny
ones, the load-balancing loss as the loss is normalised, the experts' load, the tensors kept in fp32, the attention
an architecture needs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, GptOssConfig, Qwen3MoeConfig

from finetune.model import llama4, router
from finetune.objectives.loss import causal_lm_loss
from finetune.plan.shapes import build_inventory
from finetune.recipe.schema import LoraConfig
from finetune.spec import execution_spec
from tests.support import ARCH_COMMON, ARCHITECTURES, MOE_ARCHITECTURES

# Published configs (the models' config.json), with their published parameter counts in billions.
PUBLISHED = {
    "qwen3-30b-a3b": (lambda: Qwen3MoeConfig(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        moe_intermediate_size=768, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936, tie_word_embeddings=False), 30.53, 3.3),
    "qwen3-235b-a22b": (lambda: Qwen3MoeConfig(
        hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        moe_intermediate_size=1536, intermediate_size=12288, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936, tie_word_embeddings=False), 235.09, 22.0),
    "gpt-oss-20b": (lambda: GptOssConfig(
        hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=32, num_experts_per_tok=4, intermediate_size=2880, vocab_size=201088), 20.91, None),
    "gpt-oss-120b": (lambda: GptOssConfig(
        hidden_size=2880, num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=128, num_experts_per_tok=4, intermediate_size=2880, vocab_size=201088), 116.83, None),
    # 61 layers, the first 3 dense, 256 routed experts and 1 shared in the others (671B without the MTP module)
    "deepseek-v3": (DeepseekV3Config, 671.0, 37.0),
}


def arch_config(arch: str, **changes):
    values = {**ARCH_COMMON, **ARCHITECTURES[arch], **changes}
    return AutoConfig.for_model(values.pop("model_type"), **values)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_inventory_of_published_mixtures_of_experts(name):
    """Parameter counts within 2% of the published figures, and what a token computes with within 2% of the
    published active count where the model card gives one comparably (Qwen3's A3B and A22B, DeepSeek-V3's
    37B); DeepSeek-V3's dense first layers counted as dense (one layer of each kind is built)."""
    make, total, active = PUBLISHED[name]
    inv = build_inventory(make(), name)
    assert inv.n_params / 1e9 == pytest.approx(total, rel=0.02)
    assert inv.moe is not None and inv.expert_params / inv.n_params > 0.9
    if active is not None:
        assert inv.active_params / 1e9 == pytest.approx(active, rel=0.03)
    if name == "deepseek-v3":
        assert inv.kinds == ((0, 3), (3, 58)) and inv.moe.layers == 58 and inv.moe.shared_experts == 1
        assert inv.trace_depth == 5  # three dense layers, then two of the kind the rest repeats


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_tiny_mixtures_of_experts_counted_as_built(arch):
    """Every tensor of the tiny MoE set counted as transformers builds it (DeepSeek-V3's dense layer 0 and MoE
    layer 1), the fused experts and the router known, LoRA's adapters on attention counted as peft injects
    them."""
    cfg = arch_config(arch)
    targets = ["q_b_proj", "kv_b_proj"] if arch == "deepseek_v3" else ["q_proj", "v_proj"]
    inv = build_inventory(cfg, arch, LoraConfig(r=4, alpha=8, target_modules=targets))
    model = AutoModelForCausalLM.from_config(cfg)
    llama4.adopt(model)  # Llama 4's experts behind the experts interface, as every run builds them
    assert inv.n_params == sum(p.numel() for p in model.parameters())
    experts = [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "num_experts")]
    assert inv.expert_params == sum(p.numel() for m in experts for p in m.parameters())
    assert {t.role for t in inv.base} >= {"experts", "router"}
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    adapted = get_peft_model(model, PeftLora(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
    assert inv.n_adapter == sum(p.numel() for p in adapted.parameters() if p.requires_grad)


def test_load_balancing_loss_is_added_per_target_token_as_transformers_adds_it():
    """With the router enabled the summed loss over the target tokens is transformers' own loss (the mean
    cross-entropy plus router_aux_loss_coef x aux_loss) times those tokens; without, the cross-entropy alone; the
    aux value recorded for the step's metrics is transformers'."""
    cfg = arch_config("qwen3_moe", router_aux_loss_coef=0.25)  # a coefficient large enough to matter
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).train()
    ids = torch.randint(3, 264, (2, 24), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    hf = model(input_ids=ids, labels=ids, output_router_logits=True)
    plain, targets = causal_lm_loss(model, batch)
    assert (plain / targets).item() == pytest.approx((hf.loss - 0.25 * hf.aux_loss).item(), rel=1e-5)
    state = router.enable(model, router.model_aux_coef(model))
    assert state is not None and state.coef == 0.25
    with_aux, targets = causal_lm_loss(model, batch)
    assert (with_aux / targets).item() == pytest.approx(hf.loss.item(), rel=1e-5)
    aux_sum, counts = state.take()
    assert float(aux_sum) == pytest.approx(hf.aux_loss.item() * int(targets), rel=1e-5)
    # every token's top-k slots in each of the 2 layers
    assert counts is not None and counts.sum().item() == 2 * 24 * 2 * cfg.num_experts_per_tok


def test_expert_load_counts_each_training_forward_once():
    """Activation checkpointing recomputes every layer's forward in the backward, and an evaluation runs the model
    again: neither is counted; the busiest expert's share over the mean is the figure logged."""
    cfg = arch_config("mixtral")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    state = router.enable(model, 0.0)
    assert state is not None and state.coef == 0.0 and state.layers == cfg.num_hidden_layers
    ids = torch.randint(3, 264, (2, 16), generator=torch.Generator().manual_seed(2))
    loss, _ = causal_lm_loss(model, {"input_ids": ids, "labels": ids})
    loss.backward()
    model.eval()
    with torch.no_grad():
        causal_lm_loss(model, {"input_ids": ids, "labels": ids})
    aux_sum, counts = state.take()
    assert aux_sum is None  # coefficient 0: nothing added, nothing recorded
    assert counts is not None and counts.shape == (cfg.num_hidden_layers, cfg.num_local_experts)
    assert counts.sum().item() == cfg.num_hidden_layers * 2 * 16 * cfg.num_experts_per_tok
    expected = max(float(row.max() / row.mean()) for row in counts)
    assert router.load_imbalance(counts) == pytest.approx(expected)
    assert router.load_imbalance(torch.ones(2, 4)) == 1.0


def test_routing_is_counted_through_lora_on_the_experts():
    """LoRA with all-linear adapts the fused experts (finetune.model.experts' layer around them): the block calls that
    layer, whose hook counts every token's top-k slots once."""
    from finetune.model.methods import inject
    from finetune.spec import adapter_spec

    cfg = arch_config("qwen3_moe")
    torch.manual_seed(0)
    lora = adapter_spec("lora", LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    model = inject(AutoModelForCausalLM.from_config(cfg), lora, num_layers=cfg.num_hidden_layers).train()
    assert any(".experts." in n for n, p in model.named_parameters() if p.requires_grad)
    state = router.enable(model, router.model_aux_coef(model))
    assert state is not None and state.layers == cfg.num_hidden_layers
    ids = torch.randint(3, 264, (2, 16), generator=torch.Generator().manual_seed(4))
    loss, _ = causal_lm_loss(model, {"input_ids": ids, "labels": ids})
    loss.backward()
    aux_sum, counts = state.take()
    assert aux_sum is not None and counts is not None
    assert counts.sum().item() == cfg.num_hidden_layers * 2 * 16 * cfg.num_experts_per_tok


def test_deepseek_router_stays_fp32_in_a_bf16_base_as_the_spec_says():
    """DeepSeek-V3 keeps its router weight and e_score_correction_bias in fp32 (transformers'
    _keep_in_fp32_modules_strict): the execution spec of a bf16 LoRA base names them, the inventory counts
    their fp32 bytes, and the trainer's storage check accepts the model transformers builds."""
    from finetune.train.model.build import check_model_storage
    from finetune.train.precision import keep_fp32

    cfg = arch_config("deepseek_v3")
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_b_proj", "kv_b_proj"])
    inv = build_inventory(cfg, "deepseek_v3", lora)
    spec = execution_spec("lora", "single", "bf16", checkpointing=False, lora=lora, keep_fp32=inv.keep_fp32)
    assert spec.frozen_dtype == "bf16" and set(spec.fp32_tensors) == {"gate.weight", "e_score_correction_bias"}
    assert spec.tensor_dtype("model.layers.1.mlp.gate.weight", False) == "fp32"
    assert spec.keeps_fp32("base_model.model.model.layers.1.mlp.gate.base_layer.weight")  # peft's wrapped router
    assert spec.tensor_dtype("model.layers.0.mlp.gate_proj.weight", True) == "bf16"
    by_dtype = inv.bytes_by_dtype(spec)
    router_values = cfg.n_routed_experts * cfg.hidden_size  # one MoE layer's gate.weight
    assert by_dtype["fp32"] == 4 * (router_values + inv.n_adapter)
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    model = keep_fp32(AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16), spec)
    model = get_peft_model(model, PeftLora(r=4, lora_alpha=8, target_modules=["q_b_proj", "kv_b_proj"],
                                           task_type="CAUSAL_LM"))
    for p in model.parameters():  # peft keeps adapters in the base's dtype unless told; the trainer's are fp32
        if p.requires_grad:
            p.data = p.data.float()
    check_model_storage(model, spec, by_dtype)
    # fp32 masters of full fine-tuning: nothing to keep apart
    assert execution_spec("full", "single", "bf16", checkpointing=False, keep_fp32=inv.keep_fp32).fp32_tensors == ()


def test_aux_loss_coefficient_resolution():
    """auto is the model's coefficient (0 for DeepSeek-V3, which has no such loss, and for dense models); a number
    asked of a model without the loss is one sentence naming the key."""
    from finetune.errors import UserError
    from finetune.plan.request import Request
    from finetune.plan.setting import aux_loss_coef

    def coef(arch: str, asked: float | str) -> float:
        cfg = arch_config(arch)
        return aux_loss_coef(Request(config=cfg, source=arch, aux_loss_coef=asked), build_inventory(cfg, arch))

    assert coef("qwen3_moe", "auto") == 0.001 and coef("qwen3_moe", 0.01) == 0.01 and coef("qwen3_moe", 0) == 0.0
    assert coef("deepseek_v3", "auto") == 0.0 and coef("qwen3", "auto") == 0.0
    with pytest.raises(UserError, match=r"train.router_aux_loss_coef: 0.01 .* deepseek_v3 is a mixture of experts "
                                        r"without a load-balancing loss"):
        coef("deepseek_v3", 0.01)
    with pytest.raises(UserError, match="qwen3 is not a mixture of experts"):
        coef("qwen3", 0.01)


def test_routed_activations_the_plan_states_are_what_the_trace_keeps(tmp_path, monkeypatch):
    """The plan's routed_activation_bytes_per_token against the trace itself: two traces that differ only in
    top-k (2 and 4) differ in one layer's kept activations by the tokens x 2 more routed slots."""
    import finetune.plan.activations as acts
    from finetune.plan.activations import TraceSpec, trace_windows

    arch = "qwen3_moe"
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(acts, "_CACHE", {})
    spec = TraceSpec.of(execution_spec("full", "single", "fp32", checkpointing=False), seq_len=64, packed=False,
                        attn_implementation="sdpa")
    kept = {k: trace_windows(arch_config(arch, num_experts_per_tok=k), spec, 2, 2).layer_acts for k in (2, 4)}
    moe = build_inventory(arch_config(arch, num_experts_per_tok=2), arch).moe
    assert moe is not None
    per_slot = moe.routed_bytes_per_token(4) / (moe.layers * moe.top_k)
    assert (kept[4] - kept[2]) / (2 * 64 * 2) == pytest.approx(per_slot, rel=0.01)


def test_the_trace_counts_routed_experts_with_bincount_as_transformers_5_17_does():
    """transformers before 5.24 counts each expert's routed tokens in the load-balancing loss with
    ``torch.bincount(selected_experts, minlength=num_experts)``, whose length fake tensors cannot know: under the
    planner's trace modes the counts have the length and dtype the real call gives (a weighted count, the weights'
    dtype); without a minlength torch's refusal stands."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, FakeTensorMode

    from finetune.plan.activations import grouped_mm_any_dtype

    selected = torch.topk(torch.randn(6, 8), 2, dim=-1).indices  # 6 tokens routed to 2 of 8 experts
    weights = torch.rand(12)
    real = (torch.bincount(selected.reshape(-1), minlength=8),
            torch.bincount(selected.reshape(-1), weights=weights, minlength=8))
    with FakeTensorMode() as fake_mode:
        fake_selected, fake_weights = fake_mode.from_tensor(selected), fake_mode.from_tensor(weights)
        with grouped_mm_any_dtype():
            fake = (torch.bincount(fake_selected.reshape(-1), minlength=8),
                    torch.bincount(fake_selected.reshape(-1), weights=fake_weights, minlength=8))
            with pytest.raises(DynamicOutputShapeException):
                torch.bincount(fake_selected.reshape(-1))
    for got, want in zip(fake, real, strict=True):
        assert isinstance(got, FakeTensor) and (got.shape, got.dtype) == (want.shape, want.dtype)


def test_the_grouped_product_traces_on_fake_tensors_without_reading_the_offsets():
    """LoRA on the experts multiplies per group (finetune.model.experts): in fp32 on fake tensors (the planner's
    trace), forward and backward run without reading the group offsets' values (transformers' fallback reads them in
    its backward before 5.24), keep the input and the weights for the backward, and give the real gradients'
    shapes; on real tensors the product is each group's matmul."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from finetune.model.experts import _grouped

    x, w = torch.randn(10, 8, requires_grad=True), torch.randn(3, 8, 4, requires_grad=True)
    offsets = torch.tensor([4, 4, 10], dtype=torch.int32)  # group 1 has no rows
    out = _grouped(x, w, offsets)
    torch.testing.assert_close(out, torch.cat([x[:4] @ w[0], x[4:] @ w[2]]))
    out.sum().backward()
    mode = FakeTensorMode()
    fx, fw = (mode.from_tensor(t.detach()).requires_grad_() for t in (x, w))
    fake_offsets = mode.from_tensor(offsets)
    saved: list[torch.Tensor] = []
    with mode:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fake = _grouped(fx, fw, fake_offsets)
        fake.sum().backward()
    assert isinstance(fake, FakeTensor) and fake.shape == out.shape
    assert (fx.grad.shape, fw.grad.shape) == (x.grad.shape, w.grad.shape)
    assert any(t is fx for t in saved) and any(t is fw for t in saved)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "llama4_text"])
def test_moe_model_flops_match_the_flop_counter(arch):
    """The planner's model FLOPs per token against torch's FlopCounterMode over one training step, run with the
    eager experts kernel (the counter has no formula for grouped_mm; eager's per-expert matmuls see exactly the
    routed tokens): top-k of the fused experts, DeepSeek-V3's dense first layer and its latent attention's widths,
    Llama 4's shared expert beside its top-1 routed one (the remaining gap: the routers' own matmuls and layer 0's
    key gradient, as for dense models)."""
    from torch.utils.flop_counter import FlopCounterMode

    from finetune.model.kernels import set_experts_kernel
    from finetune.plan.flops import config_flops_per_token

    cfg = arch_config(arch)
    torch.manual_seed(0)
    model = set_experts_kernel(AutoModelForCausalLM.from_config(cfg, attn_implementation="eager"), "eager")
    ids = torch.randint(3, 264, (2, 128), generator=torch.Generator().manual_seed(3))
    counter = FlopCounterMode(display=False)
    with counter:
        loss, _ = causal_lm_loss(model, {"input_ids": ids, "labels": ids})
        loss.backward()
    counted = counter.get_total_flops() / ids.numel()
    assert config_flops_per_token(cfg, seq_len=128).per_token == pytest.approx(counted, rel=0.012)
