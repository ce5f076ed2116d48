"""Rule plumbing: passes built from onnxscript rewrite rules, with per-rule counts."""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnxscript.rewriter import RewriteRule, RewriteRuleSet


class RulePass(InPlacePass):
    """Apply onnxscript rewrite rules one after another; ``counts`` says how often each fired.

    Subclasses set ``rules``. Each rule runs to a fixed point over the whole model before
    the next one starts, so the counts are per rule, not per rule set.
    """

    rules: Sequence[RewriteRule] = ()

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def call(self, model: ir.Model) -> PassResult:
        """Apply every rule in ``rules`` to ``model`` in place."""
        self.counts = apply_rules(model, self.rules)
        return PassResult(model, modified=any(self.counts.values()))

def apply_rules(model: ir.Model, rules: Sequence[RewriteRule]) -> dict[str, int]:
    """Apply each rule in turn; return how often each one fired (summed over same names)."""
    counts: dict[str, int] = {}
    for rule in rules:
        name = rule.name or type(rule).__name__
        fired = RewriteRuleSet([rule]).apply_to_model(model)
        counts[name] = counts.get(name, 0) + fired
    return counts
