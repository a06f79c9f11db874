"""The planner's record of a model config: a config read back from it answers as the transformers config does
(attributes, the attribute map, the serialized form the trace cache is keyed by, the planner's reduced and
tensor-parallel copies), and an edited config.json or remote code is read by transformers again."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from transformers import GPT2Config

from finetune.plan.config import PlanConfig, concrete, config_class_name, planning_config
from finetune.plan.shapes import reduced_config
from finetune.plan.tensor_parallel import tp_config, tp_problem
from finetune.recipe.catalog import CATALOG
from finetune.recipe.locate import locate_model, model_config
from tests.support import TINY_MODEL


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def recorded(value: str, base: Path, trust_remote_code: bool = False) -> tuple[object, object]:
    """The config of ``value`` read by transformers (the first plan) and then from the record (the next)."""
    location = locate_model(value, base)
    first, source = planning_config(location, trust_remote_code)
    second, source_again = planning_config(location, trust_remote_code)
    assert source_again == source
    return first, second


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_a_recorded_catalog_config_answers_as_transformers_does(name: str, cache: Path) -> None:
    real, rec = recorded(name, Path.cwd())
    assert not isinstance(real, PlanConfig) and isinstance(rec, PlanConfig)
    assert config_class_name(rec) == type(real).__name__
    assert rec.to_json_string(use_diff=False) == real.to_json_string(use_diff=False)
    for attr in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size", "tie_word_embeddings", "model_type", "architectures",
                 "base_model_tp_plan", "max_position_embeddings", "rms_norm_eps"):
        assert getattr(rec, attr) == getattr(real, attr), attr
    assert getattr(rec, "head_dim", None) == getattr(real, "head_dim", None)  # Qwen2 has none
    assert getattr(rec, "no_such_setting", "absent") == "absent"
    assert str(rec.dtype).removeprefix("torch.") == str(real.dtype).removeprefix("torch.")
    for tp in (2, 4, 8, 16):
        assert tp_problem(rec, tp) == tp_problem(real, tp)
        if tp_problem(real, tp) is None:
            assert tp_config(rec, tp).to_json_string(use_diff=False) == tp_config(real, tp).to_json_string(use_diff=False)
    one = reduced_config(rec, 1)
    assert one.to_json_string(use_diff=False) == reduced_config(real, 1).to_json_string(use_diff=False)
    assert rec.num_hidden_layers == real.num_hidden_layers  # the copy's change stays in the copy
    # building a model needs the transformers config: loaded again, with the copy's change
    built = concrete(one)
    assert type(built) is type(real) and built.num_hidden_layers == 1
    assert built.to_json_string(use_diff=False) == one.to_json_string(use_diff=False)


def test_the_attribute_map_and_an_edited_config_json(tmp_path: Path, cache: Path) -> None:
    model = tmp_path / "gpt2-small"
    GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300).save_pretrained(model)
    real, rec = recorded(str(model), tmp_path)
    assert isinstance(rec, PlanConfig)
    # GPT-2 names its fields n_embd, n_head, n_layer; transformers maps the common names onto them
    assert (rec.hidden_size, rec.num_attention_heads, rec.num_hidden_layers) == (64, 4, 2)
    assert "n_embd" in vars(rec) and "hidden_size" not in vars(rec)
    copy_ = copy.deepcopy(rec)
    copy_.num_attention_heads = 2
    assert (copy_.n_head, rec.n_head) == (2, 4)
    assert json.loads(copy_.to_json_string(use_diff=False))["n_head"] == 2
    assert concrete(copy_).n_head == 2 and concrete(copy_).to_json_string(use_diff=False) == copy_.to_json_string(use_diff=False)
    assert rec.to_dict() == real.to_dict()  # a method: read from the transformers config
    # an edited config.json is a different config: read by transformers again, then recorded
    GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=300).save_pretrained(model)
    edited, edited_rec = recorded(str(model), tmp_path)
    assert not isinstance(edited, PlanConfig) and edited.hidden_size == 128 and edited_rec.hidden_size == 128


def test_remote_code_configs_are_never_recorded(cache: Path) -> None:
    first, second = recorded(str(TINY_MODEL), Path.cwd(), trust_remote_code=True)
    assert not isinstance(first, PlanConfig) and not isinstance(second, PlanConfig)
    assert not cache.exists() or not (cache / "configs").exists()


def test_a_damaged_record_is_read_again(cache: Path) -> None:
    location = locate_model(str(TINY_MODEL), Path.cwd())
    real, _ = planning_config(location)
    (record,) = (cache / "configs").iterdir()
    record.write_text("{not json")
    again, source = planning_config(location)
    assert not isinstance(again, PlanConfig) and source == model_config(location)[1]
    assert again.to_json_string(use_diff=False) == real.to_json_string(use_diff=False)
    assert isinstance(planning_config(location)[0], PlanConfig)  # recorded anew
