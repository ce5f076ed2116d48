"""The ``kvexport`` command: a thin click layer over the library (parse, call, render).

Results go to stdout, progress to stderr. Every user error is one line and a non-zero
exit, never a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import click

from kvexport.drafting import DEFAULT_DRAFT_TOKENS
from kvexport.errors import TERMINATING, KvexportError, Terminated
from kvexport.export.choices import (
    DEFAULT_OPSET,
    EXPORT_STRATEGIES,
    KV_CACHE_KINDS,
    AttentionKind,
    CacheKind,
    DtypeKind,
    QuantizationChoice,
    QuantizeKind,
    TargetKind,
    values,
)
from kvexport.extras import require_export_extra, require_extra
from kvexport.serving.config import engine_options

F = TypeVar("F", bound=Callable[..., Any])

EXIT_FAILED_CHECKS = 1  # verify ran and some check failed; user errors exit 2 (click's usage code)


def _progress(message: str) -> None:
    if TERMINATING.is_set():  # a SIGTERM whose exception a finalizer swallowed: stop at the next stage
        raise Terminated
    click.echo(f"kvexport: {message}", err=True)


def _quiet_libraries() -> None:
    """Keep third-party chatter off the terminal; kvexport reports what matters itself."""
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # read by transformers when export or verify first imports it; importing it here would
    # load transformers (and torch) for commands that need neither
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one cleanup, however many signals follow
    TERMINATING.set()  # in case the exception below lands where something swallows it
    raise Terminated


def _swallowed_sigterm_hook(previous: Callable[[Any], object]) -> Callable[[Any], None]:
    """An unraisable hook that drops a Terminated a ``__del__`` or callback swallowed, and hands the rest to ``previous``.

    A SIGTERM that lands while the garbage collector runs a finalizer raises there, and Python
    prints "Exception ignored in ..." with a traceback. The command stops anyway: at its next
    progress line or before its output is renamed into place (TERMINATING is set).
    """

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, Terminated):
            previous(unraisable)

    hook.kvexport = True  # type: ignore[attr-defined]  # installed once, however often main() runs
    return hook


class UserError(click.ClickException):
    """A ClickException that exits 2, like click's own usage errors."""

    exit_code = 2


def _run(call: Callable[[], Any]) -> Any:
    """Run library code, turning user errors into one-line ClickExceptions."""
    try:
        return call()
    except KvexportError as exc:
        raise UserError(str(exc)) from None
    except (KeyboardInterrupt, Terminated) as stop:
        click.echo("kvexport: interrupted; nothing was written", err=True)
        sys.exit(143 if isinstance(stop, Terminated) else 130)


