"""The tiny vision-language checkpoints (LLaVA, Qwen2.5-VL): real HF folders written by
transformers from a fixed torch seed, with a locally trained tokenizer holding the vision tokens.
Shared by the engine, HTTP and tensor-parallel tests; each returns the transformers model too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def build_tiny_llava(folder: Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a tiny ``LlavaForConditionalGeneration`` written to ``folder``."""
    import torch
    import transformers

    from jaxserve.models.demo import build_tokenizer

    tok = build_tokenizer(folder, vocab_size=320, added_tokens=("<image>",))
    image_id = tok.convert_tokens_to_ids("<image>")
    torch.manual_seed(0)
    cfg = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            image_size=28, patch_size=7, projection_dim=16, initializer_range=0.2),
        text_config=transformers.LlamaConfig(
            vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2, eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id),
        image_token_index=image_id)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    model.save_pretrained(folder)
    transformers.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
                                    ).save_pretrained(folder)
    return model, tok


def build_tiny_qwen2_5_vl(folder: Path) -> tuple[Any, int]:
    """``(model, image pad token id)`` of a tiny ``Qwen2_5_VLForConditionalGeneration`` in ``folder``."""
    import torch
    import transformers

    from jaxserve.models.demo import build_tokenizer

    tok = build_tokenizer(folder, vocab_size=320, added_tokens=QWEN_VISION_TOKENS)
    start, end, pad, video = (tok.convert_tokens_to_ids(t) for t in QWEN_VISION_TOKENS)
    torch.manual_seed(0)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64,
                           patch_size=2, temporal_patch_size=2, spatial_merge_size=2, window_size=8,
                           fullatt_block_indexes=[1]),
        image_token_id=pad, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 64, "max_pixels": 576, "patch_size": 2, "merge_size": 2, "temporal_patch_size": 2}))
    return model, pad
