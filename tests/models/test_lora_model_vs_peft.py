"""The decoder with LoRA slots: each slot's logits equal transformers + peft; writing a slot compiles nothing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels
from jaxserve.exceptions import ConfigError
from jaxserve.models import load_model
from jaxserve.models.config import ModelConfig
from jaxserve.models.lora_adapter import load_lora_adapter
from jaxserve.models.lora_slots import LoRASlotTable, _write_slot
from tests.models.paged_sequence import PagedSequence, prompt
from tests.models.test_lora_adapter import make_peft_adapter


class LoRASequence(PagedSequence):
    """One sequence through the paged decoder, every token on LoRA slot ``slot`` (-1: base)."""

    def __init__(self, model, table: LoRASlotTable, slot: int):
        super().__init__(model)
        self.table, self.slot = table, slot

    def _step(self, state, ids, kv, md, lora):
        model = nnx.merge(self.graphdef, state)
        hidden, kv = model(ids, kv, md, pallas_kernels.ragged_paged_attention_reference, lora=lora)
        return model.compute_logits(hidden, lora=lora), kv

    def feed(self, token_ids):
        ids, md = self.inputs(token_ids)
        lora = self.table.batch(jnp.full((len(token_ids),), self.slot, jnp.int32))
        logits, self.kv = self.step(self.state, ids, self.kv, md, lora)
        self.num_computed += len(token_ids)
        return np.asarray(logits)


def peft_logits(pm, ids):
    import torch

    with torch.no_grad():
        return pm(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("scan_layers", [True])
def test_each_slot_matches_peft(tiny_checkpoints, tmp_path, scan_layers):
    folder = tiny_checkpoints["LlamaForCausalLM"]
    cfg = ModelConfig.from_pretrained(folder)
    model = load_model(folder, scan_layers=scan_layers)
    pms = [make_peft_adapter(folder, tmp_path / "a0", seed=3, r=8).eval(),
           make_peft_adapter(folder, tmp_path / "a1", seed=4, r=4, targets=["q_proj", "v_proj", "down_proj"],
                             use_rslora=True, lora_alpha=5).eval()]
    table = LoRASlotTable(cfg, max_loras=3, max_rank=8)
    table.write(2, load_lora_adapter(tmp_path / "a0", cfg, 8))
    compiled = _write_slot._cache_size()
    table.write(0, load_lora_adapter(tmp_path / "a1", cfg, 8))
    assert _write_slot._cache_size() == compiled
    ids = prompt(11, seed=5)
    for slot, pm in ((2, pms[0]), (0, pms[1])):
        seq = LoRASequence(model, table, slot)
        ours = np.concatenate([seq.feed(ids[:6]), seq.feed(ids[6:])])  # two chunks, the KV of the first reused
        np.testing.assert_allclose(ours[:, :cfg.vocab_size], peft_logits(pm, ids), rtol=2e-4, atol=2e-4)
    with pms[0].disable_adapter():
        base = peft_logits(pms[0], ids)
    ours = LoRASequence(model, table, -1).feed(ids)
    np.testing.assert_allclose(ours[:, :cfg.vocab_size], base, rtol=2e-4, atol=2e-4)
    assert not np.allclose(base, peft_logits(pms[0], ids), atol=1e-3)  # the adapter does change the output
    jax.clear_caches()


def test_one_step_mixes_an_adapter_and_the_base(tiny_checkpoints, tmp_path):
    from jaxserve.layers.attention import AttentionMetadata
    from tests.models.paged_sequence import BLOCK_SIZE, NUM_BLOCKS

    folder = tiny_checkpoints["LlamaForCausalLM"]
    cfg = ModelConfig.from_pretrained(folder)
    model = load_model(folder, scan_layers=True)
    pm = make_peft_adapter(folder, tmp_path / "a", seed=7, r=4).eval()
    table = LoRASlotTable(cfg, max_loras=2, max_rank=8)
    table.write(1, load_lora_adapter(tmp_path / "a", cfg, 8))
    seqs = [prompt(9, seed=1), prompt(6, seed=2)]  # sequence 0 on slot 1, sequence 1 on the base
    half = NUM_BLOCKS // 2
    positions = np.concatenate([np.arange(len(s)) for s in seqs]).astype(np.int32)
    first_block = np.repeat([1, half], [len(s) for s in seqs])
    md = AttentionMetadata(
        positions=jnp.asarray(positions),
        slot_mapping=jnp.asarray((first_block + positions // BLOCK_SIZE) * BLOCK_SIZE + positions % BLOCK_SIZE,
                                 jnp.int32),
        block_tables=jnp.asarray(np.stack([np.arange(1, half), np.arange(half, 2 * half - 1)]), jnp.int32),
        kv_lens=jnp.asarray([len(s) for s in seqs], jnp.int32),
        query_start_loc=jnp.asarray([0, len(seqs[0]), len(seqs[0]) + len(seqs[1])], jnp.int32),
        num_seqs=jnp.asarray([2], jnp.int32),
    )
    slot_ids = jnp.asarray([1] * len(seqs[0]) + [-1] * len(seqs[1]), jnp.int32)
    seq = LoRASequence(model, table, 0)
    logits, _ = seq.step(seq.state, jnp.asarray(seqs[0] + seqs[1], jnp.int32), seq.kv, md, table.batch(slot_ids))
    logits = np.asarray(logits)[:, :cfg.vocab_size]
    np.testing.assert_allclose(logits[:len(seqs[0])], peft_logits(pm, seqs[0]), rtol=2e-4, atol=2e-4)
    with pm.disable_adapter():
        np.testing.assert_allclose(logits[len(seqs[0]):], peft_logits(pm, seqs[1]), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])  # untied and tied heads
def test_lm_head_lora_matches_peft_in_a_mixed_step(tiny_checkpoints, tmp_path, arch):
    """An adapter on the LM head (and q/v): its rows equal peft, a base row and a layers-only
    adapter's row in the same step are untouched by it, and writing a slot compiles nothing."""
    folder = tiny_checkpoints[arch]
    cfg = ModelConfig.from_pretrained(folder)
    model = load_model(folder, scan_layers=True)
    with_head = make_peft_adapter(folder, tmp_path / "h", seed=11, r=4, targets=["q_proj", "v_proj", "lm_head"]).eval()
    with_head.save_pretrained(str(tmp_path / "h"), save_embedding_layers=False)  # no copy of the base head
    no_head = make_peft_adapter(folder, tmp_path / "n", seed=12, r=8, targets=["o_proj"]).eval()
    table = LoRASlotTable(cfg, max_loras=2, max_rank=8, lm_head=True)
    head_adapter = load_lora_adapter(tmp_path / "h", cfg, 8, allow_lm_head=True)
    assert head_adapter.lm_head is not None and head_adapter.lm_head.b.shape == (cfg.vocab_size, 4)
    table.write(0, load_lora_adapter(tmp_path / "n", cfg, 8, allow_lm_head=True))
    compiled = _write_slot._cache_size()
    table.write(1, head_adapter)
    assert _write_slot._cache_size() == compiled
    ids = prompt(9, seed=3)
    for slot, pm in ((1, with_head), (0, no_head)):
        seq = LoRASequence(model, table, slot)
        ours = np.concatenate([seq.feed(ids[:5]), seq.feed(ids[5:])])
        np.testing.assert_allclose(ours[:, :cfg.vocab_size], peft_logits(pm, ids), rtol=2e-4, atol=2e-4)
    with with_head.disable_adapter():
        base = peft_logits(with_head, ids)
    np.testing.assert_allclose(LoRASequence(model, table, -1).feed(ids)[:, :cfg.vocab_size], base,
                               rtol=2e-4, atol=2e-4)
    # The head's delta alone changes the logits: peft with only its lm_head LoRA active differs from the base.
    assert not np.allclose(peft_logits(with_head, ids), base, atol=1e-3)
    # One step, rows on slot 1 then the base: compute_logits applies each row's own slot.
    seq = LoRASequence(model, table, -1)
    mixed = jnp.asarray([1] * 4 + [-1] * 5, jnp.int32)
    state_model = nnx.merge(seq.graphdef, seq.state)
    h = jnp.asarray(np.random.default_rng(0).standard_normal((9, cfg.hidden_size)), jnp.float32)
    got = np.asarray(state_model.compute_logits(h, lora=table.batch(mixed)))
    plain = np.asarray(state_model.compute_logits(h))
    w = head_adapter.lm_head
    normed = np.asarray(state_model.norm(h), np.float32)
    want = plain + np.where(np.asarray(mixed)[:, None] >= 0, normed @ w.a.T @ w.b.T, 0.0)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    jax.clear_caches()


