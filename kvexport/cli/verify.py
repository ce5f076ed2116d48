"""``kvexport verify``: the export against PyTorch, step by step (:func:`kvexport.tools.verify.verify`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from kvexport.cli.base import (
    EXIT_FAILED_CHECKS,
    UserError,
    json_option,
    main,
    progress,
    provider_option,
    run,
)
from kvexport.extras import require_export_extra


@main.command("verify")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--steps", default=8, show_default=True, type=int, help="Decode steps after prefill.")
@click.option(
    "--text",
    type=click.Path(path_type=Path),
    default=None,
    help="A UTF-8 text file: add teacher-forced perplexity of the export and of PyTorch on it.",
)
@click.option(
    "--text-tokens", default=2048, show_default=True, type=int, help="Use at most this many tokens of --text."
)
@provider_option
@json_option
def verify_command(
    directory: Path, steps: int, text: Path | None, text_tokens: int, provider: str, as_json: bool
) -> None:
    """Check DIRECTORY's graphs against PyTorch, step by step; exit 0 only if all checks hold.

    A quantized export is judged by quality against PyTorch fp32 (top-1 agreement, KL
    divergence) within its scheme's tolerances, not by fp32 parity.
    """
    run(lambda: require_export_extra("kvexport verify (the PyTorch reference)"))
    from kvexport.tools.verify import verify

    if steps < 1:
        raise UserError(f"--steps {steps}: must be at least 1")
    report = run(
        lambda: verify(
            directory,
            steps=steps,
            provider=provider,
            text=text,
            text_tokens=text_tokens,
            progress=progress,
        )
    )
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _render_verify(report)
    if not report.ok:
        sys.exit(EXIT_FAILED_CHECKS)


def _render_verify(report: Any) -> None:
    rows: dict[tuple[str, str], list[Any]] = {}
    for check in report.tensors:
        kind = "logits" if check.name == "logits" else "cache"
        rows.setdefault((check.case, kind), []).append(check)
    click.echo(
        f"{'case':<20} {'tensor':<7} {'checks':>6} {'max abs diff':>13} {'max rel diff':>13} {'tol (abs/rel)':>15}  result"
    )
    for (case, kind), checks in rows.items():
        worst_abs = max(c.max_abs_diff for c in checks)
        worst_rel = max(c.max_rel_diff for c in checks)
        ok = all(c.ok for c in checks)
        tol = f"{checks[0].atol:g}/{checks[0].rtol:g}"
        click.echo(
            f"{case:<20} {kind:<7} {len(checks):>6} {worst_abs:>13.3e} {worst_rel:>13.3e} {tol:>15}  {'ok' if ok else 'FAIL'}"
        )
    for case in dict.fromkeys(t.case for t in report.tokens):
        tokens = [t for t in report.tokens if t.case == case]
        agree = sum(t.ok for t in tokens)
        verdict = "ok" if agree == len(tokens) else ("FAIL" if not report.quantized else "-")
        click.echo(
            f"{case:<20} {'tokens':<7} {len(tokens):>6} {'greedy agree':>13} {agree:>13}/{len(tokens):<15} {verdict}"
        )
    if report.quantized:
        _render_quality(report)
    if report.text is not None:
        _render_text(report)
    for line in report.failures():
        click.echo(f"FAIL {line}")
    verdict = "PASS" if report.ok else "FAIL"
    click.echo(
        f"{verdict}: {report.provider}, {report.dtype}, {report.steps} steps, {report.seconds:.1f} s"
    )


def _render_quality(report: Any) -> None:
    """Quantized exports: quality against PyTorch fp32, per case and over a text."""
    tol = report.tolerances
    click.echo(
        f"quality vs PyTorch fp32 (tolerance: mean KL <= {tol['max_mean_kl']}; over --text also top-1 "
        f"agreement >= {tol['min_top1_agreement']}, perplexity increase <= {tol['max_perplexity_delta_pct']}%)"
    )
    click.echo(f"{'case':<20} {'steps':>6} {'greedy agree':>12} {'mean KL':>10} {'max logit err':>14}")
    for case in dict.fromkeys(q.case for q in report.quality):
        checks = [q for q in report.quality if q.case == case]
        agree = sum(q.top1_agreement for q in checks) / len(checks)
        kl = sum(q.mean_kl for q in checks) / len(checks)
        error = max(q.max_logit_error for q in checks)
        click.echo(f"{case:<20} {len(checks):>6} {agree:>12.3f} {kl:>10.2e} {error:>14.3f}")


def _render_text(report: Any) -> None:
    text = report.text
    click.echo(
        f"text {text.file}: {text.tokens} tokens, perplexity {text.perplexity_onnx:.3f} vs PyTorch "
        f"{text.perplexity_torch:.3f} ({text.perplexity_delta_pct:+.2f}%; {text.late_perplexity_delta_pct:+.2f}% over each "
        f"window's second half, as llama-perplexity scores), top-1 agreement "
        f"{text.top1_agreement:.3f}, mean KL {text.mean_kl:.2e}, max logit error {text.max_logit_error:.3f}"
    )
