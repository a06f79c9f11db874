"""The training methods as types: one class per method, behind one interface.

A run trains one of: every weight (:class:`FullFineTuning`); low-rank adapters (:class:`LoRA`, whose QLoRA,
DoRA, rsLoRA and PiSSA/OLoRA are options: a quantized base, a magnitude vector, a scale, an initialisation);
key/value prefixes (:class:`PrefixTuning`); virtual token embeddings before the input (:class:`PromptTuning`);
or bottleneck modules (:class:`BottleneckAdapters`). Each class
says, for its own method:

- what it trains (``trains_adapters``: a frozen base with no gradients or optimizer state) and what the
  planner counts (:meth:`~TrainingMethod.adapter_spec`, the :class:`~finetune.spec.AdapterSpec` that the
  inventory and the activation traces inject);
- whether it supports an execution (:meth:`~TrainingMethod.supports`: the capability table's sentence);
- how it is injected into a model (:meth:`~TrainingMethod.inject`, the planner's stand-in and the trainer's
  model alike), initialised and checkpointed (:meth:`~TrainingMethod.checkpoint_identity`);
- what it saves and how a user loads it (:meth:`~TrainingMethod.saved_message`,
  :meth:`~TrainingMethod.saved_weight_bytes`), and whether ``finetune merge`` folds it into the base.

The execution spec names the method (``ExecSpec.method``, a plain name in JSON) and hands out its object
(:func:`training_of`); callers ask the object instead of comparing names. What the name itself says (title,
injected kind, quantized base, recomputable) is the ``Method`` enum's, which the classes read.

Pure Python at import: torch and peft are imported inside the methods that need them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, ClassVar, cast

from finetune.model.adapters import DECOMPOSING_INITS
from finetune.spec import AdapterSpec, ExecSpec, Method, QuantSpec

if TYPE_CHECKING:
    from finetune.recipe.capabilities import Cell


class TrainingMethod:
    """What a run trains (a subclass per method). ``adapter``: the spec of what is injected (None for full
    fine-tuning); ``quant``: the frozen base's quantization (QLoRA), else None."""

    name: ClassVar[Method]
    #: ``finetune merge`` folds what it trains into the base weights
    merges: ClassVar[bool] = False

    def __init__(self, adapter: AdapterSpec | None = None, quant: QuantSpec | None = None) -> None:
        self.adapter, self.quant = adapter, quant

    # -- what it is ---------------------------------------------------------------------------------------
    @property
    def title(self) -> str:
        """The name people use."""
        return self.name.title

    @property
    def trains_adapters(self) -> bool:
        """A frozen base with trained modules on it (no gradients or optimizer state for the base)."""
        return self.name.adapters

    @property
    def recomputable(self) -> bool:
        """Activation checkpointing keeps its behaviour."""
        return self.name.recomputable

    @property
    def quantized(self) -> bool:
        """The frozen base's linear weights are quantized (bitsandbytes)."""
        return self.quant is not None

    @classmethod
    def adapter_spec(cls, settings: Any = None) -> AdapterSpec | None:
        """What the method injects, from its recipe section (None: the section's defaults); None when it
        injects nothing."""
        return None

    def supports(self, cell: Cell) -> str | None:
        """The capability table's sentence when this method cannot run ``cell`` (None: it can)."""
        from finetune.recipe.capabilities import first_refusal

        found = first_refusal(cell.with_(method=self.name.value))
        return None if found is None else str(found)

    # -- building -----------------------------------------------------------------------------------------
    def inject(self, model: Any, *, num_layers: int | None = None, stand_in: bool = False) -> Any:
        """``model`` with what this method trains on its frozen base; only those parameters require
        gradients. ``stand_in``: the planner's model (meta or zero weights). ``num_layers``: the prefix's
        depth when it differs from the model's (the planner builds fewer layers)."""
        raise NotImplementedError

    def prepare_on_meta(self, model: Any) -> None:
        """After :meth:`inject` on a meta-device model (the sharded load): what must wait for real weights."""

    @property
    def decomposes(self) -> bool:
        """The trained modules start as a decomposition of the real base weights (LoRA's pissa/olora), which
        a meta-device build leaves to the sharded load."""
        return False

    @property
    def seeded_init(self) -> str | None:
        """How the trainer redraws the trained parameters from ``train.seed`` on every rank and load path
        (``default`` or ``gaussian`` for LoRA; None: the injection's own values stand)."""
        return None

    # -- saving and resuming -------------------------------------------------------------------------------
    def checkpoint_identity(self, recipe: Any) -> dict[str, Any]:
        """What a checkpoint of this method depends on beyond the run's shared identity (a resume with other
        values is refused): ``{recipe section: settings}``."""
        return {}

    def saved_weight_bytes(self, param_bytes: int, trainable: int, value_bytes: int = 4) -> int:
        """Bytes of the weights a checkpoint or the final save holds: the trained parameters as stored
        (``value_bytes`` each: fp32, or lora.dtype's)."""
        return trainable * value_bytes

    def saves_frozen(self) -> bool:
        """Whether the saved weights include the frozen base (only full fine-tuning saves every weight)."""
        return not self.trains_adapters

    def saved_message(self, out: str) -> str:
        """Where the run's result is and how to load it (the run's last lines)."""
        raise NotImplementedError

    def merge_refusal(self) -> str | None:
        """Why ``finetune merge`` cannot fold this method into the base (None: it can)."""
        return None

    # -- preference tuning --------------------------------------------------------------------------------
    def base_only(self, model: Any) -> AbstractContextManager[Any]:
        """Within this context ``model`` (the adapted model, unwrapped from DDP) computes as its frozen base:
        dpo's reference policy for an adapter method, at no memory cost. Full fine-tuning has no base to switch
        to (its reference is a frozen copy, finetune/train/model/reference.py)."""
        raise AssertionError(f"{self.title} trains every weight: its dpo reference is a frozen copy")


