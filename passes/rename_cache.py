"""rename_cache: give the KV-cache inputs and outputs canonical names.

Every exporter names the cache its own way. The pass parses the layer number and the
key / value kind out of each graph input and output that looks like a cache tensor and
renames it by object (every use follows), keeping the old name in ``metadata_props``:

=====================================  ================================
name seen                              canonical
=====================================  ================================
``past_key_values.3.key`` (Optimum)    ``past.3.key``
``present.3.value`` (Optimum)          ``present.3.value``
``past_key_3`` / ``present_value_3``   ``past.3.key`` / ``present.3.value``
``past_key_values_3_0`` (torch)        ``past.3.key`` (0 key, 1 value)
``cache.k.3`` / ``present_v_3``        ``past.3.key`` / ``present.3.value``
``past_3`` [2, batch, H, S, D]         split into ``past.3.key`` and ``past.3.value``
=====================================  ================================

Inputs become ``past.*``, outputs ``present.*``. The whole mapping is worked out and
checked before anything is renamed: a name that looks like a cache tensor but can't be
parsed, two tensors claiming one slot, layers not numbered 0..L-1, or a key without its
value all raise :class:`CacheNamingError` and leave the graph untouched. A graph with no
cache at all raises :class:`NoCacheError`.

``RenameCachePass(style="optimum")`` maps the other way (``past_key_values.<l>.key`` /
``present.<l>.key``) for tools that expect Optimum's names.
"""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from .cache_names import CacheSlot, Direction, Kind, Style, canonical_slot
from .errors import PassInputError
from .values import initializer

_ORIGINAL_NAME = "kvexport.original_name"
_KEY_TOKENS = {"key", "keys", "k"}
_VALUE_TOKENS = {"value", "values", "v"}
# Tokens that mark a tensor as part of a KV cache (after "past_key_values" is collapsed).
_CACHE_TOKENS = {"past", "present", "pkv", "cache", "kv", "layer_past", "cached"}


class CacheNamingError(PassInputError):
    """The graph's cache tensors can't be mapped onto canonical names without guessing."""


class NoCacheError(CacheNamingError):
    """The graph has no KV-cache inputs or outputs at all."""


def _tokens(name: str) -> list[str]:
    lowered = re.sub(r"(past|present)[^a-z0-9]*key[^a-z0-9]*values?", r"\1 pkv", name.lower())
    lowered = re.sub(r"layer[^a-z0-9]*past", "layer_past", lowered)
    return re.findall(r"layer_past|[a-z]+|\d+", lowered)


def parse_cache_name(name: str, direction: Direction) -> CacheSlot | None:
    """Parse ``name`` into a slot; None if it does not look like a cache tensor.

    Raises:
        CacheNamingError: it looks like a cache tensor, but the layer or kind is ambiguous.

    """
    tokens = _tokens(name)
    if not _CACHE_TOKENS.intersection(tokens):
        return None
    numbers = [int(t) for t in tokens if t.isdigit()]
    if not numbers:
        return None  # a cache tensor carries its layer number; "cache_position" is not one
    has_key = any(t in _KEY_TOKENS for t in tokens)
    has_value = any(t in _VALUE_TOKENS for t in tokens)
    if has_key and has_value:
        raise CacheNamingError(f"{name!r} names both a key and a value; rename it by hand")
    kind: Kind | None = "key" if has_key else "value" if has_value else None
    if kind is not None and len(numbers) == 1:
        return CacheSlot(direction, numbers[0], kind)
    if kind is None and len(numbers) == 2 and numbers[1] in (0, 1):
        # torch's flattened tuples: past_key_values_<layer>_<0 key | 1 value>
        return CacheSlot(direction, numbers[0], "key" if numbers[1] == 0 else "value")
    if kind is None and len(numbers) == 1:
        return CacheSlot(direction, numbers[0], None)
    raise CacheNamingError(
        f"can't tell the layer and key/value kind of cache tensor {name!r}; rename it by hand"
    )


def _is_stacked(value: ir.Value) -> bool:
    shape = value.shape
    return shape is not None and len(shape) == 5 and shape[0] == 2


