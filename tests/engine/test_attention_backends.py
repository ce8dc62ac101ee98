"""The engine gives the same greedy tokens whichever attention backend runs the step."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import pallas_kernels
from jaxserve import LLM, SamplingParams
from tests.shapes import BACKEND_COMPARISON_SHAPE
from tests.triton_mode import pin_triton_interpreter

pin_triton_interpreter()  # at collection, before any test can import Triton in compiled mode


def _greedy_tokens(demo_model, **engine_args):
    rng = np.random.default_rng(2)
    # mixed lengths: chunked prefill (> 32 tokens), a 1-token prompt, decode-only steps
    prompts = [{"prompt_token_ids": rng.integers(3, 1000, n).tolist()} for n in (1, 7, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(demo_model, show_progress=False, **BACKEND_COMPARISON_SHAPE, **engine_args)
    assert llm.stats()["attention_backend"] == engine_args["attention_backend"]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_pallas_interpret_matches_xla(demo_model):
    expected = _greedy_tokens(demo_model, attention_backend="xla")
    assert _greedy_tokens(demo_model, attention_backend="pallas", interpret_kernels=True,
                          enforce_eager=True) == expected


def test_triton_interpreted_matches_xla(demo_model):
    """The Triton kernel's own source, run by Triton's interpreter inside the engine's step."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    expected = _greedy_tokens(demo_model, attention_backend="xla")
    assert _greedy_tokens(demo_model, attention_backend="triton", interpret_kernels=True,
                          enforce_eager=True) == expected


def test_cpu_kernel_matches_xla(demo_model):
    """The C++ kernel inside the compiled step, and in eager mode, gives xla's greedy tokens."""
    expected = _greedy_tokens(demo_model, attention_backend="xla")
    assert _greedy_tokens(demo_model, attention_backend="cpu") == expected
    assert _greedy_tokens(demo_model, attention_backend="cpu", enforce_eager=True) == expected


def test_auto_backend_on_cpu_is_the_cpu_kernel_else_xla(demo_model, monkeypatch):
    from jaxserve.runner import model_runner

    assert model_runner.resolve_attention_backend("auto") == "cpu"
    assert model_runner.resolve_attention_backend("pallas") == "pallas"
    monkeypatch.setattr(pallas_kernels, "cpu_attention_available", lambda *_: (False, "no compiler"))
    assert model_runner.resolve_attention_backend("auto") == "xla"


def test_cpu_backend_unavailable_is_a_clear_error(demo_model, monkeypatch):
    monkeypatch.setattr(pallas_kernels, "cpu_attention_available", lambda *_: (False, "no C++ compiler found"))
    with pytest.raises(RuntimeError, match="cpu attention backend is unavailable: no C\\+\\+ compiler"):
        LLM(demo_model, show_progress=False, attention_backend="cpu", **BACKEND_COMPARISON_SHAPE)


def test_triton_backend_unavailable_on_cpu_is_a_clear_error(demo_model):
    ok, reason = pallas_kernels.triton_available()
    if ok:
        pytest.skip("triton is available here")
    with pytest.raises(RuntimeError, match="triton"):  # a real launch needs jax_triton and a GPU
        LLM(demo_model, show_progress=False, attention_backend="triton", interpret_kernels=False,
            **BACKEND_COMPARISON_SHAPE)


# Greedy decoding of a random tiny model meets near-ties: its next-token distribution is almost
# flat, and the top two logits of a step may lie within a bf16 ulp of each other (the windowed
# Mistral's 40-token prompt over an fp8 pool has one at its 5th token: 0.008 apart). Two correct
# kernels that round differently (mosaic rounds p to bf16 before p V, as FlashAttention does; xla
# keeps f32; each within about a bf16 ulp of the exact attention) may pick either token there,
# and the sequences part. So each sequence is compared up to its first difference, which must
# fall on a step where xla's top two are within NEAR_TIE; the agreed tokens' logprobs must be
# within LOGPROB_TOL. (The two backends' top-two gaps differ by about 0.015 at most on these runs.)
NEAR_TIE = 0.03
LOGPROB_TOL = 0.03


def _greedy_with_logprobs(model, **engine_args):
    """Per sequence, per step: (the token chosen, its logprob, the gap to the runner-up)."""
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(3, 1000, n).tolist()} for n in (1, 7, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    llm = LLM(model, show_progress=False, **BACKEND_COMPARISON_SHAPE, **engine_args)
    assert llm.stats()["attention_backend"] == engine_args["attention_backend"]
    out = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        steps = []
        for token, top in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True):
            first, second = sorted((lp.logprob for lp in top.values()), reverse=True)[:2]
            steps.append((token, top[token].logprob, first - second))
        out.append(steps)
    return out


def _assert_same_greedy_up_to_near_ties(expected, got) -> int:
    """Compare each sequence up to its first difference (a near-tie); returns the tokens agreed."""
    agreed = 0
    for exp_seq, got_seq in zip(expected, got, strict=True):
        for (exp_tok, exp_lp, exp_gap), (got_tok, got_lp, _) in zip(exp_seq, got_seq, strict=True):
            if got_tok != exp_tok:
                assert exp_gap <= NEAR_TIE, ("not a near-tie", exp_seq, got_seq)
                break  # the sequences part here: what follows has other contexts
            assert abs(got_lp - exp_lp) <= LOGPROB_TOL, (exp_seq, got_seq)
            agreed += 1
    return agreed


@pytest.mark.slow  # Mosaic GPU's interpreter simulates every TMA copy and barrier: about a minute
@pytest.mark.parametrize("arch, extra", [("LlamaForCausalLM", {}),
                                         ("MistralForCausalLM", {"sliding_window": 24})])
def test_mosaic_interpreted_matches_xla(tmp_path, arch, extra):
    """The Mosaic GPU kernel inside the engine's step (interpreted) gives xla's greedy tokens on a
    bf16 model of its smallest head (64), over an fp8 pool too; Mistral with a window shorter than
    the longest prompt (pages of 16 leave it; decodes read a step holding a released page)."""
    from tests.tiny_models import build_tiny_checkpoint

    model = str(build_tiny_checkpoint(tmp_path / arch, arch, seed=3, dtype="bfloat16", vocab_size=1024, hidden_size=128,
                                      num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1, **extra))
    for kv_cache_dtype in ("auto", "fp8"):
        expected = _greedy_with_logprobs(model, attention_backend="xla", kv_cache_dtype=kv_cache_dtype)
        got = _greedy_with_logprobs(model, attention_backend="mosaic", interpret_kernels=True, enforce_eager=True,
                                    kv_cache_dtype=kv_cache_dtype)
        # most of the 18 tokens agree: the seeded prompts meet few near-ties
        assert _assert_same_greedy_up_to_near_ties(expected, got) >= 12
