"""``finetune export RUN --format gguf [--dtype f16|q8_0]``: a run's model as one GGUF file for llama.cpp.

What is exported is the model the run trained: a full fine-tune's weights, or its LoRA adapter folded into its
base by ``finetune merge``'s fold (:func:`finetune.merge.folded`), read and written one tensor at a time, so
memory holds one tensor (and the adapter), never the model. The file is written under a temporary name beside
``--out`` and renamed at the end: a failure leaves nothing behind.

The families llama.cpp reads and transformers' GGUF loader reads back: Llama and Mistral (llama.cpp's ``llama``
architecture: the query and key rows permuted to its rotary layout), Qwen2 and Qwen3 (their own architectures,
Qwen3 with its query/key norms). Names come from the ``gguf`` package's tensor map. Weight matrices are
written in ``--dtype`` (``f16``, or ``q8_0``: blocks of 32 values with one scale, where a row's length is a
multiple of 32, else f16), norms and biases in f32, as llama.cpp's converter writes them.

The tokenizer is written as llama.cpp keeps one (``tokenizer.ggml.*``): a byte-level BPE (GPT-2's bytes as
characters: tiny-llama's, Llama 3's, Qwen's, SmolLM's) as ``gpt2`` with its merges and the name of its
pre-tokenizer's split where it is a known one; a sentencepiece-style BPE (``▁`` for spaces, byte fallback) as
``llama``; the vocabulary padded to the model's embedding rows with unused ``[PAD<i>]`` tokens; special tokens
as control tokens; the BOS/EOS/padding ids, whether BOS is added, and the chat template.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import UserError

INSTALL = "pip install 'gguf>=0.10' (or pip install -e '.[export]' in a checkout)"
#: Hugging Face model_type -> the llama.cpp architecture it is written as.
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
DTYPES = ("f16", "q8_0")


@dataclass
class ExportOptions:
    """What ``finetune export`` was asked (the CLI's flags)."""

    target: str
    out: Path
    format: str = "gguf"
    dtype: str = "f16"
    base: str | None = None
    force: bool = False
    trust_remote_code: bool = False


@dataclass
class ExportResult:
    """What an export wrote."""

    out: Path
    architecture: str
    tensors: int
    bytes: int
    dtype: str
    folded: bool  # an adapter was folded into its base first
    notes: list[str]

    def __str__(self) -> str:
        what = "its LoRA adapter folded into the base, " if self.folded else ""
        notes = "".join(f"; {n}" for n in self.notes)
        return (f"exported {self.out} ({self.architecture}, {what}{self.tensors} tensors, {self.dtype}, "
                f"{self.bytes / 2**20:.1f} MiB){notes}")


# --------------------------------------------------------------------------------------------------
# What is exported
# --------------------------------------------------------------------------------------------------


@dataclass
class Source:
    """The model to write: its config, its tokenizer, and its tensors one at a time (``specs`` in the order
    ``tensors`` yields them)."""

    config: dict[str, Any]
    tokenizer: Any
    specs: list[tuple[str, list[int]]]
    tensors: Any  # () -> Iterator[(name, torch.Tensor)]
    folded: bool


def _plain_tensors(model_dir: Path) -> tuple[list[tuple[str, list[int]]], Any]:
    """A model directory's tensors by name, read one at a time from its safetensors shards."""
    from safetensors import safe_open

    from finetune.storage.safetensors_stream import shard_map

    shards, source_of = shard_map(model_dir)
    specs = [(k, list(source_of[k].shape)) for names in shards.values() for k in names]

    def tensors() -> Iterator[tuple[str, Any]]:
        for shard, names in shards.items():
            with safe_open(str(model_dir / shard), framework="pt") as f:
                for k in names:
                    yield k, f.get_tensor(source_of[k].key)

    return specs, tensors


@contextmanager
def source_of(opts: ExportOptions) -> Iterator[Source]:
    """What ``opts.target`` holds as a :class:`Source`: a model directory as it is, an adapter folded into its
    base. One sentence for what cannot be exported."""
    from finetune.inference import load_tokenizer
    from finetune.model.methods import method_type
    from finetune.recipe.locate import check_remote_code
    from finetune.storage.rundir import find_base, read_json, read_run

    run = read_run(opts.target, "RUN_OR_MODEL")
    if run.kind == "model":
        check_remote_code(run.path, opts.trust_remote_code)  # before transformers reads any of it
        config = read_json(run.path / "config.json")
        _check_family(config, run.path)
        specs, tensors = _plain_tensors(run.path)
        yield Source(config, load_tokenizer(run.path, run.path, opts.trust_remote_code), specs, tensors, False)
        return
    if run.peft_type != "LORA":
        method = run.method or "this"
        try:
            why = method_type(method)().merge_refusal() or ""
        except (KeyError, ValueError):
            why = ""
        raise UserError(
            f"RUN_OR_MODEL {opts.target} holds a {method} adapter, which export cannot fold into the base "
            f"(only LoRA adapters are folded){': ' + why if why else ''}"
        )
    if opts.base is None:
        ref = find_base(run)
        if not ref.rebuild:
            _check_family(read_json(ref.path / "config.json"), ref.path)
    from finetune.merge import folded

    with folded(run.path, opts.base, opts.trust_remote_code) as model:
        _check_family(model.config, model.base_dir)
        tok = load_tokenizer(run.path, model.base_dir, opts.trust_remote_code)
        yield Source(model.config, tok, [(k, shape) for k, shape, _ in model.specs()], model.tensors, True)


def _check_family(config: dict[str, Any], where: Path) -> None:
    model_type = str(config.get("model_type"))
    if model_type not in FAMILIES:
        raise UserError(
            f"RUN_OR_MODEL: {where} is a {model_type} model, which finetune export does not write as GGUF; it "
            f"exports {', '.join(sorted(FAMILIES))} models"
        )
    if config.get("quantization_config"):
        raise UserError(f"RUN_OR_MODEL: {where} is stored quantized; export needs its 16/32-bit weights")
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in ("default", None):
        raise UserError(
            f"RUN_OR_MODEL: {where} scales its rotary positions ({rope_type}), which finetune export does not "
            "write yet; export a model without rope_scaling"
        )


# --------------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------------


@dataclass
class Vocab:
    """A tokenizer as llama.cpp keeps it."""

    model: str  # gpt2 | llama
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str]
    notes: list[str]


