"""The ahead-of-time GPU check's pieces that run anywhere: the HLO statistics (on CPU programs)
and the target description."""

import jax
import jax.numpy as jnp
import pytest

from jaxserve.bench import gpu_aot, gpu_targets
from jaxserve.bench.hlo_stats import analyze_hlo

L, D = 6, 256
WEIGHTS = {("f32", (L, D, D)), ("f32", (D, D))}
POOL = {("f32", (64, D))}


def _layers(scan: bool):
    def f(w, pool, x, i):
        if scan:
            x, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
        else:  # one parameter per layer, as jaxserve's unrolled layout holds them
            for wl in w:
                x = jnp.tanh(x @ wl)
        return pool.at[i].set(x[0]), x

    return jax.jit(f, donate_argnums=(1,))


def _args(scan: bool):
    w = jnp.ones((L, D, D)) if scan else [jnp.ones((D, D))] * L
    return (w, jnp.zeros((64, D)), jnp.ones((8, D)), jnp.int32(3))


def test_a_layer_scan_copies_weight_slices_and_unrolled_layers_do_not():
    # XLA:CPU materialises each layer's slice of the stacked weights, as XLA:GPU does.
    scanned = analyze_hlo(_layers(True).lower(*_args(True)).compile().as_text(), WEIGHTS, POOL)
    assert scanned.weight_copies and scanned.whiles == 1 and scanned.data_dependent_whiles == 0
    unrolled = analyze_hlo(_layers(False).lower(*_args(False)).compile().as_text(), WEIGHTS, POOL)
    assert unrolled.weight_copies == [] and unrolled.whiles == 0
    assert scanned.pool_aliased and unrolled.pool_aliased and not unrolled.pool_copies


def test_host_round_trips_are_counted():
    def f(x, n):
        x = jax.lax.cond(x.sum() > 0, lambda: x * 2, lambda: x)
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 0.5), (0, x))[1]

    stats = analyze_hlo(jax.jit(f).lower(jnp.ones(8), 3).compile().as_text(), set(), set())
    assert stats.conditionals == 1 and stats.data_dependent_whiles == 1 and stats.host_round_trips == 2


def test_a_pool_that_is_not_donated_is_not_aliased():
    f = jax.jit(lambda pool, x: pool.at[0].set(x))
    stats = analyze_hlo(f.lower(jnp.zeros((64, D)), jnp.ones(D)).compile().as_text(), set(), POOL)
    assert not stats.pool_aliased


def test_h200_spec_from_the_packaged_target_config():
    spec = gpu_targets.gpu_spec("h200", gpu_targets.target_config_path("h200").read_text())
    assert spec.sm_count == 132 and spec.hbm_bytes_per_s == 4.8e12
    assert spec.memory_bytes == 151397597184 and "H200" in spec.description


def test_compile_only_devices_need_the_cuda_plugin():
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="compile-only CUDA devices"):
            gpu_aot.compile_only_sharding(gpu_targets.target_config_path("h200").read_text())
    else:
        pytest.skip("the CUDA plugin is installed here: scripts/gpu_aot_check.py covers this path")


def test_a_dequantized_weight_copy_is_found_where_the_convert_is_not_fused():
    """XLA:CPU converts an int8 weight to float before its dot (a weight-sized float buffer);
    the int8 x int8 path reads the int8 weight as stored. (On a GPU the check runs on the H200
    programs: scripts/gpu_aot_check.py --quantization.)"""
    from jaxserve.bench.hlo_stats import dequantized_copies
    from jaxserve.layers.quantized_linear import quantized_linear

    x = jnp.ones((16, 256), jnp.float32)
    kernel = jnp.ones((256, 512), jnp.int8)
    scale = jnp.ones((512,), jnp.float32)
    floats = {(f, (256, 512)) for f in ("bf16", "f32")}
    w8a16 = jax.jit(lambda x, k, s: quantized_linear(x, k, s)).lower(x, kernel, scale).compile().as_text()
    w8a8 = jax.jit(lambda x, k, s: quantized_linear(x, k, s, int8_activations=True)).lower(
        x, kernel, scale).compile().as_text()
    assert dequantized_copies(w8a16, floats)
    assert dequantized_copies(w8a8, floats) == []


