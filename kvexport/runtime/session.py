"""Opening ONNX Runtime sessions on an explicitly chosen provider.

ONNX Runtime silently falls back to CPU when the CUDA provider cannot load. kvexport
never does: asking for ``cuda`` on a machine without it is an error, and ``auto``
picks CUDA only when a session really runs on it.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import onnx
import onnxruntime as ort

from kvexport.bundle.storage import check_external_data
from kvexport.errors import ManifestError, ProviderError, first_line
from kvexport.passes.vocabulary import (
    GROUP_QUERY_ATTENTION,
    KVEXPORT_DOMAIN,
    MATMUL_INTEGER_TO_FLOAT,
    MATMUL_NBITS,
    MS_DOMAIN,
)
from kvexport.runtime.cache import check_pool_dtype
from kvexport.runtime.kernels import KERNELS_VARIABLE, library_path

if TYPE_CHECKING:
    from onnx_ir.passes import InPlacePass

Provider = Literal["cpu", "cuda", "auto"]
ORT_PROVIDER_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# ONNX Runtime's CUDA provider runs fp32 MatMul/Gemm as TF32 unless told not to. Measured
# on an H200 (GPT-2 124M, random init): logits 1.6e-3 away from PyTorch's fp32, where
# fp32 without TF32 stays near 1e-5 (verify's fp32 tolerance is 1e-4 + 1e-3 relative).
# An fp32 export is asked for to get fp32 numbers; fp16 exports are not affected.
CUDA_PROVIDER_OPTIONS = {"use_tf32": "0"}
# what --cuda-graph adds: the provider records a run as a CUDA graph and replays it (kvexport.runtime.cuda_graph)
CUDA_GRAPH_OPTIONS = {"enable_cuda_graph": "1"}
# Which kernel runs 8-bit per-channel weights (stored as uint8 around 128) on CPU:
# auto (uint8 x int8 where the CPU has AVX-512 VNNI, else uint8 x uint8), u8s8 or u8u8.
INT8_KERNEL_VARIABLE = "KVEXPORT_INT8_KERNEL"
INT8_KERNELS = ("auto", "u8s8", "u8u8")
# How CPU sessions run a prompt's attention over the in-place cache: products (the
# default, kvexport.passes.PromptAttentionPass) or ONNX Runtime's GroupQueryAttention.
PROMPT_ATTENTION_VARIABLE = "KVEXPORT_PROMPT_ATTENTION"
PROMPT_ATTENTIONS = ("products", "gqa")
# the ops the CPU rewrites look for: a graph with none of them is opened as it is, without loading onnx_ir and the
# passes (half a second on 2 cores, against 40 ms to open a tiny graph)
CPU_REWRITTEN_OPS = frozenset({(MS_DOMAIN, GROUP_QUERY_ATTENTION), (MS_DOMAIN, MATMUL_INTEGER_TO_FLOAT)})
CPU_REWRITES_VERSION = 4  # raise it when a CPU rewrite's graph changes: pre-packed caches built by older ones are then rebuilt


@functools.cache
def cuda_available() -> bool:
    """Whether a session on ``CUDAExecutionProvider`` really runs on CUDA here."""
    if ORT_PROVIDER_NAMES["cuda"] not in ort.get_available_providers():
        return False
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])],
        "probe",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    probe = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=8
    )
    options = ort.SessionOptions()
    options.log_severity_level = 4  # the failed CUDA load is expected here; keep stderr clean
    try:
        session = ort.InferenceSession(
            probe.SerializeToString(),
            options,
            providers=[ORT_PROVIDER_NAMES["cuda"], ORT_PROVIDER_NAMES["cpu"]],
        )
    except Exception:
        return False
    return session.get_providers()[0] == ORT_PROVIDER_NAMES["cuda"]


def resolve_provider(provider: str) -> Literal["cpu", "cuda"]:
    """Turn ``cpu`` / ``cuda`` / ``auto`` into the provider to use, or say why not."""
    if provider == "cpu":
        return "cpu"
    if provider in ("cuda", "auto"):
        if cuda_available():
            return "cuda"
        if provider == "auto":
            return "cpu"
        raise ProviderError(
            "--provider cuda: ONNX Runtime's CUDA provider is not usable on this machine "
            "(no GPU or CUDA libraries); use --provider cpu, or auto to pick what is available"
        )
    raise ProviderError(f"--provider {provider}: choose cpu, cuda or auto")


def session_options(intra_op_threads: int | None = None, *, spinning: bool = False) -> ort.SessionOptions:
    """Kvexport's session settings: all graph optimisations, warnings and worse only, no spinning.

    Each session has its own intra-op thread pool, and by default its threads spin for a
    while after every run. With prefill and decode loaded side by side, one session's
    spinning threads then compete with the other's workers for the same cores: measured
    on 2 cores (GPT-2 124M), TTFT went from ~127 to ~165 ms from the second generation
    on. Threads that sleep between runs cost less than that. ``spinning`` lets them spin
    between the nodes of a run and stops them at its end (``session.force_spinning_stop``),
    for the serving engine: its prefill and mixed-step sessions run in turn, and spinning
    past a run slowed the other session's next call (a 128-token chunk and a 16-row decode
    1.2x) and, with one session alone, gained nothing measurable (2 cores, AVX2).
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if spinning:  # between its nodes only: threads still spinning after a run slow what runs next
        options.add_session_config_entry("session.force_spinning_stop", "1")
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    return options