def _pre_tokenizer(pre: Any) -> str | None:
    """llama.cpp's name of a byte-level tokenizer's pre-tokenizer (tokenizer.json's ``pre_tokenizer``), None
    when it is not one llama.cpp names: GPT-2's split (ByteLevel's own regex), SmolLM's (each digit apart, then
    GPT-2's), or a Split regex that transformers' GGUF reader knows by llama.cpp's name."""
    steps = [s.get("type") for s in _steps(pre)]
    byte_regex = any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in _steps(pre))
    if steps == ["ByteLevel"] and byte_regex:
        return "gpt-2"
    if steps == ["Digits", "ByteLevel"] and byte_regex and _steps(pre)[0].get("individual_digits"):
        return "smollm"
    if steps == ["Split", "ByteLevel"] and not byte_regex:
        regex = (_steps(pre)[0].get("pattern") or {}).get("Regex")
        try:  # the splits transformers' GGUF loader knows, by llama.cpp's names
            from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
        except ImportError:
            return None
        return next((name for name, split in GGUF_PRE_TOKENIZER_SPLITS.items() if split == regex), None)
    return None


def vocab_of(tokenizer: Any, vocab_size: int) -> Vocab:
    """``tokenizer`` (a fast tokenizer) as llama.cpp's GGUF vocabulary, padded to ``vocab_size`` rows."""
    import gguf

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(
            f"the tokenizer is a {model.get('type')} model; finetune export writes byte-level and sentencepiece "
            "BPE tokenizers only"
        )
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {t["content"]: t for t in state.get("added_tokens") or []}
    for content, t in added.items():
        vocab.setdefault(content, int(t["id"]))
    if max(vocab.values()) >= vocab_size:
        raise UserError(f"the tokenizer has ids up to {max(vocab.values())} but the model's vocabulary is "
                        f"{vocab_size}; the tokenizer does not belong to this model")
    by_id = {i: t for t, i in vocab.items()}
    byte_level = any(s.get("type") == "ByteLevel" for s in _steps(state.get("pre_tokenizer"))) or (
        (state.get("decoder") or {}).get("type") == "ByteLevel")
    tokens, types, notes = [], [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED.value)
            continue
        tokens.append(token)
        if token in added:
            types.append(gguf.TokenType.CONTROL.value if added[token].get("special") else
                         gguf.TokenType.USER_DEFINED.value)
        elif not byte_level and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            types.append(gguf.TokenType.BYTE.value)
        else:
            types.append(gguf.TokenType.NORMAL.value)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    if byte_level:
        pre = _pre_tokenizer(state.get("pre_tokenizer"))
        if pre is None:
            pre = "default"
            if merges:
                notes.append("its pre-tokenizer's split is not one llama.cpp names: it splits with its default")
        return Vocab("gpt2", pre, tokens, types, None, merges, notes)
    return Vocab("llama", None, tokens, types, [-float(i) for i in range(vocab_size)], merges, notes)