def _split_stacked_input(graph: ir.Graph, stacked: ir.Value, layer: int) -> None:
    """Replace a [2, b, H, S, D] input by separate key and value inputs."""
    assert stacked.shape is not None
    halves: list[ir.Value] = []
    for kind in ("key", "value"):
        half = ir.Value(name=f"past.{layer}.{kind}", shape=ir.Shape(list(stacked.shape)[1:]), type=stacked.type)
        half.metadata_props[_ORIGINAL_NAME] = f"{stacked.name}[{0 if kind == 'key' else 1}]"
        halves.append(half)
    position = list(graph.inputs).index(stacked)
    graph.inputs[position : position + 1] = halves
    axes = initializer(graph, f"{stacked.name}.stack_axes", np.array([0], np.int64))
    unsqueezed = [ir.node("Unsqueeze", [half, axes]) for half in halves]
    stack = ir.node("Concat", [u.outputs[0] for u in unsqueezed], attributes={"axis": 0})
    graph.insert_before(graph[0], [*unsqueezed, stack])
    ir.convenience.replace_all_uses_with(stacked, stack.outputs[0])
    # Gather(stack, 0 | 1, axis 0) reads one half: wire the half in directly.
    for use in list(stack.outputs[0].uses()):
        node = use.node
        index_value = node.inputs[1] if node.op_type == "Gather" and len(node.inputs) > 1 else None
        index = index_value.const_value if index_value is not None else None
        if index is None or index.numpy().shape != () or node.attributes.get_int("axis", 0) != 0:
            continue
        ir.convenience.replace_all_uses_with(node.outputs[0], halves[int(index.numpy())])


def _split_stacked_output(graph: ir.Graph, stacked: ir.Value, layer: int) -> None:
    """Replace a [2, b, H, S, D] output by separate key and value outputs."""
    position = list(graph.outputs).index(stacked)
    halves: list[ir.Value] = []
    producer = stacked.producer()
    stacked_from = _unstack_source(producer)
    for index, kind in enumerate(("key", "value")):
        if stacked_from is not None and not stacked_from[index].is_graph_input() and not stacked_from[index].is_graph_output():
            half = stacked_from[index]
        else:
            indices = initializer(graph, f"{stacked.name}.index{index}", np.array(index, np.int64))
            gather = ir.node("Gather", [stacked, indices], attributes={"axis": 0})
            graph.append(gather)
            half = gather.outputs[0]
            if stacked.shape is not None:
                half.shape = ir.Shape(list(stacked.shape)[1:])
            half.type = stacked.type
        half.name = f"present.{layer}.{kind}"
        half.metadata_props[_ORIGINAL_NAME] = f"{stacked.name}[{index}]"
        halves.append(half)
    graph.outputs[position : position + 1] = halves


def _unstack_source(producer: ir.Node | None) -> tuple[ir.Value, ir.Value] | None:
    """The two halves when ``producer`` is Concat(Unsqueeze(k, [0]), Unsqueeze(v, [0]), axis=0)."""
    if producer is None or producer.op_type != "Concat" or len(producer.inputs) != 2:
        return None
    if producer.attributes.get_int("axis", -1) != 0:
        return None
    halves = []
    for value in producer.inputs:
        node = value.producer() if value is not None else None
        if node is None or node.op_type != "Unsqueeze":
            return None
        axes = node.inputs[1].const_value if len(node.inputs) > 1 and node.inputs[1] is not None else None
        if axes is None or axes.numpy().reshape(-1).tolist() != [0] or node.inputs[0] is None:
            return None
        halves.append(node.inputs[0])
    return halves[0], halves[1]


