"""LLaVA's image side as Flax NNX modules: the CLIP vision tower and the multimodal projector.

The tower runs only up to ``vision_feature_layer`` (LLaVA reads a hidden state, never the pooled
output, so the post-layernorm is never applied); the ``default`` strategy drops the class token.
The projector (``linear_1``, activation, ``linear_2``) maps each patch to one language-model
embedding, which replaces one image placeholder token in the prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.layers.linear import Linear

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


@dataclass(frozen=True)
class LlavaVisionConfig:
    """The vision tower's and projector's shapes, read from a LLaVA ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    text_hidden_size: int
    projector_hidden_act: str
    projector_bias: bool
    vision_feature_layer: int
    select_strategy: str
    image_token_id: int

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> LlavaVisionConfig:
        v, t = d["vision_config"], d["text_config"]
        layer = d.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ValueError("vision_feature_layer: only one layer is supported, not a list")
        strategy = d.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy: {strategy!r} is not 'default' or 'full'")
        return cls(
            hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
            num_hidden_layers=v["num_hidden_layers"], num_attention_heads=v["num_attention_heads"],
            image_size=v["image_size"], patch_size=v["patch_size"], num_channels=v.get("num_channels", 3),
            layer_norm_eps=v.get("layer_norm_eps", 1e-5), hidden_act=v.get("hidden_act", "quick_gelu"),
            text_hidden_size=t["hidden_size"], projector_hidden_act=d.get("projector_hidden_act", "gelu"),
            projector_bias=d.get("multimodal_projector_bias", True), vision_feature_layer=layer,
            select_strategy=strategy, image_token_id=d.get("image_token_id", d.get("image_token_index", 32000)),
        )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens one image expands to."""
        return self.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def layers_run(self) -> int:
        """Encoder layers before the hidden state LLaVA reads (``hidden_states[0]`` is the input)."""
        layer = self.vision_feature_layer
        return layer if layer >= 0 else self.num_hidden_layers + 1 + layer


class LayerNorm(nnx.Module):
    def __init__(self, n: int, eps: float):
        self.scale = nnx.Param(jnp.ones((n,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((n,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]


class CLIPEncoderLayer(nnx.Module):
    """Pre-norm block: full (non-causal) attention over the image's tokens, then the MLP."""

    def __init__(self, cfg: LlavaVisionConfig, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.act = cfg.hidden_act
        self.layer_norm1 = LayerNorm(h, cfg.layer_norm_eps)
        self.layer_norm2 = LayerNorm(h, cfg.layer_norm_eps)
        self.qkv_proj = Linear(h, 3 * h, use_bias=True, rngs=rngs)
        self.out_proj = Linear(h, h, use_bias=True, rngs=rngs)
        self.fc1 = Linear(h, cfg.intermediate_size, use_bias=True, rngs=rngs)
        self.fc2 = Linear(cfg.intermediate_size, h, use_bias=True, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [N, S, hidden]`` (N images of S tokens each)."""
        n, s, h = x.shape
        d = h // self.num_heads
        q, k, v = jnp.split(self.qkv_proj(self.layer_norm1(x)), 3, axis=-1)
        q, k, v = (t.reshape(n, s, self.num_heads, d) for t in (q, k, v))
        scores = jnp.einsum("nqhd,nkhd->nhqk", q, k) * d**-0.5
        attn = jnp.einsum("nhqk,nkhd->nqhd", jax.nn.softmax(scores, axis=-1), v).reshape(n, s, h)
        x = x + self.out_proj(attn)
        return x + self.fc2(activation(self.act)(self.fc1(self.layer_norm2(x))))


class LlavaImageEncoder(nnx.Module):
    """``pixel_values [N, C, H, W]`` -> ``[N, tokens_per_image, text_hidden]`` embeddings."""

    def __init__(self, cfg: LlavaVisionConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        h, p = cfg.hidden_size, cfg.patch_size
        # The patch convolution (stride = kernel = patch, no bias) as one matmul over flattened patches.
        self.patch_embedding = Linear(cfg.num_channels * p * p, h, rngs=rngs)
        self.class_embedding = nnx.Param(jnp.zeros((h,), jnp.float32))
        self.position_embedding = nnx.Param(jnp.zeros((cfg.num_patches + 1, h), jnp.float32))
        self.pre_layrnorm = LayerNorm(h, cfg.layer_norm_eps)
        self.layers = nnx.List([CLIPEncoderLayer(cfg, rngs) for _ in range(cfg.layers_run)])
        self.linear_1 = Linear(h, cfg.text_hidden_size, use_bias=cfg.projector_bias, rngs=rngs)
        self.linear_2 = Linear(cfg.text_hidden_size, cfg.text_hidden_size, use_bias=cfg.projector_bias, rngs=rngs)

    def vision_features(self, pixel_values: jax.Array) -> jax.Array:
        """The tower's hidden state at ``vision_feature_layer``, class token included."""
        n, c, height, width = pixel_values.shape
        p = self.cfg.patch_size
        patches = pixel_values.reshape(n, c, height // p, p, width // p, p).transpose(0, 2, 4, 1, 3, 5)
        x = self.patch_embedding(patches.reshape(n, (height // p) * (width // p), c * p * p))
        cls = jnp.broadcast_to(self.class_embedding[...], (n, 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.position_embedding[...]
        x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer(x)
        return x

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        x = self.vision_features(pixel_values.astype(jnp.float32))
        if self.cfg.select_strategy == "default":
            x = x[:, 1:]
        return self.linear_2(activation(self.cfg.projector_hidden_act)(self.linear_1(x)))


def _strip(name: str) -> str | None:
    """An HF tensor name -> its name under the tower or the projector, or None if neither. The
    tower is ``vision_tower.vision_model.`` in the original checkpoints, ``vision_tower.`` in
    those transformers 5 writes."""
    for marker in ("vision_tower.vision_model.", "vision_tower.", "multi_modal_projector."):
        if marker in name:
            return name.split(marker, 1)[1]
    return None


def load_llava_image_encoder(cfg: LlavaVisionConfig, tensors: Mapping[str, np.ndarray]) -> LlavaImageEncoder:
    """Build the encoder from a LLaVA checkpoint's tensors (HF names, torch layouts)."""
    w = {short: np.asarray(t, np.float32) for name, t in tensors.items() if (short := _strip(name)) is not None}
    enc = LlavaImageEncoder(cfg, nnx.Rngs(0))

    def put(param: nnx.Param, value: np.ndarray, name: str) -> None:
        if tuple(param.shape) != value.shape:
            raise ValueError(f"{name}: shape {value.shape}, expected {tuple(param.shape)}")
        param[...] = jnp.asarray(value)

    def put_linear(lin: Linear, prefix: str) -> None:
        put(lin.kernel, w[f"{prefix}.weight"].T, prefix)
        if lin.bias is not None:
            put(lin.bias, w[f"{prefix}.bias"], prefix)

    def put_norm(norm: LayerNorm, prefix: str) -> None:
        put(norm.scale, w[f"{prefix}.weight"], prefix)
        put(norm.bias, w[f"{prefix}.bias"], prefix)

    conv = w["embeddings.patch_embedding.weight"]  # [hidden, C, p, p]
    put(enc.patch_embedding.kernel, conv.reshape(conv.shape[0], -1).T, "embeddings.patch_embedding")
    put(enc.class_embedding, w["embeddings.class_embedding"], "embeddings.class_embedding")
    put(enc.position_embedding, w["embeddings.position_embedding.weight"], "embeddings.position_embedding")
    put_norm(enc.pre_layrnorm, "pre_layrnorm")
    for i, layer in enumerate(enc.layers):
        pre = f"encoder.layers.{i}"
        qkv_w = np.concatenate([w[f"{pre}.self_attn.{x}_proj.weight"] for x in "qkv"], axis=0)
        qkv_b = np.concatenate([w[f"{pre}.self_attn.{x}_proj.bias"] for x in "qkv"], axis=0)
        put(layer.qkv_proj.kernel, qkv_w.T, f"{pre}.self_attn.qkv")
        assert layer.qkv_proj.bias is not None
        put(layer.qkv_proj.bias, qkv_b, f"{pre}.self_attn.qkv")
        put_linear(layer.out_proj, f"{pre}.self_attn.out_proj")
        put_linear(layer.fc1, f"{pre}.mlp.fc1")
        put_linear(layer.fc2, f"{pre}.mlp.fc2")
        put_norm(layer.layer_norm1, f"{pre}.layer_norm1")
        put_norm(layer.layer_norm2, f"{pre}.layer_norm2")
    put_linear(enc.linear_1, "linear_1")
    put_linear(enc.linear_2, "linear_2")
    return enc


def expand_image_placeholders(token_ids: list[int], image_token_id: int, tokens_per_image: int) -> list[int]:
    """Repeat each image placeholder ``tokens_per_image`` times, as LLaVA's processor does."""
    out: list[int] = []
    for t in token_ids:
        out.extend([t] * tokens_per_image if t == image_token_id else [t])
    return out


def merge_image_embeddings(text_embeds: jax.Array, token_ids: jax.Array, image_embeds: jax.Array,
                           image_token_id: int) -> jax.Array:
    """Put ``image_embeds [M, hidden]`` in order at the ``M`` placeholder positions of ``token_ids [T]``."""
    is_image = token_ids == image_token_id
    index = jnp.clip(jnp.cumsum(is_image) - 1, 0, max(image_embeds.shape[0] - 1, 0))
    return jnp.where(is_image[:, None], image_embeds[index].astype(text_embeds.dtype), text_embeds)


def load_llava_image_encoder_from_folder(folder: str) -> tuple[LlavaVisionConfig, LlavaImageEncoder]:
    """Read a LLaVA HF folder's ``config.json`` and the tower's and projector's tensors only."""
    import json
    from pathlib import Path

    from jaxserve.models.safetensors_io import open_checkpoint_files

    cfg = LlavaVisionConfig.from_hf(json.loads((Path(folder) / "config.json").read_text()))
    files = open_checkpoint_files(folder)
    tensors = {name: f.get(name) for name, f in files.items() if _strip(name) is not None}
    return cfg, load_llava_image_encoder(cfg, tensors)