def _steps(pre: Any) -> list[dict[str, Any]]:
    if not isinstance(pre, dict):
        return []
    return list(pre.get("pretokenizers", [])) if pre.get("type") == "Sequence" else [pre]


def _adds_bos(tokenizer: Any) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


# --------------------------------------------------------------------------------------------------
# The file
# --------------------------------------------------------------------------------------------------


def _permute(w: Any, heads: int) -> Any:
    """Rows of a query/key weight from transformers' rotary layout (halves) to llama.cpp's (pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stored(name: str, shape: list[int], dtype: str) -> tuple[Any, list[int], int]:
    """(the GGML type, the shape gguf's writer takes, bytes) of a tensor written in ``dtype``."""
    import gguf
    import numpy as np

    if len(shape) < 2:
        return gguf.GGMLQuantizationType.F32, shape, int(np.prod(shape)) * 4
    if dtype == "q8_0" and shape[-1] % 32 == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        byte_shape = [*shape[:-1], shape[-1] // block * size]
        return qtype, byte_shape, int(np.prod(byte_shape))
    return gguf.GGMLQuantizationType.F16, shape, int(np.prod(shape)) * 2


def _array(tensor: Any, qtype: Any) -> Any:
    """A tensor as the bytes of its GGML type."""
    import gguf
    import numpy as np

    data = tensor.float().numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return data.astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)


def _metadata(writer: Any, config: dict[str, Any], name: str) -> None:
    """The architecture's hyper-parameters, under llama.cpp's keys."""
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    writer.add_name(name)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    rope = config.get("rope_parameters")
    theta = config.get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 10000.0
    writer.add_rope_freq_base(float(theta))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(int(config["vocab_size"]))
    if head_dim != hidden // heads or config.get("model_type") == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _tokenizer_metadata(writer: Any, tok: Any, vocab: Vocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    elif vocab.model == "gpt2":  # llama.cpp needs the key of a BPE, even one without merges (bytes alone)
        import gguf

        writer.add_key_value(gguf.Keys.Tokenizer.MERGES, [], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
    for token_id, add in ((tok.bos_token_id, writer.add_bos_token_id), (tok.eos_token_id, writer.add_eos_token_id),
                          (tok.pad_token_id, writer.add_pad_token_id), (tok.unk_token_id, writer.add_unk_token_id)):
        if token_id is not None:
            add(int(token_id))
    writer.add_add_bos_token(_adds_bos(tok))
    writer.add_add_eos_token(False)
    template = getattr(tok, "chat_template", None)
    if isinstance(template, str):
        writer.add_chat_template(template)


def _writer(path: Path, arch: str) -> Any:
    """gguf's writer, which here also writes an empty array (gguf-py refuses one; the format has it: a type
    and a count of 0), for a byte-level vocabulary without merges."""
    import gguf

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val: Any, vtype: Any, add_vtype: bool, sub_type: Any = None) -> bytes:
            if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                head = self._pack("I", vtype) if add_vtype else b""
                return head + self._pack("I", sub_type) + self._pack("Q", 0)
            return bytes(super()._pack_val(val, vtype, add_vtype, sub_type))

    return Writer(path, arch)


def write_gguf(source: Source, out: Path, dtype: str, name: str) -> ExportResult:
    """Write ``source`` as GGUF at ``out`` (a temporary file beside it, renamed at the end)."""
    import gguf

    config = source.config
    arch_name = FAMILIES[str(config["model_type"])]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    blocks = int(config["num_hidden_layers"])
    names = gguf.get_tensor_name_map(arch, blocks)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    tied = bool(config.get("tie_word_embeddings", False))
    vocab = vocab_of(source.tokenizer, int(config["vocab_size"]))

    plan: list[tuple[str, str, Any]] = []  # (hf name, gguf name, ggml type)
    tmp = Path(tempfile.mkstemp(prefix=f".{out.name}.", suffix=".writing", dir=out.parent)[1])
    try:
        writer = _writer(tmp, arch_name)
        _metadata(writer, config, name)
        _tokenizer_metadata(writer, source.tokenizer, vocab)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if dtype == "q8_0" else gguf.LlamaFileType.MOSTLY_F16)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        total = 0
        for key, shape in source.specs:
            if tied and key == "lm_head.weight":
                continue  # llama.cpp reads a tied head from the token embeddings
            if key.endswith("rotary_emb.inv_freq"):
                continue
            target = names.get_name(key, try_suffixes=(".weight", ".bias"))
            if target is None:
                raise UserError(f"the model has a tensor {key} that llama.cpp's {arch_name} architecture has no "
                                "place for; it cannot be exported")
            qtype, stored_shape, nbytes = _stored(target, shape, dtype)
            writer.add_tensor_info(target, stored_shape, _np_dtype(qtype), nbytes, raw_dtype=qtype)
            plan.append((key, target, qtype))
            total += nbytes
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        order = {k: i for i, (k, _, _) in enumerate(plan)}
        done = 0
        for key, tensor in source.tensors():
            if key not in order:
                continue
            hf, _, qtype = plan[done]
            assert hf == key, f"tensors come in the order of their specs ({hf} before {key})"
            if arch_name == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
                tensor = _permute(tensor, heads if key.endswith("q_proj.weight") else kv_heads)
            writer.write_tensor_data(_array(tensor, qtype))
            done += 1
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ExportResult(out, arch_name, len(plan), total, dtype, source.folded, vocab.notes)


def _np_dtype(qtype: Any) -> Any:
    import gguf
    import numpy as np

    return {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}.get(qtype, np.uint8)


def run_export(opts: ExportOptions) -> ExportResult:
    """``finetune export``: check the flags and ``--out``, then write the GGUF file."""
    if opts.format != "gguf":
        raise UserError(f"--format {opts.format}: finetune export writes gguf (llama.cpp's format)")
    if opts.dtype not in DTYPES:
        raise UserError(f"--dtype {opts.dtype} is not one of {', '.join(DTYPES)}")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UserError(f"finetune export needs the gguf package, which is not installed; {INSTALL}") from None
    out = opts.out
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give the .gguf file to write")
    if out.exists() and not opts.force:
        raise UserError(f"--out {out} already exists; pass --force to replace it")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: the directory {out.parent} does not exist; create it first")
    with source_of(opts) as source:
        name = Path(opts.target).name or "model"
        return write_gguf(source, out, opts.dtype, name)