class FullFineTuning(TrainingMethod):
    """Every weight trained, in the master dtype."""

    name = Method.FULL

    def inject(self, model: Any, *, num_layers: int | None = None, stand_in: bool = False) -> Any:
        for p in model.parameters():
            p.requires_grad_(True)
        return model

    def saved_weight_bytes(self, param_bytes: int, trainable: int, value_bytes: int = 4) -> int:
        return param_bytes

    def saved_message(self, out: str) -> str:
        return f"model saved to {out}/  load it with: AutoModelForCausalLM.from_pretrained('{out}')"

    def merge_refusal(self) -> str | None:
        return "a full fine-tuning run has nothing to merge"


class LoRA(TrainingMethod):
    """Low-rank updates B·A on a frozen base (peft), folded into the base by ``finetune merge``. Options:
    a quantized base (QLoRA, ``quant``), DoRA, rsLoRA, and the initialisation (default, gaussian, pissa,
    olora; pissa and olora decompose the base weights)."""

    name = Method.LORA
    merges = True
    #: initialisations that decompose the base weights (and subtract the initial adapter from them)
    DECOMPOSING = DECOMPOSING_INITS

    @classmethod
    def adapter_spec(cls, settings: Any = None) -> AdapterSpec:
        return AdapterSpec.lora(settings)

    @property
    def decomposes(self) -> bool:
        """pissa/olora: the adapter starts as a decomposition of the real weights (none on a stand-in)."""
        return self.adapter is not None and self.adapter.init in self.DECOMPOSING

    def peft_config(self, model_config: Any, *, stand_in: bool = False) -> Any:
        """peft's LoraConfig for a model of ``model_config`` (``stand_in``: pissa/olora drawn as default)."""
        from peft import LoraConfig as PeftLoraConfig

        from finetune.recipe.schema import lora_targets

        spec = self.adapter
        assert spec is not None
        init = "default" if stand_in and self.decomposes else spec.init
        return PeftLoraConfig(
            r=spec.r, lora_alpha=cast(Any, spec.alpha), lora_dropout=spec.dropout,  # peft takes a float alpha too
            target_modules=lora_targets(spec.target_modules, model_config.model_type),
            use_dora=spec.use_dora, use_rslora=spec.use_rslora,
            init_lora_weights=True if init == "default" else cast(Any, init), bias="none", task_type="CAUSAL_LM",
        )

    def inject(self, model: Any, *, num_layers: int | None = None, stand_in: bool = False) -> Any:
        from finetune.model.adapters import LORA_INIT_ATTR, peft_inject
        from finetune.model.experts import (
            fused_experts,
            lora_config_with_experts,
            peft_as_targeted,
            resolve_lora_targets,
        )

        config = self.peft_config(model.config, stand_in=stand_in)
        if fused_experts(model):  # a mixture of experts: its expert weights and routers as finetune.model.experts says
            targets = resolve_lora_targets(model, config.target_modules)
            with peft_as_targeted():
                adapted = peft_inject(model, lora_config_with_experts(config, model, targets), "lora.target_modules")
        else:
            adapted = peft_inject(model, config, "lora.target_modules")
        assert self.adapter is not None
        if self.adapter.dtype != "fp32":  # lora.dtype: peft makes them fp32; kept in the compute dtype instead
            from finetune.units import torch_dtype

            dtype = torch_dtype(self.adapter.dtype)
            for p in adapted.parameters():
                if p.requires_grad:
                    p.data = p.data.to(dtype)
        if self.decomposes and not stand_in:
            initial = {n: p.detach().clone() for n, p in adapted.named_parameters() if p.requires_grad}
            setattr(adapted, LORA_INIT_ATTR, initial)
        return adapted

    def prepare_on_meta(self, model: Any) -> None:
        # injected as default on meta (nothing to decompose yet); the sharded load decomposes the real weights
        if self.decomposes:
            assert self.adapter is not None
            model.peft_config["default"].init_lora_weights = self.adapter.init

    @property
    def seeded_init(self) -> str | None:
        # pissa/olora's A and B are the decomposition peft made when it injected them (no random draw to redo)
        if self.adapter is None or self.decomposes:
            return None
        return "gaussian" if self.adapter.init == "gaussian" else "default"

    def checkpoint_identity(self, recipe: Any) -> dict[str, Any]:
        ident: dict[str, Any] = {"r": recipe.lora.r, "target_modules": recipe.lora.target_modules}
        if recipe.lora.use_dora:
            ident["use_dora"] = True
        return {"lora": ident}

    def saved_message(self, out: str) -> str:
        return (
            f"adapter saved to {out}/  load it with: PeftModel.from_pretrained(base, '{out}'), "
            f"or fold it in: finetune merge {out} --out {out}-merged"
        )

    def base_only(self, model: Any) -> AbstractContextManager[Any]:
        return cast(AbstractContextManager[Any], model.disable_adapter())  # peft's: the LoRA layers pass through