def json_option(function: F) -> F:
    """``--json``: machine-readable output on stdout."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(
        function
    )


def attention_option(default: str | None, note: str) -> Callable[[F], F]:
    """``--attention unfused|onnx|ort``, shared by ``gpt2`` and ``rewrite``."""
    return click.option(
        "--attention",
        type=click.Choice(values(AttentionKind)),
        default=default,
        show_default=default is not None,
        help=f"Attention: unfused, onnx (opset-23 Attention op) or ort (com.microsoft fused ops){note}.",
    )


def quantization_options(function: F) -> F:
    """``--quantize`` and its knobs, handed to the command as one ``quantization`` (a :class:`QuantizationChoice`)."""

    @functools.wraps(function)
    def command(
        *args: Any,
        quantize: str,
        block_size: int | None,
        symmetric: bool | None,
        offsets: bool | None,
        accuracy_level: int | None,
        head_bits: str | None,
        per_channel: bool | None,
        **kwargs: Any,
    ) -> Any:
        given = {
            "block_size": block_size,
            "symmetric": symmetric,
            "offsets": offsets,
            "accuracy_level": accuracy_level,
            "head_bits": int(head_bits) if head_bits is not None else None,
            "per_channel": per_channel,
        }
        overrides = {knob: value for knob, value in given.items() if value is not None}
        choice = _run(lambda: QuantizationChoice(QuantizeKind(quantize), overrides))
        return function(*args, quantization=choice, **kwargs)

    for option in reversed(
        [
            click.option(
                "--quantize",
                type=click.Choice(values(QuantizeKind)),
                default=QuantizeKind.NONE.value,
                show_default=True,
                help="Weight-only quantization with ONNX Runtime's MatMulNBits / GatherBlockQuantized (ort attention only).",
            ),
            click.option(
                "--per-channel/--blocks",
                default=None,
                help="int8: blocks of 32 (MatMulNBits, llama.cpp Q8_0's grid and arithmetic: SmolLM2-135M +0.35% "
                "perplexity, 96% top-1, Q8_0 +0.46%) or per-channel (fp32, CPU: weights per output channel, activations quantized row by row, "
                "MatMulIntegerToFloat; prompts in 0.4x the blocks' time, but on real weights far below Q8_0: "
                "SmolLM2-135M +3.2% perplexity, 88% top-1) [default: blocks].",
            ),
            click.option(
                "--block-size",
                type=int,
                default=None,
                help="Weights per scale, a power of two >= 16 [default: 32].",
            ),
            click.option(
                "--symmetric/--asymmetric",
                default=None,
                help="Symmetric blocks (a scale each) or asymmetric (a zero point too) [default: int8 symmetric, "
                "int4 asymmetric with --offsets; --symmetric --block-size 128 is the int4 before December 2026: "
                "faster prompts, but on SmolLM2-135M +35% perplexity against +0.5%].",
            ),
            click.option(
                "--offsets/--no-offsets",
                default=None,
                help="Asymmetric blocks keep each block's float offset (llama.cpp's Q4_1 format: an integer zero point "
                "plus the remainder, added back through the activation's block sums) [default: on for int4].",
            ),
            click.option(
                "--accuracy-level",
                type=click.IntRange(0, 4),
                default=None,
                help="MatMulNBits compute type on CPU: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 [default: 4].",
            ),
            click.option(
                "--head-bits",
                type=click.Choice(["4", "8"]),
                default=None,
                help="Bits of the LM head and embeddings [default: 8].",
            ),
        ]
    ):
        command = option(command)
    return command  # type: ignore[return-value]


def _knobs(choice: QuantizationChoice, *, defaulted: bool = False) -> Any:
    """The :class:`~passes.QuantizationConfig` a command's ``quantization`` stands for (None: float).

    ``defaulted``: None too when no knob was given, so the export picks the scheme's default
    (and, for ``--per-channel``, the family's recipe).
    """
    from kvexport.export.quantization import quantization_config

    if defaulted and not choice.overrides:
        return None
    return _run(lambda: quantization_config(choice))


def kv_cache_option(function: F) -> F:
    """``--kv-cache`` (:data:`~kvexport.export.choices.KV_CACHE_KINDS`), shared by the export commands and ``import``."""
    return click.option(
        "--kv-cache",
        type=click.Choice(KV_CACHE_KINDS),
        default=None,
        help="The KV cache's type [default: the graph dtype]; int8 / int4 quantize it in GroupQueryAttention "
        "(the in-place cache, fp32 graphs) with per-channel scales calibrated on text at export. int8 holds "
        "fp32's quality on real weights (SmolLM2-135M: +0.14% perplexity, 98% top-1); int4 does not (+13%, 78%: "
        "verify fails it) and is there by name only.",
    )(function)


def cache_option(help_text: str) -> Callable[[F], F]:
    """``--cache concat|shared-buffer``, shared by ``gpt2`` and ``import``."""
    return click.option("--cache", type=click.Choice(values(CacheKind)), default=None, help=help_text)


def provider_option(function: F) -> F:
    """``--provider cpu|cuda|auto``, as ``EngineConfig.provider`` defines it."""
    from kvexport.serving.config import EngineConfig

    setting = next(f for f in dataclasses.fields(EngineConfig) if f.name == "provider")
    return click.option(
        "--provider",
        type=click.Choice(list(setting.metadata["choices"])),
        default=setting.default,
        show_default=True,
        help=setting.metadata["help"],
    )(function)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvexport")
def main() -> None:
    """Export decoder LMs (GPT-2, ...) to ONNX prefill/decode graphs with a KV cache, verify and serve them."""
    _quiet_libraries()
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    if not getattr(sys.unraisablehook, "kvexport", False):
        sys.unraisablehook = _swallowed_sigterm_hook(sys.unraisablehook)


def export_options(function: F) -> F:
    """The options every export command takes (all but ``--model``), from the export's choices."""
    for option in reversed(
        [
            click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Output directory."),
            click.option("--random-init", is_flag=True, help="Seeded random weights for the architecture (offline)."),
            click.option("--seed", default=0, show_default=True, type=int, help="Seed for --random-init."),
            click.option(
                "--target",
                type=click.Choice(values(TargetKind)),
                default=TargetKind.PORTABLE.value,
                show_default=True,
                help="Where the graphs will run: portable (standard ops), ort-cpu / ort-cuda (ONNX Runtime fused ops; ort-cuda defaults to fp16).",
            ),
            attention_option(default=None, note="; default per target"),
            click.option(
                "--dtype",
                type=click.Choice(values(DtypeKind)),
                default=None,
                help="Weights and activations [default: fp16 for ort-cuda, else fp32].",
            ),
            cache_option(
                "Cache layout: concat (a new present per step) or shared-buffer (one buffer updated in "
                "place; needs ort attention) [default: shared-buffer for ort targets, else concat]."
            ),
            quantization_options,
            click.option(
                "--opset", default=DEFAULT_OPSET, show_default=True, type=click.IntRange(14, 24), help="ONNX opset."
            ),
            click.option("--all-logits", is_flag=True, help="Prefill returns logits for every position."),
            kv_cache_option,
            click.option("--force", is_flag=True, help="Replace a non-empty output directory."),
            click.option("--allow-pickle", is_flag=True, help="Allow a trusted pickle (.bin) checkpoint."),
            click.option(
                "--exporter",
                type=click.Choice(["auto", *EXPORT_STRATEGIES]),
                default="auto",
                show_default=True,
                help="Export road; auto tries dynamo, then torchscript.",
            ),
            json_option,
        ]
    ):
        function = option(function)
    return function


@main.command("gpt2")
@click.option(
    "--model",
    default="gpt2",
    show_default=True,
    help="Model directory or hub id; with --random-init a preset (gpt2, distilgpt2, gpt2-medium, "
    "gpt2-large, gpt2-xl) or a config.json.",
)
@export_options
def gpt2_command(model: str, **options: Any) -> None:
    """Export GPT-2 to OUT/ (prefill.onnx, decode.onnx, weights, kvexport.json, tokenizer.json)."""
    _export("kvexport gpt2", model, "gpt2", **options)


@main.command("export")
@click.option(
    "--model",
    required=True,
    help="A model directory (config.json + safetensors + tokenizer files), or with --random-init "
    "a preset or a config.json; the family comes from its model_type.",
)
@export_options
def export_command(model: str, **options: Any) -> None:
    """Export a model of any known family to OUT/ (the family from its config's model_type)."""
    _export("kvexport export", model, None, **options)


def _export(
    command: str,
    model: str,
    family: str | None,
    out: Path,
    random_init: bool,
    seed: int,
    target: str,
    attention: str | None,
    dtype: str | None,
    cache: str | None,
    quantization: QuantizationChoice,
    opset: int,
    all_logits: bool,
    kv_cache: str | None,
    force: bool,
    allow_pickle: bool,
    exporter: str,
    as_json: bool,
) -> None:
    """Run one export command and render its result."""
    _run(lambda: require_export_extra(command))
    from kvexport.export.exporter import DEFAULT_STRATEGY_ORDER, export_model

    strategies = DEFAULT_STRATEGY_ORDER if exporter == "auto" else (exporter,)
    knobs = _knobs(quantization, defaulted=True)
    result = _run(
        lambda: export_model(
            out,
            model,
            family=family,
            random_init=random_init,
            seed=seed,
            target=target,  # type: ignore[arg-type]
            attention=attention,  # type: ignore[arg-type]
            dtype=dtype,  # type: ignore[arg-type]
            cache=cache,  # type: ignore[arg-type]
            quantize=quantization.scheme.value,
            quantization=knobs,
            opset=opset,
            all_logits=all_logits,
            kv_cache=kv_cache,
            force=force,
            allow_pickle=allow_pickle,
            strategies=strategies,
            progress=_progress,
        )
    )
    manifest = result.manifest
    if as_json:
        click.echo(json.dumps(manifest.to_dict(), indent=2))
        return
    dims = manifest.dims
    click.echo(f"exported {manifest.source.describe()} to {result.out_dir}")
    click.echo(
        f"  layers {dims.num_layers}, heads {dims.num_heads} (cache {dims.num_kv_heads}) x {dims.head_dim}, vocab {dims.vocab_size}, "
        f"positions {dims.max_positions}, {manifest.dtype}, opset {manifest.opset}"
    )
    click.echo(f"  target {manifest.target}, attention {manifest.attention}, cache {_cache_line(manifest)}")
    if manifest.quantization:
        click.echo(f"  {_quantization_line(manifest.quantization)}")
    click.echo(
        f"  strategy {result.strategy}; nodes: prefill {result.node_counts['prefill']}, decode {result.node_counts['decode']}"
    )
    click.echo(
        f"  weights {manifest.weights['bytes'] / 1e6:.1f} MB in {manifest.weights['file']} (shared)"
    )
    click.echo(f"  tokenizer: {manifest.tokenizer['source']}")
    click.echo(f"  took {result.seconds:.1f} s; next: kvexport verify {result.out_dir}")


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
    _run(lambda: require_export_extra("kvexport verify (the PyTorch reference)"))
    from kvexport.tools.verify import verify

    if steps < 1:
        raise UserError(f"--steps {steps}: must be at least 1")
    report = _run(
        lambda: verify(
            directory,
            steps=steps,
            provider=provider,
            text=text,
            text_tokens=text_tokens,
            progress=_progress,
        )
    )
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _render_verify(report)
    if not report.ok:
        sys.exit(EXIT_FAILED_CHECKS)


@main.command("check")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--steps", default=4, show_default=True, type=int, help="Greedy decode steps to run.")
@provider_option
@json_option
def check_command(directory: Path, steps: int, provider: str, as_json: bool) -> None:
    """Check DIRECTORY without torch: manifest, file hashes, graph IO, external data, a few steps.

    Exit 0 when every check holds, 1 when one fails, 2 when there is nothing to check.
    """
    from kvexport.tools.check import check

    report = _run(lambda: check(directory, steps=steps, provider=provider, progress=_progress))
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        for item in report.checks:
            click.echo(f"{'ok  ' if item.ok else 'FAIL'} {item.name:<22} {item.detail}")
        click.echo(f"{'PASS' if report.ok else 'FAIL'}: {report.directory}, {report.seconds:.1f} s")
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


def sampling_options(function: F) -> F:
    """Hugging Face style sampling options shared by generate and bench."""
    for option in reversed(
        [
            click.option("--do-sample", is_flag=True, help="Sample instead of greedy decoding."),
            click.option("--temperature", default=1.0, show_default=True, type=float),
            click.option("--top-k", default=0, show_default=True, type=int, help="0 disables it."),
            click.option(
                "--top-p", default=1.0, show_default=True, type=float, help="1.0 disables it."
            ),
            click.option("--seed", default=None, type=int, help="Seed for sampling."),
        ]
    ):
        function = option(function)
    return function


def speculation_options(function: F) -> F:
    """``--prompt-lookup`` / ``--draft DIR`` and ``--draft-tokens K``: speculative decoding."""
    for option in reversed(
        [
            click.option(
                "--prompt-lookup",
                is_flag=True,
                help="Speculative decoding with prompt lookup drafts (needs an --all-logits export).",
            ),
            click.option(
                "--draft",
                type=click.Path(path_type=Path),
                default=None,
                help="Speculative decoding with this smaller in-place export as the drafter (same tokenizer).",
            ),
            click.option(
                "--draft-tokens", default=DEFAULT_DRAFT_TOKENS, show_default=True, type=click.IntRange(1), help="Drafts per step."
            ),
        ]
    ):
        function = option(function)
    return function


def _drafter(prompt_lookup: bool, draft: Path | None, provider: str) -> Any:
    """The drafter the speculation options ask for (None: no speculation)."""
    from kvexport.serving.config import (
        EngineConfig,  # the settings' one check and one drafter choice
    )

    draft_path = None if draft is None else str(draft)
    config = _run(lambda: EngineConfig(provider=provider, prompt_lookup=prompt_lookup, draft=draft_path))
    return _run(config.drafter)


@main.command("generate")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--prompt", required=True, help="Prompt text (tokenized with the exported tokenizer)."
)
@click.option("--max-new-tokens", default=50, show_default=True, type=int)
@click.option(
    "--share-weights",
    is_flag=True,
    help="One mapped copy of the weights (least memory, slower on CPU).",
)
@click.option(
    "--prepacked",
    is_flag=True,
    help="CPU: both graphs map one file of pre-packed weights, built once per machine (less memory, same speed).",
)
@click.option(
    "--prepack-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where --prepacked keeps its cache (default: DIRECTORY/.ort-prepacked).",
)
@click.option(
    "--truncate",
    is_flag=True,
    help="Keep the prompt's last tokens when it leaves no room for --max-new-tokens (default: error).",
)
@sampling_options
@speculation_options
@provider_option
def generate_command(
    directory: Path,
    prompt: str,
    max_new_tokens: int,
    share_weights: bool,
    prepacked: bool,
    prepack_dir: Path | None,
    truncate: bool,
    do_sample: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None,
    prompt_lookup: bool,
    draft: Path | None,
    draft_tokens: int,
    provider: str,
) -> None:
    """Stream generated text for PROMPT to stdout; TTFT and tokens/s go to stderr."""
    from kvexport.runtime import Generator, SamplingConfig

    if not prompt:
        raise UserError("--prompt is empty; pass some text")
    drafter = _drafter(prompt_lookup, draft, provider)
    if drafter is not None:
        if share_weights or prepacked or truncate:
            raise UserError("--share-weights, --prepacked and --truncate are not for speculative decoding; drop them")
        sampling = SamplingConfig(do_sample, temperature, top_k, top_p, seed)
        _speculative_generate(directory, prompt, max_new_tokens, sampling, drafter, draft_tokens, provider)
        return
    generator = _run(
        lambda: Generator(
            directory,
            provider=provider,
            share_weights=share_weights,
            prepacked=prepacked,
            prepack_dir=prepack_dir,
        )
    )
    pieces = generator.stream_text(
        prompt,
        max_new_tokens,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        truncate=truncate,
    )
    _echo_stream(prompt, pieces)
    stats = generator.last_stats
    click.echo(
        f"kvexport: {stats.new_tokens} tokens, prompt {stats.prompt_tokens}; TTFT {stats.ttft_s * 1000:.1f} ms, "
        f"decode {stats.decode_ms_per_token:.1f} ms/token, {stats.tokens_per_s:.1f} tokens/s ({generator.provider})",
        err=True,
    )


