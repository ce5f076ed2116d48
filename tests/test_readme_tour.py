"""The README's five-minute tour, run as written: generate --chat, serve, curl and the openai client on out/smollm2.

The tour starts where ``scripts/demo.sh`` (the main job, which CI runs before the tests) left
``out/smollm2``: SmolLM2-135M-Instruct exported from its GGUF. Where it is missing, the test
exports it as the demo does. The two fenced blocks under "Five-minute tour" run from the
repository root with this environment's ``kvexport`` first on the PATH, in one bash session,
the server's port 8000 swapped for a free one (the only change). generate --chat must print the
Generator's greedy answer to the chat-templated question; curl and the openai client must both get
the engine's greedy answer with the server's defaults (an int4 export's paged cache holds fp16
keys and values, which the Generator's fp32 cache does not: tests/test_paged_cache.py judges
the two against each other).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from kvexport.runtime import Generator
from kvexport.serving import Engine, SamplingParams
from kvexport.serving.chat import ChatTemplate
from tests.conftest import SMOLLM2_EXPORT as EXPORT

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Name three primary colors."


def _tour_blocks() -> tuple[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Five-minute tour", 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.S)
    python = re.search(r"```python\n(.*?)```", section, re.S)
    assert bash and python, "the README's tour has a bash block and a python block"
    return bash.group(1), python.group(1)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_readme_tour_runs_as_written(smollm2_export: Path) -> None:
    bash, python = _tour_blocks()
    port = str(_free_port())
    script = (
        "set -euo pipefail\n"
        + bash.replace("8000", port)
        + "\necho '--- python'\n"
        + f"python - <<'PY'\n{python.replace('8000', port)}PY\n"
        + "kill %1\nwait %1 || true\n"
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    before, after = done.stdout.split("--- python\n")
    *generated, served = before.strip().splitlines()
    answer = json.loads(served)["choices"][0]["message"]["content"]
    generator = Generator(EXPORT)
    template = ChatTemplate.find(EXPORT)
    assert template is not None, "the GGUF's chat template ships with the export"
    ids = generator.encode(template.render([{"role": "user", "content": QUESTION}]))
    # greedy, stopping at the chat's end token as the server does (decode drops it)
    want = generator.tokenizer.decode(generator.generate([ids], 40)[0, len(ids) :].tolist())  # type: ignore[union-attr]
    assert want.strip() and "<|im" not in want
    assert "\n".join(generated).strip() == want.strip()
    with Engine(EXPORT, warm_up=0) as engine:  # the server's defaults
        tokens = engine.submit(ids, SamplingParams(max_tokens=40, temperature=0)).result()[0]
    served_want = generator.tokenizer.decode(tokens)  # type: ignore[union-attr]
    assert served_want.strip() and "<|im" not in served_want
    assert answer == served_want
    assert after.rstrip("\n") == served_want