def test_lm_head_lora_is_refused_by_default(tiny_checkpoints, tmp_path):
    folder = tiny_checkpoints["LlamaForCausalLM"]
    cfg = ModelConfig.from_pretrained(folder)
    pm = make_peft_adapter(folder, tmp_path / "h", seed=1, r=4, targets=["lm_head"])
    with pytest.raises(ConfigError, match="full LM head weight.*save_embedding_layers=False"):
        load_lora_adapter(tmp_path / "h", cfg, 8, allow_lm_head=True)  # PEFT saved a copy of the base head
    pm.save_pretrained(str(tmp_path / "h"), save_embedding_layers=False)
    with pytest.raises(ConfigError, match="LM head"):
        load_lora_adapter(tmp_path / "h", cfg, 8)
    adapter = load_lora_adapter(tmp_path / "h", cfg, 8, allow_lm_head=True)
    assert adapter.weights == {} and adapter.rank == 4
    with pytest.raises(ValueError, match="no LM-head slots"):
        LoRASlotTable(cfg, max_loras=1, max_rank=8).write(0, adapter)


def test_head_and_embedding_slots_span_the_padded_vocabulary(tiny_checkpoints):
    """Under tensor parallelism the head's B and the embedding's A have the base's padded
    vocabulary (a multiple of the shards): the adapter's own rows, then zeros."""
    from jaxserve.models.lora_adapter import LoRALayerWeights
    from jaxserve.models.lora_slots import module_slot_arrays
    from jaxserve.models.tp_layout import TPLayout

    cfg = dataclasses.replace(ModelConfig.from_pretrained(tiny_checkpoints["LlamaForCausalLM"]), vocab_size=509)
    layout = TPLayout.of(cfg, 2)
    table = LoRASlotTable(cfg, max_loras=2, max_rank=8, layout=layout, abstract=True, lm_head=True, embedding=True)
    assert layout.padded_vocab == 510
    assert table.b["lm_head"].shape == (1, 2, 8, 510) and table.a["embed"].shape == (1, 510, 2, 8)
    rng = np.random.default_rng(0)

    def draw(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, np.float32)

    head = LoRALayerWeights(a=draw(4, cfg.hidden_size), b=draw(509, 4))
    a, b = module_slot_arrays(head, cfg.hidden_size, layout.padded_vocab, 8)
    np.testing.assert_array_equal(b[0, :4, :509], head.b.T)
    assert not b[0, :, 509:].any() and not b[0, 4:].any() and np.array_equal(a[0, :, :4], head.a.T)
    emb = LoRALayerWeights(a=draw(4, 509), b=draw(cfg.hidden_size, 4))
    a, b = module_slot_arrays(emb, layout.padded_vocab, cfg.hidden_size, 8)
    np.testing.assert_array_equal(a[0, :509, :4], emb.a.T)
    assert not a[0, 509:].any() and not a[0, :, 4:].any() and np.array_equal(b[0, :4], emb.b.T)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])  # untied and tied