class QLoRA(LoRA):
    """LoRA on a quantized base (4-bit NF4/FP4, or 8-bit LLM.int8): the same adapters, the same interface."""

    name = Method.QLORA


class PrefixTuning(TrainingMethod):
    """Trained key/value prefixes in every layer (peft prefix tuning), optionally reparametrised by an MLP
    or started from a text's keys and values."""

    name = Method.PREFIX

    @classmethod
    def adapter_spec(cls, settings: Any = None) -> AdapterSpec:
        return AdapterSpec.prefix(settings)

    def peft_config(self, model_config: Any, *, num_layers: int | None = None) -> Any:
        """peft's PrefixTuningConfig (``num_layers``: the planner's shallower stand-in)."""
        from peft import PrefixTuningConfig

        spec = self.adapter
        assert spec is not None
        kw: dict[str, Any] = {}
        if num_layers is not None:
            kw["num_layers"] = num_layers
        if spec.projection_hidden is not None:
            kw["encoder_hidden_size"] = spec.projection_hidden
        return PrefixTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=spec.num_virtual_tokens, prefix_projection=spec.projection,
            **kw,
        )

    def inject(self, model: Any, *, num_layers: int | None = None, stand_in: bool = False) -> Any:
        import warnings

        from finetune.model.adapters import peft_inject

        # peft hands the prefix over as `past_key_values`, which transformers 5 renames
        warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated", category=FutureWarning)
        return peft_inject(model, self.peft_config(model.config, num_layers=num_layers), "prefix")

    def checkpoint_identity(self, recipe: Any) -> dict[str, Any]:
        return {"prefix": recipe.prefix.model_dump()}

    def saved_message(self, out: str) -> str:
        return f"prefix saved to {out}/  load it with: PeftModel.from_pretrained(base, '{out}')"

    def base_only(self, model: Any) -> AbstractContextManager[Any]:
        return cast(AbstractContextManager[Any], model.disable_adapter())  # peft's: the base's own forward

    def merge_refusal(self) -> str | None:
        return (
            "its trained keys and values are extra attention positions, not a change of any weight, so there is "
            "nothing to fold; load the base with the adapter instead (PeftModel.from_pretrained(base, dir))"
        )


