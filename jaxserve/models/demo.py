"""The random tiny demo model (``jaxserve-demo``): a tiny random Qwen3 built on first use into the
cache folder. The default demo is the trained SmolLM2 (:mod:`jaxserve.models.smollm2`); this one
serves fast tests, and the default's place when SmolLM2 cannot be fetched.

No model hub and no torch are needed. The checkpoint is a real Hugging Face folder that
transformers loads: ``config.json`` written by transformers' config class, weights drawn with numpy
and written as safetensors (:mod:`jaxserve.models.random_weights`), and a byte-level BPE tokenizer
trained with ``tokenizers`` on text generated here, with a ChatML chat template that renders tools
as Qwen3's does. A build is byte-identical from run to run. The test suite builds its tiny
checkpoints with the same function (``tests/tiny_models.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from jaxserve import envs

logger = logging.getLogger("jaxserve")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, laid out as Qwen3's template lays out tools: their definitions in the system turn inside
# <tools></tools>, the assistant's calls as <tool_call> blocks, tool results as <tool_response>
# blocks in one user turn; enable_thinking=false closes an empty think block after the generation
# prompt. A conversation without tools renders as plain ChatML.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nFunctions you may call:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nTo call one, reply with:\\n<tool_call>\\n'
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'system' and tools and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + content }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

DEMO_MODEL_NAME = "jaxserve-demo"  # how a user asks for this model (the default demo is SmolLM2)
DEMO_ARCH = "Qwen3ForCausalLM"
# Shaped like Qwen3-0.6B (explicit head_dim with q width 2x hidden, GQA 2, tied), but tiny.
DEMO_SHAPE: dict[str, Any] = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  tie_word_embeddings=True)
DEMO_VERSION = 3  # 2: weights drawn with numpy instead of torch; 3: the template renders tools

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


def build_tokenizer(folder: str | Path, vocab_size: int = 512, seed: int = 0, added_tokens: tuple[str, ...] = ()):
    """Train a byte-level BPE tokenizer and write it as a Hugging Face tokenizer with the chat
    template (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``); returns it
    loaded by transformers. ``added_tokens`` become whole tokens that decode as text (as Qwen3's
    ``<think>`` and ``</think>`` are)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(training_corpus(seed=seed), trainer=trainer)
    if added_tokens:
        tok.add_tokens(list(added_tokens))
    tok.save(str(folder / "tokenizer.json"))
    # The older spelling (PreTrainedTokenizerFast, additional_special_tokens) is the one both
    # transformers 4 and 5 read; decoding keeps spaces before punctuation as they were.
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>"], "clean_up_tokenization_spaces": False,
    })
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return AutoTokenizer.from_pretrained(str(folder))


def build_checkpoint(
    folder: str | Path,
    architecture: str,
    shape: dict[str, Any],
    *,
    seed: int = 0,
    vocab_size: int = 512,
    dtype: str = "float32",
    max_shard_bytes: int | None = None,
    initializer_range: float = 0.05,
    added_tokens: tuple[str, ...] = (),
    **overrides: Any,
) -> Path:
    """Write a random-init HF checkpoint folder (config, safetensors, tokenizer, chat template).

    ``shape`` and ``overrides`` are fields of the architecture's transformers config;
    ``initializer_range`` is the weights' standard deviation, as in transformers' own init;
    ``added_tokens``: ``build_tokenizer``'s."""
    import transformers

    from jaxserve.models.random_weights import write_random_weights

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder, vocab_size=vocab_size, seed=seed, added_tokens=added_tokens)
    kwargs = {**shape, **overrides}
    # Gemma 3's text-only model has its own config class (Gemma3Config is the image-text one).
    config_name = {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(architecture,
                                                                  architecture.replace("ForCausalLM", "Config"))
    config_cls = getattr(transformers, config_name)
    config = config_cls(
        vocab_size=len(tokenizer), max_position_embeddings=kwargs.pop("max_position_embeddings", 1024),
        bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=initializer_range,
        architectures=[architecture], dtype=dtype, **kwargs,
    )
    config.save_pretrained(str(folder))
    _write_json(folder / "generation_config.json", {
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id,
    })
    write_random_weights(folder, seed=seed, std=initializer_range, max_shard_bytes=max_shard_bytes)
    return folder


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def build_demo_checkpoint(folder: str | Path) -> Path:
    """The demo model's checkpoint, written into ``folder`` (the same bytes every time)."""
    return build_checkpoint(folder, DEMO_ARCH, DEMO_SHAPE, seed=0, vocab_size=1024, max_position_embeddings=2048)


def demo_model_path() -> Path:
    """The built-in demo model, built deterministically on first use into the cache folder."""
    key = hashlib.sha256(json.dumps([DEMO_ARCH, DEMO_VERSION, DEMO_SHAPE]).encode()).hexdigest()[:10]
    target = envs.cache_dir() / "models" / f"demo-{key}"
    if (target / "config.json").is_file():
        logger.info("demo model: %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # Build next to the target and rename, so a concurrent start never sees a half-written folder.
    staging = Path(tempfile.mkdtemp(prefix="demo-build-", dir=target.parent))
    try:
        build_demo_checkpoint(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("demo model: built in %.1f s into %s", time.perf_counter() - start, target)
    return target
