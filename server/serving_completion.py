"""/v1/completions: one or more prompts (text or token ids), ``n`` samples each.

Choice ``index`` is ``prompt_index * n + sample_index``. With ``echo`` the prompt's text comes
before the first chunk of each choice (and, with ``logprobs``, the prompt's logprobs too).
"""

from __future__ import annotations

from typing import Any, AsyncGenerator

from jaxserve import RequestOutput, SamplingParams

from .errors import APIError
from .generation import Generations
from .logprobs import completion_logprobs, prepend_prompt_logprobs
from .protocol import (
    MAX_PROMPTS,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
)
from .serving_engine import OpenAIServing, ResponseIds, make_sampling_params, usage


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
        engine_prompts = [self._engine_prompt(p, req.add_special_tokens) for p in prompts]
        kw = req.sampling_kwargs()
        if req.echo and req.logprobs is not None:
            kw["prompt_logprobs"] = req.logprobs  # the echoed prompt gets its logprobs too
        params = make_sampling_params(dict(kw, max_tokens=req.max_tokens, logprobs=req.logprobs))
        return engine_prompts, params

    def _engine_prompt(self, prompt: Any, add_special_tokens: bool) -> Any:
        """Token ids pass as they are; text is tokenized by the engine, or here when special
        tokens must be left out."""
        if not isinstance(prompt, str):
            return prompt
        tokenizer = self.state.tokenizer
        if tokenizer is None:
            raise APIError(400, "prompt: this model has no tokenizer; send token ids", param="prompt")
        if add_special_tokens:
            return prompt
        return {"prompt": prompt, "prompt_token_ids": tokenizer.encode(prompt, add_special_tokens=False)}

    def _echo_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tok = self.state.tokenizer
        return "" if tok is None else tok.decode(out.prompt_token_ids)

    def response_body(self, req: CompletionRequest, outputs: list[RequestOutput],
                      ids: ResponseIds) -> CompletionResponse:
        choices = []
        prompt_tokens = completion_tokens = 0
        for p_index, ro in enumerate(outputs):
            prompt_tokens += len(ro.prompt_token_ids)
            prefix = self._echo_text(ro) if req.echo else ""
            for out in ro.outputs:
                completion_tokens += len(out.token_ids)
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(out, self.state.token_text, len(prefix))
                    if req.echo:
                        lp = prepend_prompt_logprobs(ro, self.state.token_text, lp)
                choices.append(CompletionResponseChoice(
                    index=p_index * req.n + out.index, text=prefix + out.text, logprobs=lp,
                    finish_reason=out.finish_reason, stop_reason=out.stop_reason))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=ids.id, created=ids.created, model=ids.model, choices=choices,
                                  usage=usage(prompt_tokens, completion_tokens))

    async def stream_chunks(self, req: CompletionRequest, generations: Generations, ids: ResponseIds,
                            include_usage: bool) -> AsyncGenerator[CompletionStreamResponse, None]:
        prompt_tokens = 0
        seen_prompts: set[int] = set()
        completion_tokens = 0
        offsets: dict[int, int] = {}  # choice index -> text_offset of its next token
        async for p_index, ro in generations:
            if p_index not in seen_prompts:
                seen_prompts.add(p_index)
                prompt_tokens += len(ro.prompt_token_ids)
            for out in ro.outputs:
                index = p_index * req.n + out.index
                completion_tokens += len(out.token_ids)
                text = out.text
                first_chunk = index not in offsets
                if first_chunk:
                    prefix = self._echo_text(ro) if req.echo else ""
                    text = prefix + text
                    offsets[index] = len(prefix)
                lp = None
                if req.logprobs is not None and out.logprobs:
                    lp = completion_logprobs(out, self.state.token_text, offsets[index])
                    offsets[index] = lp.text_offset[-1] + len(lp.tokens[-1])
                    if req.echo and first_chunk:
                        lp = prepend_prompt_logprobs(ro, self.state.token_text, lp)
                if not text and not out.token_ids and out.finish_reason is None:
                    continue  # one chunk per step with new tokens, even while their text is held back
                yield CompletionStreamResponse(
                    id=ids.id, created=ids.created, model=ids.model,
                    choices=[CompletionResponseChoice(index=index, text=text, logprobs=lp,
                                                      finish_reason=out.finish_reason,
                                                      stop_reason=out.stop_reason)])
        if include_usage:
            yield CompletionStreamResponse(id=ids.id, created=ids.created, model=ids.model, choices=[],
                                           usage=usage(prompt_tokens, completion_tokens))
