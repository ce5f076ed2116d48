"""cleanup: fold constants, lift them to initializers, CSE, dead nodes, dedup, sort, strip metadata.

Runs last in the export pipeline (and in ``kvexport rewrite``), after the passes that
leave dead subgraphs behind them.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassManager, PassResult
from onnx_ir.passes.common import (
    ClearMetadataAndDocStringPass,
    CommonSubexpressionEliminationPass,
    DeduplicateInitializersPass,
    LiftConstantsToInitializersPass,
    RemoveUnusedNodesPass,
    RemoveUnusedOpsetsPass,
    TopologicalSortPass,
)
from onnxscript import optimizer


class CleanupPass(InPlacePass):
    """Dead-node removal, initializer dedup, a topological sort and metadata stripping.

    The exporters attach a Python stack trace to every node; a deployment artifact has
    no use for them, and they are most of a small graph's bytes.

    ``counts`` holds nodes and initializers removed by the last call.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def call(self, model: ir.Model) -> PassResult:
        """Run the cleanup pipeline on ``model`` in place."""
        nodes_before = len(model.graph)
        initializers_before = len(model.graph.initializers)
        optimizer.fold_constants(model)
        manager = PassManager(
            [
                LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
                # identical constants first, so that CSE sees the nodes reading them as equal
                DeduplicateInitializersPass(),
                CommonSubexpressionEliminationPass(),
                RemoveUnusedNodesPass(),
                DeduplicateInitializersPass(),
                RemoveUnusedOpsetsPass(),
                TopologicalSortPass(),
                ClearMetadataAndDocStringPass(),
            ]
        )
        result = manager(model)
        self.counts = {
            "nodes_removed": nodes_before - len(model.graph),
            "initializers_removed": initializers_before - len(model.graph.initializers),
        }
        return PassResult(result.model, modified=result.modified)
