"""Where a recipe's inputs are: the one place a model path or a data spec is turned into something to read.

:func:`finetune.recipe.schema.load_recipe` resolves ``model.path``, ``data.train`` and ``data.eval`` once, with these
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

from finetune.errors import UserError
from finetune.recipe.catalog import CATALOG, catalog_name

#: Data files this tool reads.
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def shipped_recipes_dir() -> Path:
    """The directory of shipped recipes: installed with the package, or the repo's ``recipes/``."""
    package = Path(__file__).resolve().parents[1]  # finetune/
    for cand in (package / "_recipes", package.parent / "recipes"):
        if cand.is_dir():
            return cand
    return package.parent / "recipes"


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


def path_overlap(out: str | os.PathLike[str], inp: str | os.PathLike[str]) -> str | None:
    """How a directory that will be written (``out``) overlaps an input (``inp``): ``is``, ``contains`` or ``lies
    inside``, compared as real paths (every symlink resolved, also in a part that does not exist yet); None
    when they are apart."""
    o, i = Path(os.path.realpath(os.path.expanduser(out))), Path(os.path.realpath(os.path.expanduser(inp)))
    if o == i:
        return "is"
    if i.is_relative_to(o):
        return "contains"
    if o.is_relative_to(i):
        return "lies inside"
    return None


def _hf_home() -> Path:
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache/huggingface"))


