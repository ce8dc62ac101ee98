"""``Generations`` (server/generation.py): the bridge from one API request to its engine requests.

The engine side here is a small client whose streams are scripted, because the orderings under
test (one prompt ending before another has started) are races with a real engine.
"""

from __future__ import annotations

import asyncio

import pytest

from jaxserve import RequestOutputKind, SamplingParams
from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve_server.errors import APIError
from jaxserve_server.generation import Generations


def _output(request_id: str, token: int, finish: str | None) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[1, 2],
                         outputs=[CompletionOutput(index=0, text=f"t{token}", token_ids=[token],
                                                   finish_reason=finish)],
                         finished=finish is not None)


class ScriptedClient:
    """``generate`` streams: prompt "fast" finishes at once; prompt "slow" waits for ``release``."""

    def __init__(self, fail_slow: bool = False):
        self.release = asyncio.Event()
        self.closed: list[str] = []
        self.fail_slow = fail_slow

    async def generate(self, prompt, params, request_id, **kwargs):
        try:
            if prompt == "slow":
                await self.release.wait()
                yield _output(request_id, 7, "error" if self.fail_slow else None)
                yield _output(request_id, 8, "length")
            else:
                yield _output(request_id, 5, None)
                yield _output(request_id, 6, "length")
                self.release.set()  # the other prompt starts only after this one has ended
        finally:
            self.closed.append(request_id)


def test_a_prompt_that_ends_before_another_starts_streams_in_full():
    async def run():
        client = ScriptedClient()
        gens = Generations(client, ["fast", "slow"], SamplingParams(max_tokens=2), "cmpl-x",
                           RequestOutputKind.DELTA)
        await gens.start()
        got = [(i, out.outputs[0].token_ids[0]) async for i, out in gens]
        await gens.close()
        return got, client.closed

    got, closed = asyncio.run(run())
    assert [t for i, t in got if i == 0] == [5, 6]
    assert [t for i, t in got if i == 1] == [7, 8]
    assert sorted(closed) == ["cmpl-x-0", "cmpl-x-1"]


def test_a_failed_prompt_after_another_ended_is_a_500_and_closes_all():
    async def run():
        client = ScriptedClient(fail_slow=True)
        gens = Generations(client, ["fast", "slow"], SamplingParams(max_tokens=2), "cmpl-y",
                           RequestOutputKind.DELTA)
        with pytest.raises(APIError) as err:
            await gens.start()
        return err.value, client.closed

    err, closed = asyncio.run(run())
    assert err.status == 500 and "cmpl-y-1" in err.message
    assert sorted(closed) == ["cmpl-y-0", "cmpl-y-1"]
