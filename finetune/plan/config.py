"""A model's config as the planner reads it, without importing transformers (and with it torch) when the
planner has read this config before.

A transformers config costs its library's import: about 6 s of a 2-core machine's `finetune plan`, three
quarters of a plan whose traces, inventories and FLOPs are all in the disk cache. So the first plan of a config
reads it with transformers and records in ``$FINETUNE_CACHE/configs`` what the planner can see of it: every
attribute whose value JSON keeps exactly (the config's own fields, the class's tensor-parallel plan and other
class facts), the names of its methods and of attributes JSON cannot hold, the class's ``attribute_map`` and
its ``to_json_string(use_diff=False)``. Later plans get a :class:`PlanConfig` built from that record.

A :class:`PlanConfig` answers as the transformers config would: the recorded attributes (through the
attribute map), ``AttributeError`` for a name the config does not have, ``to_json_string`` (what the cache keys
of traces, inventories and FLOPs are made of) with any attribute set on it since; ``copy.deepcopy`` and
attribute assignment work as the planner's reduced and tensor-parallel configs use them. Anything else (a
method, an attribute JSON cannot hold) and building a model (:func:`concrete`) loads the transformers config
again from where it came and applies the same assignments, so a plan is the same either way, only slower.
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from finetune.recipe.catalog import CATALOG
from finetune.recipe.locate import ModelLocation, model_config

#: Bump when what a config record holds changes: invalidates the disk cache.
CONFIG_RECORD_VERSION = 1


@dataclass
class _Meta:
    """What a :class:`PlanConfig` keeps beside its attributes."""

    serialized: dict[str, Any]  # to_dict() as to_json_string(use_diff=False) writes it, with later assignments
    attribute_map: dict[str, str]
    class_name: str
    delegated: frozenset[str]  # methods and attributes JSON cannot hold: read from the transformers config
    origin: tuple[ModelLocation, bool]  # where the config came from, and trust_remote_code
    changes: list[tuple[str, Any]] = field(default_factory=list)  # attribute assignments since it was read
    loaded: Any = None  # the transformers config with ``changes`` applied, once something needed it


class PlanConfig:
    """A transformers config's attributes read from the planner's cache (see the module's docstring)."""

    __slots__ = ("__dict__", "_meta")
    _meta: _Meta

    def __init__(self, values: dict[str, Any], meta: _Meta) -> None:
        object.__setattr__(self, "_meta", meta)
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:
        # Only names not in the instance's __dict__ get here.
        if name.startswith("__") or name == "_meta":
            raise AttributeError(name)
        meta = self._meta
        if name in meta.attribute_map and meta.attribute_map[name] in self.__dict__:
            return self.__dict__[meta.attribute_map[name]]
        if name in meta.delegated or name in meta.attribute_map:
            return getattr(self.transformers_config(), name)
        raise AttributeError(f"'{meta.class_name}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        meta = self._meta
        name = meta.attribute_map.get(name, name)
        self.__dict__[name] = value
        meta.serialized[name] = value
        meta.changes.append((name, value))
        meta.loaded = None

    def __deepcopy__(self, memo: dict[int, Any]) -> PlanConfig:
        meta = self._meta
        return PlanConfig(
            copy.deepcopy(self.__dict__, memo),
            replace(meta, serialized=copy.deepcopy(meta.serialized, memo), changes=list(meta.changes), loaded=None),
        )

    def __repr__(self) -> str:
        return f"{self._meta.class_name} (planner's record) {self.to_json_string()}"

    def to_json_string(self, use_diff: bool = True) -> str:
        """The config as transformers' ``to_json_string(use_diff=False)`` writes it (the diff form is read from
        the transformers config)."""
        if use_diff:
            return str(self.transformers_config().to_json_string(use_diff=True))
        return json.dumps(self._meta.serialized, indent=2, sort_keys=True) + "\n"

    def transformers_config(self) -> Any:
        """The transformers config this stands for: loaded again from its origin, with the same assignments."""
        meta = self._meta
        if meta.loaded is None:
            location, trust_remote_code = meta.origin
            loaded, _ = model_config(location, trust_remote_code)
            for name, value in meta.changes:
                setattr(loaded, name, value)
            meta.loaded = loaded
        return meta.loaded


def concrete(config: Any) -> Any:
    """``config`` as a transformers config (what building a model from it needs)."""
    return config.transformers_config() if isinstance(config, PlanConfig) else config


def config_class_name(config: Any) -> str:
    """The class name of the transformers config ``config`` is or stands for (``LlamaConfig``)."""
    return config._meta.class_name if isinstance(config, PlanConfig) else type(config).__name__


def planning_config(location: ModelLocation, trust_remote_code: bool = False) -> tuple[Any, str]:
    """The config of a resolved ``model.path`` for planning, and where it came from (as
    :func:`finetune.recipe.locate.model_config`): a :class:`PlanConfig` when the disk cache has a record of it, else
    the transformers config (recorded for next time). Configs with remote code and models still to be
    downloaded are always read by transformers."""
    from finetune.plan.cache import cache_file, read_json, write_json

    key = _record_key(location, trust_remote_code)
    path = cache_file("configs", key, CONFIG_RECORD_VERSION) if key is not None else None
    record = read_json(path)
    if isinstance(record, dict) and {"values", "serialized", "attribute_map", "class_name", "delegated",
                                     "source"} <= record.keys():
        meta = _Meta(record["serialized"], record["attribute_map"], record["class_name"],
                     frozenset(record["delegated"]), (location, trust_remote_code))
        return PlanConfig(record["values"], meta), record["source"]
    config, source = model_config(location, trust_remote_code)
    if path is not None:
        write_json(path, {**config_record(config), "source": source})
    return config, source


def _record_key(location: ModelLocation, trust_remote_code: bool) -> Any:
    """What a config record is computed from (the catalog's facts, or the config.json's text and where it
    is), or None when the config is not to be recorded."""
    if trust_remote_code or location.problem() is not None:
        return None
    if location.kind == "catalog":
        return ("catalog", location.path, sorted(CATALOG[location.path].items()))
    if location.kind in ("dir", "hub-cache"):
        try:
            text = (Path(location.path) / "config.json").read_text()
        except OSError:
            return None
        return (location.kind, location.path, text)
    return None


def config_record(config: Any) -> dict[str, Any]:
    """What a :class:`PlanConfig` is built from: the attributes of ``config`` JSON holds exactly, the names
    read from the transformers config (methods, other values), its serialized form and its attribute map."""
    from transformers.utils import logging

    values: dict[str, Any] = {}
    delegated: set[str] = set()
    names = set(vars(config)) | {n for n in dir(config) if not n.startswith("__")}
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # reading every attribute reads the deprecated ones: no notices for them
    try:
        read = {}
        for name in sorted(names):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    read[name] = getattr(config, name)
                except Exception:  # a property that fails: read it from the transformers config if asked
                    delegated.add(name)
    finally:
        logging.set_verbosity(verbosity)
    for name, value in read.items():
        if callable(value) and not isinstance(value, type):
            delegated.add(name)
        elif name == "dtype" and value is not None:  # a torch.dtype: its name, as the config's JSON writes it
            values[name] = str(value).removeprefix("torch.")
        elif _json_exact(value):
            values[name] = value
        else:
            delegated.add(name)
    attribute_map = dict(getattr(config, "attribute_map", {}) or {})
    for alias in attribute_map:  # aliases resolve through the map, as on the transformers config
        values.pop(alias, None)
        delegated.discard(alias)
    return {
        "values": values,
        "serialized": json.loads(config.to_json_string(use_diff=False)),
        "attribute_map": attribute_map,
        "class_name": type(config).__name__,
        "delegated": sorted(delegated),
    }


def _json_exact(value: Any) -> bool:
    """Whether ``value`` comes back from JSON equal and of the same types (no tuples, no int-keyed dicts)."""
    try:
        back = json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return False
    return _same(value, back)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
