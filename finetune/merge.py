"""``finetune merge``: fold LoRA/QLoRA adapters into the base weights, one safetensors shard at a time.

For every adapted weight ``W`` the merged weight is ``W + s·B·A`` (transposed for GPT-2's ``Conv1D``,
whose weights are stored [in, out]), with ``s = alpha/r`` (``alpha/sqrt(r)`` under rsLoRA, per-module
``rank_pattern``/``alpha_pattern`` honoured). ``modules_to_save`` tensors replace the base tensors.
The fold is computed in fp32 and cast to the output dtype (the base's own dtype unless ``--dtype``).

Streaming: the base checkpoint is read one shard at a time (``safetensors.safe_open``) and each tensor
is written as soon as it is folded, so memory holds one mapped input shard, one tensor and the adapter
(a model is never materialised). Everything is written into a temporary directory beside ``--out`` and
renamed into place at the end: a bad input or a crash leaves nothing behind.

QLoRA: by default the adapters are folded into the original 16-bit base. The trained model saw the
NF4-dequantized weights instead; ``--into-dequantized`` folds into exactly those (quantized and
dequantized the way loading did), so the merged model computes what the trained one did.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.errors import UserError
from finetune.inference import base_directory
from finetune.model.methods import BottleneckAdapters, FullFineTuning, PrefixTuning, PromptTuning
from finetune.recipe.locate import check_remote_code, needs_remote_code, path_overlap, remote_code_refused
from finetune.recipe.schema import QuantizationConfig
from finetune.storage.rundir import (
    ADAPTER_CONFIG,
    MERGE_MARKER,
    RunDir,
    adapter_weights,
    find_base,
    has_weights,
    holds,
    read_run,
)
from finetune.storage.safetensors_stream import (
    SAFE_INDEX,
    ST_DTYPES,
    ShardWriter,
    StoredTensor,
    shard_map,
    stored_name,
)
from finetune.storage.swap import swap_in
from finetune.train.model.quantize import dequantized_weight, quantized_modules
from finetune.units import DTYPE_NAMES

if TYPE_CHECKING:
    import torch

#: Non-weight files of a model directory that the merged directory needs (config is rewritten).
MODEL_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
TOKENIZER_FILES = tuple(f for f in MODEL_FILES if f != "generation_config.json")
DTYPE_FLAGS = {k: v for k, v in DTYPE_NAMES.items() if k != "bf16-pure"}  # what --dtype accepts
_LORA_PART = re.compile(
    r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
    r"(?:\.(?P<leaf>weight|bias))?$"
)


@dataclass
class LoraDelta:
    """The low-rank update of one module: ``A`` [r, in], ``B`` [out, r], optional ``B`` bias."""

    module: str
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    b_bias: torch.Tensor | None = None
    embedding: bool = False
    scaling: float = 1.0
    magnitude: torch.Tensor | None = None  # DoRA: the trained norm of each output feature's weight row
    experts: int = 0  # a fused expert weight's adapter (peft's lora.ParamWrapper layout): its experts
    transposed: bool = False  # ... stored (experts x in x out), as gpt-oss stores its experts


@dataclass
class MergeResult:
    """What ``merge`` did, for the CLI's summary."""

    out: Path
    base: str
    merged_modules: int
    replaced_tensors: int
    shards: int
    bytes_written: int
    dtype: str
    untied: list[str] = field(default_factory=list)
    into_dequantized: bool = False
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)  # the names merge wrote into ``out``


# --------------------------------------------------------------------------------------------------
# Finding the adapter and the base
# --------------------------------------------------------------------------------------------------