def test_embedding_and_lm_head_lora_match_peft(tiny_checkpoints, tmp_path, arch):
    """An adapter on embed_tokens, lm_head and k: each slot equals peft, the base slot and a
    layers-only slot are untouched by it, and writing a slot compiles nothing."""
    folder = tiny_checkpoints[arch]
    cfg = ModelConfig.from_pretrained(folder)
    model = load_model(folder, scan_layers=True)
    both = make_peft_adapter(folder, tmp_path / "e", seed=21, r=4, targets=["embed_tokens", "lm_head", "k_proj"],
                             use_rslora=True, lora_alpha=6).eval()
    both.save_pretrained(str(tmp_path / "e"), save_embedding_layers=False)
    layers_only = make_peft_adapter(folder, tmp_path / "n", seed=22, r=8, targets=["up_proj"]).eval()
    table = LoRASlotTable(cfg, max_loras=2, max_rank=8, lm_head=True, embedding=True)
    adapter = load_lora_adapter(tmp_path / "e", cfg, 8, allow_lm_head=True, allow_embedding=True)
    assert adapter.embedding is not None and adapter.embedding.a.shape == (4, cfg.vocab_size)
    table.write(1, load_lora_adapter(tmp_path / "n", cfg, 8))
    compiled = _write_slot._cache_size()
    table.write(0, adapter)
    assert _write_slot._cache_size() == compiled
    ids = prompt(10, seed=4)
    for slot, pm in ((0, both), (1, layers_only)):
        seq = LoRASequence(model, table, slot)
        ours = np.concatenate([seq.feed(ids[:4]), seq.feed(ids[4:])])
        np.testing.assert_allclose(ours[:, :cfg.vocab_size], peft_logits(pm, ids), rtol=2e-4, atol=2e-4)
    with both.disable_adapter():
        base = peft_logits(both, ids)
    np.testing.assert_allclose(LoRASequence(model, table, -1).feed(ids)[:, :cfg.vocab_size], base,
                               rtol=2e-4, atol=2e-4)
    with pytest.raises(ConfigError, match="embedding"):
        load_lora_adapter(tmp_path / "e", cfg, 8, allow_lm_head=True)  # the engine's default still refuses it
    jax.clear_caches()
