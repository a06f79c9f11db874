"""What a run left, loaded for inference: a full model, an adapter over its base, or any Hugging Face model dir.

    load_for_inference(path)  -> LoadedModel   # the run's output.dir, a PEFT/bottleneck adapter dir, a model dir
    load_base_of(loaded)      -> LoadedModel   # the model that run started from (``finetune eval --baseline``)

An adapter is put on the base its run trained against: LoRA, prefix and bottleneck adapters over the base
found as ``finetune merge`` finds it (``--base``, else the run's recipe.yaml, ``base/`` for a random init, else
the adapter's ``base_model_name_or_path``); a QLoRA adapter over that base quantized as the run quantized it
(``quantization``, the compute dtype of its plan), so what is measured is what the run's own evaluation
measured. A full fine-tune's or a merged model's directory loads as it is. Heavy imports happen inside the
functions.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from finetune.adapters import BOTTLENECK_CONFIG, load_bottlenecks
from finetune.errors import UserError
from finetune.locate import locate_model

ADAPTER_CONFIG = "adapter_config.json"
SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


@dataclass
class LoadedModel:
    """A model ready for generation and scoring, and what it is.

    ``kind``: ``model`` (a full model directory), or the method of the adapter on a base (``lora``, ``qlora``,
    ``prefix``, ``adapter``); ``base``: the directory the weights started from (an adapter's base, a full run's
    ``model.path``), None when unknown; ``recipe``: the run's saved recipe (None for a bare directory);
    ``autocast``: the dtype the run's evaluation computed in under autocast (None: the weights' own).
    """

    model: Any
    tokenizer: Any
    path: Path
    kind: str
    base: Path | None = None
    recipe: dict[str, Any] | None = None
    autocast: Any = None
    notes: list[str] = field(default_factory=list)

    @property
    def is_run(self) -> bool:
        """Whether the directory is a ``finetune run`` output (it holds the run's recipe.yaml)."""
        return self.recipe is not None

    def describe(self) -> str:
        """One line: what was loaded from where."""
        if self.kind == "model":
            return f"{self.path} (full model)"
        return f"{self.path} ({self.kind} adapter over {self.base})"


def _read_recipe(run: Path) -> dict[str, Any] | None:
    path = run / "recipe.yaml"
    if not path.is_file():
        return None
    data = yaml.safe_load(path.read_text())
    return data if isinstance(data, dict) else None


def _has_weights(d: Path) -> bool:
    return (d / "config.json").is_file() and any((d / w).is_file() for w in SAFE_WEIGHTS)


def _device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _resolve(value: str, key: str) -> Path:
    """A directory for ``value``: a path, else a built-in model or a Hub id in the local cache."""
    p = Path(value).expanduser()
    if p.is_dir():
        return p.resolve()
    location = locate_model(value, Path.cwd())
    if location.kind == "dir" and Path(location.path).is_dir():
        return Path(location.path)
    raise UserError(
        f"{key}: {value} is not a directory; give a run's output.dir, an adapter directory or a Hugging Face "
        "model directory"
    )


def _autocast_of(run: Path) -> Any:
    """The dtype a run's evaluation autocast to (its plan's execution spec), None without autocast."""
    import torch

    plan = run / "plan.json"
    if not plan.is_file():
        return None
    execution = json.loads(plan.read_text()).get("execution") or {}
    if not execution.get("autocast"):
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(execution.get("compute_dtype")))


