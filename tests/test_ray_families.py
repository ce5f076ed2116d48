"""``kvexport serve --replicas 2`` on a Llama-family export: the Ray path serves every family.

Its own module, so its Ray cluster is never up beside test_ray_serve's (each test module
waits until its cluster's processes have gone).
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import pytest

from kvexport import export_model
from kvexport.runtime import Generator

pytest.importorskip("ray")

from .test_ray_serve import AUTHORIZED, _until_both_answer, ray_deployment

TRAINED_LLAMA = Path(__file__).parent / "data" / "tiny-trained-llama"


def test_both_replicas_answer_a_llama_export_with_the_generators_tokens(tmp_path: Path) -> None:
    export = tmp_path / "llama"
    export_model(export, str(TRAINED_LLAMA), target="ort-cpu")
    prompts = ["The history of the", "In the early years", "It was a"]
    generator = Generator(export)
    assert generator.tokenizer is not None
    want = {}
    for prompt in prompts:
        ids = generator.encode(prompt)
        want[prompt] = generator.tokenizer.decode(generator.generate([ids], 8, eos_token_id=-1)[0, len(ids) :].tolist())
    with ray_deployment(export) as (url, _):

        def complete(prompt: str) -> httpx.Response:
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=60, headers=AUTHORIZED)

        batch = [prompts[i % len(prompts)] for i in range(18)]

        def send() -> tuple[set[str], list[httpx.Response]]:
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                answered = list(pool.map(complete, batch))
            return {r.headers.get("x-kvexport-replica", "") for r in answered}, answered

        _, responses = _until_both_answer(send)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    assert len({r.headers.get("x-kvexport-replica", "") for r in responses} - {""}) == 2
    asked = batch * (len(responses) // len(batch))
    assert [r.json()["choices"][0]["text"] for r in responses] == [want[p] for p in asked]