def _echo_stream(prompt: str, pieces: Iterator[str]) -> None:
    """The prompt, then each generated piece as it comes, to stdout."""
    click.echo(prompt, nl=False)

    def stream() -> None:
        for piece in pieces:
            click.echo(piece, nl=False)
            sys.stdout.flush()

    _run(stream)
    click.echo()


def _speculative_generate(
    directory: Path, prompt: str, max_new_tokens: int, sampling: Any, drafter: Any, draft_tokens: int, provider: str
) -> None:
    """``kvexport generate`` with a drafter: the text, then the speculation's figures on stderr."""
    from kvexport.runtime.speculative import SpeculativeGenerator

    generator = _run(lambda: SpeculativeGenerator(directory, drafter, draft_tokens=draft_tokens, provider=provider))
    pieces = generator.stream_text(prompt, max_new_tokens, sampling)
    _echo_stream(prompt, pieces)
    stats = generator.last_stats
    click.echo(
        f"kvexport: {stats.new_tokens} tokens in {stats.rounds} verify calls; drafts accepted {stats.accepted}/"
        f"{stats.proposed} ({100 * stats.acceptance_rate:.0f}%); TTFT {stats.ttft_s * 1000:.1f} ms, "
        f"decode {stats.decode_ms_per_token:.1f} ms/token",
        err=True,
    )


