#!/usr/bin/env python
"""Train the small models that the quantization tests measure quality on (GPT-2, and a Llama).

Random weights have no logit margins, so they say nothing about quantization error. This
trains a ``GPT2LMHeadModel`` (4 layers, 2 heads of 64, 128 wide, 256 positions) or, with
``--family llama``, a ``LlamaForCausalLM`` of the same width and depth (4 query heads of 32
sharing 2 KV heads, RMSNorm, rotary positions, a gated MLP of 384, tied embeddings), each
with its own 2,048-token byte-level BPE on English text that ships with every CPython: the
help topics of ``pydoc_data.topics`` (the text ``help("assert")`` shows). Every eighth
topic, in sorted order, is held out and never trained on.

Writes ``tests/data/tiny-trained/`` (``tests/data/tiny-trained-llama/`` for the Llama):
``config.json``, ``model.safetensors``, ``tokenizer.json``, ``heldout.txt`` and
``TRAINING.json`` (source, steps, seconds, and the train/held-out loss). Deterministic for
a given torch build (seeded, 2 threads).

    .venv/bin/python scripts/train_tiny_gpt2.py [--family gpt2|llama] [--out DIR] [--steps 1500]
"""

from __future__ import annotations

import argparse
import json
import math
import pydoc_data.topics
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

EOS = "<|endoftext|>"
VOCAB_SIZE = 2048
SEQUENCE = 128
BATCH = 16


def split_topics() -> tuple[str, str]:
    """(train text, held-out text): every eighth topic in sorted order is held out."""
    train, heldout = [], []
    for index, name in enumerate(sorted(pydoc_data.topics.topics)):
        (heldout if index % 8 == 7 else train).append(pydoc_data.topics.topics[name])
    return f"\n{EOS}\n".join(train), f"\n{EOS}\n".join(heldout)


def train_tokenizer(text: str) -> Tokenizer:
    """A byte-level BPE of VOCAB_SIZE tokens, GPT-2 style, trained on ``text``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.split(f"\n{EOS}\n"), trainer)
    return tokenizer


def batches(tokens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """BATCH random windows of SEQUENCE + 1 tokens."""
    starts = torch.randint(0, len(tokens) - SEQUENCE - 1, (BATCH,), generator=generator)
    return torch.stack([tokens[s : s + SEQUENCE + 1] for s in starts.tolist()])


@torch.no_grad()
def mean_loss(model: PreTrainedModel, tokens: torch.Tensor) -> float:
    """Mean next-token loss over consecutive windows of ``tokens``."""
    model.eval()
    losses = []
    for start in range(0, len(tokens) - SEQUENCE, SEQUENCE):
        chunk = tokens[start : start + SEQUENCE].unsqueeze(0)
        losses.append(float(model(chunk, labels=chunk).loss))
    model.train()
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    """Train, then write the checkpoint, tokenizer, held-out text and TRAINING.json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--out", type=Path, default=None, help="[default: tests/data/tiny-trained, or tiny-trained-llama]")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = Path("tests/data/tiny-trained" if args.family == "gpt2" else "tests/data/tiny-trained-llama")
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    started = time.perf_counter()

    train_text, heldout_text = split_topics()
    tokenizer = train_tokenizer(train_text)
    eos_id = tokenizer.token_to_id(EOS)
    train_tokens = torch.tensor(tokenizer.encode(train_text).ids, dtype=torch.long)
    heldout_tokens = torch.tensor(tokenizer.encode(heldout_text).ids, dtype=torch.long)

    model: PreTrainedModel
    if args.family == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=VOCAB_SIZE,
                n_positions=256,
                n_embd=128,
                n_layer=4,
                n_head=2,
                bos_token_id=eos_id,
                eos_token_id=eos_id,
                resid_pdrop=0.1,
                embd_pdrop=0.1,
                attn_pdrop=0.1,
            )
        )
    else:
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB_SIZE,
                max_position_embeddings=256,
                hidden_size=128,
                intermediate_size=384,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=True,
                bos_token_id=eos_id,
                eos_token_id=eos_id,
                attention_dropout=0.1,
            )
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / args.steps)),
    )
    generator = torch.Generator().manual_seed(args.seed)
    model.train()
    for step in range(args.steps):
        batch = batches(train_tokens, generator)
        loss = model(batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step}: train loss {loss.item():.3f}", file=sys.stderr)

    train_seconds = time.perf_counter() - started
    heldout_loss = mean_loss(model, heldout_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(args.out, safe_serialization=True)
    for extra in ("generation_config.json",):
        (args.out / extra).unlink(missing_ok=True)
    tokenizer.save(str(args.out / "tokenizer.json"))
    (args.out / "heldout.txt").write_text(heldout_text)
    record = {
        "family": args.family,
        "text": "CPython's pydoc_data.topics (the help() topics); every eighth topic in sorted order held out",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "train_tokens": len(train_tokens),
        "heldout_tokens": len(heldout_tokens),
        "steps": args.steps,
        "batch": BATCH,
        "sequence": SEQUENCE,
        "seed": args.seed,
        "train_seconds": round(train_seconds, 1),
        "final_train_loss": round(loss.item(), 4),
        "heldout_loss": round(heldout_loss, 4),
        "heldout_perplexity": round(math.exp(heldout_loss), 3),
    }
    (args.out / "TRAINING.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
