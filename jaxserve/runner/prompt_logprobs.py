"""Prompt logprobs: the logprob of each prompt token given the tokens before it (vLLM's
``prompt_logprobs``), as vLLM's Model Runner V2 keeps it, one worker apart from the step.

Only steps holding a ``prompt_logprobs`` request pay for it: after the step is launched, its
hidden states of every scheduled token go through the model's head ([T, V] logits) in a second
program, jitted per token bucket on first use rather than at warm-up, since most workloads never
ask. Each request's rows accumulate on its ``CachedRequestState`` over its prefill steps (chunked
prefill spreads them) and are handed over once, with its first sampled token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxserve.core.sched_output import SchedulerOutput
from jaxserve.layers.lora import LoRABatch
from jaxserve.runner.input_batch import CachedRequestState, StepPlan
from jaxserve.sample.policy import SamplerPolicy
from jaxserve.sample.sampler import gather_logprobs


class PromptLogprobsWorker:
    def __init__(self, graphdef: Any, split_args: tuple, num_logprobs: int, policy: SamplerPolicy,
                 replicated: Any, eager: bool):
        self.graphdef = graphdef
        self.split_args = split_args  # the mesh, when the model's calls are split
        self.num_logprobs = num_logprobs
        self.policy = policy
        self.replicated = replicated
        self._fn = self._logprobs if eager else jax.jit(self._logprobs)

    @staticmethod
    def start_rows(state: CachedRequestState) -> None:
        """A request admitted (or resumed) starts with no rows, if it asks for any."""
        state.prompt_logprobs_rows = [] if state.sampling_params.prompt_logprobs is not None else None

    def accumulate(self, model_state, hidden: jax.Array, plan: StepPlan, states: Sequence[CachedRequestState],
                   so: SchedulerOutput, head_lora: tuple | None = None) -> None:
        """Add the rows of this step's prompt tokens to the requests that ask (none: no work).
        ``head_lora``: the LoRA tables and each token's slot when the LM head has LoRA slots (the
        program then always takes them, so a step with or without adapters runs the same one)."""
        if all(s.sampling_params.prompt_logprobs is None for s in states):
            return
        next_ids = np.zeros(plan.token_bucket, np.int32)
        spans = []
        t = 0
        for state in states:
            n = so.num_scheduled_tokens[state.req_id]
            start = state.num_computed_tokens
            prompt = state.prompt_token_ids
            if state.sampling_params.prompt_logprobs is not None and start < len(prompt) - 1:
                stop = min(start + n, len(prompt) - 1)  # the last prompt token predicts an output
                next_ids[t : t + stop - start] = prompt[start + 1 : stop + 1]
                spans.append((state, t, stop - start))
            t += n
        lora = None
        if head_lora is not None:
            tables, slot_ids = head_lora
            lora = LoRABatch(slot_ids=jax.device_put(slot_ids, self.replicated), a=tables[0], b=tables[1])
        values, ids, ranks = jax.device_get(self._fn(model_state, hidden, jax.device_put(next_ids, self.replicated),
                                                     lora))
        for state, t0, count in spans:
            k = state.sampling_params.prompt_logprobs + 1
            rows = state.prompt_logprobs_rows
            assert rows is not None, "started at admission, delivered only once the prompt is done"
            for i in range(t0, t0 + count):
                rows.append((ids[i, :k].tolist(), values[i, :k].tolist(), int(ranks[i])))

    @staticmethod
    def deliver(state: CachedRequestState) -> list | None:
        """The request's rows, once (None afterwards, and for a request that never asked)."""
        rows = state.prompt_logprobs_rows
        state.prompt_logprobs_rows = None
        return rows

    def _logprobs(self, model_state, hidden, next_token_ids, lora: LoRABatch | None = None):
        """Logprobs of each scheduled token's successor in the prompt, from every position's logits
        (with ``lora``, each position's LM-head slot delta added)."""
        head = {} if lora is None else {"lora": lora}
        logits = nnx.merge(self.graphdef, model_state).compute_logits(hidden, *self.split_args, **head)
        return gather_logprobs(logits, next_token_ids, self.num_logprobs, self.policy)
