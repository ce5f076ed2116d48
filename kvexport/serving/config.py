"""``EngineConfig``: every setting of the serving engine, in one frozen object; ``ApiConfig``: the HTTP API's.

The CLI, :func:`kvexport.serving.server.serve` and the Ray Serve deployment each build it
once and hand it on; ``serve run kvexport.serving.ray:app key=value`` parses every field
from it (:meth:`EngineConfig.from_strings`), so no setting can be forgotten on one path.
``kvexport serve``'s engine options, their defaults and help come from the fields' metadata
(:func:`engine_options`, as vLLM's ``EngineArgs.add_cli_args``), so each default is
written once, here; checks across settings live in :class:`EngineConfig` alone.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvexport.drafting import DEFAULT_DRAFT_TOKENS
from kvexport.errors import KvexportError
from kvexport.passes.vocabulary import POOL_DTYPES
from kvexport.serving.request import MAX_LOGPROBS

if TYPE_CHECKING:
    from kvexport.runtime.speculative import Drafter

DEFAULT_CHUNK = 256
F = TypeVar("F", bound=Callable[..., Any])


def setting(
    default: Any, help: str, *, flag: str | None = None, low: int | None = None, choices: tuple[str, ...] = (), shown: str | None = None
) -> Any:
    """A field of :class:`EngineConfig` with its CLI flag (None: no flag), lower bound, choices and help.

    ``shown`` is what the help says the default is when the value alone would not say it.
    """
    metadata = {"help": help, "flag": flag, "low": low, "choices": choices, "shown": shown}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (see :class:`~kvexport.serving.engine.Engine`).

    Attributes:
        slots: rows of the cache: requests generating at once.
        max_context: tokens per slot (prompt + completion); default over the paged cache: the
            model's positions, at most 8192 and what one request can take of the pool; over slots, what fits
            :data:`~kvexport.serving.engine.DEFAULT_KV_MEMORY` (1 GiB) over the slots, at most the
            model's positions (with ``kv_memory``: the model's positions).
        kv_layout: ``auto`` (the default): the paged cache where kvexport's kernel reads it (CPU,
            an fp32 in-place cache, the kernels built, no fixed-address decode), else slots;
            ``paged`` (refused where it can't be) or ``slots``.
        kv_memory: the paged cache's pool, in bytes (default
            :data:`~kvexport.serving.engine.DEFAULT_POOL_MEMORY`, 4 GiB): requests hold blocks of 16
            positions as they fill them, so memory follows the tokens in use. Over slots: size
            the slots from it instead (as many slots of ``max_context`` tokens as fit, in the
            export's cache dtype: an int8 cache holds 4x the fp32 cache's slots); it overrides
            ``slots`` there (the CLI refuses both with ``--kv-layout slots``).
        kv_cache_dtype: the paged pool's element type: ``auto`` (the default: fp16 over the
            paged cache of an export with quantized weights, else the export's own cache dtype),
            ``fp16`` (half the bytes of an fp32 export's cache: the kernel converts keys and values
            as it writes and reads them, and computes in fp32), ``q8`` (each position's head as int8
            codes and one fp32 scale, its largest magnitude as 127, set as it is written: (D + 4) / 4D
            of the fp32 bytes) or ``fp32``. Over slots only the
            export's own is taken.
        max_queue: requests that may wait for a slot; more are refused.
        chunk: the most tokens of one prompt in one prefill call (prompts that share a call,
            ``batch_prompts``, take up to this many each).
        step_ms: while streams run, how long a step (prompt chunks and decode call) may
            take, its prompt tokens at their measured cost; None: twice the slowest recent
            decode step, measured. While no more streams run than prompts wait, a step
            prefills up to
            :data:`~kvexport.serving.scheduler.BURST_TOKENS` tokens (see
            :class:`~kvexport.serving.scheduler.PrefillBudget`).
        mixed_step: on CPU, run a step's last prompt chunk and its decode call as one call
            (:mod:`kvexport.passes.mixed_step`), the decode rows' tokens packed into the
            chunk's GEMMs; the runner opens a second session for it (a second copy of the
            packed weights). A graph the split can't take runs them as separate calls. Off
            by default: on an AVX2 host it saved nothing served.
        prompt_products: ``auto`` (the default): on a CPU with AMX (and kvexport's kernels
            built), prompt pieces and prefix jobs run through a second session whose
            block-quantized products are bf16 (:mod:`kvexport.passes.prompt_products`): the
            prompts' GEMMs on the CPU's bf16 units, 2 bytes a weight more in memory; decode
            calls, speculative rounds and mixed steps keep the export's blocks. A prompt's
            logits and cache then differ from the blocks' by bf16's rounding (closer to the
            float product: the activations are not quantized to int8), as the
            :class:`~kvexport.runtime.generator.Generator`'s do. ``off``: one session for
            everything, prompts through the export's blocks.
        bf16_decode_rows: decode calls of at least this many rows run through that bf16 session
            too (where there is one; 0: never). A call of many rows is compute-bound on the
            blocks' int8 arithmetic, where bf16 runs on the AMX tiles; a call of a few rows reads
            the weights, where the int8 blocks are half the bytes. A request's tokens then depend on
            how many rows its decode calls ran with, by bf16's rounding (closer to the float model).
        batch_prompts: on CPU, prefill fresh prompts' first pieces (up to ``chunk`` tokens,
            cut to one length) in consecutive slots as one call, as a burst of requests
            brings them (:class:`~kvexport.serving.scheduler.PrefillBatch`): the same rows
            and logits as one call each, fewer and larger GEMMs, and the burst's first tokens
            come out together. Measured on an AVX-512 VNNI host, sixteen 128-token prompts
            took 0.68-0.86x the time of sixteen calls. With an 8-bit cache (``--kv-cache
            int8``), whose prompts' attention runs as the CPU products, the later pieces of
            prompts that hold as many tokens share calls too: four 256-token second pieces
            took 0.80-0.91x the time of four calls (2 Zen 5 cores, SmolLM2-135M).
        batch_tokens: the most prompt tokens of one such shared call, over its rows; a burst
            with more shares several calls of even rows, each call's first tokens out as it
            ends. Measured on 2 AVX-512 AMX cores, ONNX Runtime ran 768-1024-token calls
            fastest per token: sixteen 128-token prompts took 0.84-0.87x as two calls of
            eight (GPT-2 and SmolLM2 int8) as in one.
        gather_ms: when requests reach an idle engine, wait until none has come for this
            many ms (at most ten times as long in all) before the first step, so a burst's
            prompts reach one step and share its prefill calls (``batch_prompts``); a lone
            request waits that long once. 0 (or ``batch_prompts`` off): start at once.
        provider: ``cpu``, ``cuda`` or ``auto``.
        cuda_graph: capture each decode call as a CUDA graph, once per row count (the slots'
            capacity is fixed), and replay it; prompt pieces run uncaptured. CUDA only, and an
            export whose decode graph a capture can hold (:mod:`kvexport.runtime.cuda_graph`).
        static_decode: run decode calls through the same fixed-address inputs and outputs
            without capture, on any provider (tests the captured path's logic on CPU).
        intra_op_threads: ONNX Runtime threads (default: ONNX Runtime's choice).
        spinning: let the sessions' threads spin between a run's nodes (faster decode steps
            on CPU); they stop at the end of each run.
        check: compare every file's size and sha256 with the manifest before loading (on by
            default: a damaged or different copy is refused with the file named).
        prefix_cache: reuse the cached rows of a prompt's prefix.
        prompt_lookup: speculative decoding with prompt-lookup drafts while one request
            runs alone (the export needs ``--all-logits``).
        draft: speculative decoding with drafts from this smaller in-place export.
        draft_tokens: drafts per speculative step.
        max_logprobs: the most log-probabilities a request may ask for per position (-1:
            the whole vocabulary, which a request then asks for with -1), as vLLM's.
        warm_up: requests run through the engine before it takes any (0: none), so the
            first real requests do not pay for ONNX Runtime's first runs: one alone, then
            one on every slot (at least this many) sharing a call as a burst's prompts do;
            what they leave (counters, cached rows) is cleared.

    """

    slots: int = setting(8, "Requests generating at once (cache rows).", flag="--slots", low=1)
    max_context: int | None = setting(
        None, "Tokens per slot, prompt + completion.", flag="--max-context", low=2,
        shown="paged: the model's positions, at most 8192 and what one request can take of the pool; over slots, what "
        "fits 1 GiB of cache over the slots (a "
        "multiple of 256, at least 512), at most the model's positions, and with --kv-memory the model's positions"
    )
    kv_layout: str = setting(
        "auto",
        "The cache's layout: paged (a pool of 16-token blocks that requests hold as they fill them, so memory follows "
        "the tokens in use; CPU with an fp32 cache and kvexport's kernels built), slots (a whole context a slot, "
        "reserved up front: CUDA, 8-bit caches, --cuda-graph) or auto (paged where it can be).",
        flag="--kv-layout",
        choices=("auto", "paged", "slots"),
    )
    kv_memory: int | None = setting(
        None,
        "Cache memory (e.g. 2GiB, 500MB): the paged cache's pool (default 4 GiB, touched only as blocks fill); with "
        "the slot layout, size the slots from it instead: as many slots of --max-context tokens as fit in the "
        "export's cache dtype.",
        flag="--kv-memory",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "What the paged cache holds: fp16 (half an fp32 export's cache bytes; kvexport's kernel converts as it reads "
        "and writes, and computes in fp32), q8 (int8 codes and a scale a position and head, 0.27x the fp32 bytes at a "
        "head size of 64), fp32, or auto (fp16 over the paged cache of a quantized export, else the export's own).",
        flag="--kv-cache-dtype",
        choices=("auto", *POOL_DTYPES),
    )
    max_queue: int = setting(
        64,
        "Requests that may wait for a slot; more get 503 with Retry-After. Size it to the most requests your clients "
        "send at once, minus --slots (an n > 1 request counts n): vLLM queues without a limit, so clients written "
        "for it may send hundreds.",
        flag="--max-queue",
        low=0,
    )
    chunk: int = setting(
        DEFAULT_CHUNK,
        "The most tokens of one prompt in one prefill call (prompts that share a call take up to this many each).",
        flag="--chunk",
        low=1,
    )
    step_ms: int | None = setting(
        None,
        "While streams are running, keep each engine step (its prompt chunks and its decode call) within this many "
        "ms, prompt tokens at their measured cost, so no stream's next token waits longer; while no more streams "
        "run than prompts wait, a step prefills up to 4096 tokens.",
        flag="--step-ms",
        low=1,
        shown="twice the slowest recent decode step, measured",
    )
    mixed_step: bool = setting(
        False,
        "Run each step's last prompt chunk and its decode call as one call, the chunk's and the running rows' "
        "tokens packed into the same GEMMs (CPU only; a second session, with a second copy of the packed weights). "
        "Measured on AVX2 it saves 6-13% of such a call on per-channel int8 and nothing served; try it on AVX-512.",
        flag="--mixed-step",
    )
    prompt_products: str = setting(
        "auto",
        "How prompt pieces run their int8/int4 block products: auto (in bf16 through a second session, where the CPU "
        "has AMX and kvexport's kernels are built; decode calls keep the blocks; 2 bytes a weight more "
        "memory) or off (the export's blocks, as decode calls).",
        flag="--prompt-products",
        choices=("auto", "off"),
    )
    bf16_decode_rows: int = setting(
        16,
        "Decode calls of at least this many rows run their int8/int4 block products in bf16 too, through the prompts' "
        "session (with --prompt-products auto on AMX): many rows are compute-bound on the blocks' int8 arithmetic, a few "
        "read the weights, where the blocks are half the bytes. 0: decode calls always keep the blocks.",
        flag="--bf16-decode-rows",
        low=0,
    )
    batch_prompts: bool = setting(
        True,
        "Prefill every prompt in calls of its own, never fresh prompts' first pieces together in one call.",
        flag="--no-prompt-batching",
    )
    batch_tokens: int = setting(
        1024,
        "The most prompt tokens of one prefill call that fresh prompts share (unless --no-prompt-batching); a larger burst "
        "shares several calls, each call's first tokens out as it ends. Pieces (at most --chunk tokens) longer than "
        "half of it share no call.",
        flag="--batch-tokens",
        low=2,
    )
    gather_ms: int = setting(
        2,
        "When requests reach an idle engine, wait until none has come for this many ms (at most ten times as long "
        "in all) before the first step, so a burst's prompts are admitted together and share prefill calls; 0: start "
        "at once.",
        flag="--gather-ms",
        low=0,
    )
    provider: str = setting(
        "cpu",
        "ONNX Runtime execution provider; cuda fails if unavailable, auto picks the best.",
        flag="--provider",
        choices=("cpu", "cuda", "auto"),
    )
    cuda_graph: bool = setting(
        False,
        "Capture the decode step as a CUDA graph once per batch shape (rows, cache capacity) and replay it (the CUDA "
        "provider and an ort-cuda export); prompts run uncaptured.",
        flag="--cuda-graph",
    )
    static_decode: bool = setting(False, "Run decode calls at fixed addresses as --cuda-graph does, without capture.")
    intra_op_threads: int | None = setting(None, "ONNX Runtime threads.")
    spinning: bool = setting(True, "Let the sessions' threads spin between a run's nodes.")
    check: bool = setting(True, "Skip comparing every file's sha256 with the manifest before loading.", flag="--no-check")
    prefix_cache: bool = setting(
        True, "Prefill every prompt whole instead of reusing the cached rows of a shared prefix.", flag="--no-prefix-cache"
    )
    prompt_lookup: bool = setting(
        False, "Speculative decoding with prompt lookup drafts (needs an --all-logits export).", flag="--prompt-lookup"
    )
    draft: str | None = setting(
        None, "Speculative decoding with this smaller in-place export as the drafter (same tokenizer).", flag="--draft"
    )
    draft_tokens: int = setting(DEFAULT_DRAFT_TOKENS, "Drafts per step.", flag="--draft-tokens", low=1)
    max_logprobs: int = setting(
        MAX_LOGPROBS,
        "The most logprobs / top_logprobs / prompt_logprobs a request may ask for (-1: the whole vocabulary, "
        "which a request asks for with -1), as vLLM's --max-logprobs.",
        flag="--max-logprobs",
        low=-1,
    )
    warm_up: int = setting(
        2,
        "Requests run before serving: one alone, then one on every slot (at least this many) sharing a call, so the "
        "first clients and the first burst are not slower (0: none).",
        flag="--warm-up",
        low=0,
    )

    def __post_init__(self) -> None:
        for setting_field in dataclasses.fields(self):
            low, value = setting_field.metadata.get("low"), getattr(self, setting_field.name)
            if low is not None and value is not None and value < low:
                raise KvexportError(f"{setting_field.name} {value}: must be at least {low}")
        if self.prompt_lookup and self.draft is not None:
            raise KvexportError("--prompt-lookup and --draft: pick one drafter")
        if self.kv_memory is not None and self.kv_memory < 1:
            raise KvexportError(f"kv_memory {self.kv_memory}: must be a positive number of bytes")

    def drafter(self) -> Drafter | None:
        """The drafter these settings ask for (None: no speculative decoding)."""
        from kvexport.runtime.speculative import DraftModel, PromptLookup

        if self.draft is not None:
            return DraftModel(Path(self.draft), self.provider)
        return PromptLookup() if self.prompt_lookup else None

    @classmethod
    def from_options(cls, given: dict[str, Any]) -> EngineConfig:
        """A config from the CLI's engine options (:func:`engine_options`): the fields given, ``kv_memory`` as text.

        With ``--kv-layout slots``, ``--slots`` and ``--kv-memory`` both size the cache, so giving both is refused.
        """
        if given.get("slots") is not None and given.get("kv_memory") is not None and given.get("kv_layout") == "slots":
            raise KvexportError("--slots and --kv-memory both size the slot layout's cache; give one")
        values = {name: value for name, value in given.items() if value is not None}
        if "kv_memory" in values:
            values["kv_memory"] = parse_bytes(values["kv_memory"])
        return cls(**values)

    @classmethod
    def from_strings(cls, values: dict[str, Any]) -> EngineConfig:
        """A config from ``key=value`` strings (Serve's CLI arguments), each parsed by its field's type.

        Values that are not strings (a YAML config's numbers and booleans) are taken as
        they are. Unknown keys are refused in one line naming them and the known ones.
        """
        return cls(**_parsed_fields(cls, values, "engine"))

    def updated(self, **settings: Any) -> EngineConfig:
        """A copy of the config with ``settings`` changed; an unknown name is refused in one line naming the known ones."""
        _check_known(type(self), settings, "engine")
        return dataclasses.replace(self, **settings)


