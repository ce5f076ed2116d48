"""The exportable prefill and decode modules, for any family's Hugging Face causal LM.

Transformers 5 passes the KV cache as a ``DynamicCache`` object, which neither torch
exporter can take as a graph input or output. The wrappers here take and return the
cache as flat tensors (``past.<l>.key``, ``past.<l>.value``, ...), build the cache object
inside ``forward`` and flatten it again on the way out, so the exported graphs have
plain tensor IO. What differs between families (how the decoder body is called) comes in
as a :data:`Body` from the family's module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

# The decoder body of a family: (model, input_ids, cache, attention_mask, position_ids) -> the
# final hidden states [batch, sequence, hidden]; ``cache`` is extended in place.
Body = Callable[[Any, torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor], torch.Tensor]


def cache_keyword(module: torch.nn.Module) -> str:
    """The keyword a Hugging Face model's ``forward`` takes its cache by (``cache`` in 5.2x, ``past_key_values`` before)."""
    parameters = inspect.signature(module.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def decoder_body(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    cache: DynamicCache,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """Final hidden states of a causal LM's decoder (``model.base_model``); ``cache`` grows in place."""
    decoder = model.base_model
    output = decoder(
        input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **{cache_keyword(decoder): cache},
    )
    hidden: torch.Tensor = output.last_hidden_state
    return hidden


def full_cache(pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DynamicCache:
    """A cache that keeps every position of every layer, optionally filled with ``(key, value)`` pairs.

    Built from a config, transformers gives a sliding-window model (Mistral) layers that
    drop the positions behind the window, so a present would be shorter than past + 1 and
    break the contract (``present.<l>.key`` is ``[batch, KV, total_sequence, D]``). Kept
    whole, the window is applied by the attention mask alone, as the graphs apply it.
    """
    return DynamicCache(pairs) if pairs else DynamicCache()


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(key, value) per layer of a filled cache, each ``[batch, H, total_sequence, D]``."""
    pairs = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor), (
            "cache layer is filled"
        )
        pairs.append((keys, values))
    return pairs


def _flatten_cache(cache: DynamicCache) -> list[torch.Tensor]:
    return [tensor for pair in cache_layers(cache) for tensor in pair]


def _lm_head(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """Logits from [batch, rows, hidden] hidden states, through a 2-D product.

    The dynamo exporter turns the 2-D form into ``Gemm(W, transB=1)``, which reads the tied
    weight where it is stored; a 3-D product exports as ``MatMul(X, Transpose(W))``, which
    ONNX Runtime folds into a private transposed copy per session. (Where an exporter
    emits ``MatMul(X2d, Transpose(W))``, the ``transposed_weight_gemm`` pass rewrites it.)
    """
    batch, rows, hidden_size = hidden.shape
    logits = model.lm_head(hidden.reshape(batch * rows, hidden_size))  # [batch * rows, V]
    vocab_size: int = model.config.vocab_size
    return logits.reshape(batch, rows, vocab_size)  # [batch, rows, V]


def last_positions(hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's hidden state at its last real token, [batch, 1, hidden] (see :class:`PrefillModule`)."""
    # The mask's width and the tokens' length may share one dim name in a graph, so any
    # length read off a shape is the mask's: count the columns after each row's last 1
    # from the mask's values, and the tokens fed from their values (ids are >= 0).
    ones_from_here = attention_mask.sum(-1, keepdim=True) - attention_mask.cumsum(-1) + attention_mask
    trailing = (ones_from_here == 0).sum(-1)  # [batch]
    fed = (input_ids != -1).sum(-1)  # [batch]
    index = (fed - 1 - trailing).clamp(min=0)
    return hidden.gather(1, index.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1]))


class PrefillModule(torch.nn.Module):
    """Prompt graph: ``(input_ids, attention_mask, position_ids) -> (logits, *present)``.

    With ``all_logits=False`` the LM head runs on one position per row, giving logits
    ``[batch, 1, V]``: the row's last real token, the last 1 of its mask. Left padding puts
    it in the last column; right-padded prompts (onnxruntime-genai's convention) end
    earlier. The mask may be wider than the tokens fed (a chunk after a past, or one token
    over a mask as wide as an in-place buffer): the tokens end where the row's mask ends,
    so the index is the tokens' length less one less the columns after the row's last 1,
    and at least 0.
    """

    def __init__(self, model: PreTrainedModel, body: Body, all_logits: bool = False) -> None:
        super().__init__()
        self.model = model
        self.body = body
        self.all_logits = all_logits

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Run the prompt; return last-position (or all) logits and the presents."""
        cache = full_cache()
        hidden = self.body(
            self.model, input_ids, cache, attention_mask, position_ids
        )  # [batch, sequence, hidden]
        if not self.all_logits:
            hidden = last_positions(hidden, input_ids, attention_mask)  # [batch, 1, hidden]
        return (_lm_head(self.model, hidden), *_flatten_cache(cache))


class DecodeModule(torch.nn.Module):
    """One-step graph: ``(input_ids, attention_mask, position_ids, *past) -> (logits, *present)``.

    ``past`` is flat: ``past.0.key, past.0.value, past.1.key, ...``, each
    ``[batch, H, past_sequence, D]``; presents come back ``[batch, H, past_sequence + 1, D]``.
    """

    def __init__(self, model: PreTrainedModel, body: Body) -> None:
        super().__init__()
        self.model = model
        self.body = body

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """Run one token against the past; return its logits and the grown presents."""
        pairs = [(past[2 * layer], past[2 * layer + 1]) for layer in range(len(past) // 2)]
        cache = full_cache(pairs)
        hidden = self.body(
            self.model, input_ids, cache, attention_mask, position_ids
        )  # [batch, 1, hidden]
        return (_lm_head(self.model, hidden), *_flatten_cache(cache))


class InPlaceModule(torch.nn.Module):
    """Either graph over an in-place cache, attention as GroupQueryAttention (``kvexport.models.grouped_attention``).

    ``(input_ids, attention_mask, position_ids, *past) -> (logits, *present)``: ``past`` is
    the ``[batch, KV, max_sequence, D]`` buffers (prefill takes them too), ``present`` the
    same buffers with this call's rows written at each row's end (the mask's last 1).
    ``last_only`` runs the LM head on each row's last real token.
    """

    def __init__(self, model: PreTrainedModel, last_only: bool = True) -> None:
        super().__init__()
        self.model = model
        self.last_only = last_only

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """Run the tokens against the buffers; return the logits and the written buffers."""
        from kvexport.models.grouped_attention import in_place_attention

        layers = len(past) // 2
        pairs = [(past[2 * layer], past[2 * layer + 1]) for layer in range(layers)]
        with in_place_attention(self.model, pairs, attention_mask, input_ids.shape[1]) as written:
            # no cache object: each layer's attention gets the new rows, and the op writes them
            output = self.model.base_model(input_ids, position_ids=position_ids, use_cache=False)
        hidden = output.last_hidden_state  # [batch, sequence, hidden]
        if self.last_only:
            hidden = last_positions(hidden, input_ids, attention_mask)
        presents = [tensor for layer in range(layers) for tensor in written.present[layer]]
        return (_lm_head(self.model, hidden), *presents)
