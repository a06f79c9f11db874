"""Where a recipe's inputs are: the one place a model path or a data spec is turned into something to read.

:func:`finetune.recipe.load_recipe` resolves ``model.path``, ``data.train`` and ``data.eval`` once, with these
functions, and keeps the answers on the loaded recipe; validate, plan, run, resume and merge read those
answers instead of searching again. Lookup order for a relative path: next to the recipe, the current
directory, then the shipped ``recipes/`` (``tiny-llama`` names ``recipes/models/tiny-llama``).

A model is a local directory, a hub id in the local Hugging Face cache (:func:`hub_snapshot`, the only
cache test), or a catalog name (config facts for planning, no weights). Data is local files (a file, a
directory, a glob: made absolute here) or the name of a dataset in the local datasets cache.

No torch, transformers or huggingface_hub imports: ``finetune validate`` and ``--help`` stay instant.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from finetune.catalog import catalog_name
from finetune.errors import UserError

#: Data files this tool reads.
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def shipped_recipes_dir() -> Path:
    """The directory of shipped recipes: installed with the package, or the repo's ``recipes/``."""
    here = Path(__file__).resolve().parent
    for cand in (here / "_recipes", here.parent / "recipes"):
        if cand.is_dir():
            return cand
    return here.parent / "recipes"


def resolve_input_path(value: str, base_dir: Path) -> Path:
    """Find an input path: absolute, next to the recipe, in the current directory, or shipped."""
    p = Path(os.path.expanduser(value))
    if p.is_absolute():
        return p
    shipped = shipped_recipes_dir()
    for cand in (base_dir / p, Path.cwd() / p, shipped / "models" / p, shipped / p):
        if cand.exists():
            return cand
    return base_dir / p


def _hf_home() -> Path:
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache/huggingface"))


def hub_snapshot(repo_id: str) -> Path | None:
    """The local snapshot directory of a hub model id in the Hugging Face cache (with a config.json), or None.

    The cache layout is huggingface_hub's: ``models--ORG--NAME/snapshots/REV``, ``refs/main`` naming the
    revision; without a ref, the newest snapshot holding a config.json.
    """
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        return None
    root = Path(os.environ.get("HF_HUB_CACHE") or _hf_home() / "hub") / f"models--{repo_id.replace('/', '--')}"
    ref = root / "refs" / "main"
    if ref.is_file():
        snap = root / "snapshots" / ref.read_text().strip()
        if (snap / "config.json").is_file():
            return snap
    snaps = [s for s in (root / "snapshots").glob("*") if (s / "config.json").is_file()]
    return max(snaps, key=lambda s: s.stat().st_mtime) if snaps else None


def in_datasets_cache(name: str) -> bool:
    """Whether ``name`` is a dataset in the local Hugging Face datasets cache."""
    if name.startswith((".", "/", "~")) or "." in Path(name).name:
        return False
    home = Path(os.environ.get("HF_DATASETS_CACHE") or _hf_home() / "datasets")
    return home.is_dir() and any(home.glob(f"{name.replace('/', '___')}*"))


@dataclass(frozen=True)
class ModelLocation:
    """What ``model.path`` names.

    ``kind``: ``dir`` (a local model directory, ``path`` absolute), ``hub-cache`` (a hub id whose snapshot is
    ``path``), ``catalog`` (a planning-only config, ``path`` is the catalog key), ``missing``.
    """

    value: str
    kind: Literal["dir", "hub-cache", "catalog", "missing"]
    path: str

    @property
    def has_weights(self) -> bool:
        """A directory with a config (and, for a pretrained run, weights) that transformers can load."""
        return self.kind in ("dir", "hub-cache")

    def problem(self) -> str | None:
        """Why this cannot be planned for (one sentence for ``model.path``), or None."""
        if self.kind == "missing":
            return (
                f"`{self.value}` is neither a local directory nor a model in the Hugging Face cache "
                "(this machine cannot download); give a local model directory or a built-in model such as tiny-llama"
            )
        if self.kind == "dir" and not (Path(self.path) / "config.json").is_file():
            return f"{self.path} has no config.json; it is not a Hugging Face model directory"
        return None

    def weights_dir(self) -> str:
        """The directory to load from; a :class:`UserError` for a planning-only or missing model."""
        problem = self.problem()
        if problem:
            raise UserError(f"model.path: {problem}")
        if self.kind == "catalog":
            raise UserError(
                f"model.path: `{self.value}` is a planning-only catalog entry (its public config, no weights); "
                "`finetune plan` can use it, but to train, point model.path at a local copy of the model"
            )
        return self.path


