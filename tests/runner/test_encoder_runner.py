"""The runner's image side: one compiled encoder per image-count bucket (none after warm-up),
outputs kept by hash, and a step's rows gathered across a chunk that cuts through an image."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.core.multimodal import MultiModalFeatureSpec, PlaceholderRange
from jaxserve.models.llava_vision import LlavaImageEncoder, LlavaVisionConfig
from jaxserve.runner.encoder_runner import EncoderRunner, image_buckets

CFG = LlavaVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        image_size=14, patch_size=7, num_channels=3, layer_norm_eps=1e-5, hidden_act="quick_gelu",
                        text_hidden_size=8, projector_hidden_act="gelu", projector_bias=True,
                        vision_feature_layer=-2, select_strategy="default", image_token_id=5)


def test_buckets():
    assert image_buckets(1) == [1] and image_buckets(4) == [1, 2, 4] and image_buckets(6) == [1, 2, 4, 6]


def test_encode_gather_free_without_compiles_after_warm_up():
    encoder = LlavaImageEncoder(CFG, nnx.Rngs(0))
    runner = EncoderRunner(encoder, (3, 14, 14), max_images_per_batch=4)
    runner.warm_up()
    assert runner.num_compiled == 3
    rng = np.random.default_rng(0)
    px = {f"h{i}": rng.standard_normal((3, 14, 14)).astype(np.float32) for i in range(6)}
    runner.encode([("h0", px["h0"])])
    runner.encode([(h, px[h]) for h in ("h1", "h2", "h3", "h4", "h5", "h0")])  # 5 new: a batch of 4, one of 1
    assert runner.num_compiled == 3 and runner.num_images_encoded == 6
    direct = np.asarray(encoder(jnp.asarray(np.stack([px[h] for h in sorted(px)]))))
    for i, h in enumerate(sorted(px)):
        np.testing.assert_allclose(runner.outputs[h], direct[i], atol=1e-5)

    # Request a: image h1 at tokens 2..6 (4 tokens per image); this chunk is tokens [0, 4) -> ends inside it.
    # Request b: image h2 at 0..4, this chunk [3, 6) starts inside it.
    fa = [MultiModalFeatureSpec("h1", PlaceholderRange(2, 4))]
    fb = [MultiModalFeatureSpec("h2", PlaceholderRange(0, 4))]
    embeds, mask = runner.gather([(fa, 0, 4), (fb, 3, 3)], num_rows=8, hidden=8)
    assert mask.tolist() == [False, False, True, True, True, False, False, False]
    np.testing.assert_array_equal(embeds[2:4], runner.outputs["h1"][0:2])
    np.testing.assert_array_equal(embeds[4], runner.outputs["h2"][3])
    assert not embeds[mask == 0].any()

    runner.free(["h1", "h9"])
    assert "h1" not in runner.outputs and "h2" in runner.outputs