def _int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: pass comma-separated integers, e.g. 128,512,1000"
        ) from None


@main.command("bench")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--contexts",
    default="128,512,1000",
    show_default=True,
    callback=_int_list,
    help="Prompt lengths.",
)
@click.option(
    "--batches", default="1,4", show_default=True, callback=_int_list, help="Batch sizes."
)
@click.option(
    "--new-tokens", default=16, show_default=True, type=int, help="Decode steps per measurement."
)
@click.option("--repeats", default=2, show_default=True, type=int)
@click.option("--no-baselines", is_flag=True, help="Skip the PyTorch and no-cache baselines.")
@click.option(
    "--no-memory-variants",
    "--no-shared",
    "no_memory_variants",
    is_flag=True,
    help="Skip the memory-saving Generator variants (pre-packed, shared weights); --no-shared is the old spelling.",
)
@click.option(
    "--compare",
    "compare",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Another export of the same weights (e.g. --target ort-cpu) to time in the same run; repeatable.",
)
@click.option(
    "--prefix",
    default=512,
    show_default=True,
    type=click.IntRange(0),
    help="In-place exports: the serving engine's TTFT with a cached prefix of this many tokens against cold (0 skips).",
)
@click.option(
    "--draft",
    "drafts",
    multiple=True,
    type=click.Path(path_type=Path),
    help="An --all-logits export also gets speculative rows; this export drafts in one more (repeatable).",
)
@click.option(
    "--text",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="Passages for the speculative rows (default: random token ids).",
)
@click.option(
    "--results",
    default=Path("bench-results"),
    show_default=True,
    type=click.Path(path_type=Path),
    help="Directory for bench.json and bench.png.",
)
@provider_option
@json_option
def bench_command(
    directory: Path,
    contexts: list[int],
    batches: list[int],
    new_tokens: int,
    repeats: int,
    no_baselines: bool,
    no_memory_variants: bool,
    compare: tuple[Path, ...],
    prefix: int,
    drafts: tuple[Path, ...],
    text: Path | None,
    results: Path,
    provider: str,
    as_json: bool,
) -> None:
    """Time TTFT and decode ms/token against PyTorch, no-cache and the bandwidth floor, in one run."""
    _run(lambda: require_export_extra("kvexport bench (the PyTorch baselines)"))
    _run(lambda: require_extra("bench", "kvexport bench (its plot)"))
    from kvexport.tools.bench import run_bench, write_json, write_plot

    report = _run(
        lambda: run_bench(
            directory,
            provider=provider,
            contexts=contexts,
            batches=batches,
            new_tokens=new_tokens,
            repeats=repeats,
            baselines=not no_baselines,
            memory_variants=not no_memory_variants,
            compare=compare,
            prefix=prefix,
            drafts=drafts,
            text=text,
            progress=_progress,
        )
    )
    results.mkdir(parents=True, exist_ok=True)
    write_json(report, results / "bench.json")
    write_plot(report, results / "bench.png")
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    click.echo(f"{'system':<32} {'batch':>5} {'context':>7} {'TTFT ms':>9} {'decode ms/token':>16}")
    for m in sorted(report.measurements, key=lambda m: (m.batch, m.context, m.system)):
        ttft = f"{m.ttft_ms:.1f}" if m.ttft_ms is not None else "-"
        decode = f"{m.decode_ms_per_token:.2f}" if m.decode_ms_per_token is not None else "-"
        click.echo(f"{m.system:<32} {m.batch:>5} {m.context:>7} {ttft:>9} {decode:>16}")
    memory = [f"kvexport RSS {report.generator_rss_mb:.0f} / PSS {report.generator_pss_mb:.0f} MiB"]
    memory += [
        f"{system} RSS {m['rss_mb']:.0f} / PSS {m['pss_mb']:.0f} MiB"
        for system, m in report.variant_memory.items()
    ]
    click.echo(
        f"bandwidth {report.bandwidth_gb_s} GB/s; weights {report.weight_bytes / 1e6:.1f} MB; "
        + "; ".join(memory)
        + f" (process {report.rss_after_load_mb:.0f} MiB)"
    )
    for system, figures in report.speculation.items():
        click.echo(f"{system}: drafts accepted {100 * figures['acceptance_rate']:.0f}%, {figures['tokens_per_call']} tokens per call")
    click.echo("ratios: " + ", ".join(f"{k} {v}" for k, v in report.ratios().items()))
    click.echo(f"wrote {results / 'bench.json'} and {results / 'bench.png'}")