@dataclass(frozen=True)
class ApiConfig:
    """How the HTTP API answers, beside the engine's settings: built once by the CLI, :func:`~kvexport.serving.server.serve` or the Ray deployment, and read by :func:`~kvexport.serving.app.create_app`.

    Attributes:
        name: the model name clients use (default: the export directory's name).
        chat_template: a Jinja chat template file for ``/v1/chat/completions`` (default:
            the export's ``tokenizer_config.json`` template, if it has one).
        api_key: when set, every ``/v1`` and tokenizer route needs ``Authorization: Bearer KEY``.
        enable_prompt_tokens_details: send ``usage.prompt_tokens_details`` (the prompt tokens
            the prefix cache served, ``cached_tokens``); without it the field is ``null``, as
            vLLM sends it unless started with ``--enable-prompt-tokens-details``.
        return_tokens_as_token_ids: show logprobs' tokens as ``token_id:N`` unless a request
            says otherwise (vLLM's ``--return-tokens-as-token-ids``).
        tool_call_parser: how tool calls are read from the output (``hermes``, ``llama3_json``,
            ``mistral``, ``pythonic``); None: the one the chat template implies; ``none``: no parser.
        reasoning_parser: how thinking is split from the answer (``qwen3``, ``deepseek_r1``);
            None: the one the chat template implies; ``none``: no parser.
        enable_auto_tool_choice: serve ``tool_choice: "auto"`` (the model decides whether to
            call), vLLM's ``--enable-auto-tool-choice``; ``required`` and named functions are
            served without it.

    """

    name: str | None = None
    chat_template: str | None = None
    api_key: str | None = None
    enable_prompt_tokens_details: bool = False
    return_tokens_as_token_ids: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False

    @classmethod
    def from_strings(cls, values: dict[str, Any]) -> ApiConfig:
        """A config from ``key=value`` strings (Serve's application arguments), each parsed by its field's type."""
        return cls(**_parsed_fields(cls, values, "API"))

    def model_name(self, directory: Path) -> str:
        """The name the export in ``directory`` answers to: ``name``, or else the directory's name."""
        return self.name or directory.resolve().name