def _read_adapter(run: Path) -> tuple[RunDir, dict[str, torch.Tensor]]:
    """The adapter directory ``run`` as :func:`finetune.storage.rundir.read_run` reads it, and its tensors; a clear
    error when it holds no adapter merge can fold (what it holds is the run reader's answer: ``holds``)."""
    import torch
    from safetensors.torch import load_file

    if not run.is_dir():
        raise UserError(f"{run} is not a directory; give a LoRA/QLoRA run directory or a PEFT adapter directory")
    cfg_path = run / ADAPTER_CONFIG
    kind, weights = holds(run), adapter_weights(run)
    if kind == "bottleneck":
        raise UserError(f"{run} holds bottleneck adapters: {BottleneckAdapters().merge_refusal()}")
    if kind != "peft" or weights is None:
        if has_weights(run):
            raise UserError(f"{run} holds a full model, not an adapter: {FullFineTuning().merge_refusal()}")
        raise UserError(
            f"{run} has no adapter ({ADAPTER_CONFIG} + adapter_model.safetensors); "
            "give the output.dir of a lora/qlora run or a PEFT adapter directory"
        )
    source = read_run(str(run), "RUN_OR_ADAPTER_DIR")
    config = source.adapter_config
    if source.peft_type == "PREFIX_TUNING":
        raise UserError(f"{run} holds a prefix-tuning adapter: {PrefixTuning().merge_refusal()}")
    if source.peft_type == "PROMPT_TUNING":
        raise UserError(f"{run} holds a prompt-tuning adapter: {PromptTuning().merge_refusal()}")
    if source.peft_type != "LORA":
        raise UserError(f"{cfg_path}: peft_type {source.peft_type} cannot be merged; only LoRA adapters can")
    for key, what in (("trainable_token_indices", "trainable tokens"),
                      ("layer_replication", "layer replication")):
        if config.get(key):
            raise UserError(f"{cfg_path}: {what} adapters are not supported by finetune merge")
    if weights.suffix == ".safetensors":
        tensors = load_file(str(weights))
    else:
        tensors = torch.load(weights, map_location="cpu", weights_only=True)
    return source, tensors