@main.command("serve")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port (0: any free one, printed).")
@click.option("--model-name", default=None, help="The model name clients use [default: the directory's name].")
@click.option(
    "--replicas",
    type=click.IntRange(1),
    default=None,
    help="Serve through Ray Serve with this many replicas, one engine each (needs kvexport[ray]).",
)
@click.option(
    "--ray-address",
    default=None,
    help="With --replicas: join this Ray cluster (auto, ray://host:10001) instead of starting one here.",
)
@click.option(
    "--chat-template",
    type=click.Path(path_type=Path),
    default=None,
    help="A Jinja chat template for /v1/chat/completions [default: the export's tokenizer_config.json one, if any].",
)
@click.option(
    "--api-key",
    envvar="KVEXPORT_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' on every /v1 and tokenizer route (401 otherwise) [env: KVEXPORT_API_KEY].",
)
@click.option(
    "--enable-prompt-tokens-details",
    is_flag=True,
    help="Send usage.prompt_tokens_details.cached_tokens (prompt tokens the prefix cache served); null otherwise, as vLLM.",
)
@click.option(
    "--return-tokens-as-token-ids",
    is_flag=True,
    help="Show logprobs' tokens as 'token_id:N' unless a request sets return_tokens_as_token_ids (vLLM's flag).",
)
@engine_options
def serve_command(
    directory: Path,
    host: str,
    port: int,
    model_name: str | None,
    replicas: int | None,
    ray_address: str | None,
    chat_template: Path | None,
    api_key: str | None,
    enable_prompt_tokens_details: bool,
    return_tokens_as_token_ids: bool,
    engine_settings: dict[str, Any],
) -> None:
    """Serve DIRECTORY over HTTP with an OpenAI-compatible API.

    Routes: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
    /tokenizer_info, /health, /metrics. Many requests decode together (continuous batching
    over the in-place cache): the export needs --target ort-cpu / ort-cuda. Needs the serve
    extra: pip install 'kvexport[serve]'.
    """
    from kvexport.serving.config import ApiConfig, EngineConfig

    config = _run(lambda: EngineConfig.from_options(engine_settings))
    api = ApiConfig(
        name=model_name,
        chat_template=None if chat_template is None else str(chat_template),
        api_key=api_key or None,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
    )
    if replicas is not None:
        _run(lambda: require_extra("ray", "kvexport serve --replicas"))
        from kvexport.serving.ray import serve_with_ray

        _run(
            lambda: serve_with_ray(
                directory, config, replicas=replicas, address=ray_address, host=host, port=port, api=api, say=_progress,
            )
        )
        return
    if ray_address is not None:
        raise UserError("--ray-address needs --replicas N")
    _run(lambda: require_extra("serve", "kvexport serve"))
    from kvexport.serving.server import serve

    _run(
        lambda: serve(directory, config, host=host, port=port, api=api, say=_progress)
    )


