"""What the EAGLE engine tests share: the near pass-through EAGLE-1 head, the proposals the
engine's head makes (recorded as it makes them) and their check against the dense reference
(tests/eagle_reference.py), and the pools (the target's and the head's bookkeeping) back to empty."""

from __future__ import annotations

import numpy as np

from jaxserve import LLM
from tests.eagle_heads import make_near_pass_through, write_eagle_head
from tests.spec_helpers import assert_target_pool_empty


def write_near_pass_through_head(folder, target_folder: str) -> str:
    """An EAGLE-1 head (with an fc bias) whose output is near the target hidden state it reads, so
    that some drafts are accepted (``tests/eagle_heads.make_near_pass_through``)."""
    return make_near_pass_through(write_eagle_head(folder, target_folder, "eagle", seed=1, fc_bias=True))


def write_both_heads(root, target_folder: str) -> dict[str, str]:
    """The engine tests' two heads by method: a near pass-through EAGLE-1 head (drafts accepted)
    and a random EAGLE-3 head over a 512-token draft vocabulary."""
    return {"eagle": write_near_pass_through_head(root / "eagle", target_folder),
            "eagle3": write_eagle_head(root / "eagle3", target_folder, "eagle3", seed=1, draft_vocab_size=512)}


def assert_pools_empty(llm: LLM) -> None:
    assert_target_pool_empty(llm)
    head = llm.llm_engine.core.runner.eagle
    assert head.num_computed == {} and head.blind == set() and head.unexpected_compiles == 0


def recorded_proposals(llm: LLM, monkeypatch) -> list[tuple[np.ndarray, list[int]]]:
    """(known tokens, drafts) of every proposal the head makes from now on."""
    head = llm.llm_engine.core.runner.eagle
    seen: list[tuple[np.ndarray, list[int]]] = []
    propose = head.propose

    def spy(req_ids, contexts, samples, step, hidden, *rest):
        out = propose(req_ids, contexts, samples, step, hidden, *rest)
        seen.extend((np.array(c), d) for c, d in zip(contexts, out) if d)
        return out

    monkeypatch.setattr(head, "propose", spy)
    collect = head.collect_on_device  # overlapped speculation: proposed on the device, read back here

    def spy_on_device(req_ids, contexts, *rest):
        out = collect(req_ids, contexts, *rest)
        seen.extend((np.array(c), d) for c, d in zip(contexts, out) if d)
        return out

    monkeypatch.setattr(head, "collect_on_device", spy_on_device)
    return seen


def assert_drafts_equal_the_reference(llm: LLM, which: str, folder: str, demo_model: str,
                                      sequences: list[list[int]], seen: list[tuple[np.ndarray, list[int]]],
                                      min_proposals: int = 8) -> None:
    """Each recorded proposal equals the dense computation over its context; ``sequences``: the
    requests' whole token lists (prompt and output), a proposal's context a prefix of one."""
    from jaxserve.models import load_model
    from tests.eagle_reference import DenseHead, target_hidden

    model = load_model(demo_model)
    embedding = np.asarray(model.embed_tokens.embedding[...])  # tied: also the LM head
    dense = DenseHead(folder, which, embedding, embedding)
    head = llm.llm_engine.core.runner.eagle
    # Causal: the target's hidden states over a request's whole sequence serve each of its proposals.
    # and the head's pass over it serves each proposal's first step (DenseHead.first_pass).
    arrays = [np.array(s) for s in sequences]
    first: dict[int, tuple] = {}
    assert len(seen) >= min_proposals
    for context, drafts in seen:
        i = next(i for i, seq in enumerate(arrays) if np.array_equal(seq[:len(context)], context))
        if i not in first:
            first[i] = dense.first_pass(arrays[i], target_hidden(model, arrays[i], head.cfg.aux_layers))
        assert drafts == dense.drafts_after(first[i], len(context), head.k)


def sequences_of(prompts: list[dict], outputs) -> list[list[int]]:
    """Every completion's whole token list (each of a request's n), prompt first."""
    return [p["prompt_token_ids"] + c.token_ids for p, o in zip(prompts, outputs) for c in o.outputs]
