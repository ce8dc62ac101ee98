"""Greedy EAGLE / EAGLE-3 drafts computed densely in numpy from a head's checkpoint tensors (Hugging
Face layout, ``[out, in]``), written from the published formulas and independent of
``jaxserve.models.eagle`` and the paged runner: plain causal attention over the whole context.

The target side comes from the jaxserve model (``forward_with_aux`` over the context in one
prefill): its last hidden state after the final norm for EAGLE-1, the residual stream entering
the head's layers for EAGLE-3.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.layers.attention import AttentionMetadata
from jaxserve.runner.kv_cache import allocate_kv_cache
from pallas_kernels import get_attention_fn

_FORWARDS: dict[tuple, tuple] = {}  # (id(model), aux_layers, length) -> (model, its compiled pass)


def target_hidden(model, tokens: np.ndarray, aux_layers: tuple[int, ...]) -> np.ndarray:
    """``[n, h]`` (after the final norm) or ``[n, len(aux_layers) * h]`` for ``tokens`` as one prompt.
    Causal: the sequence is padded to a multiple of 128 tokens and the first n rows kept, so one
    compiled pass serves every length up to it."""
    n, bs = len(tokens), 16
    size = -(-n // 128) * 128
    key = (id(model), tuple(aux_layers), size)
    if key not in _FORWARDS:
        def forward(ids, kv):
            md = AttentionMetadata(*(jnp.asarray(a, jnp.int32) for a in (  # one sequence from block 1
                np.arange(size), np.arange(size) + bs, [np.arange(1, size // bs + 1)], [size], [0, size], [1])))
            hidden, _, _, aux = model.forward_with_aux(ids, kv, md, get_attention_fn("xla"), aux_layers=aux_layers)
            return aux if aux_layers else model.norm(hidden)

        _FORWARDS[key] = (model, jax.jit(forward))
    ids = np.zeros(size, np.int32)
    ids[:n] = tokens
    out = _FORWARDS[key][1](ids, allocate_kv_cache(model.config, size // bs + 1, bs))
    return np.asarray(out[:n], np.float64)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    d = x.shape[-1]
    freqs = pos[:, None] * (1.0 / theta ** (np.arange(0, d, 2) / d))[None, :]
    cos, sin = np.cos(np.concatenate([freqs, freqs], -1))[:, None], np.sin(np.concatenate([freqs, freqs], -1))[:, None]
    return x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


class DenseHead:
    """A head from its folder; ``embedding`` / ``lm_head``: the target's (``[V, h]`` each)."""

    def __init__(self, folder: str, method: str, embedding: np.ndarray, lm_head: np.ndarray):
        from jaxserve.models.safetensors_io import SafetensorsFile

        file = SafetensorsFile(Path(folder) / "model.safetensors")
        self.w = {k.replace("midlayer.", "layers.0."): np.asarray(file.get(k), np.float64) for k in file.keys()}
        self.cfg = json.loads((Path(folder) / "config.json").read_text())
        self.method, self.embedding, self.lm_head = method, embedding.astype(np.float64), lm_head.astype(np.float64)

    def first_pass(self, tokens: np.ndarray, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The head over a sequence in one pass (``hidden``: the target's, at least up to its
        second-to-last position): each position's output, keys and values. Causal, so the pass
        over a context is the first rows of the pass over any sequence it begins."""
        w, n = self.w, len(tokens)
        h = hidden[:n - 1]
        if self.method == "eagle3":
            h = h @ w["fc.weight"].T + w.get("fc.bias", 0)
        return self._layer(np.asarray(tokens[1:]), np.arange(n - 1), h, np.zeros((0,)), np.zeros((0,)))

    def drafts_after(self, first: tuple[np.ndarray, np.ndarray, np.ndarray], n: int, k: int) -> list[int]:
        """K greedy drafts after the first ``n`` tokens of the sequence ``first`` passed over: the
        first from the output at ``n - 2``, each next one a one-token step on the previous output."""
        pre, keys, values = (a[:n - 1] for a in first)
        out = [self._draft(pre[-1])]
        for j in range(k - 1):
            pre, keys, values = self._layer(np.array([out[-1]]), np.array([n - 1 + j]), pre[-1:], keys, values)
            out.append(self._draft(pre[-1]))
        return out

    def _layer(self, tokens, pos, h, keys, values):
        """The head's layer on ``tokens`` at ``pos`` with the hidden states ``h`` they come with,
        after ``keys``/``values`` (the earlier positions'): its outputs and the grown keys/values."""
        w, eps, e3 = self.w, self.cfg["rms_norm_eps"], self.method == "eagle3"
        e = self.embedding[tokens]
        if e3:
            normed = _rms(h, w["layers.0.hidden_norm.weight"], eps)
            x = np.concatenate([_rms(e, w["layers.0.input_layernorm.weight"], eps), normed], -1)
            residual = h
        else:
            x = np.concatenate([e, h], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
            residual = x
        attn, keys, values = self._attend(x, pos, keys, values)
        r = residual + attn
        y = _rms(r, w["layers.0.post_attention_layernorm.weight"], eps)
        g = y @ w["layers.0.mlp.gate_proj.weight"].T
        silu_gate = g / (1 + np.exp(-g))
        pre = r + (silu_gate * (y @ w["layers.0.mlp.up_proj.weight"].T)) @ w["layers.0.mlp.down_proj.weight"].T
        return pre, keys, values

    def _draft(self, out: np.ndarray) -> int:
        """The greedy target id from one position's output."""
        w = self.w
        if self.method == "eagle3":
            d = int(np.argmax(_rms(out, w["norm.weight"], self.cfg["rms_norm_eps"]) @ w["lm_head.weight"].T))
            return d + int(w["d2t"][d])
        return int(np.argmax(out @ self.lm_head.T))

    def _attend(self, x, pos, keys, values):
        w, cfg = self.w, self.cfg
        heads, kv_heads, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        q = _rope((x @ w["layers.0.self_attn.q_proj.weight"].T).reshape(len(x), heads, d), pos, cfg["rope_theta"])
        k = _rope((x @ w["layers.0.self_attn.k_proj.weight"].T).reshape(len(x), kv_heads, d), pos, cfg["rope_theta"])
        v = (x @ w["layers.0.self_attn.v_proj.weight"].T).reshape(len(x), kv_heads, d)
        keys = k if keys.size == 0 else np.concatenate([keys, k])
        values = v if values.size == 0 else np.concatenate([values, v])
        rep = heads // kv_heads
        kk, vv = np.repeat(keys, rep, axis=1), np.repeat(values, rep, axis=1)  # [S, heads, d]
        scores = np.einsum("thd,shd->hts", q, kk) / np.sqrt(d)
        key_pos = np.arange(len(keys))
        scores = np.where(key_pos[None, None, :] <= pos[None, :, None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out = np.einsum("hts,shd->thd", p, vv).reshape(len(x), -1)
        return out @ w["layers.0.self_attn.o_proj.weight"].T, keys, values