@main.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@json_option
def inspect_command(path: Path, as_json: bool) -> None:
    """Show the IO signature, op histogram and pass report of an export directory or .onnx file."""
    from kvexport.tools.inspect import folded_tensors, inspect_path

    report = _run(lambda: inspect_path(path))
    if as_json:
        click.echo(json.dumps(asdict(report), indent=2))
        return
    if report.manifest:
        m = report.manifest
        click.echo(
            f"{report.path}: {m['source']['name']} ({m['source']['kind']}), {m['dtype']}, opset {m['opset']}, target {m['target']}, attention {m['attention']}, cache {m.get('cache_layout', 'concat')}, exported by {m['strategy']}"
        )
        click.echo(f"  {m['family']} dims {m['dims']}")
        click.echo(
            f"  weights {m['weights']['bytes'] / 1e6:.1f} MB in {m['weights']['file']}; tokenizer: {m['tokenizer']['file'] or 'none'}"
        )
        if m.get("quantization"):
            click.echo(f"  {_quantization_line(m['quantization'])}")
        if m["verify"]:
            click.echo(f"  last verify: {_verify_sentence(m['verify'])}")
    for name, graph in report.graphs.items():
        click.echo(f"\n[{name}] {graph.file}: {graph.nodes} nodes, opset {graph.opset}")
        for warning in graph.warnings:
            click.echo(f"  warning: {warning}")
        for direction, tensors in (("in ", graph.inputs), ("out", graph.outputs)):
            for tensor_name, dtype, shape in folded_tensors(tensors):
                click.echo(f"  {direction} {tensor_name:<28} {dtype:<8} [{', '.join(map(str, shape))}]")
        click.echo("  ops: " + ", ".join(f"{op} {count}" for op, count in graph.ops.items()))
    if report.passes:
        click.echo("")
        _echo_pass_table(report.passes)


