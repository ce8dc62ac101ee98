"""/v1/completions: one or more prompts (text or token ids), ``n`` samples each.

Choice ``index`` is ``prompt_index * n + sample_index``. With ``echo`` the prompt's text comes
before the first chunk of each choice (and, with ``logprobs``, the prompt's logprobs too); with
``echo`` and ``max_tokens=0`` the answer is the prompt alone, as in vLLM (the engine samples one
token that is not reported). In a stream, ``text_offset`` continues from the length of the text
already sent (vLLM's count).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

from jaxserve import CompletionOutput, RequestOutput, SamplingParams

from . import entry_times
from .errors import APIError
from .generation import Generations
from .logprobs import completion_logprobs, prepend_prompt_logprobs, prompt_logprobs_field
from .protocol import (
    MAX_PROMPTS,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
)
from .serving_engine import OpenAIServing, ResponseIds, StreamUsage, make_sampling_params, usage


class OpenAIServingCompletion(OpenAIServing):
    id_prefix = "cmpl"

    def prepare(self, req: CompletionRequest) -> tuple[list[Any], SamplingParams]:
        state = self.state
        state.check_model(req.model)
        state.check_unsupported(req.unsupported())
        prompts = req.prompts()
        if not prompts:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompts)}",
                           param="prompt")
        for p in prompts:
            if isinstance(p, str):
                state.check_prompt_chars("prompt", len(p))
        keep = state.truncation(req.truncate_prompt_tokens)
        engine_prompts = [self._engine_prompt(p, req.add_special_tokens, keep) for p in prompts]
        kw = req.sampling_kwargs()
        wanted = [n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None]
        if wanted:
            kw["prompt_logprobs"] = max(wanted)  # the echoed prompt gets its logprobs too
        max_tokens = 1 if req.echo_only() else req.max_tokens
        params = make_sampling_params(dict(kw, max_tokens=max_tokens, logprobs=req.logprobs))
        return engine_prompts, params

    def _engine_prompt(self, prompt: Any, add_special_tokens: bool, keep: int | None) -> Any:
        """Token ids pass as they are (their last ``keep`` when truncating); text is tokenized by
        the engine, or here when special tokens must be left out or the prompt truncated."""
        if not isinstance(prompt, str):
            return prompt if keep is None else prompt[-keep:]
        tokenizer = self.state.tokenizer
        if tokenizer is None:
            raise APIError(400, "prompt: this model has no tokenizer; send token ids", param="prompt")
        if add_special_tokens and keep is None:
            return prompt
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
            prompt = tokenizer.decode(ids)  # what the model sees is what echo shows
        entry_times.mark("tokenized")
        return {"prompt": prompt, "prompt_token_ids": ids}

    def _echo_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tok = self.state.tokenizer
        return "" if tok is None else tok.decode(out.prompt_token_ids)

    def _generated(self, req: CompletionRequest, out: CompletionOutput) -> CompletionOutput:
        """What the client sees of a sample: nothing when only the prompt is echoed."""
        if not req.echo_only():
            return out
        return CompletionOutput(out.index, "", [], out.cumulative_logprob, [] if out.logprobs is not None else None,
                                out.finish_reason, out.stop_reason)

    def _logprobs(self, req: CompletionRequest, ro: RequestOutput, out: CompletionOutput, start_offset: int,
                  with_prompt: bool) -> CompletionLogProbs:
        tokens = self._tokens(req)
        lp = completion_logprobs(out, tokens, start_offset)
        return prepend_prompt_logprobs(ro, tokens, lp, req.logprobs) if with_prompt else lp

    def response_body(self, req: CompletionRequest, outputs: list[RequestOutput],
                      ids: ResponseIds) -> CompletionResponse:
        choices = []
        prompt_tokens = completion_tokens = 0
        for p_index, ro in enumerate(outputs):
            prompt_tokens += len(ro.prompt_token_ids)
            prefix = self._echo_text(ro) if req.echo else ""
            prompt_lps = None if req.prompt_logprobs is None else prompt_logprobs_field(ro, req.prompt_logprobs)
            for engine_out in ro.outputs:
                out = self._generated(req, engine_out)
                completion_tokens += len(out.token_ids)
                lp = None
                if req.logprobs is not None:
                    lp = self._logprobs(req, ro, out, len(prefix), with_prompt=req.echo)
                choices.append(CompletionResponseChoice(
                    index=p_index * req.n + out.index, text=prefix + out.text, logprobs=lp,
                    finish_reason=out.finish_reason, stop_reason=out.stop_reason, prompt_logprobs=prompt_lps))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=ids.id, created=ids.created, model=ids.model, choices=choices,
                                  usage=usage(prompt_tokens, completion_tokens))

    async def stream_chunks(self, req: CompletionRequest, generations: Generations, ids: ResponseIds,
                            stream_usage: StreamUsage) -> AsyncGenerator[CompletionStreamResponse, None]:
        prompt_tokens: dict[int, int] = {}  # prompt index -> its token count
        prompt_logprobs: dict[int, Any] = {}  # prompt index -> its prompt logprobs (in its first output only)
        generated: dict[int, int] = {}  # choice index -> tokens so far
        sent_text: dict[int, int] = {}  # choice index -> characters sent (the next text_offset)
        async for p_index, ro in generations:
            prompt_tokens.setdefault(p_index, len(ro.prompt_token_ids))
            if ro.prompt_logprobs is not None:
                prompt_logprobs.setdefault(p_index, ro.prompt_logprobs)
            if req.echo and req.logprobs is not None:  # the echoed prompt carries its logprobs
                ro = dataclasses.replace(ro, prompt_logprobs=prompt_logprobs.get(p_index))
            for engine_out in ro.outputs:
                out = self._generated(req, engine_out)
                index = p_index * req.n + out.index
                generated[index] = generated.get(index, 0) + len(out.token_ids)
                first_chunk = index not in sent_text
                prefix = self._echo_text(ro) if req.echo and first_chunk else ""
                text = prefix + out.text
                lp = None
                if req.logprobs is not None and (out.logprobs or (req.echo and first_chunk)):
                    lp = self._logprobs(req, ro, out, sent_text.get(index, 0) + len(prefix),
                                        with_prompt=req.echo and first_chunk)
                sent_text[index] = sent_text.get(index, 0) + len(text)
                if not text and not out.token_ids and out.finish_reason is None:
                    continue  # one chunk per step with new tokens, even while their text is held back
                chunk_usage = (usage(prompt_tokens[p_index], generated[index]) if stream_usage.continuous
                               else None)
                yield CompletionStreamResponse(
                    id=ids.id, created=ids.created, model=ids.model, usage=chunk_usage,
                    choices=[CompletionResponseChoice(index=index, text=text, logprobs=lp,
                                                      finish_reason=out.finish_reason,
                                                      stop_reason=out.stop_reason)])
        if stream_usage.final:
            yield CompletionStreamResponse(id=ids.id, created=ids.created, model=ids.model, choices=[],
                                           usage=usage(sum(prompt_tokens.values()), sum(generated.values())))
