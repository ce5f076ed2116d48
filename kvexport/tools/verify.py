"""Numeric parity of an export directory against PyTorch, step by step.

The reference model is rebuilt from the manifest's source alone. Two cases run: batch 1
and a left-padded batch 2. Each case runs prefill and then ``steps`` greedy decode steps;
ONNX Runtime feeds its own presents back as the next past, exactly as a deployment
would, while PyTorch keeps its own cache. At every step the logits and every present
tensor are compared (cache entries and, with ``--all-logits``, logits at padded positions
are excluded: they are masked out and never read), and the greedy tokens must agree.

A quantized export (the manifest's ``quantization``) cannot meet fp32 tolerances; it is
judged by quality against PyTorch fp32 instead: at every step, greedy agreement of the
next token (both sides continue on PyTorch's choice), the KL divergence of ONNX's
next-token distribution from PyTorch's, and the largest logit error. The mean KL must be
within the scheme's tolerance in the manifest; greedy agreement over random prompts is
reported only (random ids leave near-ties that any rounding flips).

``text=`` adds perplexity on a text file (any export): the text is tokenized with the
export's tokenizer, cut into windows, and each window runs through prefill and then one
decode step per token, teacher-forced, beside one PyTorch forward of the window. It
reports both perplexities, their difference in percent, top-1 agreement, mean KL and
the largest logit error; a quantized export must keep the perplexity increase, the mean
KL and the top-1 agreement within its scheme's tolerances.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from kvexport.bundle.integrity import preflight
from kvexport.bundle.manifest import GRAPH_NAMES, Manifest, read_manifest
from kvexport.errors import KvexportError, ManifestError
from kvexport.models import family_for
from kvexport.models.base import weights_fingerprint
from kvexport.models.wrappers import cache_keyword, cache_layers, full_cache
from kvexport.passes.cache_names import cache_names
from kvexport.progress import Progress, silent
from kvexport.runtime.cache import CacheBanks, SlotCache, cache_layout_of
from kvexport.runtime.generator import positions_from_mask
from kvexport.runtime.sampling import log_softmax
from kvexport.runtime.session import open_session, resolve_provider

# (atol, rtol) per dtype: a check holds when |onnx - torch| <= atol + rtol * |torch|.
TOLERANCES: dict[str, tuple[float, float]] = {"fp32": (1e-4, 1e-3), "fp16": (2e-2, 2e-2)}
DEFAULT_STEPS = 8
DEFAULT_TEXT_TOKENS = 2048
TEXT_WINDOW = 256  # tokens per teacher-forced window (at most the model's positions)
_PROMPT_LENGTHS = (11, 6)  # batch 2 left-pads the second prompt by 5


@dataclass(frozen=True)
class TensorCheck:
    """One compared tensor at one step of one case."""

    case: str
    step: int
    name: str
    shape: list[int]
    dtype: str
    max_abs_diff: float
    max_rel_diff: float
    atol: float
    rtol: float
    ok: bool


@dataclass(frozen=True)
class TokenCheck:
    """Greedy next tokens of ONNX and PyTorch at one step of one case."""

    case: str
    step: int
    onnx_tokens: list[int]
    torch_tokens: list[int]
    ok: bool


@dataclass(frozen=True)
class QualityCheck:
    """Next-token quality of ONNX against PyTorch fp32 at one step of one case (quantized)."""

    case: str
    step: int
    top1_agreement: float  # rows whose argmax agrees, over rows
    mean_kl: float  # KL(PyTorch || ONNX) of the next-token distribution, mean over rows
    max_logit_error: float


@dataclass(frozen=True)
class TextQuality:
    """Teacher-forced quality over a text: perplexities and agreement (``verify(text=...)``)."""

    file: str
    tokens: int  # predicted positions
    window: int
    perplexity_onnx: float
    perplexity_torch: float
    perplexity_delta_pct: float
    top1_agreement: float
    mean_kl: float
    max_logit_error: float
    # the delta over each window's second half only, as llama.cpp's llama-perplexity scores a window
    late_perplexity_delta_pct: float = 0.0


@dataclass
class VerifyReport:
    """Everything :func:`verify` found; ``ok`` only when every check holds."""

    directory: str
    provider: str
    steps: int
    dtype: str
    io_problems: list[str] = field(default_factory=list)
    # files whose size or sha256 differ from the manifest's record (kvexport.bundle.integrity)
    file_problems: list[str] = field(default_factory=list)
    weights_match: bool = True
    tensors: list[TensorCheck] = field(default_factory=list)
    tokens: list[TokenCheck] = field(default_factory=list)
    # quantized exports: per-step quality and the scheme's tolerances from the manifest
    quality: list[QualityCheck] = field(default_factory=list)
    tolerances: dict[str, float] | None = None
    text: TextQuality | None = None
    seconds: float = 0.0

    @property
    def quantized(self) -> bool:
        """Whether checks are judged by quality (the scheme's tolerances), not fp32 parity."""
        return self.tolerances is not None

    def overall_quality(self) -> dict[str, float]:
        """Top-1 agreement, mean KL and max logit error over every step and case."""
        if not self.quality:
            return {}
        return {
            "top1_agreement": float(np.mean([q.top1_agreement for q in self.quality])),
            "mean_kl": float(np.mean([q.mean_kl for q in self.quality])),
            "max_logit_error": max(q.max_logit_error for q in self.quality),
        }

    def _quality_failures(self) -> list[str]:
        """Quantized exports: the steps' mean KL, and over a text KL, top-1 and perplexity.

        Greedy agreement over the random prompts is reported, not judged: random token ids
        (and random weights) leave near-ties in the logits that any rounding flips.
        """
        if self.tolerances is None:
            return []
        tol = self.tolerances
        steps = self.overall_quality()
        if not steps:
            return ["steps: nothing was compared"]
        lines = []
        if steps["mean_kl"] > tol["max_mean_kl"]:
            lines.append(f"steps: mean KL {steps['mean_kl']:.4g} over {tol['max_mean_kl']}")
        text = self.text
        if text is not None:
            if text.mean_kl > tol["max_mean_kl"]:
                lines.append(f"text: mean KL {text.mean_kl:.4g} over {tol['max_mean_kl']}")
            if text.top1_agreement < tol["min_top1_agreement"]:
                lines.append(
                    f"text: top-1 agreement {text.top1_agreement:.3f} under {tol['min_top1_agreement']}"
                )
            if text.perplexity_delta_pct > tol["max_perplexity_delta_pct"]:
                lines.append(
                    f"text: perplexity {text.perplexity_delta_pct:+.2f}% over PyTorch's, more than "
                    f"{tol['max_perplexity_delta_pct']}%"
                )
        return lines

    @property
    def ok(self) -> bool:
        """True when the IO, the weights and every check hold (quality checks when quantized)."""
        if self.io_problems or self.file_problems or not self.weights_match:
            return False
        if self.quantized:
            return bool(self.quality) and not self._quality_failures()
        return (
            bool(self.tensors)
            and all(c.ok for c in self.tensors)
            and all(c.ok for c in self.tokens)
        )

    def worst(self) -> dict[str, TensorCheck]:
        """The check with the largest abs diff, for logits and for the cache."""
        result: dict[str, TensorCheck] = {}
        for kind in ("logits", "cache"):
            checks = [c for c in self.tensors if (c.name == "logits") == (kind == "logits")]
            if checks:
                result[kind] = max(checks, key=lambda c: c.max_abs_diff)
        return result

    def failures(self) -> list[str]:
        """One line per failed check."""
        lines = [*self.file_problems, *self.io_problems]
        if not self.weights_match:
            lines.append(
                "reference weights rebuilt from the manifest's source differ from the exported ones"
            )
        lines += [
            f"{c.case} step {c.step} {c.name}: max abs diff {c.max_abs_diff:.3g} over tolerance"
            for c in self.tensors
            if not c.ok
        ]
        if self.quantized:
            return lines + self._quality_failures()
        lines += [
            f"{c.case} step {c.step}: greedy tokens differ (onnx {c.onnx_tokens}, torch {c.torch_tokens})"
            for c in self.tokens
            if not c.ok
        ]
        return lines

    def summary(self) -> dict[str, Any]:
        """Compact form recorded in the manifest."""
        worst = self.worst()
        summary: dict[str, Any] = {
            "ok": self.ok,
            "provider": self.provider,
            "steps": self.steps,
            "checks": len(self.tensors) + len(self.tokens) + len(self.quality),
            "failed": len(self.failures()),
            "max_abs_diff_logits": worst["logits"].max_abs_diff if "logits" in worst else None,
            "max_abs_diff_cache": worst["cache"].max_abs_diff if "cache" in worst else None,
            "seconds": round(self.seconds, 2),
        }
        if self.quantized:
            summary["quality"] = self.overall_quality()
        if self.text is not None:
            summary["text"] = asdict(self.text)
        return summary

    def to_dict(self) -> dict[str, Any]:
        """Full JSON-able form (``kvexport verify --json``)."""
        data = asdict(self)
        data["ok"] = self.ok
        data["failures"] = self.failures()
        data["summary"] = self.summary()
        return data


def _compare(
    case: str, step: int, name: str, got: np.ndarray, want: np.ndarray, dtype: str
) -> TensorCheck:
    atol, rtol = TOLERANCES[dtype]
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    if got64.shape != want64.shape:
        return TensorCheck(
            case,
            step,
            name,
            list(got.shape),
            str(got.dtype),
            float("inf"),
            float("inf"),
            atol,
            rtol,
            False,
        )
    diff = np.abs(got64 - want64)
    finite = bool(np.isfinite(got64).all() and np.isfinite(want64).all())
    max_abs = float(diff.max()) if diff.size else 0.0
    max_rel = float((diff / (np.abs(want64) + atol)).max()) if diff.size else 0.0
    ok = finite and bool((diff <= atol + rtol * np.abs(want64)).all())
    return TensorCheck(
        case, step, name, list(got.shape), str(got.dtype), max_abs, max_rel, atol, rtol, ok
    )


def _valid_positions(cache: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Cache entries at unpadded positions only: [batch, H, T, D] -> [H, valid, D] rows stacked."""
    rows = [cache[b][:, mask[b].astype(bool), :] for b in range(cache.shape[0])]
    return np.concatenate([r.reshape(-1) for r in rows])


def _cases(
    vocab_size: int, n_positions: int, steps: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    longest = min(_PROMPT_LENGTHS[0], n_positions - steps)
    if longest < 2:
        raise KvexportError(
            f"--steps {steps}: too many for this model's {n_positions} positions; use at most {n_positions - 2}"
        )
    shorter = max(1, min(_PROMPT_LENGTHS[1], longest - 1))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab_size, size=(2, longest), dtype=np.int64)
    padded_mask = np.ones((2, longest), dtype=np.int64)
    padded_mask[1, : longest - shorter] = 0
    padded_ids = np.where(padded_mask == 1, ids, 0)
    return {
        "batch1": (ids[:1], np.ones((1, longest), dtype=np.int64)),
        "batch2-left-padded": (padded_ids, padded_mask),
    }


class _StepRunner:
    """Runs one graph step and returns every output as host arrays, for either cache layout.

    ``concat``: plain ``session.run``; the caller feeds the presents back as pasts.
    ``shared-buffer``: one buffer per cache tensor on the session's device, bound as both
    past and present through IO binding, as the Generator does; the presents returned are
    copies of the buffers' valid part ([batch, H, total_sequence, D]).
    """

    def __init__(
        self, manifest: Manifest, sessions: dict[str, Any], provider: str, batch: int, capacity: int
    ) -> None:

        self.sessions = sessions
        self.in_place = manifest.cache_layout == "shared-buffer"
        n_layer, dims = manifest.dims.num_layers, manifest.dims
        self.past_names = cache_names("past", n_layer)
        self.present_names = cache_names("present", n_layer)
        dtype, stored_dim = cache_layout_of(manifest)
        # the Generator's own cache buffers and binding: one bank, past and present alike
        self.shape = (batch, dims.num_kv_heads, capacity, stored_dim)
        self.banks = (
            CacheBanks(len(self.past_names), int(np.prod(self.shape)), dtype, "cuda" if provider == "cuda" else "cpu", banks=1)
            if self.in_place
            else None
        )

    def run(
        self, graph: str, feeds: dict[str, np.ndarray], presents: bool = True
    ) -> dict[str, np.ndarray]:
        """Outputs by name: ``logits`` and every ``present.*``.

        With ``presents=False`` (shared-buffer layout) the buffers are not copied out: the
        caller only reads the logits, and the next step reads the buffers in place.
        """
        session = self.sessions[graph]
        if not self.in_place:
            return dict(zip(["logits", *self.present_names], session.run(None, feeds), strict=True))
        assert self.banks is not None
        binding = session.io_binding()
        for name in ("input_ids", "attention_mask", "position_ids"):
            binding.bind_cpu_input(name, feeds[name])
        binding.bind_output("logits", "cpu")
        self.banks.bind(binding, self.past_names, 0, self.shape, output=False)
        self.banks.bind(binding, self.present_names, 0, self.shape, output=True)
        session.run_with_iobinding(binding)
        total = feeds["attention_mask"].shape[1]
        result = {"logits": binding.copy_outputs_to_cpu()[0]}
        if not presents:
            return result
        for index, present in enumerate(self.present_names):
            result[present] = self.banks.read(0, index, self.shape)[:, :, :total].copy()
        return result


def _compare_cache(
    case: str,
    step: int,
    got: dict[str, np.ndarray],
    cache: DynamicCache,
    mask: np.ndarray,
    dtype: str,
    report: VerifyReport,
) -> None:
    """fp32/fp16 parity of every present tensor after one step (unpadded rows)."""
    for layer_index, (keys, values) in enumerate(cache_layers(cache)):
        for which, tensor in (("key", keys), ("value", values)):
            name = f"present.{layer_index}.{which}"
            want = tensor.float().numpy()
            if got[name].shape != want.shape:
                report.tensors.append(_compare(case, step, name, got[name], want, dtype))
                continue
            check = _compare(
                case,
                step,
                name,
                _valid_positions(got[name], mask),
                _valid_positions(want, mask),
                dtype,
            )
            report.tensors.append(TensorCheck(**{**asdict(check), "shape": list(got[name].shape)}))


def _next_token_stats(got: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Per row [.., V]: argmax agreement, KL(want || got), and the largest logit error."""
    log_got, log_want = log_softmax(got), log_softmax(want)
    kl = (np.exp(log_want) * (log_want - log_got)).sum(-1)
    agree = got.argmax(-1) == want.argmax(-1)
    return agree, kl, float(np.abs(got.astype(np.float64) - want).max())


def _quality(case: str, step: int, got: np.ndarray, want: np.ndarray) -> QualityCheck:
    agree, kl, max_error = _next_token_stats(got, want)
    return QualityCheck(case, step, float(agree.mean()), float(kl.mean()), max_error)


def _torch_logits(
    model: PreTrainedModel, inputs: dict[str, np.ndarray], cache: DynamicCache, last_only: bool
) -> np.ndarray:
    """PyTorch's logits for one step ([batch, 1 or sequence, V]); ``cache`` grows in place."""
    with torch.no_grad():
        reference = model(
            torch.from_numpy(inputs["input_ids"]),
            attention_mask=torch.from_numpy(inputs["attention_mask"]),
            position_ids=torch.from_numpy(inputs["position_ids"]),
            use_cache=True,
            **{cache_keyword(model): cache},
        )
    logits = reference.logits.float().numpy()
    return logits[:, -1:, :] if last_only else logits


def _judge_step(
    case: str,
    step: int,
    got: dict[str, np.ndarray],
    want_logits: np.ndarray,
    cache: DynamicCache,
    mask: np.ndarray,
    manifest: Manifest,
    report: VerifyReport,
) -> np.ndarray:
    """Record one step's checks (quality when quantized, else parity of logits and cache) and greedy tokens; PyTorch's tokens."""
    if not report.quantized:
        _compare_cache(case, step, got, cache, mask, manifest.dtype, report)
    logits = got["logits"]
    # every position's logits of a left-padded prompt: the padded positions' are no one's output (their queries
    # see no key; each attention kernel fills such rows its own way), so, as with the cache, only real ones count
    real = mask.astype(bool) if logits.shape[1] > 1 and logits.shape[1] == mask.shape[1] and not mask.all() else None
    return _judge_logits(case, step, logits, want_logits, manifest, report, real=real)


def _next_inputs(mask: np.ndarray, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """The decode inputs that feed ``tokens`` after a left-padded ``mask``."""
    return {
        "input_ids": tokens.reshape(-1, 1).astype(np.int64),
        "attention_mask": np.concatenate([mask, np.ones((mask.shape[0], 1), dtype=np.int64)], axis=1),
        "position_ids": mask.sum(-1, keepdims=True).astype(np.int64),
    }


def _run_case(
    case: str,
    ids: np.ndarray,
    mask: np.ndarray,
    manifest: Manifest,
    sessions: dict[str, Any],
    model: PreTrainedModel,
    steps: int,
    report: VerifyReport,
) -> None:
    """Prefill and ``steps`` greedy decode steps, ONNX beside PyTorch; both continue on PyTorch's tokens.

    The same inputs go to both sides; a concat-layout export also gets its own presents
    back as the next step's pasts, as a deployment feeds them.
    """
    runner = _StepRunner(manifest, sessions, report.provider, ids.shape[0], ids.shape[1] + steps)
    past_names = cache_names("past", manifest.dims.num_layers)
    present_names = cache_names("present", manifest.dims.num_layers)
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask)}
    pasts: dict[str, np.ndarray] = {}
    cache = full_cache()
    for step in range(steps + 1):
        got = runner.run("prefill" if step == 0 else "decode", {**inputs, **pasts})
        want_logits = _torch_logits(model, inputs, cache, last_only=not (step == 0 and manifest.all_logits))
        tokens = _judge_step(case, step, got, want_logits, cache, inputs["attention_mask"], manifest, report)
        if step == steps:
            break
        inputs = _next_inputs(inputs["attention_mask"], tokens)
        if not runner.in_place:
            pasts = {past: got[present] for past, present in zip(past_names, present_names, strict=True)}


SLOTS_CASE = "slots-ragged"
_SLOT_LENGTHS = (11, 6, 3)


def _run_rows(slots: SlotCache, session: Any, inputs: dict[str, np.ndarray], first: int, rows: int) -> np.ndarray:
    """One call over ``rows`` rows of ``slots`` from ``first``, bound by address; the logits."""
    binding = session.io_binding()
    for name, value in inputs.items():
        binding.bind_cpu_input(name, value)
    binding.bind_output("logits", "cpu")
    slots.bind(binding, first, rows)
    session.run_with_iobinding(binding)
    return np.asarray(binding.get_outputs()[0].numpy())


def _run_slots_case(
    manifest: Manifest, sessions: dict[str, Any], model: PreTrainedModel, steps: int, report: VerifyReport
) -> None:
    """In-place exports: prompts of different lengths in rows of one buffer, decoded together.

    Each prompt is prefilled alone at batch 1 into its own row (bound by address), then
    every decode step runs all rows in one call over a mask as wide as the buffer, each row
    with its own length; PyTorch runs each row alone. Logits (or quality) and greedy tokens
    at every step, and each row's cache at the end; both sides continue on PyTorch's tokens.
    """
    dims = manifest.dims
    lengths = [min(length, dims.max_positions - steps) for length in _SLOT_LENGTHS]
    capacity = max(lengths) + steps
    prompts = [np.random.default_rng(row).integers(0, dims.vocab_size, (1, n), dtype=np.int64) for row, n in enumerate(lengths)]
    slots = SlotCache(manifest, report.provider, len(prompts), capacity)
    caches = [full_cache() for _ in prompts]
    got_rows, want_rows = [], []
    for row, prompt in enumerate(prompts):
        inputs = {"input_ids": prompt, "attention_mask": np.ones_like(prompt), "position_ids": np.arange(prompt.shape[1])[None]}
        got_rows.append(_run_rows(slots, sessions["prefill"], inputs, row, 1)[:, -1:])  # all-logits: the last
        want_rows.append(_torch_logits(model, inputs, caches[row], last_only=True))
    for step in range(steps + 1):
        got, want = np.concatenate(got_rows), np.concatenate(want_rows)
        tokens = _judge_logits(SLOTS_CASE, step, got, want, manifest, report)
        if step == steps:
            break
        mask = np.zeros((len(prompts), capacity), np.int64)
        for row, length in enumerate(lengths):
            mask[row, : length + 1] = 1
        inputs = {
            "input_ids": tokens.reshape(-1, 1).astype(np.int64),
            "attention_mask": mask,
            "position_ids": np.array(lengths, np.int64).reshape(-1, 1),
        }
        got_rows = [_run_rows(slots, sessions["decode"], inputs, 0, len(prompts))]
        want_rows = [
            _torch_logits(model, {name: value[row : row + 1, : lengths[row] + 1] if name == "attention_mask" else value[row : row + 1] for name, value in inputs.items()}, caches[row], last_only=True)
            for row in range(len(prompts))
        ]
        lengths = [length + 1 for length in lengths]
    if report.quantized:
        return
    for row, cache in enumerate(caches):
        for layer, (keys, values) in enumerate(cache_layers(cache)):
            for which, tensor in (("key", keys), ("value", values)):
                index = 2 * layer + (which == "value")
                got_cache = slots.read(index, row, lengths[row])
                report.tensors.append(_compare(SLOTS_CASE, steps, f"present.{layer}.{which}[row {row}]", got_cache, tensor.float().numpy(), manifest.dtype))


def _judge_logits(
    case: str, step: int, got: np.ndarray, want: np.ndarray, manifest: Manifest, report: VerifyReport, *, real: np.ndarray | None = None
) -> np.ndarray:
    """Logits parity (or quality when quantized) and greedy tokens of one step; PyTorch's tokens.

    ``real`` ([batch, positions], bool) limits the parity check to those positions' logits.
    """
    if report.quantized:
        report.quality.append(_quality(case, step, got[:, -1, :], want[:, -1, :]))
    elif real is not None and got.shape == want.shape:
        report.tensors.append(_compare(case, step, "logits", got[real][None], want[real][None], manifest.dtype))
    else:
        report.tensors.append(_compare(case, step, "logits", got, want, manifest.dtype))
    onnx_tokens, torch_tokens = got[:, -1, :].argmax(-1), want[:, -1, :].argmax(-1)
    report.tokens.append(
        TokenCheck(case, step, onnx_tokens.tolist(), torch_tokens.tolist(), bool((onnx_tokens == torch_tokens).all()))
    )
    return torch_tokens


def _read_text(text_file: Path) -> str:
    if not text_file.is_file():
        raise KvexportError(f"--text {text_file}: no such file; pass a UTF-8 text file")
    try:
        return text_file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KvexportError(f"--text {text_file}: not UTF-8 text; pass a UTF-8 text file") from None


def _text_quality(
    text_file: Path,
    text: str,
    path: Path,
    manifest: Manifest,
    sessions: dict[str, Any],
    model: PreTrainedModel,
    provider: str,
    max_tokens: int,
    window: int,
) -> TextQuality:
    """Teacher-forced perplexity and agreement over ``text_file`` (see the module docstring)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / manifest.tokenizer["file"]))
    ids = tokenizer.encode(text).ids[: max_tokens + 1]
    if len(ids) < 2:
        raise KvexportError(f"--text {text_file}: fewer than 2 tokens; pass a longer text")
    window = max(2, min(window, manifest.dims.max_positions))
    past_names = cache_names("past", manifest.dims.num_layers)
    present_names = cache_names("present", manifest.dims.num_layers)
    got_rows, want_rows, targets = [], [], []
    positions: list[int] = []  # each target's position in its window
    for start in range(0, len(ids) - 1, window - 1):  # windows overlap by one token
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        with torch.no_grad():
            want_rows.append(model(torch.tensor([chunk])).logits[0, :-1].float().numpy())
        runner = _StepRunner(manifest, sessions, provider, 1, len(chunk))
        feeds = {
            "input_ids": np.array([[chunk[0]]], dtype=np.int64),
            "attention_mask": np.ones((1, 1), dtype=np.int64),
            "position_ids": np.zeros((1, 1), dtype=np.int64),
        }
        for position in range(1, len(chunk)):
            got = runner.run("prefill" if position == 1 else "decode", feeds, presents=not runner.in_place)
            got_rows.append(got["logits"][0, -1])
            feeds = {
                "input_ids": np.array([[chunk[position]]], dtype=np.int64),
                "attention_mask": np.ones((1, position + 1), dtype=np.int64),
                "position_ids": np.array([[position]], dtype=np.int64),
            }
            if not runner.in_place:
                feeds.update({p: got[q] for p, q in zip(past_names, present_names, strict=True)})
        targets += chunk[1:]
        positions += range(1, len(chunk))
    got_logits, want_logits = np.stack(got_rows), np.concatenate(want_rows)
    agree, kl, max_error = _next_token_stats(got_logits, want_logits)
    rows = np.arange(len(targets))
    nll_onnx_rows = -log_softmax(got_logits)[rows, targets]
    nll_torch_rows = -log_softmax(want_logits)[rows, targets]
    nll_onnx, nll_torch = nll_onnx_rows.mean(), nll_torch_rows.mean()
    late = np.asarray(positions) >= window // 2
    return TextQuality(
        file=str(text_file),
        tokens=len(targets),
        window=window,
        perplexity_onnx=float(np.exp(nll_onnx)),
        perplexity_torch=float(np.exp(nll_torch)),
        perplexity_delta_pct=float((np.exp(nll_onnx - nll_torch) - 1) * 100),
        late_perplexity_delta_pct=float((np.exp(nll_onnx_rows[late].mean() - nll_torch_rows[late].mean()) - 1) * 100)
        if late.any()
        else 0.0,
        top1_agreement=float(agree.mean()),
        mean_kl=float(kl.mean()),
        max_logit_error=max_error,
    )


def _checked_request(
    path: Path, steps: int, text: str | Path | None, text_tokens: int
) -> tuple[Manifest, str | None]:
    """The manifest and the text, or one line saying why this directory can't be verified so."""
    if steps < 1:
        raise KvexportError(f"--steps {steps}: must be at least 1")
    manifest = read_manifest(path)
    if manifest.source.kind == "graph":
        raise KvexportError(
            f"{path}: imported from {manifest.source.name} without its checkpoint, so there is no PyTorch "
            "reference; import it again with --model CHECKPOINT_DIR, or run kvexport check"
        )
    if manifest.dtype not in TOLERANCES:
        raise KvexportError(f"manifest dtype {manifest.dtype!r} is not one verify knows (fp32, fp16)")
    if text_tokens < 1:
        raise KvexportError(f"--text-tokens {text_tokens}: must be at least 1")
    text_content = None if text is None else _read_text(Path(text))
    if text is not None and not manifest.tokenizer.get("file"):
        raise KvexportError(
            f"--text: {path} has no tokenizer.json to tokenize the text with; export a model that has one"
        )
    return manifest, text_content


def quality_tolerances(manifest: Manifest) -> dict[str, float] | None:
    """What a quantized export is judged by: its weights' scheme's tolerances, its cache's, or the looser of both.

    None for float weights and a float cache (judged by fp32 / fp16 parity instead).
    """
    cache = (manifest.cache.get("quantization") or {}).get("tolerances")
    weights = manifest.quantization["tolerances"] if manifest.quantization else None
    found = [t for t in (weights, cache) if t]
    if not found:
        return None
    return {
        key: (min if key.startswith("min_") else max)(float(t[key]) for t in found) for key in found[0]
    }


def _preflight_holds(path: Path, manifest: Manifest, report: VerifyReport) -> bool:
    """Files, external data and IO as the manifest records them; what fails goes into ``report``.

    External data that can't be loaded is an error (nothing can run), not a finding.
    """
    # exports older than the file record are verified without it
    found = preflight(path, hash_files=bool(manifest.files), manifest=manifest)
    report.file_problems = found.file_problems
    if report.file_problems:
        return False
    if found.external_data:
        raise ManifestError(next(iter(found.external_data.values())))
    report.io_problems = found.graph_problems()
    return not report.io_problems


def verify(
    directory: str | Path,
    *,
    steps: int = DEFAULT_STEPS,
    provider: str = "cpu",
    text: str | Path | None = None,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    text_window: int = TEXT_WINDOW,
    record: bool = True,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check an export directory against PyTorch; see the module docstring for what runs.

    Args:
        directory: a directory written by :func:`kvexport.export_gpt2`.
        steps: decode steps after prefill, per case.
        provider: ``cpu``, ``cuda`` or ``auto`` (CUDA asked for and missing is an error).
        text: a UTF-8 text file: add teacher-forced perplexity of the export and of
            PyTorch on it (see :class:`TextQuality`).
        text_tokens: use at most this many tokens of ``text``.
        text_window: tokens per teacher-forced window of ``text`` (at most the model's positions).
        record: write the summary into the manifest's ``verify`` entry.
        progress: called with a short message at each phase (the CLI prints them).

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is the verdict. Raises a
        :class:`~kvexport.KvexportError` for a directory that cannot be verified at all.

    """
    started = time.perf_counter()
    path = Path(directory)
    manifest, text_content = _checked_request(path, steps, text, text_tokens)
    resolved = resolve_provider(provider)
    progress = progress or silent
    progress(f"verifying {path}: {manifest.source.describe()}, {steps} decode steps on {resolved}")
    report = VerifyReport(
        directory=str(path),
        provider=resolved,
        steps=steps,
        dtype=manifest.dtype,
        tolerances=quality_tolerances(manifest),
    )
    progress("checking file sizes and hashes")
    if not _preflight_holds(path, manifest, report):
        report.seconds = time.perf_counter() - started
        return report
    sessions = {
        graph: open_session(path / manifest.graphs[graph].file, resolved) for graph in GRAPH_NAMES
    }
    progress("rebuilding the PyTorch reference from the manifest's source")
    model = family_for(manifest.family).load(manifest.source, manifest.dtype)  # type: ignore[arg-type]
    report.weights_match = weights_fingerprint(model) == manifest.weights_sha256
    for case, (ids, mask) in _cases(manifest.dims.vocab_size, manifest.dims.max_positions, steps).items():
        progress(f"running {case}")
        _run_case(case, ids, mask, manifest, sessions, model, steps, report)
    if manifest.cache_layout == "shared-buffer":
        progress(f"running {SLOTS_CASE}")
        _run_slots_case(manifest, sessions, model, steps, report)
    if text is not None and text_content is not None:
        progress(f"teacher-forcing {text} (at most {text_tokens} tokens)")
        report.text = _text_quality(
            Path(text), text_content, path, manifest, sessions, model, resolved, text_tokens, text_window
        )
    report.seconds = time.perf_counter() - started
    if record:
        manifest.verify = report.summary()
        manifest.write(path)
    return report