class RenameCachePass(InPlacePass):
    """Rename the cache inputs/outputs to ``past.<l>.key|value`` / ``present.<l>.key|value``.

    ``counts`` holds how many tensors were renamed and how many stacked tensors split.
    Raises :class:`CacheNamingError` (or :class:`NoCacheError`) before changing anything
    when the mapping would need a guess.
    """

    def __init__(self, style: Style = "canonical", split_stacked: bool = True) -> None:
        super().__init__()
        self.style: Style = style
        self.split_stacked = split_stacked
        self.counts: dict[str, int] = {}

    def _plan(self, graph: ir.Graph) -> dict[ir.Value, CacheSlot]:
        plan: dict[ir.Value, CacheSlot] = {}
        for direction, values in (("past", graph.inputs), ("present", graph.outputs)):
            for value in values:
                slot = parse_cache_name(value.name or "", direction)  # type: ignore[arg-type]
                if slot is None:
                    continue
                if slot.kind is None:
                    if not _is_stacked(value):
                        raise CacheNamingError(
                            f"cache tensor {value.name!r} names no key/value kind and is not a "
                            "[2, batch, heads, sequence, head_dim] stack; rename it by hand"
                        )
                    if not self.split_stacked:
                        raise CacheNamingError(
                            f"{value.name!r} holds key and value in one tensor; "
                            "run with stacked caches split to rename it"
                        )
                plan[value] = slot
        if not plan:
            names = ", ".join(v.name or "?" for v in [*graph.inputs, *graph.outputs])
            raise NoCacheError(
                f"the graph has no KV-cache inputs or outputs (it has {names}); "
                "export the decoder with past/present tensors"
            )
        return plan

    @staticmethod
    def _check_complete(plan: dict[ir.Value, CacheSlot]) -> None:
        slots: dict[tuple[str, int, str], ir.Value] = {}
        for value, slot in plan.items():
            kinds = ("key", "value") if slot.kind is None else (slot.kind,)
            for kind in kinds:
                key = (slot.direction, slot.layer, kind)
                if key in slots:
                    raise CacheNamingError(
                        f"{slots[key].name!r} and {value.name!r} both map to "
                        f"{slot.direction}.{slot.layer}.{kind}; rename one of them by hand"
                    )
                slots[key] = value
        for direction in ("past", "present"):
            layers = sorted({layer for d, layer, _ in slots if d == direction})
            if not layers:
                continue
            if layers != list(range(len(layers))):
                raise CacheNamingError(
                    f"{direction} cache layers are numbered {layers}, not 0..{len(layers) - 1}; "
                    "rename them by hand"
                )
            for layer in layers:
                for kind in ("key", "value"):
                    if (direction, layer, kind) not in slots:
                        raise CacheNamingError(f"{direction} layer {layer} has no {kind} tensor")
        past_layers = {layer for d, layer, _ in slots if d == "past"}
        present_layers = {layer for d, layer, _ in slots if d == "present"}
        if past_layers and past_layers != present_layers:
            raise CacheNamingError(
                f"past has {len(past_layers)} layers but present has {len(present_layers)}"
            )

    def _checked_plan(self, graph: ir.Graph) -> dict[ir.Value, CacheSlot]:
        """The renaming, after every check: complete, unambiguous, and onto names no other tensor holds."""
        plan = self._plan(graph)
        self._check_complete(plan)
        target_names = set()
        for slot in plan.values():
            kinds: tuple[Kind, ...] = (slot.kind,) if slot.kind else ("key", "value")
            target_names |= {CacheSlot(slot.direction, slot.layer, k).name(self.style) for k in kinds}
        planned = set(plan)
        for value in [*graph.inputs, *graph.outputs, *(o for n in graph for o in n.outputs)]:
            if value.name in target_names and value not in planned:
                raise CacheNamingError(
                    f"{value.name!r} is already used by a tensor that is not a cache tensor; "
                    "rename it first"
                )
        return plan

    def requires(self, model: ir.Model) -> None:
        """The graph's cache maps onto canonical names without a guess; :class:`CacheNamingError` otherwise."""
        self._checked_plan(model.graph)

    def call(self, model: ir.Model) -> PassResult:
        """Rename (and split) in place; all checks ran before the first change."""
        graph = model.graph
        plan = self._checked_plan(graph)
        # Free every target name first so that a swap (a->b, b->a) can't collide.
        renamed = split = 0
        names_before = {value: value.name for value in plan}
        for value in plan:
            if plan[value].kind is not None:
                value.metadata_props.setdefault(_ORIGINAL_NAME, value.name or "")
                value.name = f"{value.name}.kvexport-renaming"
        for value, slot in plan.items():
            if slot.kind is None:
                if slot.direction == "past":
                    _split_stacked_input(graph, value, slot.layer)
                else:
                    _split_stacked_output(graph, value, slot.layer)
                split += 1
                continue
            new_name = slot.name(self.style)
            if names_before[value] != new_name:  # not the first name: a graph renamed before
                renamed += 1
            value.name = new_name
        self.counts = {"renamed": renamed, "stacked_split": split}
        return PassResult(model, modified=bool(renamed or split))

    def ensures(self, model: ir.Model) -> None:
        """Each cache name of the chosen style exists exactly once, for both key and value."""
        names = [v.name for v in [*model.graph.inputs, *model.graph.outputs]]
        for name in names:
            if name is not None and (name.startswith("past") or name.startswith("present")):
                if names.count(name) != 1:
                    raise PostconditionError(f"cache name {name!r} appears {names.count(name)} times")
        layers = {int(n.split(".")[1]) for n in names if n and n.startswith("present.")}
        for layer in layers:
            for kind in ("key", "value"):
                if f"present.{layer}.{kind}" not in names:
                    raise PostconditionError(f"present.{layer}.{kind} is missing")


def canonical_cache_names(model: ir.Model) -> list[str]:
    """The canonical cache names present in ``model``'s inputs and outputs, in graph order."""
    return [v.name for v in [*model.graph.inputs, *model.graph.outputs] if v.name and canonical_slot(v.name)]
