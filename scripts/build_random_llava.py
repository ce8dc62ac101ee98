"""Write a random LLaVA checkpoint folder for ``jaxserve bench mm`` (needs torch and transformers):
transformers' ``LlavaForConditionalGeneration`` at a small shape (CLIP 112 px, patch 14: 64 tokens
an image, 4 layers of 128; a Llama of 4 layers of 256), its CLIP preprocessor config, and the demo
model's trained tokenizer with ``<image>`` added.

    python scripts/build_random_llava.py /tmp/llava-bench
"""

from __future__ import annotations

import sys


def main(folder: str) -> None:
    import torch
    import transformers

    from jaxserve.models.demo import build_tokenizer

    tok = build_tokenizer(folder, vocab_size=512, added_tokens=("<image>",))
    torch.manual_seed(0)
    cfg = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, image_size=112,
            patch_size=14, projection_dim=64),
        text_config=transformers.LlamaConfig(
            vocab_size=len(tok), hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=1024, eos_token_id=tok.eos_token_id),
        image_token_index=tok.convert_tokens_to_ids("<image>"))
    transformers.LlavaForConditionalGeneration(cfg).eval().save_pretrained(folder)
    transformers.CLIPImageProcessor(size={"shortest_edge": 112},
                                    crop_size={"height": 112, "width": 112}).save_pretrained(folder)
    print(folder)


if __name__ == "__main__":
    main(sys.argv[1])
