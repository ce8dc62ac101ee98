"""Qwen2.5-VL's vision tower as Flax NNX modules: patch embedding, 2D rotary, window attention
(full attention in ``fullatt_block_indexes``), and the patch merger.

The tower runs on a *pack*: the patches of one or more images, padded to a patch-count bucket.
Everything an image's grid fixes (the window order of its patches, their rotary angles, which
window and which image each patch is in, the merged tokens' output order) is computed on the host
in numpy (:func:`pack_plan`) and passed as data, so the compiled program depends only on the
bucket. Padding rows form their own window and image: real rows never attend to them.
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
from jaxserve.layers.norm import RMSNorm


@dataclass(frozen=True)
class Qwen25VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    in_channels: int = 3
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, v: Mapping[str, Any]) -> Qwen25VisionConfig:
        rope = v.get("rope_parameters") or {}
        return cls(depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                   num_heads=v["num_heads"], out_hidden_size=v["out_hidden_size"], patch_size=v["patch_size"],
                   temporal_patch_size=v.get("temporal_patch_size", 2),
                   spatial_merge_size=v.get("spatial_merge_size", 2), window_size=v.get("window_size", 112),
                   fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", ())),
                   in_channels=v.get("in_channels", 3), hidden_act=v.get("hidden_act", "silu"),
                   rope_theta=float(rope.get("rope_theta", 10000.0)))


@dataclass(frozen=True)
class GridPlan:
    """What a grid fixes: the window order of the patches, each ordered patch's window, its
    rotary (h, w) position, and the inverse order of the merged tokens."""

    order: np.ndarray       # [N] patch index at each ordered position
    window_of: np.ndarray   # [N] window id of each ordered position
    hw: np.ndarray          # [N, 2] (row, column) of each ordered patch
    unorder: np.ndarray     # [N / m^2] merged token at each output position


def grid_plan(grid_h: int, grid_w: int, cfg: Qwen25VisionConfig) -> GridPlan:
    m = cfg.spatial_merge_size
    unit = m * m
    lh, lw = grid_h // m, grid_w // m
    win = cfg.window_size // m // cfg.patch_size
    # Patches arrive merge-group-major (see the image processor); their (row, column):
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    shape = (lh, m, lw, m)
    hw = np.stack([a.reshape(shape).transpose(0, 2, 1, 3).ravel() for a in (rows, cols)], -1)
    # Merged groups ordered window by window (row-major windows of win x win groups).
    gr, gc = np.meshgrid(np.arange(lh), np.arange(lw), indexing="ij")
    window = (gr // win) * (-(-lw // win)) + gc // win
    group_order = np.lexsort(((gr * lw + gc).ravel(), window.ravel()))
    order = (group_order[:, None] * unit + np.arange(unit)).ravel()
    window_of = np.repeat(window.ravel()[group_order], unit)
    return GridPlan(order, window_of, hw[order], np.argsort(group_order))


@dataclass(frozen=True)
class PackPlan:
    """The data a pack of images passes to the tower beside its padded patches."""

    order: np.ndarray      # [P] int32 padded patch row at each ordered position
    cos: np.ndarray        # [P, head_dim] float32 rotary of each ordered position
    sin: np.ndarray        # [P, head_dim]
    window_id: np.ndarray  # [P] int32 window attention is within (unique across images; -1 padding)
    image_id: np.ndarray   # [P] int32 image full attention is within (-1 padding)
    unorder: np.ndarray    # [P / m^2] int32 merged row at each output position
    num_tokens: tuple[int, ...]  # merged tokens of each image, in pack order (outputs lead, then padding)


def pack_plan(grids: list[tuple[int, int]], num_patches: int, cfg: Qwen25VisionConfig) -> PackPlan:
    """The plan of images of ``grids`` ``(grid_h, grid_w)`` laid one after another (their patches
    in that order) and padded to ``num_patches`` (a multiple of ``merge^2``)."""
    unit = cfg.spatial_merge_size ** 2
    total = sum(h * w for h, w in grids)
    if total > num_patches or num_patches % unit:
        raise ValueError(f"{total} patches do not pack into a bucket of {num_patches}")
    order, window, image, hw, unorder = [], [], [], [], []
    patches = windows = tokens = 0
    for i, (gh, gw) in enumerate(grids):
        plan = grid_plan(gh, gw, cfg)
        order.append(plan.order + patches)
        window.append(plan.window_of + windows)
        image.append(np.full(len(plan.order), i))
        hw.append(plan.hw)
        unorder.append(plan.unorder + tokens)
        patches, windows, tokens = patches + len(plan.order), windows + int(plan.window_of.max()) + 1, \
            tokens + len(plan.unorder)
    pad = num_patches - total
    order.append(np.arange(total, num_patches))
    window.append(np.full(pad, -1))
    image.append(np.full(pad, -1))
    hw.append(np.zeros((pad, 2), np.int64))
    unorder.append(np.arange(tokens, num_patches // unit))
    d = cfg.hidden_size // cfg.num_heads
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, d // 2, 2, dtype=np.float32) / (d // 2))
    freqs = (np.concatenate(hw)[:, :, None].astype(np.float32) * inv_freq).reshape(num_patches, -1)
    angles = np.concatenate([freqs, freqs], axis=-1)
    i32 = np.int32
    return PackPlan(np.concatenate(order).astype(i32), np.cos(angles), np.sin(angles),
                    np.concatenate(window).astype(i32), np.concatenate(image).astype(i32),
                    np.concatenate(unorder).astype(i32), tuple(h * w // unit for h, w in grids))


def _rotate_half(x: jax.Array) -> jax.Array:
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-b, a], axis=-1)


class VisionBlock(nnx.Module):
    def __init__(self, cfg: Qwen25VisionConfig, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.act = jax.nn.silu if cfg.hidden_act == "silu" else (lambda x: jax.nn.gelu(x, approximate=False))
        self.norm1 = RMSNorm(h, eps=1e-6)
        self.norm2 = RMSNorm(h, eps=1e-6)
        self.qkv = Linear(h, 3 * h, use_bias=True, rngs=rngs)
        self.proj = Linear(h, h, use_bias=True, rngs=rngs)
        self.gate_proj = Linear(h, cfg.intermediate_size, use_bias=True, rngs=rngs)
        self.up_proj = Linear(h, cfg.intermediate_size, use_bias=True, rngs=rngs)
        self.down_proj = Linear(cfg.intermediate_size, h, use_bias=True, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        n, h = x.shape
        d = h // self.num_heads
        q, k, v = (t.reshape(n, self.num_heads, d) for t in jnp.split(self.qkv(self.norm1(x)), 3, axis=-1))
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        scores = jnp.einsum("qhd,khd->hqk", q, k) * d**-0.5
        scores = jnp.where(mask[None], scores, -jnp.inf)
        attn = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v).reshape(n, h)
        x = x + self.proj(attn)
        y = self.norm2(x)
        return x + self.down_proj(self.act(self.gate_proj(y)) * self.up_proj(y))


class Qwen25VisionTower(nnx.Module):
    """``patches [grid_h * grid_w, C * T * p * p]`` (the processor's rows) -> ``[tokens, out_hidden]``."""

    def __init__(self, cfg: Qwen25VisionConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        p = cfg.patch_size
        self.patch_embed = Linear(cfg.in_channels * cfg.temporal_patch_size * p * p, cfg.hidden_size, rngs=rngs)
        self.blocks = nnx.List([VisionBlock(cfg, rngs) for _ in range(cfg.depth)])
        ctx = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.mlp_0 = Linear(ctx, ctx, use_bias=True, rngs=rngs)
        self.mlp_2 = Linear(ctx, cfg.out_hidden_size, use_bias=True, rngs=rngs)

    def __call__(self, patches: jax.Array, grid_h: int, grid_w: int) -> jax.Array:
        """One image, unpadded (the tests' reference path): ``[grid_h * grid_w / m^2, out_hidden]``."""
        plan = pack_plan([(grid_h, grid_w)], grid_h * grid_w, self.cfg)
        return self.packed(patches, *map(jnp.asarray, pack_arrays(plan)))

    def packed(self, patches: jax.Array, order: jax.Array, cos: jax.Array, sin: jax.Array,
               window_id: jax.Array, image_id: jax.Array, unorder: jax.Array) -> jax.Array:
        """A pack (:class:`PackPlan`'s arrays): ``[P / m^2, out_hidden]``, the images' merged
        tokens first, in pack order, then the padding's."""
        cfg = self.cfg
        window_mask = window_id[:, None] == window_id[None, :]
        full_mask = image_id[:, None] == image_id[None, :]
        x = self.patch_embed(patches.astype(jnp.float32))[order]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full_mask if i in cfg.fullatt_block_indexes else window_mask)
        x = self.ln_q(x).reshape(-1, cfg.hidden_size * cfg.spatial_merge_size**2)
        x = self.mlp_2(jax.nn.gelu(self.mlp_0(x), approximate=False))
        return x[unorder]


def pack_arrays(plan: PackPlan) -> tuple[np.ndarray, ...]:
    """The plan's arrays in :meth:`Qwen25VisionTower.packed`'s argument order (after the patches)."""
    return plan.order, plan.cos, plan.sin, plan.window_id, plan.image_id, plan.unorder


def load_qwen25_vision_tower(cfg: Qwen25VisionConfig, tensors: Mapping[str, np.ndarray]) -> Qwen25VisionTower:
    """From the tower's tensors, named as under ``visual.`` (``blocks.0.attn.qkv.weight``, ...)."""
    w = {k.split("visual.", 1)[-1]: np.asarray(v, np.float32) for k, v in tensors.items()}
    tower = Qwen25VisionTower(cfg, nnx.Rngs(0))

    def put(param, value):
        if tuple(param.shape) != value.shape:
            raise ValueError(f"shape {value.shape}, expected {tuple(param.shape)}")
        param[...] = jnp.asarray(value)

    def lin(mod: Linear, name: str):
        put(mod.kernel, w[f"{name}.weight"].T)
        if mod.bias is not None:
            put(mod.bias, w[f"{name}.bias"])

    conv = w["patch_embed.proj.weight"]
    put(tower.patch_embed.kernel, conv.reshape(conv.shape[0], -1).T)
    for i, b in enumerate(tower.blocks):
        pre = f"blocks.{i}"
        put(b.norm1.scale, w[f"{pre}.norm1.weight"])
        put(b.norm2.scale, w[f"{pre}.norm2.weight"])
        lin(b.qkv, f"{pre}.attn.qkv")
        lin(b.proj, f"{pre}.attn.proj")
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin(getattr(b, name), f"{pre}.mlp.{name}")
    put(tower.ln_q.scale, w["merger.ln_q.weight"])
    lin(tower.mlp_0, "merger.mlp.0")
    lin(tower.mlp_2, "merger.mlp.2")
    return tower