def locate_model(value: str, base_dir: Path) -> ModelLocation:
    """Resolve ``model.path``: a local directory, a cached hub id, a catalog name, or missing."""
    local = resolve_input_path(value, base_dir)
    if local.is_dir():
        return ModelLocation(value, "dir", str(local.resolve()))
    snap = hub_snapshot(value)
    if snap is not None:
        return ModelLocation(value, "hub-cache", str(snap))
    name = catalog_name(value)
    if name is not None:
        return ModelLocation(value, "catalog", name)
    return ModelLocation(value, "missing", value)


@dataclass(frozen=True)
class DataLocation:
    """What a ``data.train`` / ``data.eval`` entry names.

    ``kind``: ``files`` (``target`` is an absolute file, directory or glob), ``dataset`` (a name in the
    datasets cache), ``split`` (``data.eval`` naming another split of the ``data.train`` dataset), ``missing``.
    """

    value: str
    kind: Literal["files", "dataset", "split", "missing"]
    target: str

    def files(self, key: str) -> list[Path]:
        """The data files (sorted); one sentence naming ``key`` when there are none."""
        spec = self.target
        is_glob = any(ch in spec for ch in "*?[")
        if self.kind != "files":
            if is_glob:
                raise UserError(f"{key}: the glob `{self.value}` matches no files")
            raise UserError(f"{key}: no data found at `{self.value}` (looked next to the recipe and in the current directory)")
        if is_glob:
            files = [Path(m) for m in sorted(glob.glob(spec, recursive=True)) if Path(m).is_file()]
            if not files:
                raise UserError(f"{key}: the glob `{self.value}` matches no files")
        elif Path(spec).is_dir():
            files = sorted(f for f in Path(spec).rglob("*") if f.is_file() and f.suffix in DATA_SUFFIXES)
            if not files:
                raise UserError(f"{key}: the directory {spec} holds no {', '.join(DATA_SUFFIXES)} files")
        else:
            files = [Path(spec)]
        for f in files:
            if f.suffix not in DATA_SUFFIXES:
                raise UserError(f"{key}: {f} is not a data file this tool reads ({', '.join(DATA_SUFFIXES)})")
        return files


def locate_data(spec: str, base_dir: Path, *, split_of: DataLocation | None = None) -> DataLocation:
    """Resolve one data spec: local files (made absolute), a cached dataset name, or missing.

    A glob is matched next to the recipe first, then in the current directory; the location keeps the
    absolute pattern that matched, so every later reader expands the same files. ``split_of``: the
    ``data.train`` location, when resolving ``data.eval`` (which may name another split of its dataset).
    """
    if any(ch in spec for ch in "*?["):
        if os.path.isabs(spec):
            return DataLocation(spec, "files" if glob.glob(spec, recursive=True) else "missing", spec)
        for root in (base_dir, Path.cwd()):
            pattern = str(root / spec)
            if glob.glob(pattern, recursive=True):
                return DataLocation(spec, "files", pattern)
        return DataLocation(spec, "missing", spec)
    p = resolve_input_path(spec, base_dir)
    if p.exists():
        return DataLocation(spec, "files", str(p.resolve()))
    if split_of is not None and split_of.kind == "dataset" and "/" not in spec:
        return DataLocation(spec, "split", spec)
    if Path(spec).suffix not in DATA_SUFFIXES and not spec.startswith((".", "/", "~")) and in_datasets_cache(spec):
        return DataLocation(spec, "dataset", spec)
    return DataLocation(spec, "missing", spec)


def resolve_model_config(value: str, base_dir: Path | None = None, trust_remote_code: bool = False) -> tuple[Any, str]:
    """The ``transformers`` config of a ``model.path`` value and where it came from (see :func:`locate_model`)."""
    from finetune.catalog import model_config

    return model_config(locate_model(value, base_dir or Path.cwd()), trust_remote_code)
