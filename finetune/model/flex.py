"""``model.attn_implementation: flex_attention``: packed rows without a (B, 1, T, T) mask.

transformers (5.x, ``masking_utils.create_causal_mask``) already turns a packed row's ``position_ids`` into a
document mask: it finds where positions restart (``find_packed_sequence_indices``) and, for flex attention,
hands ``create_block_mask`` a mask function "causal within the same document". The result is a ``BlockMask``
(per 128 x 128 block: empty, full or partial), so the fused kernel skips the blocks between documents and no
T x T tensor ever exists. finetune adds nothing to that on a GPU.

On CPU, torch 2.13 compiles flex attention's forward to a C++ kernel but has no backward for it
(``FlexAttention does not support backward on CPU``). So that flex recipes train (and are tested) on CPU,
:func:`install` registers two thin wrappers in transformers' interfaces for the name ``flex_attention``:

* the mask: on CPU the ``BlockMask`` is built without ``torch.compile`` (compiling it costs a minute on a
  loaded 2-core machine; the eager build is exact);
* the attention: on CPU the same ``BlockMask``'s mask function is evaluated densely
  (``torch.nn.attention.flex_attention.create_mask``) and passed to sdpa. That is the same attention pattern
  with sdpa's memory (a (B, 1, T, T) boolean mask): a CPU path for correctness, not for memory. Forwards
  without gradients take it too: the compiled CPU kernel does not compile for generation with a KV cache in
  torch 2.13 (an inductor C++ error), and compiling it costs a minute. On a GPU transformers' own flex
  attention runs unchanged.
"""

from __future__ import annotations

from typing import Any

FLEX = "flex_attention"
_INSTALLED = False


def install_if(attn_implementation: str) -> None:
    """:func:`install` when a recipe asks for ``flex_attention`` (called wherever the trainer builds a model)."""
    if attn_implementation == FLEX:
        install()


def install() -> None:
    """Register finetune's CPU-aware ``flex_attention`` mask and attention functions in transformers (once;
    models built afterwards with ``attn_implementation="flex_attention"`` use them)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from transformers import AttentionInterface
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    gpu_mask = ALL_MASK_ATTENTION_FUNCTIONS[FLEX]

    def mask(*args: Any, device: Any = "cpu", **kwargs: Any) -> Any:
        if _device_type(device) == "cpu":
            return _eager_block_mask(*args, device=device, **kwargs)  # type: ignore[misc]  # transformers passes the rest by keyword
        return gpu_mask(*args, device=device, **kwargs)

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        if query.device.type == "cpu":
            return dense_flex_attention(module, query, key, value, attention_mask, **kwargs)
        return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionMaskInterface.register(FLEX, mask)
    AttentionInterface.register(FLEX, attention)
    _INSTALLED = True


def dense_flex_attention(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any
) -> Any:
    """Flex attention's result computed by sdpa, its ``BlockMask`` evaluated element by element (the CPU
    path: torch has no flex backward on CPU). Returns what transformers' attention functions do:
    (output as (B, T, H, D), None)."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask, create_mask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("flex_attention's CPU training path has no softcap or attention sinks")
    if isinstance(attention_mask, BlockMask):
        q_len, kv_len = attention_mask.seq_lengths
        dense = create_mask(attention_mask.mask_mod, query.shape[0], None, q_len, kv_len, device=query.device)
        attention_mask = dense[..., : query.shape[-2], : key.shape[-2]]
    elif attention_mask is None:
        # no mask at all (transformers skips it only for plain causal rows): causal, as flex's default
        n = query.shape[-2]
        attention_mask = torch.ones(n, key.shape[-2], dtype=torch.bool, device=query.device).tril(
            key.shape[-2] - n
        )
    return sdpa_attention_forward(module, query, key, value, attention_mask, is_causal=False, **kwargs)


def _device_type(device: Any) -> str:
    import torch

    return torch.device(device).type


def _eager_block_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: Any = None,
    device: Any = "cpu",
    **kwargs: Any,
) -> Any:
    """transformers' ``flex_attention_mask`` (padding, offsets, then ``create_block_mask``), without
    ``torch.compile``."""
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers import masking_utils as mu

    if mask_function is None:
        mask_function = mu.causal_mask_function
    if attention_mask is not None and not mu.fast_all(attention_mask):
        padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        assert padding is not None, "a mask gives a padding mask"
        mask_function = mu.and_masks(mask_function, mu.padding_mask_function(padding))
    mask_function = mu.add_offsets_to_mask_function(mask_function, q_offset, kv_offset)
    return create_block_mask(mask_function, batch_size, None, q_length, kv_length, device=device)