class PromptTuning(TrainingMethod):
    """Trained embedding vectors before every sequence's tokens, at the input only (peft prompt tuning, Lester
    et al. 2021), drawn at random or started from a text's token embeddings (``prompt.init: text``, set by
    :func:`finetune.model.adapters.init_prompt_from_text`; peft's own text init would load a tokenizer by name)."""

    name = Method.PROMPT

    @classmethod
    def adapter_spec(cls, settings: Any = None) -> AdapterSpec:
        return AdapterSpec.prompt(settings)

    def peft_config(self) -> Any:
        """peft's PromptTuningConfig (random init: a text init is applied to the injected embeddings)."""
        from peft import PromptTuningConfig, PromptTuningInit

        assert self.adapter is not None
        return PromptTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=self.adapter.num_virtual_tokens,
            prompt_tuning_init=PromptTuningInit.RANDOM,
        )

    def inject(self, model: Any, *, num_layers: int | None = None, stand_in: bool = False) -> Any:
        from finetune.model.adapters import peft_inject

        return peft_inject(model, self.peft_config(), "prompt")

    def checkpoint_identity(self, recipe: Any) -> dict[str, Any]:
        return {"prompt": recipe.prompt.model_dump()}

    def saved_message(self, out: str) -> str:
        return f"prompt saved to {out}/  load it with: PeftModel.from_pretrained(base, '{out}')"

    def base_only(self, model: Any) -> AbstractContextManager[Any]:
        return cast(AbstractContextManager[Any], model.disable_adapter())  # peft's: the base's own forward

    def merge_refusal(self) -> str | None:
        return (
            "its trained vectors are extra input positions before every sequence, not a change of any weight, so "
            "there is nothing to fold; load the base with the adapter instead (PeftModel.from_pretrained(base, dir))"
        )


class BottleneckAdapters(TrainingMethod):
    """Bottleneck modules after the attention and/or MLP of every layer (Houlsby et al.), our own modules
    (finetune/model/adapters.py), saved beside a config and loaded with ``finetune.model.adapters.load_bottlenecks``."""

    name = Method.ADAPTER

    @classmethod
    def adapter_spec(cls, settings: Any = None) -> AdapterSpec:
        return AdapterSpec.bottleneck(settings)

    def inject(self, model: Any, *, num_layers: int | None = None, stand_in: bool = False) -> Any:
        from finetune.model.adapters import add_bottlenecks

        assert self.adapter is not None
        return add_bottlenecks(model, self.adapter)

    def checkpoint_identity(self, recipe: Any) -> dict[str, Any]:
        ident = recipe.adapter.model_dump()
        if not ident["embeddings"]:  # as checkpoints from before adapter.embeddings recorded it
            del ident["embeddings"]
        return {"adapter": ident}

    def saved_message(self, out: str) -> str:
        return (
            f"bottleneck adapters saved to {out}/  load them with: "
            f"finetune.model.adapters.load_bottlenecks(base, '{out}')"
        )

    def base_only(self, model: Any) -> AbstractContextManager[Any]:
        return _bottlenecks_off(model)

    def merge_refusal(self) -> str | None:
        return (
            "they add a non-linear module after attention and MLP, not a linear update of a weight, so they "
            "cannot be folded into the base; load the base with them instead "
            "(finetune.model.adapters.load_bottlenecks(base, dir))"
        )