def test_mistral_preset_and_depth_override():
    """The Mistral-7B preset is a windowed Mistral; ``num_layers`` changes the depth only."""
    mistral = gpu_aot.abstract_model("mistral-7b", False, num_layers=1).config
    assert (mistral.architecture, mistral.sliding_window, mistral.qk_norm) == ("MistralForCausalLM", 4096, False)
    assert (mistral.num_hidden_layers, mistral.num_attention_heads, mistral.num_key_value_heads) == (1, 32, 8)
    qwen = gpu_aot.abstract_model("qwen3-0.6b", False).config
    assert qwen.num_hidden_layers == 28 and qwen.sliding_window is None and qwen.qk_norm


def test_pooling_step_lowers_from_shapes_alone_with_its_pool_aliased():
    """The pooling engine's step as scripts/gpu_aot_check.py --pooling-budget compiles it for an
    H200, here for the CPU (xla attention, whose loops are the CPU's own: host round trips are
    checked on the H200 programs): weights, pool and inputs are shapes only, and the donated pool
    is updated in place."""
    from jaxserve.runner.pooling_model_runner import token_buckets

    model = gpu_aot.abstract_model("cpu-bench", False)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    for bucket in token_buckets(32):
        lowered, kv = gpu_aot.lower_pooling_step(model, sharding, bucket, backend="xla", max_num_seqs=8,
                                                 max_model_len=128, num_blocks=16)
        pools = {("f32", tuple(x.shape)) for x in jax.tree.leaves(kv)}
        stats = analyze_hlo(lowered.compile().as_text(), set(), pools)
        assert stats.pool_aliased and not stats.pool_copies


def test_lora_step_lowers_from_shapes_alone_reading_its_tables_in_place():
    """A LoRA engine's step as scripts/gpu_aot_check.py --enable-lora compiles it for an H200,
    here for the CPU (xla attention): the slot tables are shapes carrying their placement, arguments
    of the step (never constants, so writing a slot compiles nothing), and neither a table nor one
    layer's slice of it is copied."""
    from jaxserve.config import EngineConfig
    from jaxserve.runner.mesh import make_mesh

    model = gpu_aot.abstract_model("cpu-bench", False)
    sharding = jax.sharding.NamedSharding(make_mesh(jax.devices("cpu")[:1], 1), jax.sharding.PartitionSpec())
    config = EngineConfig(attention_backend="xla", num_gpu_blocks_override=16, max_num_seqs=8,
                          max_num_batched_tokens=32, enable_lora=True, max_loras=3, max_lora_rank=8)
    runner = gpu_aot.abstract_runner(model, config, sharding, max_model_len=128)
    a, b = runner.lora.tables  # a: (layers, in, slots, R), b: (layers, slots, R, out)
    tables = jax.tree.leaves((a, b))
    assert tables and all(isinstance(t, jax.ShapeDtypeStruct) for t in tables)
    assert all(t.shape[2] == 3 for t in a.values()) and all(t.shape[1] == 3 for t in b.values())
    variants = [v for v in runner.variants() if v.lora]
    assert variants and len(variants) * 2 == len(runner.variants())  # each variant with and without LoRA
    # XLA:CPU writes each layer's A out flat, (in, slots*width), for its dot (library call) to
    # read; the H200 programs are checked for those too (scripts/gpu_aot_check.py --enable-lora)
    table_shapes = gpu_aot.lora_table_shapes(runner, flat_slices=False)
    for variant in (variants[0], variants[-1]):
        text = runner.steps.lowered(variant).compile().as_text()
        stats = analyze_hlo(text, table_shapes, set())
        assert stats.weight_copies == [], stats.weight_copies
        # the tables enter as parameters of their own shape
        params = [line for line in text.splitlines() if "parameter(" in line and "ENTRY" not in line]
        for dtype, dims in table_shapes:
            if len(dims) == 4:
                assert any(f"{dtype}[{','.join(map(str, dims))}]" in line for line in params), dims


def test_host_callbacks_are_round_trips():
    """A callback into Python (``jax.pure_callback``) is a host round trip each run."""
    import numpy as np

    def f(x):
        return jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1

    stats = analyze_hlo(jax.jit(f).lower(jnp.ones(8)).compile().as_text(), set(), set())
    assert stats.host_callbacks == 1 and stats.host_round_trips == 1
    plain = analyze_hlo(jax.jit(lambda x: x * 2 + 1).lower(jnp.ones(8)).compile().as_text(), set(), set())
    assert plain.host_callbacks == 0 and plain.host_round_trips == 0