def _check_known(config: type, names: Iterable[str], what: str) -> None:
    """One line naming the first of ``names`` that is not a field of ``config``, and the fields."""
    known = [f.name for f in dataclasses.fields(config)]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise KvexportError(f"unknown {what} setting {unknown[0]!r}; the settings are {', '.join(known)}")


def _parsed_fields(config: type, values: dict[str, Any], what: str) -> dict[str, Any]:
    """``values`` checked against ``config``'s fields, each string parsed by its field's type (other values taken as they are)."""
    _check_known(config, values, what)
    hints = typing.get_type_hints(config)
    return {name: _parse(name, text, hints[name]) for name, text in values.items()}


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1e9"`` or ``"1073741824"`` as bytes; one line naming the units otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise KvexportError(f"{text!r}: not a size; write bytes, or a number with B, KB, MB, GB, KiB, MiB or GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _parse(name: str, text: Any, hint: Any) -> Any:
    """``text`` as a value of the annotated type ``hint`` (int, bool, str, or one of them or None)."""
    if not isinstance(text, str):
        return text
    choices = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if type(None) in choices and text.lower() in ("", "none", "null"):
        return None
    kind = next(choice for choice in choices if choice is not type(None))
    if kind is bool:
        lowered = text.lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise KvexportError(f"{name}={text}: expected true or false")
        return lowered in ("true", "1", "yes")
    if kind is int and name == "kv_memory":
        return parse_bytes(text)
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise KvexportError(f"{name}={text}: expected an integer") from None
    return text


