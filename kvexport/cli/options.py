"""The export commands' options, built from :class:`~kvexport.export.choices.ExportChoices`' fields.

Flag, type, choices, bounds, default and help come from the field (its ``metadata``, see
:func:`~kvexport.export.choices.flagged`), as ``kvexport serve``'s come from
:class:`~kvexport.serving.config.EngineConfig`: each is written once, there.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import click

from kvexport.cli.base import json_option, run
from kvexport.export.choices import EXPORT_FIELDS, ExportChoices, QuantizationChoice, QuantizeKind

F = TypeVar("F", bound=Callable[..., Any])
_UNSET: Any = object()


def choice_option(name: str, *, default: Any = _UNSET, shown: Any = _UNSET) -> Callable[[F], F]:
    """A click option for the :class:`ExportChoices` field ``name``; ``default`` / ``shown`` override the field's."""
    setting = EXPORT_FIELDS[name]
    meta = setting.metadata
    value = setting.default if default is _UNSET else default
    value = value.value if isinstance(value, Enum) else value
    if shown is _UNSET:  # a default of the command's own is shown as it is
        shown = meta["shown"] if default is _UNSET else None
    shown_default = shown
    if isinstance(setting.default, bool):
        return click.option(meta["flag"], name, is_flag=True, default=value, help=meta["help"])
    option_type: Any = int if isinstance(value, int) else None
    if meta["choices"]:
        option_type = click.Choice(list(meta["choices"]))
    elif meta["low"] is not None or meta["high"] is not None:
        option_type = click.IntRange(meta["low"], meta["high"])
    help_text = meta["help"] + ("" if shown_default is None else f" [default: {shown_default}]")
    return click.option(
        meta["flag"], name, type=option_type, default=value, show_default=shown_default is None and value is not None, help=help_text
    )


def quantization_options(function: F) -> F:
    """``--quantize`` and its knobs, handed to the command as one ``quantization`` (a :class:`QuantizationChoice`)."""

    @functools.wraps(function)
    def command(
        *args: Any,
        quantize: str | None,
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
        choice = run(lambda: QuantizationChoice(QuantizeKind(quantize) if quantize is not None else None, overrides))
        return function(*args, quantization=choice, **kwargs)

    for option in reversed(
        [
            choice_option("quantize"),
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



def knobs(choice: QuantizationChoice, *, defaulted: bool = False) -> Any:
    """The :class:`~passes.QuantizationConfig` a command's ``quantization`` stands for (None: float).

    ``defaulted``: None too when no knob was given, so the export picks the scheme's default
    (and, for ``--per-channel``, the family's recipe).
    """
    from kvexport.export.quantization import quantization_config

    if defaulted and not choice.overrides:
        return None
    return run(lambda: quantization_config(choice))



def export_options(function: F) -> F:
    """The options every export command takes (all but ``--model``): one per :class:`ExportChoices` field.

    The command gets them as keywords named as the fields, the quantization knobs as one
    ``quantization`` (:func:`quantization_options`), and ``out`` and ``as_json``.
    """
    flagged = [name for name, f in EXPORT_FIELDS.items() if f.metadata["flag"] and name != "quantize"]
    options: list[Callable[[Any], Any]] = [
        click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Output directory.")
    ]
    for name in flagged:
        options.append(choice_option(name))
        if name == "cache":  # --quantize and its knobs follow the cache, as the fields do
            options.append(quantization_options)
    decorated: Any = function
    for option in reversed([*options, json_option]):
        decorated = option(decorated)
    return typing.cast(F, decorated)


def export_choices(quantization: QuantizationChoice, given: dict[str, Any]) -> ExportChoices:
    """The :class:`ExportChoices` an export command's options stand for."""
    scheme: QuantizeKind | None = quantization.scheme
    return run(lambda: ExportChoices(quantize=scheme, quantization=knobs(quantization, defaulted=True), **given))