def _cache_line(manifest: Any) -> str:
    """The cache's layout, and its type when it is not the graph's."""
    if manifest.cache_dtype == manifest.dtype:
        return manifest.cache_layout
    q = manifest.cache.get("quantization") or {}
    return f"{manifest.cache_layout}, {manifest.cache_dtype} {q.get('type', '').lower().replace('_', '-')}"


def _quantization_line(q: dict[str, Any]) -> str:
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


def _verify_sentence(summary: dict[str, Any]) -> str:
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


def _echo_pass_table(entries: list[dict[str, Any]]) -> None:
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


@main.command("rewrite")
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("output", type=click.Path(path_type=Path))
@click.option(
    "--passes",
    "pass_list",
    default=None,
    help="Comma-separated passes [default: rename_cache,fold_shapes,cleanup]; "
    "choose from rename_cache, transposed_weight_gemm, fold_shapes, fuse_attention, fuse_ort_block, "
    "shared_buffer_cache (changes the cache IO; needs --attention ort), quantize_weights (with --quantize), cleanup.",
)
@attention_option(default="unfused", note="")
@quantization_options
@click.option(
    "--names",
    type=click.Choice(["canonical", "optimum"]),
    default="canonical",
    show_default=True,
    help="Cache names to write: past.<l>.key or Optimum's past_key_values.<l>.key.",
)
@click.option("--force", is_flag=True, help="Replace an existing OUTPUT.")
@click.option(
    "--explain", is_flag=True, help="Say why each fusion rule that matched 0 times did not match."
)
@json_option
def rewrite_command(
    source: Path,
    output: Path,
    pass_list: str | None,
    attention: str,
    quantization: QuantizationChoice,
    names: str,
    force: bool,
    explain: bool,
    as_json: bool,
) -> None:
    """Run the rewrite passes on any decoder graph SOURCE.onnx and write OUTPUT.onnx."""
    from kvexport.tools.rewrite import rewrite_graph

    knobs = _knobs(quantization)
    chosen = [p.strip() for p in pass_list.split(",") if p.strip()] if pass_list else None
    result = _run(
        lambda: rewrite_graph(
            source,
            output,
            passes=chosen,
            attention=attention,
            quantization=knobs,
            names=names,  # type: ignore[arg-type]
            force=force,
            explain=explain,
        )
    )
    entries = [r.to_json() for r in result.reports]
    if as_json:
        click.echo(json.dumps({"output": str(result.output), "passes": entries}, indent=2))
        return
    _echo_pass_table(entries)
    for entry in entries:
        for rule, why in entry.get("explanations", {}).items():
            click.echo(f"{entry['name']}: {rule} matched 0 times: {why}")
    data = f" (weights in {result.data_file.name})" if result.data_file else ""
    click.echo(f"wrote {result.output}{data}")