def engine_options(command: F) -> F:
    """Add a click option for each :class:`EngineConfig` field with a flag; the command gets them as ``engine_settings``.

    Flag, type, bounds, choices, default and help come from the field (:func:`setting`).
    ``engine_settings`` holds the fields given on the command line (``--no-x`` flags as
    ``x=False``); pass it to :meth:`EngineConfig.from_options`.
    """
    import click

    hints = typing.get_type_hints(EngineConfig)
    flagged = [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("flag")]

    def parameter(setting_field: dataclasses.Field[Any]) -> str:
        return str(setting_field.metadata["flag"]).lstrip("-").replace("-", "_")

    @functools.wraps(command)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        given: dict[str, Any] = {}
        for setting_field in flagged:
            value = kwargs.pop(parameter(setting_field))
            if hints[setting_field.name] is bool:
                value = (not setting_field.default) if value else None  # a flag: given or not
            elif isinstance(value, Path):
                value = str(value)
            given[setting_field.name] = value
        return command(*args, engine_settings=given, **kwargs)

    for setting_field in reversed(flagged):
        meta, kind = setting_field.metadata, hints[setting_field.name]
        choices = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
        base = next(choice for choice in choices if choice is not type(None))
        if base is bool:
            wrapped = click.option(meta["flag"], is_flag=True, help=meta["help"])(wrapped)
            continue
        shown = meta["shown"] if meta["shown"] is not None else setting_field.default
        help_text = meta["help"] + ("" if shown is None else f" [default: {shown}]")
        option_type: Any = None
        if meta["choices"]:
            option_type = click.Choice(meta["choices"])
        elif setting_field.name == "draft":
            option_type = click.Path(path_type=Path)
        elif base is int and setting_field.name != "kv_memory":
            option_type = click.IntRange(meta["low"]) if meta["low"] is not None else int
        wrapped = click.option(meta["flag"], type=option_type, default=None, help=help_text)(wrapped)
    return wrapped  # type: ignore[return-value]
