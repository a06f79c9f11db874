"""What the tests share: the repository's paths, recipes for a few fast steps of the tiny model, small model
directories, the distributed parity runs' helpers, and data-file helpers. Fixtures live in conftest.py."""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent


RECIPES = ROOT / "recipes"


TINY_MODEL = RECIPES / "models" / "tiny-llama"


def tiny_recipe(out_dir: Path, **sections: dict) -> dict:
    """A recipe dict for a few fast steps of the tiny model (override sections by keyword)."""
    recipe = {
        "model": {"path": str(TINY_MODEL), "init": "random"},
        "method": "full",
        "data": {
            "train": str(RECIPES / "data/reverse/train.jsonl"),
            "eval": str(RECIPES / "data/reverse/eval.jsonl"),
            "max_seq_len": 48,
        },
        "train": {"max_steps": 4, "global_batch_size": 8, "micro_batch_size": 4, "lr": 1e-3, "seed": 0},
        "precision": "fp32",
        "distributed": {"strategy": "single"},
        "eval": {"max_samples": 8, "max_new_tokens": 4, "batch_size": 8},
        "output": {"dir": str(out_dir), "log_every": 1},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            recipe.setdefault(key, {}).update(value)
        else:
            recipe[key] = value
    return recipe


def write_recipe(path: Path, recipe: dict) -> Path:
    """Write a recipe dict as YAML and return its path."""
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def micro_model_dir(d: Path, **config: object) -> Path:
    """tiny-llama's tokenizer and config in ``d``, with the config keys in ``config`` changed (small test models)."""
    d.mkdir(parents=True, exist_ok=True)
    for f in TINY_MODEL.iterdir():
        if f.name != "config.json":
            shutil.copy(f, d / f.name)
    cfg = json.loads((TINY_MODEL / "config.json").read_text())
    cfg.update(config)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# Tiny models of current architectures, dense and mixtures of experts (transformers 5 stores every MoE here with
# fused 3-D expert weights): each a config small enough to trace and train in seconds, with tiny-llama's
# byte-level tokenizer (vocabulary 264). What every one shares, then what each architecture adds.
ARCH_COMMON: dict[str, object] = {
    "vocab_size": 264, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}
ARCHITECTURES: dict[str, dict[str, object]] = {
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "intermediate_size": 128},
    "gemma3_text": {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "intermediate_size": 128,
        "sliding_window": 16, "tie_word_embeddings": True,
    },
    "olmo2": {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "intermediate_size": 128},
    "smollm3": {"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "intermediate_size": 128},
    "granite": {"model_type": "granite", "architectures": ["GraniteForCausalLM"], "intermediate_size": 128},
    "qwen3_moe": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
    },
    "mixtral": {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "intermediate_size": 32,
        "num_local_experts": 4, "num_experts_per_tok": 2,
    },
    "gpt_oss": {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "intermediate_size": 32,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    # multi-head latent attention (as many key/value heads as query heads), a shared expert, a dense first layer
    "deepseek_v3": {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "intermediate_size": 128,
        "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 8, "num_key_value_heads": 4,
    },
    # Llama 4's text model: every token through a shared expert and its top-1 of 4 routed experts (scored by a
    # sigmoid), the experts in ``feed_forward``; transformers runs every expert on every token, finetune.model.llama4
    # puts them behind the experts interface
    "llama4_text": {
        "model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"], "intermediate_size": 32,
        "intermediate_size_mlp": 128, "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
    },
}
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "llama4_text")


def arch_model_dir(d: Path, arch: str, **config: object) -> Path:
    """A model directory in ``d`` for the tiny ``arch`` of :data:`ARCHITECTURES` (config keys in ``config``
    changed), with tiny-llama's tokenizer: ``model.init: random`` trains it from a seed."""
    d.mkdir(parents=True, exist_ok=True)
    for f in TINY_MODEL.iterdir():
        if f.name != "config.json":
            shutil.copy(f, d / f.name)
    cfg = {**ARCH_COMMON, **ARCHITECTURES[arch], **config, "torch_dtype": "float32"}
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


STEPS = 10


LOSS_RTOL = 1e-4


WEIGHT_ATOL = 1e-4


def parity_recipe(model_dir: Path, out: Path, method: str, strategy: str) -> dict:
    """fp32, global batch 8 in micro-batches of 2 (accumulation 4 on 1 process, 2 on 2), eval off (prompt
    tuning: 8 held-out prompts at the end, generated greedily). ``method`` pissa or olora: LoRA with that
    ``lora.init``."""
    init = method if method in ("pissa", "olora") else "default"
    prompt = method == "prompt"
    recipe = {
        "model": {"path": str(model_dir), "init": "random"},
        "method": "lora" if init != "default" else method,
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "init": init},
        "prefix": {"num_virtual_tokens": 4, "projection": True, "projection_hidden": 16},
        "adapter": {"size": 8, "embeddings": True},  # the embeddings' bottleneck sits in FSDP's root unit
        "prompt": {"num_virtual_tokens": 4},  # the prompt encoder too
        "data": {"train": str(RECIPES / "data/reverse/train.jsonl"), "max_seq_len": 48},
        "train": {"max_steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-2 if prompt else 3e-3,
                  "warmup_steps": 2, "max_grad_norm": 1.0, "seed": 0},
        "precision": "fp32",
        "distributed": {"strategy": strategy},
        # pissa/olora runs also checkpoint at step 5 (the fsdp pissa run's resume starts there)
        "output": {"dir": str(out), "log_every": 1, **({"save_every": 5} if init != "default" else {})},
    }
    if prompt:
        recipe["data"]["eval"] = str(RECIPES / "data/reverse/eval.jsonl")
        recipe["eval"] = {"every": 0, "at_start": False, "max_samples": 8, "max_new_tokens": 6, "batch_size": 4}
    return recipe


def clean_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env.update(extra)
    return env


def finetune_run(recipe: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`finetune run RECIPE ARGS` as a subprocess (the real CLI)."""
    return subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(recipe), *args],
        capture_output=True, text=True, timeout=600, env=env or clean_env(),
    )


def step_rows(out: Path) -> list[dict]:
    """metrics.jsonl rows of optimizer steps."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def max_rel(a: list[float], b: list[float]) -> float:
    """Largest relative difference of two equally long series."""
    assert len(a) == len(b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def max_weight_diff(a: Path, b: Path) -> float:
    """Largest absolute difference between two safetensors files with the same keys."""
    wa, wb = load_file(a), load_file(b)
    assert sorted(wa) == sorted(wb)
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


def release_before_destroy() -> None:
    """Free what still holds the process group (a DDP's reducer, once the test dropped its DDP) while the group is
    registered: called before ``dist.destroy_process_group()``. A reducer freed after it holds the gloo group's
    last reference and destroys the group holding the GIL, joining the group's worker threads, and a worker
    still freeing its last allreduce needs the GIL: the process hangs. Freed here, the reducer's reference is
    not the last, and destroy_process_group destroys the group without the GIL."""
    gc.collect()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(tmp_path: Path, tok, **data):
    """load_data on a recipe whose data section is ``data`` (cache in tmp_path)."""
    from finetune.recipe.schema import recipe_from_dict
    from finetune.train.data import load_data

    data.setdefault("cache_dir", str(tmp_path / "cache"))
    raw = {"model": {"path": str(TINY_MODEL)}, "data": data, "train": {"seed": 0}}
    return load_data(recipe_from_dict(raw, base_dir=tmp_path), tok)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Rev: abc"},
    {"role": "assistant", "content": "cba"},
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": "y"},
]
