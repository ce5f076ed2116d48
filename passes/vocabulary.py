"""The words the passes write into a graph and the rest of kvexport reads back: domains, op types, metadata keys.

Each is spelled here once. Standard library only (as :mod:`.choices` and :mod:`.cache_names`),
so the runtime and the server, which run without onnx_ir, import the same names the passes use.
"""

from __future__ import annotations

MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib operators
KVEXPORT_DOMAIN = "kvexport"  # kvexport's own kernels (kvexport.runtime.kernels registers the domain)

# op types a pass or the runtime looks for (with their domain)
GROUP_QUERY_ATTENTION = "GroupQueryAttention"  # com.microsoft
MULTI_HEAD_ATTENTION = "MultiHeadAttention"  # com.microsoft
ROTARY_EMBEDDING = "RotaryEmbedding"  # com.microsoft
MATMUL_INTEGER_TO_FLOAT = "MatMulIntegerToFloat"  # com.microsoft
CACHE_ATTENTION = "CacheAttention"  # kvexport: the CPU kernel (passes.cache_attention)
PROMPT_MATMUL = "PromptMatMul"  # kvexport: the bf16 prompt product (passes.prompt_products)
MATMUL_NBITS = "MatMulNBits"  # com.microsoft
ATTENTION = "Attention"  # the standard opset-23 op
FUSED_ATTENTION = frozenset({ATTENTION, MULTI_HEAD_ATTENTION, GROUP_QUERY_ATTENTION})

# node metadata: a fused GroupQueryAttention whose cache IO is still the exporter's (passes.fuse_grouped_attention
# writes "concat", kvexport.export.genai_graph "genai"); passes.shared_buffer_cache rewrites it and drops the mark
GQA_MARK = "kvexport.gqa_cache"
# model metadata: every layer's attention takes several rows after a past ("products": an 8-bit cache's
# products; the op refuses such a call). passes.prompt_attention sets it, kvexport.serving.runner reads it
ROWS_AFTER_PAST = "kvexport.rows_after_past"

# the paged cache (passes.paged_cache): the int32 graph input that maps a row's positions to the pool's blocks
# ("decode." before it for the mixed step's decode half), and the positions a block holds, which the runtime's
# pool (kvexport.runtime.cache.PagedCache) and the engine's block manager (kvexport.serving.blocks) both count in
BLOCK_TABLE = "block_table"
PAGE_TOKENS = 16  # vLLM's default block size too
# what a paged pool may hold: kvexport's kernel reads each, converting an fp16 or q8 pool as it reads and writes it
# (q8: a position's head as int8 codes followed by its fp32 scale, Q8_SCALE_BYTES more a position)
POOL_DTYPES = ("fp32", "fp16", "q8")
Q8_SCALE_BYTES = 4