@main.command("import")
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The kvexport directory to write.")
@click.option(
    "--model",
    "checkpoint",
    type=click.Path(path_type=Path),
    default=None,
    help="The checkpoint directory the graph was exported from; recorded so verify can compare with PyTorch.",
)
@attention_option(default="unfused", note="")
@cache_option("Cache layout [default: shared-buffer with --attention ort (also loads in onnxruntime-genai), else concat].")
@quantization_options
@kv_cache_option
@click.option("--force", is_flag=True, help="Replace a non-empty --out.")
@json_option
def import_command(
    source: Path,
    out: Path,
    checkpoint: Path | None,
    attention: str,
    cache: str | None,
    quantization: QuantizationChoice,
    kv_cache: str | None,
    force: bool,
    as_json: bool,
) -> None:
    """Turn a one-graph decoder SOURCE (an Optimum export directory or its .onnx) into a kvexport directory."""
    from kvexport.export.importer import import_decoder

    knobs = _knobs(quantization, defaulted=True)
    manifest = _run(
        lambda: import_decoder(
            source,
            out,
            model=checkpoint,
            attention=attention,
            cache=cache,
            quantize=quantization.scheme.value,
            quantization=knobs,
            kv_cache=kv_cache,
            force=force,
            progress=None if as_json else _progress,
        )
    )
    if as_json:
        click.echo(json.dumps(manifest.to_dict(), indent=2))
        return
    _echo_pass_table(manifest.passes)
    nodes = ", ".join(f"{name} {spec.nodes} nodes" for name, spec in manifest.graphs.items())
    click.echo(f"imported {source} to {out}: {nodes}, weights {manifest.weights['bytes'] / 1e6:.1f} MB once")
    if manifest.source.kind == "graph":
        click.echo("  no checkpoint given: verify needs --model; kvexport check and generate work as they are")


@main.command("build-kernels")
@click.option(
    "--ort-include",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="A folder with ONNX Runtime's onnxruntime_cxx_api.h [default: Debian's libonnxruntime-dev 1.21, downloaded once].",
)
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=None, help="Where to write the library [default: the cache the runtime looks in].")
def build_kernels_command(ort_include: Path | None, out: Path | None) -> None:
    """Build kvexport's CPU kernels (attention over the in-place fp32 cache, for ONNX Runtime); CPU sessions use them once built."""
    from kvexport.runtime.kernels import KERNELS_VARIABLE, build, default_library

    library = _run(lambda: build(ort_include, out))
    click.echo(f"built {library}")
    if library != default_library():
        click.echo(f"  the runtime uses it with {KERNELS_VARIABLE}={library}")


if __name__ == "__main__":  # pragma: no cover
    main()