@functools.cache
def cpu_flags_line() -> str | None:
    """The CPU's feature line of ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on Arm), stripped; None where it can't be read."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "").strip()
    except OSError:
        return None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    return frozenset((cpu_flags_line() or "").partition(":")[2].split())


def signed_int8_weights() -> bool:
    """Whether CPU sessions run 8-bit per-channel weights by the uint8 x int8 kernel.

    The weights are stored as uint8 around 128 for the uint8 x uint8 kernel, which is exact
    everywhere; where the CPU has AVX-512 VNNI, ONNX Runtime's uint8 x int8 kernel is exact
    too and about 1.5-2x faster at 16 and 128 rows, so a session opened there reads them as
    int8 (:class:`kvexport.passes.SignedChannelsPass`). ``KVEXPORT_INT8_KERNEL`` overrides
    the choice: ``u8s8`` or ``u8u8`` (``u8s8`` on an x86 CPU without VNNI saturates sums
    of products and loses accuracy: for measurements only).
    """
    choice = os.environ.get(INT8_KERNEL_VARIABLE, "auto").strip().lower() or "auto"
    if choice not in INT8_KERNELS:
        raise ProviderError(f"{INT8_KERNEL_VARIABLE}={choice}: choose {', '.join(INT8_KERNELS)}")
    if choice != "auto":
        return choice == "u8s8"
    return platform.machine() in ("x86_64", "AMD64") and "avx512_vnni" in cpu_flags()


def session_providers(provider: Literal["cpu", "cuda"], *, cuda_graph: bool = False) -> list[Any]:
    """The ``providers`` list for a resolved provider: CUDA (no TF32) backed by CPU, or CPU.

    ``cuda_graph`` adds the CUDA provider's ``enable_cuda_graph``
    (:mod:`kvexport.runtime.cuda_graph`); asked for on CPU it is a :class:`ProviderError`.
    """
    if provider == "cuda":
        options = dict(CUDA_PROVIDER_OPTIONS) | (CUDA_GRAPH_OPTIONS if cuda_graph else {})
        return [(ORT_PROVIDER_NAMES["cuda"], options), ORT_PROVIDER_NAMES["cpu"]]
    if cuda_graph:
        raise ProviderError(
            f"--cuda-graph needs the CUDA provider (this runs on {provider}); use --provider cuda on a machine "
            "with a GPU, or drop --cuda-graph"
        )
    return [ORT_PROVIDER_NAMES["cpu"]]


def open_session(
    graph_path: Path,
    provider: str = "cpu",
    options: ort.SessionOptions | None = None,
    *,
    cuda_graph: bool = False,
    paged: str | None = None,
) -> ort.InferenceSession:
    """Open one graph on the resolved provider, after checking its external data is safe.

    ``options`` defaults to :func:`session_options`; CPU backs CUDA for the ops it lacks.
    ``cuda_graph``: the CUDA provider may capture runs as CUDA graphs (a run's
    ``gpu_graph_id`` says which, :func:`kvexport.runtime.cuda_graph.graph_run_options`);
    refused on CPU. ``paged``: the cache as a pool of blocks of that element type (``fp32``,
    ``fp16``, ``q8``) read through a block table (:func:`page_cache`; CPU only); None: the export's cache.
    """
    check_external_data(graph_path)
    resolved = resolve_provider(provider)
    session_providers(resolved, cuda_graph=cuda_graph)  # refuses --cuda-graph on CPU before any work
    if paged and resolved != "cpu":
        raise ProviderError("the paged cache runs on CPU only (kvexport's attention kernel reads it)")
    options = options or session_options()
    model = cpu_graph(graph_path, options, paged=paged) if resolved == "cpu" else str(graph_path)
    return _inference_session(model, graph_path, provider, options, "this graph", cuda_graph=cuda_graph)


def prompt_attention_products() -> bool:
    """Whether CPU sessions run a prompt's attention as products (:class:`kvexport.passes.PromptAttentionPass`).

    ONNX Runtime 1.31's CPU ``GroupQueryAttention`` took 10 ms a layer for sixteen 128-token
    GPT-2 prompts on 2 AVX-512 cores; ``MatMul`` / ``Softmax`` / ``MatMul`` over the same
    tensors 2.8 ms, and the whole call 0.81-0.95x the time with several rows (one row keeps
    the op; docs/benchmarks-history.md, "Several prompts' attention as products").
    ``KVEXPORT_PROMPT_ATTENTION`` overrides the choice: ``products`` or ``gqa``.
    """
    choice = os.environ.get(PROMPT_ATTENTION_VARIABLE, "products").strip().lower() or "products"
    if choice not in PROMPT_ATTENTIONS:
        raise ProviderError(f"{PROMPT_ATTENTION_VARIABLE}={choice}: choose {', '.join(PROMPT_ATTENTIONS)}")
    return choice == "products"


def cpu_graph(graph_path: Path, options: ort.SessionOptions, *, paged: str | None = None) -> str | bytes:
    """What a CPU session of ``graph_path`` loads: its path, or the graph rewritten for this CPU.

    Where :func:`signed_int8_weights` holds, per-channel weights are read as int8; where
    kvexport's kernels are built (:func:`kvexport.runtime.kernels.library_path`), attention
    over an fp32 in-place cache runs through its kernel, and ``options`` registers the
    library; where :func:`prompt_attention_products` holds, the rest of a prompt's attention
    (an 8-bit cache's) runs as products (:func:`cpu_pipeline`: each pass decides what it
    rewrites). The
    rewritten graph comes as bytes, and ``options`` is told where its data file is: only
    the graph is read here, the weights stay in the export's data file, and ONNX Runtime
    folds the int8 codes from them when the session loads. ``paged``: the cache becomes a pool
    of blocks of that element type (:func:`page_cache`) too.
    """
    kernels = library_path()
    ops = graph_ops(onnx.load(str(graph_path), load_external_data=False).graph)
    rewritten = _cpu_rewrite(graph_path, ops, kernels, paged=paged)
    if rewritten is not None:
        graph, ops = rewritten
    _register_kernels(ops, graph_path, kernels, options)  # or a pre-packed graph's
    if rewritten is None:
        return str(graph_path)
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(graph_path.parent))
    return graph


def graph_ops(graph: onnx.GraphProto) -> set[tuple[str, str]]:
    """The ``(domain, op_type)`` of every node in ``graph`` and its subgraphs."""
    ops = set()
    for node in graph.node:
        ops.add((node.domain, node.op_type))
        for attribute in node.attribute:
            for subgraph in [attribute.g] if attribute.HasField("g") else attribute.graphs:
                ops |= graph_ops(subgraph)
    return ops


def _register_kernels(ops: set[tuple[str, str]], graph_path: Path, kernels: Path | None, options: ort.SessionOptions) -> None:
    """Register kvexport's kernel library with ``options`` where a graph of ``ops`` (:func:`graph_ops`) runs its op.

    Raises :class:`ManifestError` where it does and the library is not built (or is turned off).
    """
    if not any(domain == KVEXPORT_DOMAIN for domain, _ in ops):
        return
    if kernels is None:
        raise ManifestError(
            f"{graph_path}: this graph runs kvexport's kernels, which are not built here "
            f"(or {KERNELS_VARIABLE}=off); run kvexport build-kernels"
        )
    options.register_custom_ops_library(str(kernels))


def _cpu_rewrite(
    graph_path: Path, ops: set[tuple[str, str]], kernels: Path | None, *, paged: str | None = None
) -> tuple[bytes, set[tuple[str, str]]] | None:
    """The graph at ``graph_path`` (whose ops are ``ops``) after the CPU rewrites, and its ops; None where none changed it.

    None too where the graph has no op a CPU rewrite looks for (:data:`CPU_REWRITTEN_OPS`), this
    host wants none of them, or onnx_ir is not installed (a serving image): then nothing of
    onnx_ir or the passes is loaded. ``paged`` always rewrites (:func:`page_cache`).
    """
    if not paged and not ops & CPU_REWRITTEN_OPS:
        return None
    choices = {"signed": signed_int8_weights(), "products": prompt_attention_products(), "kernel": kernels is not None}
    if not paged and (not any(choices.values()) or importlib.util.find_spec("onnx_ir") is None):
        return None
    import onnx_ir as ir  # onnx_ir and the passes load here, for the graphs they may rewrite only

    model = ir.load(graph_path)
    changed = cpu_rewrites(model, **choices)
    if paged:
        page_cache(model, graph_path, paged)
    elif not changed:
        return None
    proto = ir.to_proto(model)
    return proto.SerializeToString(), graph_ops(proto.graph)


def cpu_pipeline(*, signed: bool | None = None, products: bool | None = None, kernel: bool | None = None) -> list[InPlacePass]:
    """The CPU rewrites this host wants, in the order they run.

    ``signed`` / ``products`` / ``kernel`` default to :func:`signed_int8_weights` /
    :func:`prompt_attention_products` / whether kvexport's kernels are built:
    :class:`~kvexport.passes.SignedChannelsPass`, :class:`~kvexport.passes.CacheAttentionPass`
    and :class:`~kvexport.passes.PromptAttentionPass`. The kernel takes every attention it
    can first; the products take what is left (an 8-bit cache's). Each pass finds what it
    rewrites itself, and reports an unchanged model where it finds nothing.
    """
    from kvexport.passes import CacheAttentionPass, PromptAttentionPass, SignedChannelsPass

    wanted: list[tuple[type[InPlacePass], bool]] = [
        (SignedChannelsPass, signed_int8_weights() if signed is None else signed),
        (CacheAttentionPass, library_path() is not None if kernel is None else kernel),
        (PromptAttentionPass, prompt_attention_products() if products is None else products),
    ]
    return [make() for make, on in wanted if on]


def cpu_rewrites(model: Any, *, signed: bool | None = None, products: bool | None = None, kernel: bool | None = None) -> bool:
    """Run :func:`cpu_pipeline` on ``model`` (an ``onnx_ir`` model) in place, as a ``PassManager``; whether any pass changed it.

    A session of a model the kernel rewrote needs the library registered (:func:`cpu_graph`
    does).
    """
    from onnx_ir.passes import PassManager

    pipeline = cpu_pipeline(signed=signed, products=products, kernel=kernel)
    return bool(pipeline) and PassManager(pipeline)(model).modified


def page_cache(model: Any, graph_path: Path, dtype: str) -> None:
    """Make ``model``'s in-place cache a pool of ``dtype`` (fp32, fp16, q8) blocks read through a block table (:class:`~kvexport.passes.PagedCachePass`).

    Run after :func:`cpu_rewrites`: only kvexport's attention kernel reads a paged cache, so a
    graph where another op reads the cache (an 8-bit cache's), or where the kernel library is
    not built, is refused in one :class:`ManifestError` line.
    """
    import onnx_ir as ir

    from kvexport.passes import PagedCachePass, PassInputError

    check_pool_dtype(dtype)
    pool_type = {"fp16": ir.DataType.FLOAT16, "q8": ir.DataType.INT8}.get(dtype)
    try:
        PagedCachePass(pool_type)(model)
    except PassInputError as exc:
        raise ManifestError(f"{graph_path}: no paged cache for this graph ({first_line(exc)})") from exc


def disabled_optimizers(provider: str) -> list[str]:
    """ONNX Runtime's graph optimizers a session on ``provider`` leaves out.

    On CPU, ``SkipLayerNormFusion``: ``ort-cpu`` exports keep a LayerNorm's residual ``Add``
    unfused (see :mod:`kvexport.passes.fuse_ort_block`) because ONNX Runtime's CPU
    ``SkipLayerNormalization`` is the slower; left on, the optimizer fuses back the one
    residual sum that nothing else reads (GPT-2's last, before ``ln_f``).

    On CUDA, ``GroupQueryAttentionFusion``: it rewrites a ``GroupQueryAttention`` whose query
    and key are rotated straight from their ``MatMul`` ops and leaves the node's inputs
    miscounted when it has more than nine, so the session fails to load (every Llama-family
    ``ort-cuda`` export before :mod:`kvexport.passes.pack_projections`); on kvexport's rotary
    tables, indexed by token, its rotation would be wrong besides. Exports written since
    do not match it; older ones load with it off.
    """
    return ["SkipLayerNormFusion"] if provider == "cpu" else ["GroupQueryAttentionFusion"]


def _inference_session(
    model: str | bytes, graph_path: Path, provider: str, options: ort.SessionOptions, what: str, *, cuda_graph: bool = False
) -> ort.InferenceSession:
    """A session of ``model`` (a path or serialized bytes) on the resolved provider; ORT's failure as one ManifestError line."""
    resolved = resolve_provider(provider)
    providers = session_providers(resolved, cuda_graph=cuda_graph)
    try:
        return ort.InferenceSession(model, options, providers=providers, disabled_optimizers=disabled_optimizers(resolved))
    except Exception as exc:  # ORT raises its own Fail / InvalidGraph / RuntimeException types
        raise ManifestError(f"{graph_path}: ONNX Runtime cannot load {what} ({first_line(exc)[:300]})") from exc


def open_mixed_session(
    graph_path: Path,
    provider: str = "cpu",
    options: ort.SessionOptions | None = None,
    *,
    all_logits: bool = False,
    paged: str | None = None,
) -> ort.InferenceSession:
    """Open the mixed step's graph, derived from an in-place prefill graph (:func:`kvexport.passes.mixed_step.mixed_step`).

    The graph is derived in memory, its weights still read from the export's data file
    (``options`` gets the data file's folder: pass options of its own). Raises
    :class:`~kvexport.passes.mixed_step.MixedStepError` for a graph it can't split, and
    ``ImportError`` where onnx_ir is not installed (a serving image).
    """
    # onnx_ir (and onnxscript's rewriter, with the passes) load here: for the engine only
    import onnx_ir as ir

    from kvexport.passes.mixed_step import mixed_step

    check_external_data(graph_path)
    model = ir.load(graph_path)
    mixed_step(model, all_logits=all_logits)
    options = options or session_options()
    kernels = None
    if resolve_provider(provider) == "cpu":  # its prompt half runs at batch 1, where the op is the faster
        kernels = library_path()
        cpu_rewrites(model, products=False, kernel=kernels is not None)
    if paged:
        page_cache(model, graph_path, paged)
    proto = ir.to_proto(model)
    _register_kernels(graph_ops(proto.graph), graph_path, kernels, options)
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(graph_path.parent))
    return _inference_session(proto.SerializeToString(), graph_path, provider, options, "its mixed step")


def prompt_session_for(
    graph_path: Path, provider: str, options: ort.SessionOptions, vocab_size: int, *, paged: str | None = None
) -> tuple[ort.InferenceSession | None, str]:
    """The session for prompts where this CPU has bf16 units (:func:`open_prompt_session`), and its kernel path or why none.

    None off CPU, where kvexport's kernels are not built, where the prompt product would take
    the portable loop (no AMX, and no AVX512-BF16 asked for by name: ONNX Runtime's blocks are the faster there), and
    for a graph without block-quantized products. The LM head (``vocab_size`` wide) keeps its blocks.
    """
    from kvexport.runtime.kernels import FAST_PROMPT_GEMMS, prompt_gemm_path

    path = prompt_gemm_path() if resolve_provider(provider) == "cpu" else None
    if path not in FAST_PROMPT_GEMMS:
        return None, f"no bf16 units for prompts here (kernel path: {path or 'not built, or not on CPU'})"
    session = open_prompt_session(graph_path, options, skip_width=vocab_size, paged=paged)
    return session, path if session is not None else "no block-quantized products in the graph"


def _ask_for_tiles(model: Any) -> None:
    """Mark the prompt graph's attention for AMX tiles (``bf16_tiles``: taken where the CPU and OS give them, unless ``KVEXPORT_ATTENTION_PATH`` narrows the paths).

    A function of its own, so no loop variable outlives it: a node held past ``del model`` kept
    the graph's tensors, and the export's data file they map, alive (0.14 GB more RSS for SmolLM2-135M).
    """
    import onnx_ir as ir

    for node in model.graph:
        if node.domain == KVEXPORT_DOMAIN and node.op_type == "CacheAttention":
            node.attributes["bf16_tiles"] = ir.AttrInt64("bf16_tiles", 1)


def open_prompt_session(
    graph_path: Path, options: ort.SessionOptions | None = None, *, skip_width: int | None = None, paged: str | None = None
) -> ort.InferenceSession | None:
    """A CPU session of ``graph_path`` for prompts: its block-quantized products in bf16 (:class:`~kvexport.passes.PromptProductsPass`).

    The graph gets the CPU rewrites first (:func:`cpu_rewrites`), then every ``MatMulNBits``
    but the LM head's (``skip_width``, its output width) becomes ``kvexport.PromptMatMul``, which
    keeps its weights in bf16 (2 bytes a weight, beside the int8 blocks the decoding session
    holds). None where the graph has no such product or onnx_ir is not installed. Open it only
    where :func:`kvexport.runtime.kernels.prompt_gemm_path` names the CPU's bf16 units.
    """
    if importlib.util.find_spec("onnx_ir") is None:
        return None
    if (MS_DOMAIN, MATMUL_NBITS) not in graph_ops(onnx.load(str(graph_path), load_external_data=False).graph):
        return None
    import onnx_ir as ir

    from kvexport.passes import PromptProductsPass

    check_external_data(graph_path)
    model = ir.load(graph_path)
    kernels = library_path()
    cpu_rewrites(model, kernel=kernels is not None)
    products = PromptProductsPass(skip_width, placeholders=True)
    if not products(model).modified:
        return None
    _ask_for_tiles(model)
    if paged:
        page_cache(model, graph_path, paged)
    options = options or session_options()
    proto = ir.to_proto(model)
    del model
    gc.collect()  # the graph's tensors map the export's data file until they are collected (0.14 GB for SmolLM2-135M)
    _register_kernels(graph_ops(proto.graph), graph_path, kernels, options)
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(graph_path.parent))
    # the bf16 weights go to ONNX Runtime where they are (no copy); they must live as long as the session, which holds them
    values = {name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, onnx.TensorProto.BFLOAT16) for name, array in products.weights.items()}
    for name, value in values.items():
        options.add_initializer(name, value)
    session = _inference_session(proto.SerializeToString(), graph_path, "cpu", options, "its prompt graph")
    session.kvexport_prompt_weights = (products.weights, values)
    return session