def _spec_runner(speculative_config: dict, give_draft: bool = True, preset: str = "cpu-bench", **overrides):
    """A compile-only runner of ``preset`` (one layer unless cpu-bench) on the CPU (xla attention)
    speculating per ``speculative_config``, its draft given as scripts/gpu_aot_check.py gives it
    (or none)."""
    from jaxserve.bench.gpu_aot_draft import abstract_draft
    from jaxserve.config import EngineConfig
    from jaxserve.runner.mesh import make_mesh

    model = gpu_aot.abstract_model(preset, False, num_layers=None if preset == "cpu-bench" else 1)
    sharding = jax.sharding.NamedSharding(make_mesh(jax.devices("cpu")[:1], 1), jax.sharding.PartitionSpec())
    # at most 8 tokens a step: a 16-token gather of the xla attention would have one 16-slot
    # block's shape, which the copy check cannot tell from a copy of the pool's block
    config = EngineConfig(**{"attention_backend": "xla", "num_gpu_blocks_override": 16, "max_num_seqs": 4,
                             "max_num_batched_tokens": 8, "speculative_config": speculative_config, **overrides})
    draft = abstract_draft(config.spec_decode_config.spec, model.config, preset=preset) if give_draft else None
    return gpu_aot.abstract_runner(model, config, sharding, max_model_len=128, draft=draft), draft


def _shapes(tree) -> set:
    hlo = {"float32": "f32", "int32": "s32", "bfloat16": "bf16"}
    return {(hlo[str(x.dtype)], tuple(x.shape)) for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3", "mtp"])
def test_a_speculating_runners_proposer_compiles_from_shapes_alone(method):
    """scripts/gpu_aot_check.py --speculative-config: the compile-only runner is given its draft
    (a preset), EAGLE head (the target's shape) or MTP layer (a MiMo target's), and every program
    its proposer compiles at warm-up lowers from shapes, here for the CPU: the draft's pool donated
    and updated in place, no copy of its weights (or of the target's tables a head reads). Its
    shapes are placed on the runner's mesh as a local proposer's arrays are. Host round trips are
    checked on the H200 programs (the CPU's xla attention has its own loops)."""
    from jaxserve.bench.gpu_aot_draft import draft_programs

    spec = {"method": method, "num_speculative_tokens": 3, **({} if method == "mtp" else {"model": "cpu-bench"})}
    runner, _ = _spec_runner(spec, preset="mimo-7b" if method == "mtp" else "cpu-bench")
    proposer = runner.drafter if method == "draft_model" else runner.eagle
    assert proposer is not None and (runner.drafter is None) == (method != "draft_model")
    for x in jax.tree.leaves((proposer.weights, proposer.kv)):
        assert isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding.mesh == runner.mesh
    programs = draft_programs(runner)
    if method == "draft_model":  # a catch-up per token bucket, a K-1-step loop per row bucket
        expected = len(proposer.token_buckets) + len(proposer.row_buckets)
    else:  # a program per target token bucket, and with async scheduling (the overlap) a second
        # one run from a step's device outputs
        assert proposer.on_device
        expected = 2 * len(runner.buckets.token_buckets)
        assert sum(p.name.startswith(f"{method}-device-") for p in programs) == expected // 2
    assert len(programs) == expected
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((proposer.weights, proposer.kv)))
    for program in (programs[0], programs[-1]):
        stats = analyze_hlo(program.lower().compile().as_text(), _shapes(program.weights), _shapes(program.pools))
        assert stats.pool_aliased and not stats.pool_copies, (program.name, stats)
        assert stats.weight_copies == [], (program.name, stats.weight_copies)
    top = runner.buckets.token_buckets[-1]  # --buckets: only the programs of those sizes
    only = draft_programs(runner, [top])
    assert only and {p.name for p in only} <= {p.name for p in programs} and not draft_programs(runner, [top + 1])
    assert all(p.name.endswith((f"-{top}", f"-r{top}")) for p in only)


def test_an_abstract_eagle_head_has_the_loaded_heads_tensors(tmp_path):
    """The head the check builds holds the tensors (names, served shapes) a loaded head of the
    same shape holds."""
    import json

    from jaxserve.bench.gpu_aot_draft import abstract_eagle_head
    from jaxserve.bench.presets import preset_config
    from jaxserve.models.eagle import eagle_config, load_eagle_weights
    from tests.eagle_heads import write_eagle_head

    target = gpu_aot.abstract_model("cpu-bench", False).config
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(preset_config("cpu-bench")))
    for method in ("eagle", "eagle3"):
        folder = write_eagle_head(tmp_path / method, tmp_path / "target", method, draft_vocab_size=4096,
                                  intermediate_size=2 * target.hidden_size)
        loaded = load_eagle_weights(folder, eagle_config(folder, method, target), jnp.float32)
        cfg, weights = abstract_eagle_head(method, target)
        assert set(weights) == set(loaded)
        same_mlp = {k for k in loaded if "mlp" not in k}  # the written head's MLP is 2h wide, the target's 3h
        assert {k: weights[k].shape for k in same_mlp if k not in ("lm_head.weight", "d2t")} == {
            k: loaded[k].shape for k in same_mlp if k not in ("lm_head.weight", "d2t")}