def hub_snapshot(repo_id: str, repo_type: str = "model", revision: str | None = None) -> Path | None:
    """The local snapshot directory of a hub id in the Hugging Face cache (a model's with a config.json), or None.

    The cache layout is huggingface_hub's: ``models--ORG--NAME/snapshots/REV`` (``datasets--`` for a dataset),
    ``refs/main`` naming the revision; without a ref, the newest snapshot (holding a config.json, for a model).
    ``revision`` (``model.revision``): only the snapshot of that commit, or of the branch or tag a ref names.
    """
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        return None
    root = (
        Path(os.environ.get("HF_HUB_CACHE") or _hf_home() / "hub")
        / f"{repo_type}s--{repo_id.replace('/', '--')}"
    )

    def usable(snap: Path) -> bool:
        return (snap / "config.json").is_file() if repo_type == "model" else snap.is_dir()

    if revision is not None:
        if ".." in revision.split("/") or revision.startswith("/"):
            return None
        ref = root / "refs" / revision  # a branch or tag names its commit; a commit hash is the snapshot's name
        commit = ref.read_text().strip() if ref.is_file() else revision
        snap = root / "snapshots" / commit
        return snap if "/" not in commit and usable(snap) else None
    ref = root / "refs" / "main"
    if ref.is_file():
        snap = root / "snapshots" / ref.read_text().strip()
        if usable(snap):
            return snap
    snaps = [s for s in (root / "snapshots").glob("*") if usable(s)]
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
    ``path``), ``hub`` (a hub id to download: not cached, downloads allowed), ``catalog`` (a planning-only
    config, ``path`` is the catalog key), ``missing``. ``revision``: the Hub revision a hub id is pinned to
    (``model.revision``).
    """

    value: str
    kind: Literal["dir", "hub-cache", "hub", "catalog", "missing"]
    path: str
    revision: str | None = None

    @property
    def has_weights(self) -> bool:
        """A directory with a config (and, for a pretrained run, weights) that transformers can load."""
        return self.kind in ("dir", "hub-cache")

    def problem(self) -> str | None:
        """Why this cannot be planned for (one sentence for ``model.path``), or None."""
        if self.kind == "missing":
            if looks_like_hub_id(self.value) and hub_offline():
                return (
                    f"`{self.value}` is neither a local directory nor a model in the Hugging Face cache, and "
                    "downloads are off (HF_HUB_OFFLINE=1 or --offline); unset it to download, or give a local "
                    "model directory"
                )
            return (
                f"`{self.value}` is neither a local directory, a model in the Hugging Face cache nor a Hub id "
                "(org/name); give a local model directory or a built-in model such as tiny-llama"
            )
        if self.kind == "dir" and not (Path(self.path) / "config.json").is_file():
            return f"{self.path} has no config.json; it is not a Hugging Face model directory"
        return None

    @property
    def downloadable(self) -> bool:
        """A hub id a run would download (not cached; a catalog entry's hub id counts too), downloads on."""
        return self.kind == "hub" or (
            self.kind == "catalog" and looks_like_hub_id(self.value) and not hub_offline()
        )

    def weights_dir(self) -> str:
        """The directory to load from; a :class:`UserError` for a planning-only or missing model.

        A hub id is not downloaded here: :func:`fetch_hub_inputs` does it once, when a run's recipe is loaded.
        """
        problem = self.problem()
        if problem:
            raise UserError(f"model.path: {problem}")
        if self.kind == "hub":
            raise UserError(f"model.path: `{self.value}` is not downloaded yet; `finetune run` downloads it")
        if self.kind == "catalog":
            raise UserError(
                f"model.path: `{self.value}` is a planning-only catalog entry (its public config, no weights); "
                "`finetune plan` can use it, but to train, point model.path at a local copy of the model"
            )
        return self.path


def locate_model(value: str, base_dir: Path, revision: str | None = None) -> ModelLocation:
    """Resolve ``model.path``: a local directory, a cached hub id (at ``revision`` when given), a catalog name, or
    missing."""
    local = resolve_input_path(value, base_dir)
    if local.is_dir():
        return ModelLocation(value, "dir", str(local.resolve()))
    snap = hub_snapshot(value, revision=revision)
    if snap is not None:
        return ModelLocation(value, "hub-cache", str(snap), revision)
    name = catalog_name(value)
    if name is not None and revision is None:
        return ModelLocation(value, "catalog", name)
    if looks_like_hub_id(value) and not hub_offline():
        return ModelLocation(value, "hub", value, revision)
    return ModelLocation(value, "missing", value, revision)


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
            raise UserError(
                f"{key}: no data found at `{self.value}` (looked next to the recipe and in the current directory)"
            )
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
        # abspath, not resolve: a Hub snapshot's files are symlinks to blobs that have no file suffix
        return DataLocation(spec, "files", os.path.abspath(p))
    if split_of is not None and split_of.kind == "dataset" and "/" not in spec:
        return DataLocation(spec, "split", spec)
    if (
        Path(spec).suffix not in DATA_SUFFIXES
        and not spec.startswith((".", "/", "~"))
        and in_datasets_cache(spec)
    ):
        return DataLocation(spec, "dataset", spec)
    return DataLocation(spec, "missing", spec)


def model_config(location: ModelLocation, trust_remote_code: bool = False) -> tuple[Any, str]:
    """A ``transformers`` config for a resolved ``model.path``; return (config, where it came from).

    A local directory or cached hub snapshot is read from disk; a catalog name is built from its facts.
    Raises :class:`UserError` for a model that is none of these.
    """
    from transformers import AutoConfig

    if location.kind == "catalog":
        facts = dict(CATALOG[location.path])
        return AutoConfig.for_model(facts.pop("model_type"), **facts), f"catalog:{location.path}"
    if location.kind == "hub":  # planning needs only the config: fetch that one file
        path = download_config(location.value, location.revision)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
        return config, f"hub:{location.value}"
    problem = location.problem()
    if problem is not None:
        if location.kind == "missing":
            problem = (
                f"model `{location.value}` is not a local model directory, a catalog model ({', '.join(CATALOG)}) "
                "or a hub id in the local cache"
            )
        raise UserError(problem)
    config = AutoConfig.from_pretrained(location.path, trust_remote_code=trust_remote_code, local_files_only=True)
    source = location.path if location.kind == "dir" else f"hub-cache:{location.value}"
    return config, source


def needs_remote_code(err: BaseException) -> bool:
    """Whether transformers refused to load a model because its own code would have to run (trust_remote_code)."""
    return isinstance(err, ValueError) and "trust_remote_code" in str(err)


def remote_code_refused(model_dir: str | os.PathLike[str], flag: str) -> UserError:
    """The sentence for a model directory whose config names code of its own that was not allowed to run."""
    return UserError(
        f"{model_dir}: its config names model code of its own (auto_map), which finetune runs only when you pass "
        f"{flag}; pass it if you trust the model's author, or use a model transformers implements"
    )


def check_remote_code(model_dir: str | os.PathLike[str], trust_remote_code: bool, flag: str = "--trust-remote-code") -> None:
    """Refuse, before transformers reads anything of it, a model directory that only loads by running its own code
    (its config.json's ``auto_map`` names classes for a ``model_type`` transformers does not implement), unless
    ``trust_remote_code`` (the user's ``flag``)."""
    if trust_remote_code:
        return
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return  # no readable config: the loader says what is wrong
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not isinstance(auto_map, dict) or not auto_map:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if config.get("model_type") not in CONFIG_MAPPING_NAMES:
        raise remote_code_refused(model_dir, flag)


def resolve_model_config(
    value: str, base_dir: Path | None = None, trust_remote_code: bool = False
) -> tuple[Any, str]:
    """The ``transformers`` config of a ``model.path`` value and where it came from (see :func:`locate_model`)."""
    return model_config(locate_model(value, base_dir or Path.cwd()), trust_remote_code)


# --------------------------------------------------------------------------------------------------------------
# The Hub: `model.path: org/name` and `data.train: org/dataset` are downloaded into the Hugging Face cache when
# they are neither local nor cached, unless HF_HUB_OFFLINE=1 (`--offline` sets it). Only what a run reads is
# fetched: a model's config, tokenizer and safetensors weights (pickled `.bin`/`.pt` weights only with
# `model.allow_pickle: true`, since unpickling can run code); a dataset's data files. huggingface_hub is
# imported here only when a download is needed; HF_ENDPOINT points it at another server (the tests' stand-in).
# --------------------------------------------------------------------------------------------------------------

#: What a model download fetches (safetensors weights; config, tokenizer, generation and chat template files).
MODEL_FILES = [
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
]
#: Pickled weight files, fetched only with model.allow_pickle.
PICKLE_FILES = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl"]


def hub_offline() -> bool:
    """Whether downloads are switched off (HF_HUB_OFFLINE=1, which ``--offline`` sets)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def looks_like_hub_id(value: str) -> bool:
    """``org/name`` with nothing that makes it a path (no leading ./~, no file suffix, one slash)."""
    if value.count("/") != 1 or value.startswith((".", "/", "~")) or Path(value).suffix in DATA_SUFFIXES:
        return False
    org, name = value.split("/")
    return bool(org) and bool(name) and not any(ch in value for ch in "*?[ \\")


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _unreachable(key: str, repo_id: str, err: BaseException) -> UserError:
    reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
    return UserError(
        f"{key}: could not download `{repo_id}` from the Hugging Face Hub at {hub_endpoint()} ({reason}); check the "
        "network or the name, or set HF_HUB_OFFLINE=1 (--offline) to use only local files and the cache"
    )


def _reach(key: str, repo_id: str) -> None:
    """One request to the Hub through huggingface_hub's own session, without its retries: an unreachable Hub
    is said at once (its API calls retry a refused connection for ~20 s, logging each attempt)."""
    from huggingface_hub.utils import get_session, logging

    logging.set_verbosity_error()  # our sentence replaces its per-retry warnings
    try:
        get_session().head(hub_endpoint(), timeout=10)
    except Exception as err:
        raise _unreachable(key, repo_id, err) from None


def _hub_call(key: str, repo_id: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a huggingface_hub function; any failure to get an answer becomes one sentence naming ``key``."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    _reach(key, repo_id)
    try:
        return fn(*args, **kwargs)
    except RepositoryNotFoundError:
        raise UserError(
            f"{key}: `{repo_id}` is not a repository on the Hugging Face Hub at {hub_endpoint()} "
            "(or it is private: set HF_TOKEN)"
        ) from None
    except GatedRepoError:
        raise UserError(
            f"{key}: `{repo_id}` is gated on the Hugging Face Hub; accept its terms on its page and "
            "set HF_TOKEN"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as err:
        raise _unreachable(key, repo_id, err) from None
    except Exception as err:  # httpx2 connection errors and timeouts: not an OSError
        if type(err).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2"):
            raise _unreachable(key, repo_id, err) from None
        raise


def download_model(repo_id: str, *, allow_pickle: bool = False, revision: str | None = None) -> Path:
    """Download ``repo_id``'s config, tokenizer and safetensors weights into the cache; return the snapshot.

    A repository whose weights are only pickles is refused unless ``allow_pickle``.
    """
    from huggingface_hub import HfApi, snapshot_download

    files = _hub_call("model.path", repo_id, HfApi().list_repo_files, repo_id, revision=revision)
    safetensors = [f for f in files if f.endswith(".safetensors")]
    pickles = [f for f in files if f.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl"))]
    if "config.json" not in files:
        raise UserError(
            f"model.path: `{repo_id}` on the Hugging Face Hub has no config.json; it is not a "
            "transformers model repository"
        )
    patterns = list(MODEL_FILES)
    if not safetensors and pickles:
        if not allow_pickle:
            raise UserError(
                f"model.path: `{repo_id}` has only pickled weights ({', '.join(sorted(pickles)[:3])}), which can "
                "run code when loaded; set model.allow_pickle: true if you trust its author, or use a "
                "safetensors copy"
            )
        patterns += PICKLE_FILES
    path = _hub_call(
        "model.path", repo_id, snapshot_download, repo_id, revision=revision, allow_patterns=patterns
    )
    return Path(path)


def download_config(repo_id: str, revision: str | None = None) -> Path:
    """Download only ``repo_id``'s config.json (what planning needs); return its directory."""
    from huggingface_hub import hf_hub_download

    return Path(
        _hub_call("model.path", repo_id, hf_hub_download, repo_id, "config.json", revision=revision)
    ).parent


def download_dataset(repo_id: str, *, key: str = "data.train", revision: str | None = None) -> Path:
    """Download ``repo_id``'s data files (.jsonl, .json, .csv, .parquet) into the cache; return the snapshot."""
    from huggingface_hub import snapshot_download

    patterns = [f"*{s}" for s in DATA_SUFFIXES] + [f"**/*{s}" for s in DATA_SUFFIXES]
    path = _hub_call(
        key,
        repo_id,
        snapshot_download,
        repo_id,
        repo_type="dataset",
        revision=revision,
        allow_patterns=patterns,
    )
    return Path(path)


def _dataset(repo_id: str, key: str) -> Path | None:
    """A dataset's snapshot: from the cache, else downloaded (None when offline and not cached)."""
    cached = hub_snapshot(repo_id, "dataset")
    if cached is not None:
        return cached
    return None if hub_offline() else download_dataset(repo_id, key=key)


def split_files(snapshot: Path, split: str) -> list[str]:
    """The data files of ``split`` in a downloaded dataset: those whose path names the split (the Hub's own
    convention: ``train.jsonl``, ``data/train-00000.parquet``...), else every data file."""
    files = sorted(
        p
        for p in snapshot.rglob("*")
        if p.is_file() and p.suffix in DATA_SUFFIXES and not p.name.startswith(".")
    )

    def words(p: Path) -> list[str]:
        return (
            p.relative_to(snapshot)
            .as_posix()
            .replace(".", "/")
            .replace("-", "/")
            .replace("_", "/")
            .split("/")
        )

    named = [p for p in files if split in words(p)]
    return [str(p) for p in (named or files)]


def fetch_hub_inputs(loaded: Any) -> bool:
    """Download the hub ids a recipe names that are neither local nor cached (unless offline), and point the
    recipe at them; return whether anything was downloaded (the caller then resolves the inputs again).

    The model lands in the Hugging Face cache, where :func:`hub_snapshot` finds it (``model.path`` keeps the id);
    a dataset's files are written into ``data.train`` (``data.eval``: a split name, or another dataset id).
    """
    inputs, r = loaded.inputs, loaded.recipe
    if inputs is None:
        return False
    fetched = False
    if inputs.model.downloadable:
        download_model(inputs.model.value, allow_pickle=r.model.allow_pickle, revision=r.model.revision)
        fetched = True
    specs = r.data.train_specs()
    new_specs: list[list[str]] = [[] for _ in range(max(t.source for t in specs) + 1)]
    train_snapshot: Path | None = None
    changed = False
    for spec, where in zip(specs, inputs.train, strict=True):
        if where.kind == "missing" and looks_like_hub_id(where.value):
            train_snapshot = _dataset(where.value, spec.key)
            if train_snapshot is None:
                new_specs[spec.source].append(spec.spec)
                continue
            new_specs[spec.source] += split_files(train_snapshot, r.data.split)
            fetched = changed = True
        else:
            new_specs[spec.source].append(spec.spec)
    if changed:  # a mixture's source keeps its weight over the dataset's files
        r.data.set_train_specs(new_specs)
    if r.data.eval and inputs.eval is not None and inputs.eval.kind == "missing":
        held_snapshot = _dataset(r.data.eval, "data.eval") if looks_like_hub_id(r.data.eval) else None
        if held_snapshot is not None:
            r.data.eval = split_files(held_snapshot, "validation")[0]
            fetched = True
        elif train_snapshot is not None and "/" not in r.data.eval:
            held = split_files(train_snapshot, r.data.eval)
            r.data.eval = held[0]
            fetched = True
    return fetched
