"""The built-in demo model: a tiny random Qwen3 built on first use into the cache folder.

No model hub is needed. The checkpoint is a real Hugging Face folder written by transformers' own
model classes (random init, fixed seed) plus a byte-level BPE tokenizer trained with
``tokenizers`` on text generated here, with a ChatML chat template. Building needs torch; loading
does not. The test suite builds its tiny checkpoints with the same functions (``jaxserve.testing``).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from jaxserve import envs

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEMO_ARCH = "Qwen3ForCausalLM"
# Shaped like Qwen3-0.6B (explicit head_dim with q width 2x hidden, GQA 2, tied), but tiny.
DEMO_SHAPE: dict[str, Any] = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  tie_word_embeddings=True)
DEMO_VERSION = 1

_WORDS = (
    "the a engine model token request block cache batch step prefix chunk page kernel graph "
    "scheduler budget decode prefill sample stream server client query key value head layer "
    "jax xla compile shape bucket queue memory device host fast small large quick brown fox "
    "jumps over lazy dog river mountain city light dark red blue green time world people "
    "water fire earth air number story reason answer question hello thanks please good"
).split()
_EXTRA = ["café", "naïve", "über", "日本語", "東京", "你好", "😀", "🚀", "€100", "π≈3.14", "Ünïcödé"]


def training_corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic English-like text with digits, punctuation and multi-byte characters."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), rng.choice(_EXTRA))
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "!", "?", ",", ":"]))
    return lines


def build_tokenizer(folder: str | Path, vocab_size: int = 512, seed: int = 0):
    """Train a byte-level BPE tokenizer and save it as an HF tokenizer with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(training_corpus(seed=seed), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.save_pretrained(str(folder))
    return hf_tok


def build_checkpoint(
    folder: str | Path,
    architecture: str,
    shape: dict[str, Any],
    *,
    seed: int = 0,
    vocab_size: int = 512,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    initializer_range: float = 0.05,
    **overrides: Any,
) -> Path:
    """Write a random-init HF checkpoint folder (config, safetensors, tokenizer, chat template)."""
    import torch
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder, vocab_size=vocab_size, seed=seed)
    kwargs = {**shape, **overrides}
    config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_cls(
        vocab_size=len(tokenizer), max_position_embeddings=kwargs.pop("max_position_embeddings", 1024),
        bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=initializer_range, **kwargs,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(getattr(torch, dtype)).eval()
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), safe_serialization=True, **save_kwargs)
    return folder


def demo_model_path() -> Path:
    """The built-in demo model, built deterministically on first use into the cache folder."""
    key = hashlib.sha256(json.dumps([DEMO_ARCH, DEMO_VERSION, DEMO_SHAPE]).encode()).hexdigest()[:10]
    target = envs.cache_dir() / "models" / f"demo-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename, so a concurrent start never sees a half-written folder.
    staging = Path(tempfile.mkdtemp(prefix="demo-build-", dir=target.parent))
    try:
        build_checkpoint(staging, DEMO_ARCH, DEMO_SHAPE, seed=0, vocab_size=1024, max_position_embeddings=2048)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
