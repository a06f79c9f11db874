"""LoRA and NF4 on fused expert weights (finetune/model/experts.py), on tiny models of every MoE architecture:
the forward of every experts implementation against transformers' own, which layers ``all-linear`` and named
targets adapt, the saved adapter in peft's layout, and NF4 experts against their dequantized weights."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from finetune.errors import UserError  # noqa: E402
from finetune.model import experts as X  # noqa: E402
from finetune.model import llama4  # noqa: E402
from finetune.model.methods import training_method  # noqa: E402
from finetune.spec import AdapterSpec, QuantSpec  # noqa: E402
from tests.support import MOE_ARCHITECTURES, arch_model_dir  # noqa: E402

KERNELS = ("eager", "grouped_mm", "batched_mm")
#: The module holding a decoder layer's mixture (Llama 4's ``feed_forward``, the others' ``mlp``).
BLOCK = {"llama4_text": "feed_forward"}


def _model(tmp: Path, arch: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(arch_model_dir(tmp / arch, arch))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    llama4.adopt(model)  # Llama 4's experts behind the experts interface, as every run builds them
    return model


def _routing(experts, tokens: int, top_k: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, experts.hidden_size if hasattr(experts, "hidden_size") else experts.hidden_dim, generator=g)
    # every expert but the last gets rows (an expert without tokens is skipped by every kernel)
    idx = torch.stack([torch.randperm(experts.num_experts - 1, generator=g)[:top_k] for _ in range(tokens)])
    return x, idx, torch.rand(tokens, top_k, generator=g)


def _factors(experts, r: int = 4, seed: int = 2) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in X.expert_weight_names(experts):
        n_exp, fan_in, fan_out = X.expert_shape(experts, name)
        a = (torch.randn(n_exp, r, fan_in, generator=g) * 0.1).requires_grad_()
        b = (torch.randn(n_exp, fan_out, r, generator=g) * 0.1).requires_grad_()
        out[name] = [X.ExpertLoRA(a, b, 2.0)]
    return out


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_every_kernel_computes_transformers_experts_with_the_update_inside(tmp_path, arch):
    """Without adapters each kernel gives transformers' own output; with LoRA, the output and the gradients
    (input, A) of the model whose weights are W + s·B·A, which the adapter never builds."""
    model = _model(tmp_path, arch)
    experts = next(iter(X.fused_experts(model).values()))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.2)
    x, idx, w = _routing(experts, 12, model.config.num_experts_per_tok)
    factors = _factors(experts)
    names = X.expert_weight_names(experts)
    for kernel in KERNELS:
        experts.config._experts_implementation = kernel
        torch.testing.assert_close(X.experts_forward(experts, x, idx, w), experts(x, idx, w), atol=1e-5, rtol=1e-5)
        xo = x.clone().requires_grad_()
        out = X.experts_forward(experts, xo, idx, w, factors)
        grad = torch.randn_like(out)
        out.backward(grad)
        got_a = {n: factors[n][0].a.grad.clone() for n in names}
        for n in names:
            factors[n][0].a.grad = factors[n][0].b.grad = None
        # the reference: the same experts computing with merged weights, differentiated through the merge
        saved = {n: getattr(experts, n) for n in names}
        for n in names:
            delattr(experts, n)
            f = factors[n][0]
            setattr(experts, n, saved[n].detach() + X.expert_delta(f.a, f.b, f.scaling, experts.is_transposed))
        xr = x.clone().requires_grad_()
        ref = experts(xr, idx, w)
        ref.backward(grad)
        for n in names:
            delattr(experts, n)
            experts.register_parameter(n, saved[n])
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(xo.grad, xr.grad, atol=1e-5, rtol=1e-5)
        for n in names:
            torch.testing.assert_close(got_a[n], factors[n][0].a.grad, atol=1e-4, rtol=1e-4)
            factors[n][0].a.grad = factors[n][0].b.grad = None


def _adapted(model, targets):
    spec = AdapterSpec(kind="lora", r=4, alpha=8.0, target_modules=targets)
    peft_model = training_method("lora", spec).inject(model)
    return peft_model, [n for n, p in peft_model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_all_linear_adapts_every_layers_experts_and_never_the_router(tmp_path, arch):
    model = _model(tmp_path, arch)
    block = BLOCK.get(arch, "mlp")
    n_layers = model.config.num_hidden_layers
    moe_layers = {n.split(".layers.")[1].split(".")[0] for n in X.fused_experts(model)}
    weights = X.expert_weight_names(next(iter(X.fused_experts(model).values())))
    _, names = _adapted(model, "all-linear")
    for layer in moe_layers:
        for w in weights:
            assert any(f"layers.{layer}.{block}.experts.lora_A.default.{w}" in n for n in names)
            assert any(f"layers.{layer}.{block}.experts.lora_B.default.{w}" in n for n in names)
    assert not [n for n in names if f".{block}.gate." in n or f".{block}.router." in n]
    assert all(any(f"layers.{i}.self_attn." in n for n in names) for i in range(n_layers))


def test_named_targets_adapt_what_they_name(tmp_path):
    """``experts``: the expert weights only; a leaf name: that weight in the experts and the linear layers of
    that name (DeepSeek's shared expert); ``gate``: the router, through peft's target_parameters."""
    model = _model(tmp_path, "deepseek_v3")
    _, names = _adapted(model, ["experts"])
    assert names and all(".mlp.experts.lora_" in n for n in names)
    _, names = _adapted(_model(tmp_path, "deepseek_v3"), ["down_proj"])
    assert {n.rsplit(".", 1)[-1] for n in names if ".mlp.experts." in n} == {"down_proj"}
    assert any("shared_experts.down_proj.lora_A" in n for n in names)
    assert any("layers.0.mlp.down_proj.lora_A" in n for n in names)  # the dense first layer's MLP
    assert not any("gate_up_proj" in n or "gate_proj" in n for n in names)
    _, names = _adapted(_model(tmp_path, "qwen3_moe"), ["gate"])
    assert names and all(".mlp.gate." in n for n in names)
    with pytest.raises(UserError, match=r"lora.target_modules: none of nothing_here names"):
        _adapted(_model(tmp_path, "qwen3_moe"), ["nothing_here"])


def test_targets_from_the_config_alone():
    from transformers import AutoConfig

    from tests.support import ARCH_COMMON, ARCHITECTURES

    moe = AutoConfig.for_model(**{**ARCH_COMMON, **ARCHITECTURES["qwen3_moe"]})
    dense = AutoConfig.for_model(**{**ARCH_COMMON, **ARCHITECTURES["qwen3"]})
    assert X.adapts_experts("all-linear", moe) and X.adapts_experts(["q_proj", "gate_up_proj"], moe)
    assert not X.adapts_experts(["q_proj", "v_proj"], moe) and not X.adapts_experts("all-linear", dense)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_saved_expert_adapter_loads_with_peft(tmp_path, arch):
    """The adapter in peft's target_parameters layout: PeftModel.from_pretrained computes what trained."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = _model(tmp_path, arch)
    base.save_pretrained(tmp_path / "base")
    loaded_base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    llama4.adopt(loaded_base)
    peft_model, _ = _adapted(loaded_base, "all-linear")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in peft_model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ids = torch.randint(3, 260, (2, 9), generator=g)
    peft_model.eval()
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
    state = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    rest, tensors, targets = X.peft_layout(state, peft_model)
    peft_model.save_pretrained(tmp_path / "adapter", state_dict=rest)
    X.add_to_peft_dir(tmp_path / "adapter", tensors, targets, X.experts_layer_names(peft_model))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    moe_layers = range(base.config.first_k_dense_replace if arch == "deepseek_v3" else 0, 2)  # DeepSeek: dense first
    assert config["target_parameters"] == sorted(
        f"model.layers.{i}.{BLOCK.get(arch, 'mlp')}.experts.{w}" for i in moe_layers for w in ("gate_up_proj", "down_proj")
    )
    # DeepSeek-V3 keeps its dense first layers' and its shared experts' MLPs as linear layers named gate_proj,
    # up_proj and down_proj. peft 0.21 reads any such target as a transformers 4 expert (its v4 -> v5 conversion
    # for the Qwen2-MoE family): it drops those adapters and doubles the fused gate_up_proj's rank, so the saved
    # tensors no longer fit. Loaded with that rewrite off (what finetune's loaders do), the same files compute
    # what trained.
    # Llama 4's experts module does not say in transformers that it stores its weights (in, out) (the experts
    # interface's is_transposed), so peft reads them as (out, in); put behind the interface (llama4.adopt, as
    # finetune's loaders build it), the base tells peft and the same files compute what trained.
    rewrite = X.peft_as_targeted() if arch == "deepseek_v3" else contextlib.nullcontext()
    base_again = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    llama4.adopt(base_again)
    with rewrite:
        loaded = PeftModel.from_pretrained(base_again, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if arch in ("deepseek_v3", "llama4_text"):
        with pytest.raises(RuntimeError, match=r"size mismatch for .*experts\.(base_layer\.)?lora_A"):
            PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32), tmp_path / "adapter"
            )


