"""Renderings more than one command prints: the manifest's quantization and cache lines, verify's summary, the pass table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


def cache_line(manifest: Any) -> str:
    """The cache's layout, and its type when it is not the graph's."""
    if manifest.cache_dtype == manifest.dtype:
        return manifest.cache_layout
    q = manifest.cache.get("quantization") or {}
    return f"{manifest.cache_layout}, {manifest.cache_dtype} {q.get('type', '').lower().replace('_', '-')}"


def quantization_line(q: dict[str, Any]) -> str:
    """The manifest's ``quantization`` as one line (export summary and ``inspect``)."""
    if q.get("per_channel"):
        if q.get("activation_scale") != "row":
            kernel, weights = "DynamicQuantizeMatMul, activations quantized per call", "7-bit"
        else:
            kernel, weights = "MatMulIntegerToFloat, activations quantized per row", f"{q.get('channel_bits', 7)}-bit"
        gated = f"; the gated MLP's down projection in 8-bit blocks of {q['block_size']}" if q.get("gated_blocks") else ""
        if q.get("gated_rotation"):
            gated = f"; the gated MLP's down projection after a Hadamard rotation in blocks of up to {q['gated_rotation']}"
        return f"quantized {q['scheme']}: {weights} weights per output channel, head included ({kernel}){gated}"
    if q.get("offsets"):  # Q4_1's format: the head and embeddings stay symmetric
        blocks = "asymmetric with each block's float offset; head and embeddings symmetric"
    else:
        blocks = "symmetric" if q["symmetric"] else "asymmetric"
    return (
        f"quantized {q['scheme']}: {q['bits']}-bit blocks of {q['block_size']}, head and embeddings "
        f"{q['head_bits']}-bit, {blocks}, accuracy level {q['accuracy_level']}"
    )


def verify_sentence(summary: dict[str, Any]) -> str:
    """The manifest's last verify summary as one sentence."""
    verdict = "PASS" if summary.get("ok") else "FAIL"
    text = (
        f"{verdict} on {summary.get('provider', '?')}, {summary.get('steps', '?')} decode steps, "
        f"{summary.get('failed', 0)} of {summary.get('checks', '?')} checks failed"
    )
    if summary.get("max_abs_diff_logits") is not None:
        text += f", logits within {summary['max_abs_diff_logits']:.2g} of PyTorch"
    quality = summary.get("quality")
    if quality:
        text += f", mean KL {quality['mean_kl']:.2g} against PyTorch fp32"
    if summary.get("text"):
        text += f", perplexity {summary['text']['perplexity_delta_pct']:+.2f}% on {Path(summary['text']['file']).name}"
    return text + f" ({summary.get('seconds', 0):.1f} s)"


def echo_pass_table(entries: list[dict[str, Any]]) -> None:
    """One line per pass: nodes, Shape nodes, fused attention and Softmax after, rule counts."""
    click.echo(f"{'graph':<8} {'pass':<23} {'nodes':>11} {'Shape':>9} {'fused':>5} {'Softmax':>7}  counts")
    for e in entries:
        nodes = f"{e['nodes_before']}->{e['nodes_after']}"
        shapes = f"{e.get('shape_nodes_before', '?')}->{e.get('shape_nodes_after', '?')}"
        counts = ", ".join(f"{k} {v}" for k, v in e.get("counts", {}).items() if v)
        click.echo(
            f"{e.get('graph', ''):<8} {e.get('name', e.get('pass', '?')):<23} {nodes:>11} {shapes:>9} "
            f"{e.get('fused_attention_after', '?'):>5} {e.get('softmax_after', '?'):>7}  {counts}"
        )