@contextmanager
def _bottlenecks_off(model: Any) -> Any:
    """Every bottleneck of ``model`` passes its input through unchanged and every trained gain is 1, for the
    context's duration (their hooks stay; each module's own forward and gain are shadowed on the instance)."""
    from finetune.model.adapters import EMBED_NAME, HEAD_GAIN_NAME, SLOT_NAMES

    names = (*SLOT_NAMES.values(), EMBED_NAME, HEAD_GAIN_NAME)
    shadowed = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names]

    def same(h: Any) -> Any:
        return h

    try:
        for m in shadowed:
            m.forward = same
            m.scale_input = same
        yield model
    finally:
        for m in shadowed:
            del m.forward, m.scale_input


#: The class of each method name.
METHOD_TYPES: dict[Method, type[TrainingMethod]] = {
    Method.FULL: FullFineTuning,
    Method.LORA: LoRA,
    Method.QLORA: QLoRA,
    Method.PREFIX: PrefixTuning,
    Method.ADAPTER: BottleneckAdapters,
    Method.PROMPT: PromptTuning,
}
#: The class that injects each kind of :class:`~finetune.spec.AdapterSpec`.
ADAPTER_TYPES: dict[str, type[TrainingMethod]] = {
    "lora": LoRA, "prefix": PrefixTuning, "bottleneck": BottleneckAdapters, "prompt": PromptTuning,
}


def method_type(name: str | Method) -> type[TrainingMethod]:
    """The class of a method name (``full``, ``lora``, ``qlora``, ``prefix``, ``adapter``, ``prompt``)."""
    return METHOD_TYPES[Method(name)]


def training_method(name: str | Method, adapter: AdapterSpec | None = None, quant: QuantSpec | None = None) -> TrainingMethod:
    """The method object of a name with what it injects (``adapter``) and its base's quantization."""
    return method_type(name)(adapter, quant)


def training_of(spec: ExecSpec) -> TrainingMethod:
    """The method object of an execution spec (what it injects and the base's quantization)."""
    return training_method(spec.method, spec.adapter, spec.quant)


def adapter_method(spec: AdapterSpec) -> TrainingMethod:
    """The method object that injects ``spec`` (its kind: lora, prefix, bottleneck or prompt)."""
    return ADAPTER_TYPES[spec.kind](spec)


def inject(model: Any, spec: AdapterSpec, *, num_layers: int | None = None, stand_in: bool = False) -> Any:
    """``model`` with ``spec``'s trainable modules on its frozen base (a peft model for lora, prefix and prompt,
    the same model with bottleneck modules for adapter); only the injected parameters require gradients. The
    planner's inventory and traces and the trainer all inject through here, so what is counted and traced is
    what is trained.

    ``stand_in``: the planner's model (meta or zero weights): LoRA's pissa/olora initialisation, which
    decomposes the real weights, is replaced by the default one (the same shapes).
    A pissa/olora peft model keeps its initial adapter as ``LORA_INIT_ATTR`` (see ``adapters.plain_lora``).
    """
    return adapter_method(spec).inject(model, num_layers=num_layers, stand_in=stand_in)


__all__ = [
    "ADAPTER_TYPES",
    "METHOD_TYPES",
    "BottleneckAdapters",
    "FullFineTuning",
    "LoRA",
    "PrefixTuning",
    "PromptTuning",
    "QLoRA",
    "TrainingMethod",
    "adapter_method",
    "inject",
    "method_type",
    "training_method",
    "training_of",
]