def test_nf4_experts_compute_with_their_dequantized_weights(tmp_path):
    """Each expert quantized on its own: the NF4 forward of every kernel equals transformers' forward on the
    dequantized weights; the codes take half a byte per weight; only routed experts are dequantized."""
    model = _model(tmp_path, "qwen3_moe")
    experts = next(iter(X.fused_experts(model).values()))
    x, idx, w = _routing(experts, 10, 2)
    quant = QuantSpec(4, "nf4", True, "fp32", "uint8")
    dequantized = {n: X.dequantized_expert_weight(getattr(experts, n).detach(), quant) for n in ("gate_up_proj", "down_proj")}
    reference = {}
    for kernel in KERNELS:
        experts.config._experts_implementation = kernel
        saved = {n: getattr(experts, n) for n in dequantized}
        for n, t in dequantized.items():
            setattr(experts, n, torch.nn.Parameter(t))
        reference[kernel] = experts(x, idx, w)
        for n in dequantized:
            setattr(experts, n, saved[n])
    X.quantize_experts(model, quant)
    codes = experts.gate_up_proj
    assert X.is_expert_codes(codes) and codes.dtype == torch.uint8
    assert codes.numel() == 8 * 64 * 64 // 2
    for kernel in KERNELS:
        experts.config._experts_implementation = kernel
        torch.testing.assert_close(X.experts_forward(experts, x, idx, w), reference[kernel], atol=1e-5, rtol=1e-5)
    routing = X._Routing("eager", 8, idx.reshape(-1), sizes=torch.bincount(idx.reshape(-1), minlength=8).tolist())
    assert routing.hit() == sorted(set(idx.reshape(-1).tolist())) and 7 not in routing.hit()


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"method": "lora", "lora": {"target_modules": "all-linear", "use_dora": True}},
         "lora.use_dora: DoRA is not available on a mixture's fused expert weights"),
        ({"method": "lora", "lora": {"target_modules": ["experts"], "init": "pissa"}},
         "lora.init: pissa decomposes linear weights, not a mixture's fused expert weights"),
        ({"method": "lora", "lora": {"target_modules": "all-linear"}, "distributed": {"strategy": "fsdp", "tp": 2}},
         "distributed.tp: 2 with LoRA on a mixture's fused expert weights is not supported"),
        ({"method": "qlora", "quantization": {"bits": 8}},
         "quantization.bits: 8 (LLM.int8) quantizes linear layers only"),
    ],
)
def test_validate_refuses_what_expert_weights_cannot_take(tmp_path, sections, message):
    """The capability rows about a mixture's experts, read from the model's config by validate."""
    from finetune.recipe.schema import check_files, load_recipe
    from tests.support import tiny_recipe, write_recipe

    model = arch_model_dir(tmp_path / "model", "qwen3_moe")
    recipe = tiny_recipe(tmp_path / "out", model={"path": str(model), "init": "random"}, **sections)
    problems = [str(p) for p in check_files(load_recipe(write_recipe(tmp_path / "r.yaml", recipe)))]
    assert any(message in p for p in problems), problems
    # the same settings with the experts left out are not refused by these rows
    recipe["lora"] = {**recipe.get("lora", {}), "target_modules": ["q_proj", "v_proj"]}
    if sections.get("method") == "qlora":
        return
    problems = [str(p) for p in check_files(load_recipe(write_recipe(tmp_path / "r2.yaml", recipe)))]
    assert not any(message in p for p in problems), problems