# --------------------------------------------------------------------------------------------------
# The adapter as deltas
# --------------------------------------------------------------------------------------------------


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """peft's rank_pattern/alpha_pattern lookup: a key matches the module name or a dotted suffix of it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _deltas(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[dict[str, LoraDelta], dict[str, torch.Tensor]]:
    """Group the adapter tensors into per-module deltas and whole-tensor replacements (modules_to_save)."""
    deltas: dict[str, LoraDelta] = {}
    replacements: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix("base_model.model.")
        m = _LORA_PART.match(name)
        if m is None:
            if ".base_layer." in name or name.endswith(".base_layer"):
                continue  # a copy of the frozen base (saved for embedding layers); nothing to fold
            replacements[name.replace(".modules_to_save.default.", ".").replace(".modules_to_save.", ".")] = tensor
            continue
        d = deltas.setdefault(m["module"], LoraDelta(m["module"]))
        part, leaf = m["part"], m["leaf"]
        if part.startswith("lora_embedding"):
            d.embedding = True
        if part == "lora_magnitude_vector":
            d.magnitude = tensor
        elif part.endswith("A"):
            d.a = tensor
        elif leaf == "bias":
            d.b_bias = tensor
        else:
            d.b = tensor
    for d in deltas.values():
        if d.a is None or d.b is None:
            raise UserError(f"the adapter is incomplete: {d.module} lacks its lora_A or lora_B weight")
        if d.magnitude is not None and d.embedding:
            raise UserError(f"the adapter has a DoRA embedding ({d.module}), which finetune merge does not fold")
        r = int(_pattern_value(config.get("rank_pattern") or {}, d.module, config.get("r", 8)))
        alpha = float(_pattern_value(config.get("alpha_pattern") or {}, d.module, config.get("lora_alpha", r)))
        d.scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return deltas, replacements


def _delta_shape(d: LoraDelta, conv1d: bool) -> list[int]:
    """Shape of :func:`_delta_weight` without computing it."""
    assert d.a is not None and d.b is not None, "an incomplete adapter is refused when it is read"
    out, inp = d.b.shape[0], d.a.shape[-1]
    if d.experts:
        return [d.experts, inp, out] if d.transposed else [d.experts, out, inp]
    return [inp, out] if (d.embedding or conv1d) else [out, inp]


def _delta_weight(d: LoraDelta, conv1d: bool) -> torch.Tensor:
    """``s·B·A`` in fp32, in the layout the base stores the weight in."""
    assert d.a is not None and d.b is not None, "an incomplete adapter is refused when it is read"
    if d.experts:  # every expert's s·B_e·A_e, in the layout the fused weight is stored in
        from finetune.model.experts import expert_delta, from_peft_layout

        a3, b3 = from_peft_layout(d.a, d.b, d.experts)
        return expert_delta(a3, b3, d.scaling, d.transposed)
    a, b = d.a.float(), d.b.float()
    if d.embedding:  # peft: A [r, num_embeddings], B [dim, r]; the embedding stores [num_embeddings, dim]
        return (b @ a).t() * d.scaling
    delta = (b @ a) * d.scaling
    return delta.t() if conv1d else delta


# --------------------------------------------------------------------------------------------------
# The merge
# --------------------------------------------------------------------------------------------------


def _meta_model(config_dir: Path, trust_remote_code: bool) -> Any:
    """The model of ``config_dir`` on the meta device: module types and tied parameters, no memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(config_dir, trust_remote_code=trust_remote_code, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        from finetune.model import llama4

        llama4.adopt(model)  # Llama 4's fused experts known as the run knew them
        return model
    except ValueError as err:
        if needs_remote_code(err):
            raise remote_code_refused(config_dir, "--trust-remote-code") from None
        raise


@dataclass
class Fold:
    """What happens to each checkpoint tensor: replaced, re-quantized, plus a LoRA update, cast."""

    weight_delta: dict[str, tuple[LoraDelta, bool]]  # key -> (delta, is Conv1D)
    bias_delta: dict[str, LoraDelta]
    replace: dict[str, torch.Tensor]  # modules_to_save
    quantized: dict[str, bool]  # keys quantized in training (--into-dequantized) -> is Conv1D
    out_dtype: torch.dtype | None  # None: keep each tensor's dtype
    qcfg: QuantizationConfig | None = None
    compute_dtype: torch.dtype | None = None
    quantized_experts: set[str] = field(default_factory=set)  # fused expert weights stored in NF4 per expert
    # a checkpoint of one tensor per expert: each tensor's update (rows of its expert's fused update), the
    # tensors a 4-bit run quantized with their siblings (gate and up together), and how to read a sibling
    piece_delta: dict[str, tuple[LoraDelta, Any]] = field(default_factory=dict)
    quantized_pieces: dict[str, Any] = field(default_factory=dict)
    read: Any = None

    def dtype_of(self, stored: torch.dtype) -> torch.dtype:
        """Output dtype of a tensor stored as ``stored``."""
        return self.out_dtype if (self.out_dtype is not None and stored.is_floating_point) else stored

    def __call__(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """The merged value of checkpoint tensor ``key`` (computed in fp32)."""
        target = self.dtype_of(tensor.dtype)
        if key in self.replace:
            return self.replace[key].to(target)
        if not tensor.is_floating_point():
            return tensor
        w = tensor.float()
        if key in self.quantized:
            assert self.qcfg is not None and self.compute_dtype is not None, "set with --into-dequantized"
            w = dequantized_weight(tensor, self.qcfg, self.compute_dtype, conv1d=self.quantized[key])
        elif key in self.quantized_experts:
            assert self.qcfg is not None and self.compute_dtype is not None, "set with --into-dequantized"
            w = _dequantized_experts(tensor, self.qcfg, self.compute_dtype)
        elif key in self.quantized_pieces:
            assert self.qcfg is not None and self.compute_dtype is not None, "set with --into-dequantized"
            import torch

            piece = self.quantized_pieces[key]
            whole = torch.cat([tensor if k == key else self.read(k) for k in piece.siblings])
            rows = tensor.shape[0]
            w = _dequantized_experts(whole[None], self.qcfg, self.compute_dtype)[0, piece.part * rows : (piece.part + 1) * rows]
        elif self.compute_dtype is not None:
            w = tensor.to(self.compute_dtype).float()  # loaded in the compute dtype, then upcast for training
        if key in self.weight_delta:
            d, conv1d = self.weight_delta[key]
            w = w + _delta_weight(d, conv1d)
            if d.magnitude is not None:  # DoRA: each output row rescaled to its trained magnitude
                import torch

                dim = 0 if conv1d else 1  # Conv1D stores [in, out]
                norm = torch.linalg.vector_norm(w, dim=dim, keepdim=True)
                w = w * (d.magnitude.float().reshape(norm.shape) / norm)
        if key in self.piece_delta:
            d, piece = self.piece_delta[key]
            rows = w.shape[0]
            w = w + _expert_rows(d, piece.expert)[piece.part * rows : (piece.part + 1) * rows]
        if key in self.bias_delta:
            d = self.bias_delta[key]
            assert d.b_bias is not None, "bias_delta holds the deltas that have a bias"
            w = w + d.b_bias.float() * d.scaling
        return w.to(target)


def _expert_weight_of(mod_name: str, modules: dict[str, Any], targets: list[str]) -> tuple[Any, str] | None:
    """(the experts module, the fused weight) a peft ``lora.ParamWrapper`` named ``mod_name`` adapts, or None
    for any other adapted module. ``targets``: the adapter's ``target_parameters``. peft nests one wrapper per
    adapted weight in registration order, the first innermost: ``experts.lora_A`` is the last adapted weight's,
    ``experts.base_layer.lora_A`` the one before."""
    from finetune.model.experts import expert_weight_names

    base = mod_name.split(".base_layer")[0]
    experts = modules.get(base)
    names = expert_weight_names(experts) if experts is not None else ()
    adapted = [w for w in names if any(f"{base}.{w}" == t or f"{base}.{w}".endswith("." + t) for t in targets)]
    if not adapted:
        return None
    depth = mod_name.count(".base_layer")
    if depth >= len(adapted):
        raise UserError(f"the adapter nests more wrappers at `{base}` than its target_parameters adapt there")
    return experts, adapted[len(adapted) - 1 - depth]


def _expert_rows(d: LoraDelta, expert: int) -> torch.Tensor:
    """``s·B_e·A_e`` of one expert (out x in, fp32) from a fused weight's adapter."""
    from finetune.model.experts import from_peft_layout

    assert d.a is not None and d.b is not None, "an incomplete adapter is refused when it is read"
    a3, b3 = from_peft_layout(d.a, d.b, d.experts)
    return (b3[expert].float() @ a3[expert].float()) * d.scaling


def _tensor_reader(base_dir: Path, layout: _Layout) -> Any:
    """A function reading one checkpoint tensor whole by its key (for an expert's sibling tensors)."""
    from safetensors import safe_open

    def read(key: str) -> torch.Tensor:
        stored = layout.source_of[key]
        with safe_open(str(base_dir / stored.file), framework="pt") as f:
            return f.get_tensor(stored.key)

    return read


def _dequantized_experts(tensor: torch.Tensor, qcfg: QuantizationConfig, compute_dtype: torch.dtype) -> torch.Tensor:
    """A fused expert weight as the 4-bit run computed with it: NF4 per expert, dequantized (fp32)."""
    from finetune.model.experts import dequantized_expert_weight
    from finetune.spec import QuantSpec
    from finetune.units import DTYPE_NAMES

    names = {v: k for k, v in DTYPE_NAMES.items() if k != "bf16-pure"}
    compute = names[str(compute_dtype).removeprefix("torch.")]
    quant = QuantSpec(4, qcfg.quant_type, qcfg.double_quant, compute, "uint8")
    return dequantized_expert_weight(tensor, quant)


def _check_out_apart(out: Path, inp: Path, what: str) -> None:
    """Refuse an ``--out`` that is, contains or lies inside an input: replacing it would delete the input."""
    relation = path_overlap(out, inp)
    if relation is not None:
        raise UserError(f"--out {out} {relation} {what} {inp}, an input of the merge; choose a directory outside it")


def _check_replaceable(out: Path) -> None:
    """``--force`` replaces only what merge itself wrote (its marker file) or an empty directory."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        raise UserError(
            f"--out {out} exists and is not a directory; remove it yourself or choose another path"
        )
    if any(out.iterdir()) and not (out / MERGE_MARKER).is_file():
        raise UserError(
            f"--out {out} is not empty and was not written by finetune merge (no {MERGE_MARKER}); "
            "--force only replaces an earlier merge: remove it yourself or choose another directory"
        )


def merge(
    run_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    dtype: str | None = None,
    base: str | None = None,
    force: bool = False,
    into_dequantized: bool = False,
    trust_remote_code: bool = False,
) -> MergeResult:
    """Fold the adapter of ``run_dir`` into its base and write a Hugging Face model directory at ``out``.

    ``dtype`` (bf16, fp16, fp32) converts every floating tensor; by default each keeps the base's dtype.
    ``base`` overrides where the base model is found. ``force`` replaces an existing ``out`` when it is empty
    or an earlier merge (it holds ``finetune_merge.json``); an ``out`` that is, contains or lies inside the
    adapter or the base directory is always refused.
    ``into_dequantized`` (QLoRA runs) folds into the NF4-dequantized weights the run trained against.
    ``trust_remote_code`` (the user's ``--trust-remote-code``, never the run directory's recipe) lets a base whose
    config names its own code run it. Raises :class:`UserError` on bad input before anything is written.
    """
    with tempfile.TemporaryDirectory(prefix="finetune-merge-") as scratch:
        return _merge(Path(run_dir), Path(out), dtype, base, force, into_dequantized, Path(scratch), trust_remote_code)


@dataclass
class FoldedModel:
    """An adapter folded into its base, one tensor at a time (for writers of other formats: ``finetune
    export``): the merged checkpoint's keys, shapes and dtypes, its config, and the base it came from."""

    base_dir: Path
    config: dict[str, Any]  # the merged model's config.json
    _layout: _Layout
    _fold: Fold
    _extra: dict[str, list[tuple[str, str]]]

    def specs(self) -> list[tuple[str, list[int], torch.dtype]]:
        """(key, shape, dtype) of every merged tensor, in the order :meth:`tensors` yields them."""
        import torch

        st_to_torch = {v: getattr(torch, k) for k, v in ST_DTYPES.items()}
        return [(k, self._layout.shapes[k], self._fold.dtype_of(st_to_torch[stored.dtype]))
                for shard in self._layout.shards for k, stored in _shard_items(self._layout, self._extra, shard)]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every merged tensor, folded as its shard is read (one input shard mapped at a time)."""
        from safetensors import safe_open

        for shard in self._layout.shards:
            with safe_open(str(self.base_dir / shard), framework="pt") as f:
                for key, stored in _shard_items(self._layout, self._extra, shard):
                    yield key, self._fold(key, f.get_tensor(stored.key))


@contextmanager
def folded(run_dir: str | os.PathLike[str], base: str | None = None,
           trust_remote_code: bool = False) -> Iterator[FoldedModel]:
    """The adapter of ``run_dir`` folded into its base as :func:`merge` folds it, read tensor by tensor
    without writing a merged directory. Raises :class:`UserError` on bad input as ``merge`` does."""
    with tempfile.TemporaryDirectory(prefix="finetune-fold-") as scratch:
        inputs = _read_inputs(Path(run_dir), None, None, base, False, Path(scratch), trust_remote_code)
        meta = _meta_model(inputs.base_dir, trust_remote_code)
        layout = _locate_keys(inputs.base_dir, meta)
        fold = _plan_fold(inputs, layout, meta, False, None, None, None)
        extra, untied = _untie(layout, fold)
        yield FoldedModel(inputs.base_dir, _merged_config(inputs.base_dir, None, bool(untied)), layout, fold, extra)


@dataclass
class _Inputs:
    """What a merge starts from, every input checked: the adapter, the run's recipe and the base."""

    run: Path
    recipe: dict[str, Any] | None
    base_dir: Path
    trust_remote_code: bool
    deltas: dict[str, LoraDelta]  # module name -> its low-rank update
    replacements: dict[str, torch.Tensor]  # modules_to_save: parameter name -> its trained value
    target_parameters: list[str] = field(default_factory=list)  # the adapter's (fused expert weights, routers)
    source: RunDir | None = None  # the adapter's directory as the run reader read it


@dataclass
class _Layout:
    """Where the base checkpoint keeps each tensor, and which tied parameters it stores once."""

    shards: dict[str, list[str]]  # shard file -> tensor names
    source_of: dict[str, StoredTensor]  # tensor name -> where it is stored
    shapes: dict[str, list[int]]  # also of the tied parameters the checkpoint leaves out
    aliases: dict[str, str]  # tied parameter missing from the checkpoint -> the key holding its value
    tied: list[list[str]]  # each tied group, as the keys the merged checkpoint would use
    prefix: str  # the model's base_model_prefix (older checkpoints omit it)

    def locate(self, name: str) -> str | None:
        """The checkpoint key of model parameter ``name`` (the parameter's own name for a tied one that the
        checkpoint leaves out); None when the base has no such parameter."""
        return stored_name(name, self.source_of, self.prefix) or (name if name in self.aliases else None)


def _merge(
    run: Path, out_path: Path, dtype: str | None, base: str | None, force: bool, into_dequantized: bool,
    scratch: Path, trust_remote_code: bool = False,
) -> MergeResult:
    """:func:`merge` with a scratch directory: read and check the inputs, locate every key the adapter
    changes in the base checkpoint, plan the fold, then write the merged directory and swap it in."""
    start = time.perf_counter()
    inputs = _read_inputs(run, out_path, dtype, base, force, scratch, trust_remote_code)
    qcfg, compute_dtype = _dequantization(inputs, into_dequantized)
    meta = _meta_model(inputs.base_dir, inputs.trust_remote_code)
    layout = _locate_keys(inputs.base_dir, meta)
    out_dtype = _torch_dtype(dtype)
    fold = _plan_fold(inputs, layout, meta, into_dequantized, out_dtype, qcfg, compute_dtype)
    extra, untied = _untie(layout, fold)
    total, files = _write_and_swap_in(inputs, layout, fold, extra, untied, dtype, into_dequantized, out_path)
    rebuilt = inputs.base_dir.is_relative_to(scratch)
    return MergeResult(
        out=out_path,
        base="its seeded random init (rebuilt)" if rebuilt else str(inputs.base_dir),
        merged_modules=len(inputs.deltas),
        replaced_tensors=len(inputs.replacements),
        shards=len(layout.shards),
        bytes_written=total,
        dtype=dtype or "as base",
        untied=sorted(set(untied)),
        into_dequantized=into_dequantized,
        seconds=time.perf_counter() - start,
        files=files,
    )


def _read_inputs(
    run: Path, out_path: Path | None, dtype: str | None, base: str | None, force: bool, scratch: Path,
    trust_remote_code: bool = False,
) -> _Inputs:
    """Check the flags and ``--out``, read the adapter and the run's recipe, find the base. A bad flag or
    input is refused here, before anything is written."""
    if dtype is not None and dtype not in DTYPE_FLAGS:
        raise UserError(f"--dtype {dtype} is not one of bf16, fp16, fp32")
    if out_path is not None:
        if out_path.exists() and not force:
            raise UserError(f"--out {out_path} already exists; pass --force to replace it")
        _check_out_apart(out_path, run, "the adapter directory")
    source, adapter = _read_adapter(run)
    # remote code runs on the user's word alone: a run directory (perhaps received) cannot turn it on
    base_dir = base_directory(source, find_base(source, base), scratch, trust_remote_code)
    check_remote_code(base_dir, trust_remote_code)
    if out_path is not None:
        _check_out_apart(out_path, base_dir, "the base model")
        _check_replaceable(out_path)
    deltas, replacements = _deltas(source.adapter_config, adapter)
    targets = list(source.adapter_config.get("target_parameters") or [])
    return _Inputs(run, source.recipe, base_dir, trust_remote_code, deltas, replacements, targets, source)


def _dequantization(
    inputs: _Inputs, into_dequantized: bool
) -> tuple[QuantizationConfig | None, torch.dtype | None]:
    """``--into-dequantized``: the run's quantization settings and the compute dtype it dequantized to, or
    a clear error for a run that did not train on a quantized base. (None, None) without the flag."""
    if not into_dequantized:
        return None, None
    import torch

    recipe, source = inputs.recipe, inputs.source
    assert source is not None, "set by _read_inputs"
    if not source.quantized_base:
        method = (recipe or {}).get("method")
        raise UserError(
            f"--into-dequantized needs a qlora run; {inputs.run} is "
            + (f"a {method} run" if method else "not a finetune run (no recipe.yaml)")
        )
    assert recipe is not None
    qcfg = QuantizationConfig.model_validate(recipe.get("quantization") or {})
    return qcfg, getattr(torch, DTYPE_FLAGS[source.compute_dtype])


def _torch_dtype(dtype: str | None) -> torch.dtype | None:
    """The torch dtype of a ``--dtype`` flag (None: each tensor keeps the base's dtype)."""
    if dtype is None:
        return None
    import torch

    return getattr(torch, DTYPE_FLAGS[dtype])


def _locate_keys(base_dir: Path, meta: Any) -> _Layout:
    """The base checkpoint's shards and the shape of each tensor, from the headers; and the model's tied
    parameters (e.g. lm_head <- embed_tokens), which a checkpoint stores once: a member missing from it is
    an alias of the stored one."""
    prefix = getattr(meta, "base_model_prefix", "")
    shards, source_of = shard_map(base_dir)
    shapes = {name: list(stored.shape) for name, stored in source_of.items()}
    groups: dict[int, list[str]] = {}
    for name, p in meta.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    aliases: dict[str, str] = {}
    tied: list[list[str]] = []
    for names in groups.values():
        if len(names) < 2:
            continue
        ck = {n: stored_name(n, source_of, prefix) for n in names}
        source = next((k for k in ck.values() if k), None)
        if source is None:
            continue
        for n, k in ck.items():
            if k is None:
                aliases[n] = source
                shapes[n] = shapes[source]
        tied.append([k or n for n, k in ck.items()])
    return _Layout(shards, source_of, shapes, aliases, tied, prefix)


def _plan_fold(
    inputs: _Inputs, layout: _Layout, meta: Any, into_dequantized: bool, out_dtype: torch.dtype | None,
    qcfg: QuantizationConfig | None, compute_dtype: torch.dtype | None,
) -> Fold:
    """What to do with each checkpoint key: add a LoRA update to a weight or a bias, replace a tensor
    (modules_to_save), re-quantize it (``--into-dequantized``). Every delta is checked against the base's
    shapes here, so an adapter of another model is refused before anything is written."""
    base_dir = inputs.base_dir
    modules = dict(meta.named_modules())
    shapes = layout.shapes
    from finetune.model.experts import checkpoint_pieces

    weight_delta: dict[str, tuple[LoraDelta, bool]] = {}
    bias_delta: dict[str, LoraDelta] = {}
    pieces = checkpoint_pieces(str(getattr(meta.config, "model_type", "")), layout.source_of)
    piece_delta: dict[str, tuple[LoraDelta, Any]] = {}
    for mod_name, d in inputs.deltas.items():
        param = _expert_weight_of(mod_name, modules, inputs.target_parameters)  # a fused expert weight's
        if param is not None:
            experts, weight = param
            d.experts, d.transposed = int(experts.num_experts), bool(experts.is_transposed)
            mod_name = mod_name.split(".base_layer")[0]
            key = layout.locate(f"{mod_name}.{weight}")
            expected = _delta_shape(d, False)
            found = [k for k, p in pieces.items() if p.fused == f"{mod_name}.{weight}"]
            if key is None and found:  # a checkpoint of one tensor per expert: each gets its rows of the update
                rows = expected[1] // pieces[found[0]].parts
                if len(found) != expected[0] * pieces[found[0]].parts or any(
                    shapes[k] != [rows, expected[2]] for k in found
                ):
                    raise UserError(
                        f"the adapter's update of `{mod_name}.{weight}` is {'x'.join(map(str, expected))} but the "
                        f"base model {base_dir} stores {len(found)} expert tensors of another shape: the adapter was "
                        "trained on another model; pass the right --base"
                    )
                for k in found:
                    piece_delta[k] = (d, pieces[k])
                continue
            if key is None or shapes[key] != expected:
                raise UserError(
                    f"the adapter's update of `{mod_name}.{weight}` is {'x'.join(map(str, expected))} but the base "
                    f"model {base_dir} has {'x'.join(map(str, shapes[key])) if key else 'no such weight'}: the "
                    "adapter was trained on another model; pass the right --base"
                )
            weight_delta[key] = (d, False)
            continue
        key = layout.locate(f"{mod_name}.weight")
        module = modules.get(mod_name)
        if key is None or module is None:
            raise UserError(
                f"the adapter adapts `{mod_name}`, which the base model {base_dir} does not have: "
                "the adapter was trained on another model; pass the right --base"
            )
        conv1d = type(module).__name__ == "Conv1D"
        expected = _delta_shape(d, conv1d)
        if shapes[key] != expected:
            raise UserError(
                f"the adapter's update of `{mod_name}` is {'x'.join(map(str, expected))} but the base weight "
                f"{key} in {base_dir} is {'x'.join(map(str, shapes[key]))}: the adapter was trained on "
                "another model; pass the right --base"
            )
        if d.magnitude is not None and d.magnitude.numel() != expected[1 if conv1d else 0]:
            raise UserError(
                f"the adapter's DoRA magnitude of `{mod_name}` has {d.magnitude.numel()} values but the base weight "
                f"{key} has {expected[1 if conv1d else 0]} output features: the adapter was trained on another model"
            )
        weight_delta[key] = (d, conv1d)
        if d.b_bias is not None:
            bkey = layout.locate(f"{mod_name}.bias")
            if bkey is None:
                raise UserError(f"the adapter has a lora_B bias for `{mod_name}` but the base has no bias there")
            bias_delta[bkey] = d
    replace: dict[str, torch.Tensor] = {}
    for name, tensor in inputs.replacements.items():
        key = layout.locate(name)
        if key is None or shapes[key] != list(tensor.shape):
            raise UserError(
                f"the adapter's saved module tensor `{name}` {list(tensor.shape)} has no match in the base "
                f"model {base_dir}: the adapter was trained on another model; pass the right --base"
            )
        replace[key] = tensor
    quantized: dict[str, bool] = {}
    quantized_experts: set[str] = set()
    quantized_pieces: dict[str, Any] = {}
    if into_dequantized:
        for mod_name, conv1d in quantized_modules(meta.config).items():
            key = layout.locate(f"{mod_name}.weight")
            if key is not None:
                quantized[key] = conv1d
        if qcfg is not None and qcfg.bits == 4:  # a 4-bit run's fused expert weights: NF4 per expert
            from finetune.model.experts import expert_weight_names, fused_experts

            for mod_name, experts in fused_experts(meta).items():
                for weight in expert_weight_names(experts):
                    key = layout.locate(f"{mod_name}.{weight}")
                    if key is not None:
                        quantized_experts.add(key)
            for key, piece in pieces.items():  # each expert's parts were quantized together, as one slice
                quantized_pieces[key] = piece
    return Fold(
        weight_delta, bias_delta, replace, quantized, out_dtype, qcfg, compute_dtype, quantized_experts,
        piece_delta, quantized_pieces, _tensor_reader(base_dir, layout),
    )


def _untie(layout: _Layout, fold: Fold) -> tuple[dict[str, list[tuple[str, str]]], list[str]]:
    """Tied parameters stop being equal when the adapter changes any of them: then every member is written
    (the ones the checkpoint left out, from the stored one) and the config unties them. Returns the keys to
    add per shard (key, the checkpoint key it starts from) and the untied keys."""
    touched = set(fold.weight_delta) | set(fold.bias_delta) | set(fold.replace)
    shard_of = {k: s for s, names in layout.shards.items() for k in names}
    extra: dict[str, list[tuple[str, str]]] = {}
    untied: list[str] = []
    for members in layout.tied:
        if any(m in touched for m in members):
            untied.extend(members)
            for m in members:
                if m in layout.aliases:
                    extra.setdefault(shard_of[layout.aliases[m]], []).append((m, layout.aliases[m]))
    return extra, untied


def _write_and_swap_in(
    inputs: _Inputs, layout: _Layout, fold: Fold, extra: dict[str, list[tuple[str, str]]], untied: list[str],
    dtype: str | None, into_dequantized: bool, out_path: Path,
) -> tuple[int, list[str]]:
    """Write the merged directory into a hidden sibling of ``out_path``, then swap it into place; a failure
    leaves nothing behind. Returns the bytes of weights written and the names of the files."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.merging-", dir=out_path.parent))
    try:
        total = _write_shards(inputs.base_dir, layout, extra, fold, tmp)
        _write_config(inputs.base_dir, dtype, bool(untied), tmp)
        _copy_model_files(inputs.run, inputs.base_dir, tmp)
        marker = {
            "adapter": str(inputs.run.resolve()),
            "base": str(inputs.base_dir.resolve()),
            "dtype": dtype or "as base",
            "into_dequantized": into_dequantized,
        }
        (tmp / MERGE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        files = sorted(p.name for p in tmp.iterdir())
        swap_in(tmp, out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return total, files


def _write_shards(
    base_dir: Path, layout: _Layout, extra: dict[str, list[tuple[str, str]]], fold: Fold, out: Path
) -> int:
    """Fold and write every shard of ``base_dir`` into ``out``, one tensor at a time (``extra``: the tied
    members to add to each shard), and the index when the base has one or there are several shards;
    returns the bytes of weights written."""
    import torch
    from safetensors import safe_open

    st_to_torch = {v: getattr(torch, k) for k, v in ST_DTYPES.items()}
    weight_map: dict[str, str] = {}
    total = 0
    for shard in layout.shards:
        with safe_open(str(base_dir / shard), framework="pt") as f:
            items = _shard_items(layout, extra, shard)
            specs = [(k, layout.shapes[k], fold.dtype_of(st_to_torch[stored.dtype])) for k, stored in items]
            # largest itemsize first keeps every tensor aligned to its dtype, as safetensors does
            order = sorted(range(len(items)), key=lambda i: (-specs[i][2].itemsize, specs[i][0]))
            writer = ShardWriter(out / shard, [specs[i] for i in order])
            for i in order:
                key, stored = items[i]
                writer.write(key, fold(key, f.get_tensor(stored.key)))
                weight_map[key] = shard
            writer.close()
            total += writer.total
    if (base_dir / SAFE_INDEX).is_file() or len(layout.shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return total


def _shard_items(layout: _Layout, extra: dict[str, list[tuple[str, str]]], shard: str) -> list[tuple[str, StoredTensor]]:
    """The keys a merged shard holds, in the base's order, each with where its value is stored (``extra``:
    the tied members added to the shard)."""
    source_of = layout.source_of
    return [(k, source_of[k]) for k in layout.shards[shard]] + [(k, source_of[src]) for k, src in extra.get(shard, [])]


def _merged_config(base_dir: Path, dtype: str | None, untied: bool) -> dict[str, Any]:
    """The base's config with the output dtype (``--dtype``) and tied embeddings untied when they are."""
    config = json.loads((base_dir / "config.json").read_text())
    if dtype is not None:
        config["dtype"] = DTYPE_FLAGS[dtype]
        config.pop("torch_dtype", None)
    if untied:
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["tie_word_embeddings"] = False
    return config


def _write_config(base_dir: Path, dtype: str | None, untied: bool, out: Path) -> None:
    """The base's config.json with the output dtype (``--dtype``) and tied embeddings untied when they are."""
    config = _merged_config(base_dir, dtype, untied)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _copy_model_files(run: Path, base_dir: Path, out: Path) -> None:
    """The generation config and the tokenizer files: the run's own tokenizer files where it saved them,
    else the base's."""
    for name in MODEL_FILES:
        src = run / name if name in TOKENIZER_FILES and (run / name).is_file() else base_dir / name
        if src.is_file():
            shutil.copyfile(src, out / name)
