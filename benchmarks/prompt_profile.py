#!/usr/bin/env python
"""Where one prompt's time goes in the bf16 prompt session: ONNX Runtime's profile by op type (issue #71).

Outside CI. One ``--tokens``-token prompt of random ids, at batch 1 into a slot, through the session
the engine runs prompts with on AMX (:func:`kvexport.runtime.session.open_prompt_session`), on 2
spinning threads; the first run dropped, the next three averaged; prints ms and share by op type.

    .venv/bin/python benchmarks/prompt_profile.py /tmp/exp/smol-int8 [--tokens 512]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from roofline import _by_op, isa

from kvexport.bundle.manifest import read_manifest
from kvexport.runtime.cache import SlotCache
from kvexport.runtime.session import open_prompt_session, session_options

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("export", type=Path)
parser.add_argument("--tokens", type=int, default=512)
args = parser.parse_args()
export = args.export
manifest = read_manifest(export)
graph = export / manifest.graphs["prefill"].file
vocab = manifest.dims.vocab_size
rng = np.random.default_rng(0)
prompt = rng.integers(0, vocab, args.tokens).tolist()
with tempfile.TemporaryDirectory() as folder:
    options = session_options(2, spinning=True)
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(folder, "p")
    session = open_prompt_session(graph, options, skip_width=vocab)
    if session is None:
        sys.exit("no prompt session here: it opens only where the CPU has AMX (or KVEXPORT_PROMPT_GEMM names a path)")
    cache = SlotCache(manifest, "cpu", 1, max(1024, args.tokens))
    for _ in range(4):
        cache.run_piece(session, 0, prompt, 0)
    by_op = _by_op(json.loads(Path(session.end_profiling()).read_text()), 1)
    total = sum(by_op.values())
    print(f"{args.tokens}-token prompt, {', '.join(isa())}: total {total:.1f} ms")
    for op, ms in sorted(by_op.items(), key=lambda x: -x[1])[:14]:
        print(f"  {op:32s} {ms:7.2f} ms  {100*ms/total:4.1f}%")
