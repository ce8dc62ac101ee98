"""Greedy MTP drafts computed densely in numpy from a MiMo checkpoint's tensors (Hugging Face layout,
``[out, in]``), written from the published formula (vLLM's ``mimo_mtp.py``) and independent of
``jaxserve.models.mtp`` and the paged runner: plain causal attention over the whole context, the
first MTP layer for every draft step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxserve.models.safetensors_io import SafetensorsFile
from tests.eagle_reference import _rms, _rope


class DenseMTP:
    """The first MTP layer of the MiMo checkpoint in ``folder``, with the target's embedding and LM head."""

    def __init__(self, folder: str):
        file = SafetensorsFile(Path(folder) / "model.safetensors")
        self.w = {k.removeprefix("model.mtp_layers.0."): np.asarray(file.get(k), np.float64) for k in file.keys()
                  if k.startswith("model.mtp_layers.0.")}
        self.embedding = np.asarray(file.get("model.embed_tokens.weight"), np.float64)
        self.lm_head = (np.asarray(file.get("lm_head.weight"), np.float64) if "lm_head.weight" in file.keys()
                        else self.embedding)  # tied
        self.cfg = json.loads((Path(folder) / "config.json").read_text())

    def layer(self, tokens: np.ndarray, pos: np.ndarray, hidden: np.ndarray, keys: np.ndarray,
              values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The layer over ``tokens`` (the token after each position) at ``pos`` with the target's
        ``hidden``, after the cached ``keys``/``values``: (output rows, keys, values)."""
        w, eps = self.w, self.cfg["rms_norm_eps"]
        e = np.where((pos == 0)[:, None], 0.0, self.embedding[tokens])
        x = np.concatenate([_rms(hidden, w["hidden_layernorm.weight"], eps),
                            _rms(e, w["token_layernorm.weight"], eps)], -1) @ w["input_proj.weight"].T
        attn, keys, values = self._attend(_rms(x, w["input_layernorm.weight"], eps), pos, keys, values)
        r = x + attn
        y = _rms(r, w["post_attention_layernorm.weight"], eps)
        g = y @ w["mlp.gate_proj.weight"].T
        out = r + (g / (1 + np.exp(-g)) * (y @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        return _rms(out, w["final_layernorm.weight"], eps), keys, values

    def drafts(self, context: np.ndarray, hidden: np.ndarray, k: int) -> list[int]:
        """K greedy drafts after ``context`` (n tokens), ``hidden`` the target's at positions 0..n-2."""
        tokens, pos, h = np.asarray(context[1:]), np.arange(len(context) - 1), hidden
        keys, values = np.zeros((0,)), np.zeros((0,))
        out: list[int] = []
        for _ in range(k):
            y, keys, values = self.layer(tokens, pos, h, keys, values)
            token = int(np.argmax(y[-1] @ self.lm_head.T))
            out.append(token)
            tokens, pos, h = np.array([token]), pos[-1:] + 1, y[-1:]
        return out

    def _attend(self, x, pos, keys, values):
        w, cfg = self.w, self.cfg
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        d = cfg["hidden_size"] // heads

        def proj(n: str, count: int) -> np.ndarray:
            return (x @ w[f"self_attn.{n}_proj.weight"].T + w[f"self_attn.{n}_proj.bias"]).reshape(len(x), count, d)

        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        q, k = _rope(proj("q", heads), pos, theta), _rope(proj("k", kv_heads), pos, theta)
        keys = k if keys.size == 0 else np.concatenate([keys, k])
        values = proj("v", kv_heads) if values.size == 0 else np.concatenate([values, proj("v", kv_heads)])
        rep = heads // kv_heads
        kk, vv = np.repeat(keys, rep, axis=1), np.repeat(values, rep, axis=1)
        scores = np.einsum("thd,shd->hts", q, kk) / np.sqrt(d)
        scores = np.where(np.arange(len(keys))[None, None, :] <= pos[None, :, None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.einsum("hts,shd->thd", p, vv).reshape(len(x), -1) @ w["self_attn.o_proj.weight"].T, keys, values
