"""``dpo.reference_model``: another checkpoint as dpo's reference policy, checked before anything loads, and the
fingerprint of a reference's weights that keys its precomputed log-probabilities.

Full fine-tuning compares the policy with its starting weights unless ``dpo.reference_model`` names another
model directory (the SFT model the policy starts from, another run's output). That model must score the same
token ids as the policy (the same vocabulary size and token map) and be of the same architecture family
(``model_type``), so it is built, held and sharded as the policy's frozen copy is
(finetune/train/model/reference.py). :func:`reference_model_problem` says in one sentence what does not match.

Pure Python (json and file stats, no torch or transformers): ``finetune validate`` stays instant.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from finetune.recipe.locate import ModelLocation, locate_model

#: Files that hold a model's weights (a directory without any has nothing to compare with).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
#: Files that describe the weights (their layout and the architecture).
WEIGHT_INDEXES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def locate_reference(value: str, base_dir: Path) -> ModelLocation:
    """Where ``dpo.reference_model`` is (as :func:`~finetune.recipe.locate.locate_model` finds ``model.path``)."""
    return locate_model(value, base_dir)


def weight_files(path: Path) -> list[Path]:
    """The weight files of a model directory (sorted by name)."""
    return sorted(f for f in path.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))


def _config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _vocab_size(config: dict[str, Any]) -> int | None:
    value = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return int(value) if isinstance(value, int) else None


def token_map(path: Path) -> dict[str, Any] | None:
    """The tokenizer's map from tokens to ids as its files hold it (tokenizer.json's vocabulary and added
    tokens, or the digest of a sentencepiece / vocab file), or None when the directory has no tokenizer."""
    tj = path / "tokenizer.json"
    if tj.is_file():
        try:
            data = json.loads(tj.read_text())
        except (OSError, ValueError):
            return {"tokenizer.json": hashlib.sha256(tj.read_bytes()).hexdigest()}
        vocab = (data.get("model") or {}).get("vocab")
        if isinstance(vocab, list):  # Unigram: [piece, score] pairs, the id is the position
            vocab = [v[0] if isinstance(v, list) else v for v in vocab]
        added = {t.get("content"): t.get("id") for t in data.get("added_tokens") or [] if isinstance(t, dict)}
        return {"vocab": vocab, "added": added}
    for name in ("tokenizer.model", "vocab.json", "vocab.txt"):
        if (path / name).is_file():
            return {name: hashlib.sha256((path / name).read_bytes()).hexdigest()}
    return None


def reference_model_problem(value: str, base_dir: Path, policy: ModelLocation) -> str | None:
    """Why ``dpo.reference_model: value`` cannot be the reference of a policy at ``policy`` (the sentence after
    ``dpo.reference_model: ``), or None. Checks what a directory's files tell: a config, weights, the same
    ``model_type`` and vocabulary size, the same token map (when both directories hold a tokenizer)."""
    ref = locate_reference(value, base_dir)
    if ref.kind not in ("dir", "hub-cache") or not (Path(ref.path) / "config.json").is_file():
        return (
            f"`{value}` is not a model directory (no config.json there); give the directory of a Hugging Face "
            "model, e.g. the output.dir of a full fine-tuning run"
        )
    path = Path(ref.path)
    if not weight_files(path):
        return (
            f"{path} holds no weights ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}); the reference must be "
            "trained weights, e.g. the output.dir of a full fine-tuning run"
        )
    if not policy.has_weights or not (Path(policy.path) / "config.json").is_file():
        return None  # model.path's own problem is reported there; a hub model is compared once downloaded
    mine, theirs = _config(path), _config(Path(policy.path))
    if mine.get("model_type") != theirs.get("model_type"):
        return (
            f"{path} is a `{mine.get('model_type')}` model but model.path is a `{theirs.get('model_type')}` "
            "model; the reference must be of the policy's architecture (a checkpoint of the same model)"
        )
    if _vocab_size(mine) != _vocab_size(theirs):
        return (
            f"{path} has a vocabulary of {_vocab_size(mine)} tokens but model.path has {_vocab_size(theirs)}; "
            "the reference must share the policy's tokenizer"
        )
    a, b = token_map(path), token_map(Path(policy.path))
    if a is not None and b is not None and a != b:
        return (
            f"the tokenizer files of {path} map tokens to other ids than model.path's; the reference must share "
            "the policy's tokenizer"
        )
    return None


def weights_fingerprint(location: ModelLocation) -> list[Any]:
    """What identifies a model directory's weights without reading them: each weight file's name, size and
    modification time, and the content of its config and shard index (a rewritten or replaced file changes it)."""
    path = Path(location.path)
    out: list[Any] = [str(path.resolve())]
    for f in weight_files(path):
        st = f.stat()
        out.append([f.name, st.st_size, st.st_mtime_ns])
    for name in WEIGHT_INDEXES:
        if (path / name).is_file():
            out.append([name, hashlib.sha256((path / name).read_bytes()).hexdigest()])
    return out