def test_an_abstract_mtp_layer_has_the_loaded_layers_tensors(tmp_path):
    """The MTP layer the check builds holds the tensors (names, served shapes, dtype) that
    loading a MiMo checkpoint's layer gives, biases included; a target preset with no MTP layers
    is refused naming the ones that have them."""
    from jaxserve.bench.gpu_aot_draft import abstract_draft, abstract_mtp_head
    from jaxserve.config.speculative import SpeculativeConfig
    from jaxserve.exceptions import ConfigError
    from jaxserve.models.config import ModelConfig
    from jaxserve.models.mtp import load_mtp_head
    from tests.mtp_models import write_mimo
    from tests.tiny_models import build_tiny_checkpoint

    qwen2 = build_tiny_checkpoint(tmp_path / "qwen2", "Qwen2ForCausalLM", vocab_size=512)
    target = ModelConfig.from_pretrained(write_mimo(tmp_path / "mimo", qwen2))
    cfg, loaded = load_mtp_head(tmp_path / "mimo", target, jnp.dtype(target.dtype))
    abstract_cfg, weights = abstract_mtp_head(target)
    assert abstract_cfg == cfg and "layers.0.self_attn.q_proj.bias" in weights
    assert {k: (w.shape, w.dtype) for k, w in weights.items()} == {k: (w.shape, w.dtype) for k, w in loaded.items()}
    mtp = SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ConfigError, match="method=mtp: the preset 'cpu-bench' has no multi-token.*mimo-7b"):
        abstract_draft(mtp, gpu_aot.abstract_model("cpu-bench", False).config, preset="cpu-bench")


def test_a_compile_only_runner_needs_its_draft_and_a_draft_preset_needs_the_vocabulary():
    from jaxserve.bench.gpu_aot_draft import abstract_draft
    from jaxserve.config.speculative import SpeculativeConfig
    from jaxserve.exceptions import ConfigError

    with pytest.raises(ConfigError, match="speculative_config.method=draft_model"):
        _spec_runner({"method": "draft_model", "model": "cpu-bench", "num_speculative_tokens": 2}, give_draft=False)
    target = gpu_aot.abstract_model("cpu-bench", False).config
    with pytest.raises(ConfigError, match="speculative_config.model.*vocabulary"):
        abstract_draft(SpeculativeConfig.parse({"model": "qwen3-tiny-draft", "num_speculative_tokens": 2}), target)
    with pytest.raises(ConfigError, match="speculative_config.model.*not a preset"):
        abstract_draft(SpeculativeConfig.parse({"model": "/no/such/draft", "num_speculative_tokens": 2}), target)


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_the_kv_budget_holds_the_proposers_pool_with_the_targets(method):
    """With a KV budget (kv_cache_memory here, the GPU's share the same way), the target's pool
    leaves room for the draft's or the head's: both pools together fit it, where the target's
    alone would take all of it; the proposer's pool is what the sizing counted for it."""
    from jaxserve.bench.gpu_aot_draft import proposer_memory
    from jaxserve.runner.kv_cache import bytes_per_block

    budget = 2 << 20
    spec = {"method": method, "model": "cpu-bench", "num_speculative_tokens": 3}
    runner, draft = _spec_runner(spec, num_gpu_blocks_override=None, kv_cache_memory=budget)
    proposer = runner.drafter if method == "draft_model" else runner.eagle
    target_pool, proposer_pool = _nbytes(runner.state.kv_cache), _nbytes(proposer.kv)
    assert target_pool + proposer_pool <= budget
    target_alone = budget // bytes_per_block(runner.mc, runner.block_size)
    assert runner.num_blocks < target_alone
    pool, weights = proposer_memory(runner.config.spec_decode_config.spec, draft, runner.config, runner.max_model_len)
    assert proposer_pool <= pool.fixed + pool.per_block * runner.num_blocks
    # as many tokens as the target's pool (the draft), or one layer in each of its blocks (the head)
    assert proposer_pool >= pool.per_block * runner.num_blocks
    assert weights == _nbytes(proposer.weights)