def test_grouped_kernel_traces_narrow_adapters_in_bf16_on_fake_tensors(tmp_path):
    """The planner traces bf16 LoRA of rank 4 (8-byte rows) through the grouped kernel on fake tensors: the
    backward's transposed products must not reach torch's grouped matmul, which wants 16-byte strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = _model(tmp_path, "qwen3_moe").to(torch.bfloat16)
    experts = next(iter(X.fused_experts(model).values()))
    experts.config._experts_implementation = "grouped_mm"
    x, idx, w = _routing(experts, 12, model.config.num_experts_per_tok)
    factors = {n: [X.ExpertLoRA(f[0].a.detach().bfloat16().requires_grad_(),
                                f[0].b.detach().bfloat16().requires_grad_(), 2.0)]
               for n, f in _factors(experts).items()}
    real = X.experts_forward(experts, x.bfloat16(), idx, w.bfloat16(), factors)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx = mode.from_tensor(x.bfloat16()).requires_grad_()
        out = X.experts_forward(experts, fx, mode.from_tensor(idx), mode.from_tensor(w.bfloat16()), factors)
        out.sum().backward()
        assert tuple(out.shape) == tuple(real.shape) and tuple(fx.grad.shape) == tuple(x.shape)


def test_llama4_behind_the_experts_interface_computes_transformers_llama4(tmp_path):
    """Llama 4's mixture put behind the experts interface (finetune.model.llama4) gives transformers' own logits
    and weight gradients with every experts kernel, though its experts see only each token's routed rows; the
    routing is then counted as for the other mixtures (top-1 of 4 experts in each of 2 layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.model import router

    config = AutoConfig.from_pretrained(arch_model_dir(tmp_path / "llama4", "llama4_text"))
    torch.manual_seed(0)
    native = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in native.named_parameters():
            if ".experts." in name:
                p.normal_(0, 0.2)  # transformers initialises the experts to zeros
    ids = torch.randint(3, 260, (2, 12), generator=torch.Generator().manual_seed(4))
    out = native(input_ids=ids, labels=ids)
    out.loss.backward()
    want = {n: p.grad.clone() for n, p in native.named_parameters() if ".experts." in n or ".router." in n}
    import copy

    adopted = copy.deepcopy(native)
    adopted.zero_grad()
    assert llama4.adopt(adopted) and not llama4.adopt(native.model.embed_tokens)
    assert len(X.fused_experts(adopted)) == 2 and not X.fused_experts(native)
    for kernel in KERNELS:
        adopted.config._experts_implementation = kernel
        got = adopted(input_ids=ids, labels=ids)
        torch.testing.assert_close(got.logits, out.logits, atol=1e-5, rtol=1e-5)
        got.loss.backward()
        for n, p in adopted.named_parameters():
            if n in want:
                torch.testing.assert_close(p.grad, want[n], atol=1e-5, rtol=1e-4)
        adopted.zero_grad()
    state = router.enable(adopted.train(), router.model_aux_coef(adopted))
    assert state is not None and state.coef == 0.0  # Llama 4 defines no load-balancing loss
    with router.training_forward(adopted) as extra:
        adopted(input_ids=ids, **extra)
    _, counts = state.take()
    assert counts is not None and counts.shape == (2, 4) and counts.sum().item() == 2 * ids.numel() * 1


def test_a_named_llama4_router_is_adapted_through_its_weight(tmp_path):
    """Llama 4's router is a linear layer with a forward of its own (scores and logits): named, it is adapted as a
    parameter (peft's target_parameters), so the block still routes through it, and its adapter moves the logits."""
    model = _model(tmp_path, "llama4_text")
    ids = torch.randint(3, 260, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    peft_model, names = _adapted(model, ["router"])
    assert names and all(".feed_forward.router." in n for n in names)
    with torch.no_grad():
        for p in peft_model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.5)
        after = peft_model(input_ids=ids).logits
    assert after.shape == before.shape and not torch.allclose(after, before)
