"""``kvexport generate``: stream text from an export (:class:`kvexport.runtime.Generator`), speculative or not."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click

from kvexport.cli.base import UserError, cuda_graph_option, main, provider_option, run
from kvexport.drafting import DEFAULT_DRAFT_TOKENS

F = TypeVar("F", bound=Callable[..., Any])


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
    config = run(lambda: EngineConfig(provider=provider, prompt_lookup=prompt_lookup, draft=draft_path))
    return run(config.drafter)


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
@cuda_graph_option
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
    cuda_graph: bool,
) -> None:
    """Stream generated text for PROMPT to stdout; TTFT and tokens/s go to stderr."""
    from kvexport.runtime import Generator, SamplingConfig

    if not prompt:
        raise UserError("--prompt is empty; pass some text")
    drafter = _drafter(prompt_lookup, draft, provider)
    if drafter is not None:
        if share_weights or prepacked or truncate or cuda_graph:
            raise UserError(
                "--share-weights, --prepacked, --truncate and --cuda-graph are not for speculative decoding; drop them"
            )
        sampling = SamplingConfig(do_sample, temperature, top_k, top_p, seed)
        _speculative_generate(directory, prompt, max_new_tokens, sampling, drafter, draft_tokens, provider)
        return
    generator = run(
        lambda: Generator(
            directory,
            provider=provider,
            share_weights=share_weights,
            prepacked=prepacked,
            prepack_dir=prepack_dir,
            cuda_graph=cuda_graph,
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
        f"decode {stats.decode_ms_per_token:.1f} ms/token, {stats.tokens_per_s:.1f} tokens/s ({generator.provider}{', CUDA graph' if generator.cuda_graph else ''})",
        err=True,
    )


def _echo_stream(prompt: str, pieces: Iterator[str]) -> None:
    """The prompt, then each generated piece as it comes, to stdout."""
    click.echo(prompt, nl=False)

    def stream() -> None:
        for piece in pieces:
            click.echo(piece, nl=False)
            sys.stdout.flush()

    run(stream)
    click.echo()


def _speculative_generate(
    directory: Path, prompt: str, max_new_tokens: int, sampling: Any, drafter: Any, draft_tokens: int, provider: str
) -> None:
    """``kvexport generate`` with a drafter: the text, then the speculation's figures on stderr."""
    from kvexport.runtime.speculative import SpeculativeGenerator

    generator = run(lambda: SpeculativeGenerator(directory, drafter, draft_tokens=draft_tokens, provider=provider))
    pieces = generator.stream_text(prompt, max_new_tokens, sampling)
    _echo_stream(prompt, pieces)
    stats = generator.last_stats
    click.echo(
        f"kvexport: {stats.new_tokens} tokens in {stats.rounds} verify calls; drafts accepted {stats.accepted}/"
        f"{stats.proposed} ({100 * stats.acceptance_rate:.0f}%); TTFT {stats.ttft_s * 1000:.1f} ms, "
        f"decode {stats.decode_ms_per_token:.1f} ms/token",
        err=True,
    )
