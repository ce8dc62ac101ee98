"""The engine's one validation of a request against its limits: every refusal is an
``InvalidRequestError`` naming its field (and OpenAI's code where there is one). No model runs."""

from __future__ import annotations

import pytest

from jaxserve import EngineConfig, SamplingParams
from jaxserve.engine.processor import InputProcessor
from jaxserve.exceptions import CONTEXT_LENGTH_EXCEEDED, InvalidRequestError
from jaxserve.models.config import ModelConfig
from jaxserve.sample.metadata import DEFAULT_MAX_ALLOWED_TOKENS, DEFAULT_MAX_LOGIT_BIAS, MAX_MIN_TOKENS_STOP_IDS

VOCAB = 100
MAX_MODEL_LEN = 32


def model_config() -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": VOCAB, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "eos_token_id": 2, "torch_dtype": "float32"})


def processor(**config) -> InputProcessor:
    engine = EngineConfig(**{"max_logprobs": 5, **config})
    return InputProcessor(None, model_config(), MAX_MODEL_LEN, engine)


def refused(proc: InputProcessor, prompt, **params) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        proc.process("r", prompt, SamplingParams(**params), arrival_time=0.0)
    return err.value


@pytest.mark.parametrize("prompt, params, field, code", [
    ([], {}, "prompt", None),
    ([1, VOCAB], {}, "prompt", None),
    ([1, -1], {}, "prompt", None),
    ([1] * MAX_MODEL_LEN, {}, "prompt", CONTEXT_LENGTH_EXCEEDED),
    ([1] * 10, {"max_tokens": MAX_MODEL_LEN - 9}, "max_tokens", CONTEXT_LENGTH_EXCEEDED),
    ([1], {"stop_token_ids": [VOCAB]}, "stop_token_ids", None),
    ([1], {"logit_bias": {VOCAB: 1.0}}, "logit_bias", None),
    ([1], {"logit_bias": {i: 1.0 for i in range(DEFAULT_MAX_LOGIT_BIAS + 1)}}, "logit_bias", None),
    ([1], {"allowed_token_ids": [0, VOCAB]}, "allowed_token_ids", None),
    ([1], {"allowed_token_ids": list(range(DEFAULT_MAX_ALLOWED_TOKENS + 1))}, "allowed_token_ids", None),
    ([1], {"min_tokens": 1, "stop_token_ids": list(range(3, 3 + MAX_MIN_TOKENS_STOP_IDS))}, "stop_token_ids", None),
    ([1], {"logprobs": 6}, "logprobs", None),
    ([1], {"prompt_logprobs": 6}, "prompt_logprobs", None),
    ("text", {}, "prompt", None),  # no tokenizer: text prompts cannot be served
    (3.5, {}, "prompt", None),
])
def test_refusals_name_their_field_and_code(prompt, params, field, code):
    err = refused(processor(), prompt, **params)
    assert err.param == field and err.code == code
    assert str(err).startswith(f"{field}: ")


def test_the_largest_request_that_fits_is_accepted():
    proc = processor()
    processed = proc.process("r", [1] * 10, SamplingParams(max_tokens=MAX_MODEL_LEN - 10, logprobs=5,
                                                           logit_bias={VOCAB - 1: 1.0}), arrival_time=0.0)
    assert processed.prompt_token_ids == [1] * 10 and len(processed.core_requests) == 1


def test_without_chunked_prefill_a_prompt_must_fit_the_token_budget():
    proc = processor(enable_chunked_prefill=False, max_num_batched_tokens=8, max_num_seqs=8)
    proc.process("ok", [1] * 8, SamplingParams(), arrival_time=0.0)
    err = refused(proc, [1] * 9)
    assert err.param == "prompt" and "max_num_batched_tokens=8" in str(err)
    # with chunking the same prompt is split across steps
    processor(max_num_batched_tokens=8, max_num_seqs=8).process("ok", [1] * 9, SamplingParams(), arrival_time=0.0)


def test_n_fans_out_to_distinct_child_requests():
    processed = processor().process("p", [1, 2], SamplingParams(n=3, seed=7, temperature=1.0), arrival_time=0.0)
    ids = [r.request_id for r in processed.core_requests]
    assert ids == ["0_p", "1_p", "2_p"]
    assert [r.sampling_params.seed for r in processed.core_requests] == [7, 8, 9]


def test_min_tokens_masks_the_stop_ids_and_the_eos_id_within_the_width():
    proc = processor()
    stop_ids = list(range(3, 2 + MAX_MIN_TOKENS_STOP_IDS))  # with EOS 2: exactly the width
    core = proc.process("r", [1], SamplingParams(min_tokens=2, stop_token_ids=stop_ids), arrival_time=0.0)
    assert core.core_requests[0].sampling_params.all_stop_token_ids == [*stop_ids, 2]
    ignored = proc.process("s", [1], SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[*stop_ids, 99]),
                           arrival_time=0.0)
    assert ignored.core_requests[0].sampling_params.all_stop_token_ids == [*stop_ids, 99]  # no EOS to mask
    # without min_tokens nothing is masked, so any number of stop ids is served
    proc.process("t", [1], SamplingParams(stop_token_ids=list(range(3, 60))), arrival_time=0.0)


def test_a_request_id_must_be_a_string():
    with pytest.raises(TypeError, match="request_id must be a string"):
        processor().process(7, [1], SamplingParams(), arrival_time=0.0)  # type: ignore[arg-type]