def _tokenizer(*dirs: Path) -> Any:
    """The tokenizer of the first directory that has one, with a pad token (eos when it has none)."""
    from transformers import AutoTokenizer

    for d in dirs:
        if (d / "tokenizer_config.json").is_file() or (d / "tokenizer.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token
            return tok
    raise UserError(f"{dirs[0]} has no tokenizer, nor has {dirs[-1]}; save the tokenizer beside the model")


def _stop_at_eos(model: Any, tokenizer: Any) -> None:
    """Generation stops at the tokenizer's end-of-sequence token and pads with its pad token, as the run's
    own evaluation does."""
    config = getattr(model, "generation_config", None)
    if config is not None:
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id


def _plain(d: Path, trust_remote_code: bool = False) -> Any:
    """A Hugging Face model directory, in its saved dtype, on the device."""
    from transformers import AutoModelForCausalLM

    from finetune.kernels import use_experts_kernel

    model = AutoModelForCausalLM.from_pretrained(
        str(d), dtype="auto", local_files_only=True, trust_remote_code=trust_remote_code
    )
    return use_experts_kernel(model.to(_device()), _device())


def _quantized(base: Path, recipe: dict[str, Any], run: Path) -> Any:
    """``base`` quantized as the QLoRA run quantized it (4-bit NF4 or 8-bit, its compute dtype)."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.kernels import use_experts_kernel
    from finetune.merge import _compute_dtype_of_run
    from finetune.recipe import Recipe
    from finetune.train.quantize import bnb_config, disable_cpu_packed_inference

    compute = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[_compute_dtype_of_run(recipe, run)])
    model = AutoModelForCausalLM.from_pretrained(
        str(base), quantization_config=bnb_config(Recipe.model_validate(recipe), compute), dtype=compute,
        device_map={"": _device()}, local_files_only=True,
        trust_remote_code=bool((recipe.get("model") or {}).get("trust_remote_code", False)),
    )
    return disable_cpu_packed_inference(use_experts_kernel(model, _device(), compute))


def inspect_dir(value: str, key: str = "RUN_OR_MODEL") -> tuple[Path, dict[str, Any] | None]:
    """The directory ``value`` names and its run's recipe (None when it is not a run), without loading weights;
    one sentence naming ``key`` when it is not a run, an adapter or a model directory."""
    d = _resolve(value, key)
    if not ((d / ADAPTER_CONFIG).is_file() or (d / BOTTLENECK_CONFIG).is_file() or _has_weights(d)):
        what = "a model config without weights" if (d / "config.json").is_file() else "no model"
        raise UserError(
            f"{key}: {d} holds {what} (no adapter_config.json, no config.json with model.safetensors); give a "
            "run's output.dir, an adapter directory or a Hugging Face model directory"
        )
    return d, _read_recipe(d)


def run_tokenizer(d: Path) -> Any:
    """The tokenizer saved in ``d`` (a run saves it beside its model or adapter), else its base's."""
    if (d / "tokenizer_config.json").is_file() or (d / "tokenizer.json").is_file():
        return _tokenizer(d)
    from finetune.merge import find_base

    config_name = BOTTLENECK_CONFIG if (d / BOTTLENECK_CONFIG).is_file() else ADAPTER_CONFIG
    config = json.loads((d / config_name).read_text()) if (d / config_name).is_file() else {}
    with tempfile.TemporaryDirectory(prefix="finetune-eval-base-") as scratch:
        return _tokenizer(find_base(d, _read_recipe(d), config, None, Path(scratch)))


def load_for_inference(value: str, *, key: str = "RUN_OR_MODEL", base: str | None = None) -> LoadedModel:
    """Load what ``value`` names for inference, in eval mode: a run's output.dir (a full model or an adapter
    over its base), a PEFT or bottleneck adapter directory, or a Hugging Face model directory (a merged model,
    any local or cached model). ``base`` overrides an adapter's base. One sentence naming ``key`` when it is
    none of these."""
    from finetune.merge import find_base

    d, recipe = inspect_dir(value, key)
    trust = bool(((recipe or {}).get("model") or {}).get("trust_remote_code", False))
    if (d / ADAPTER_CONFIG).is_file() or (d / BOTTLENECK_CONFIG).is_file():
        bottleneck = (d / BOTTLENECK_CONFIG).is_file()
        config = json.loads((d / (BOTTLENECK_CONFIG if bottleneck else ADAPTER_CONFIG)).read_text())
        method = str((recipe or {}).get("method") or ("adapter" if bottleneck else "lora"))
        if not bottleneck and config.get("peft_type") == "PREFIX_TUNING":
            method = "prefix"
        with tempfile.TemporaryDirectory(prefix="finetune-eval-base-") as scratch:
            base_dir = find_base(d, recipe, config, base, Path(scratch))
            if method == "qlora" and recipe is not None:
                model = _quantized(base_dir, recipe, d)
            else:
                model = _plain(base_dir, trust)
            if bottleneck:
                model = load_bottlenecks(model, d)
            else:
                from peft import PeftModel

                from finetune.experts import peft_as_targeted

                with peft_as_targeted():  # the adapter's targets as saved (peft_as_targeted says why)
                    model = PeftModel.from_pretrained(model, str(d), is_trainable=False)
        kept_base: Path | None = base_dir if base_dir.parent != Path(scratch) else None
        tokenizer = _tokenizer(d, base_dir)
        loaded = LoadedModel(model, tokenizer, d, method, kept_base, recipe, _autocast_of(d))
    else:
        tokenizer = _tokenizer(d)
        model_path = (recipe or {}).get("model", {}).get("path") if recipe else None
        loaded = LoadedModel(
            _plain(d, trust), tokenizer, d, "model", Path(model_path) if model_path else None, recipe,
            _autocast_of(d),
        )
    loaded.model.eval()
    _stop_at_eos(loaded.model, loaded.tokenizer)
    return loaded


def load_base_of(loaded: LoadedModel) -> LoadedModel:
    """The model ``loaded`` started from: an adapter's base, a full run's ``model.path`` (rebuilt from its
    config and ``train.seed`` for ``model.init: random``). One sentence when it cannot be found."""
    recipe = loaded.recipe or {}
    model_cfg = recipe.get("model") or {}
    if loaded.kind == "model" and model_cfg.get("init") == "random":
        from finetune.kernels import use_experts_kernel
        from finetune.recipe import recipe_from_dict
        from finetune.train.quantize import build_random_base

        config_dir = _resolve(str(model_cfg.get("path", "")), "--baseline")
        model = build_random_base(recipe_from_dict(recipe, base_dir=loaded.path), str(config_dir)).to(_device())
        use_experts_kernel(model, _device())
        model.eval()
        _stop_at_eos(model, loaded.tokenizer)
        return LoadedModel(model, loaded.tokenizer, config_dir, "model", notes=[
            f"the random init of {config_dir} from train.seed {(recipe.get('train') or {}).get('seed', 0)}"
        ])
    if loaded.kind == "model" and loaded.base is None:
        raise UserError(
            f"--baseline: {loaded.path} is not a finetune run, so its base model is unknown; give --baseline MODEL"
        )
    if loaded.base is None:  # a random-init QLoRA run whose fp32 base was rebuilt in a temporary directory
        raise UserError(
            f"--baseline: the base of {loaded.path} was rebuilt from its seed and not kept; give --baseline MODEL"
        )
    base = load_for_inference(str(loaded.base), key="--baseline")
    if base.tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
        base.notes.append(f"the base's own tokenizer ({loaded.base}) differs from the run's")
    return base
