"""Rule plumbing: passes built from onnxscript rewrite rules, with per-rule counts."""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnxscript.rewriter import MatchingTracer, RewriteRule, RewriteRuleSet


class RulePass(InPlacePass):
    """Apply onnxscript rewrite rules one after another; ``counts`` says how often each fired.

    Subclasses set ``rules``. Each rule sweeps the whole model before the next one starts,
    so the counts are per rule, not per rule set. With ``explain``, ``explanations`` says
    for each rule that fired 0 times why its closest match failed.
    """

    rules: Sequence[RewriteRule] = ()

    def __init__(self, explain: bool = False) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.explain = explain
        self.explanations: dict[str, str] = {}

    def call(self, model: ir.Model) -> PassResult:
        """Apply every rule in ``rules`` to ``model`` in place."""
        self.explanations = {}
        self.counts = apply_rules(model, self.rules, self.explanations if self.explain else None)
        return PassResult(model, modified=any(self.counts.values()))


def apply_rules(
    model: ir.Model, rules: Sequence[RewriteRule], explanations: dict[str, str] | None = None
) -> dict[str, int]:
    """Apply each rule in turn; return how often each one fired (summed over same names).

    ``explanations``, when given, receives :func:`explain_miss` for each rule that fired
    0 times.
    """
    counts: dict[str, int] = {}
    for rule in rules:
        name = rule.name or type(rule).__name__
        fired = RewriteRuleSet([rule]).apply_to_model(model)
        counts[name] = counts.get(name, 0) + fired
        if explanations is not None and not fired:
            explanations[name] = explain_miss(model, rule)
    return counts


def explain_miss(model: ir.Model, rule: RewriteRule) -> str:
    """Why ``rule`` does not fire on ``model``: its closest match, from onnxscript's MatchingTracer.

    The tracer keeps the best partial match (most pattern nodes matched, furthest stage):
    a failed ``check`` gives the rule's own reason; a pattern that stops short says so.
    Matching under a tracer changes nothing in the model.
    """
    return closest_miss(model, rule)[1]


def closest_miss(model: ir.Model, rule: RewriteRule) -> tuple[int, str]:
    """:func:`explain_miss`'s answer with the number of pattern nodes its closest match matched (0: none)."""
    tracer = MatchingTracer()
    RewriteRuleSet([rule]).apply_to_model(model, tracer=tracer)
    matches = tracer.best_matches_map.get(rule) or []
    if not matches:
        return 0, "no node looks like the pattern's output"
    best = matches[0]
    nodes = len(best.match_result.nodes)
    reason = best.match_result.reason or "the pattern did not match"
    stage = "check failed" if best.status.name == "CONDITION_FAILED" else "pattern stopped"
    where = best.root_node.name or best.root_node.op_type
    return nodes, f"{stage} at {where} ({nodes} nodes matched): {reason}"
