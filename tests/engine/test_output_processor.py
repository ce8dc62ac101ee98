"""OutputProcessor on hand-made EngineCoreOutputs: what each RequestOutputKind delivers, n > 1,
stop strings (held back, cut, reported for aborting in the core), split characters, logprobs,
prompt logprobs and aborts. A real tokenizer, no model."""

from __future__ import annotations

import time

import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.sched_output import EngineCoreOutput
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.outputs import Logprob, RequestOutput, RequestOutputKind

DELTA, CUMULATIVE, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY
PROMPT = "Tell me a story:"
STORY = " the quick fox jumps."


class Run:
    """One OutputProcessor holding one request ``"r"`` with ``n`` children named like the engine's."""

    def __init__(self, tokenizer, kind: RequestOutputKind, n: int = 1, **params):
        self.tokenizer = tokenizer
        self.finished_parents = []
        self.proc = OutputProcessor(tokenizer, on_finished=self.finished_parents.append)
        self.prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
        self.core_ids = ["r"] if n == 1 else [f"{i}_r" for i in range(n)]
        child_params = [SamplingParams(max_tokens=64, **params) for _ in self.core_ids]
        self.proc.add_request("r", PROMPT, self.prompt_ids, self.core_ids, child_params, kind, time.monotonic())

    def ids(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        assert self.tokenizer.decode(ids) == text
        return ids

    def step(self, *outputs: EngineCoreOutput) -> tuple[list[RequestOutput], list[str]]:
        delivered, to_abort = self.proc.process_outputs(list(outputs))
        return [ro for _, ro in delivered], to_abort

    def stream(self, token_ids: list[int], finish_reason: str | None = "length", core_id: str = "r"):
        """One token per step, the last one finishing; returns every step's deliveries and aborts."""
        steps = []
        for i, token_id in enumerate(token_ids):
            last = i == len(token_ids) - 1
            steps.append(self.step(EngineCoreOutput(core_id, [token_id], finish_reason if last else None)))
        return steps


def only(ros: list[RequestOutput]) -> RequestOutput:
    assert len(ros) == 1, ros
    return ros[0]


# ---- the three output kinds -------------------------------------------------------------------


def test_final_only_delivers_one_output_when_the_request_finishes(tokenizer):
    run = Run(tokenizer, FINAL_ONLY)
    tokens = run.ids(STORY)
    steps = run.stream(tokens)
    assert all(ros == [] and aborts == [] for ros, aborts in steps[:-1])
    ro = only(steps[-1][0])
    assert (ro.request_id, ro.prompt, ro.prompt_token_ids, ro.finished) == ("r", PROMPT, run.prompt_ids, True)
    out = only(ro.outputs)
    assert (out.index, out.text, out.token_ids) == (0, STORY, tokens)
    assert (out.finish_reason, out.stop_reason) == ("length", None)
    assert out.logprobs is None and out.cumulative_logprob is None and ro.prompt_logprobs is None
    assert not run.proc.has_unfinished_requests()
    assert len(run.finished_parents) == 1 and run.finished_parents[0].request_id == "r"
    m = ro.metrics
    assert m.num_generation_tokens == len(tokens)
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time


def test_cumulative_outputs_carry_everything_so_far(tokenizer):
    run = Run(tokenizer, CUMULATIVE)
    tokens = run.ids(STORY)
    ros = [only(ros) for ros, _ in run.stream(tokens)]
    for i, ro in enumerate(ros):
        out = only(ro.outputs)
        assert out.token_ids == tokens[: i + 1] and out.text == tokenizer.decode(tokens[: i + 1])
        assert ro.finished == (i == len(tokens) - 1) == (out.finish_reason == "length")
    assert ros[0].outputs[0].token_ids == tokens[:1]  # an output already delivered is not mutated later


def test_delta_outputs_carry_only_what_is_new(tokenizer):
    run = Run(tokenizer, DELTA)
    tokens = run.ids(STORY)
    ros = [only(ros) for ros, _ in run.stream(tokens)]
    assert [only(ro.outputs).token_ids for ro in ros] == [[t] for t in tokens]
    assert "".join(only(ro.outputs).text for ro in ros) == STORY
    assert [ro.finished for ro in ros] == [False] * (len(tokens) - 1) + [True]
    assert [only(ro.outputs).finish_reason for ro in ros][-2:] == [None, "length"]


def test_outputs_for_unknown_requests_are_ignored(tokenizer):
    run = Run(tokenizer, DELTA)
    assert run.step(EngineCoreOutput("other", [5])) == ([], [])
    assert run.proc.has_unfinished_requests()


def test_num_cached_tokens_is_the_largest_reported(tokenizer):
    run = Run(tokenizer, CUMULATIVE)
    a, b = run.ids(" the quick")
    assert only(run.step(EngineCoreOutput("r", [a], num_cached_tokens=4))[0]).num_cached_tokens == 4
    assert only(run.step(EngineCoreOutput("r", [b], "length"))[0]).num_cached_tokens == 4


# ---- n > 1 --------------------------------------------------------------------------------------


def two_children_step(run, t0: int, t1: int, finish0=None, finish1=None):
    return run.step(EngineCoreOutput("0_r", [t0], finish0), EngineCoreOutput("1_r", [t1], finish1))


def test_n2_delta_delivers_each_child_separately(tokenizer):
    run = Run(tokenizer, DELTA, n=2)
    (a0, a1), (b0, b1) = run.ids(" the fox"), run.ids(" a dog")
    ros, _ = two_children_step(run, a0, b0)
    assert sorted((only(ro.outputs).index, only(ro.outputs).token_ids) for ro in ros) == [(0, [a0]), (1, [b0])]
    assert not any(ro.finished for ro in ros)
    ros, _ = two_children_step(run, a1, b1, finish0="length")
    by_index = {only(ro.outputs).index: only(ro.outputs) for ro in ros}
    assert (by_index[0].text, by_index[0].finish_reason) == (" fox", "length")
    assert (by_index[1].text, by_index[1].finish_reason) == (" dog", None)
    assert not any(ro.finished for ro in ros)  # the request finishes with its last child
    ro = only(run.step(EngineCoreOutput("1_r", [], "length"))[0])
    assert ro.finished and only(ro.outputs).index == 1 and only(ro.outputs).text == ""
    assert not run.proc.has_unfinished_requests()


def test_n2_cumulative_delivers_every_child_in_one_output(tokenizer):
    run = Run(tokenizer, CUMULATIVE, n=2)
    (a0, a1), (b0, b1) = run.ids(" the fox"), run.ids(" a dog")
    ro = only(two_children_step(run, a0, b0)[0])
    assert [(o.index, o.text) for o in ro.outputs] == [(0, " the"), (1, " a")]
    ro = only(two_children_step(run, a1, b1, "length", "length")[0])
    assert ro.finished and [(o.index, o.text, o.finish_reason) for o in ro.outputs] == [
        (0, " the fox", "length"), (1, " a dog", "length")]


def test_n2_final_only_waits_for_the_last_child(tokenizer):
    run = Run(tokenizer, FINAL_ONLY, n=2)
    (a0, a1), (b0, b1) = run.ids(" the fox"), run.ids(" a dog")
    assert two_children_step(run, a0, b0) == ([], [])
    assert run.step(EngineCoreOutput("0_r", [a1], "length")) == ([], [])
    assert run.finished_parents == []
    ro = only(run.step(EngineCoreOutput("1_r", [b1], "length"))[0])
    assert ro.finished and [(o.index, o.text, o.token_ids) for o in ro.outputs] == [
        (0, " the fox", [a0, a1]), (1, " a dog", [b0, b1])]
    assert len(run.finished_parents) == 1


# ---- stop strings -------------------------------------------------------------------------------


@pytest.mark.parametrize("include", [False, True])
def test_delta_holds_back_a_partial_stop_and_cuts_at_the_match(tokenizer, include):
    run = Run(tokenizer, DELTA, stop=["quick fox"], include_stop_str_in_output=include)
    tokens = run.ids(STORY)  # " the", " quick", " fox", ...
    the, quick, fox = tokens[:3]
    assert only(only(run.step(EngineCoreOutput("r", [the]))[0]).outputs).text == " the"
    ros, aborts = run.step(EngineCoreOutput("r", [quick]))
    held = only(only(ros).outputs)
    assert held.text == " " and held.token_ids == [quick] and aborts == []  # "quick" may start the stop
    ros, aborts = run.step(EngineCoreOutput("r", [fox]))
    out = only(only(ros).outputs)
    assert out.text == ("quick fox" if include else "")
    assert (out.finish_reason, out.stop_reason, only(ros).finished) == ("stop", "quick fox", True)
    assert aborts == ["r"]  # the core still runs it: the caller must abort it there
    assert not run.proc.has_unfinished_requests()
    assert run.step(EngineCoreOutput("r", [tokens[3]])) == ([], [])


@pytest.mark.parametrize("include", [False, True])
def test_cumulative_text_is_cut_at_a_stop_inside_a_token(tokenizer, include):
    run = Run(tokenizer, CUMULATIVE, stop=["ick f"], include_stop_str_in_output=include)
    the, quick, fox = run.ids(STORY)[:3]
    texts = [only(only(run.step(EngineCoreOutput("r", [t]))[0]).outputs).text for t in (the, quick, fox)]
    assert texts == [" the", " the qu", " the quick f" if include else " the qu"]  # "ick" was held back


def test_a_partial_stop_that_does_not_complete_is_released(tokenizer):
    run = Run(tokenizer, DELTA, stop=["quick cat"])
    steps = run.stream(run.ids(STORY))
    deltas = [only(only(ros).outputs).text for ros, _ in steps]
    assert deltas[:3] == [" the", " ", "quick fox"]
    assert "".join(deltas) == STORY and all(aborts == [] for _, aborts in steps)


def test_a_partial_stop_at_the_end_is_released_when_the_request_finishes(tokenizer):
    run = Run(tokenizer, CUMULATIVE, stop=["quick fox"])
    steps = run.stream(run.ids(" the quick"))
    out = only(only(steps[-1][0]).outputs)
    assert (out.text, out.finish_reason, out.stop_reason) == (" the quick", "length", None)


def test_a_stop_completed_by_the_core_s_last_token_needs_no_abort(tokenizer):
    run = Run(tokenizer, FINAL_ONLY, stop=["fox"])
    ros, aborts = run.stream(run.ids(" the quick fox"))[-1]
    out = only(only(ros).outputs)
    assert (out.text, out.finish_reason, out.stop_reason) == (" the quick ", "stop", "fox")
    assert aborts == []  # the core finished it (length) already


def test_n2_stop_string_aborts_only_the_child_that_hit_it(tokenizer):
    run = Run(tokenizer, FINAL_ONLY, n=2, stop=["fox"])
    (a0, a1), (b0, b1) = run.ids(" the fox"), run.ids(" a dog")
    assert two_children_step(run, a0, b0) == ([], [])
    assert two_children_step(run, a1, b1) == ([], ["0_r"])
    ro = only(run.step(EngineCoreOutput("1_r", run.ids(" ran"), "length"))[0])
    assert [(o.text, o.finish_reason, o.stop_reason) for o in ro.outputs] == [
        (" the ", "stop", "fox"), (" a dog ran", "length", None)]


# ---- characters split over several tokens -------------------------------------------------------


def test_a_split_character_is_delivered_once_complete(tokenizer):
    run = Run(tokenizer, DELTA)
    tokens = run.ids("日本")
    steps = run.stream(tokens)
    outs = [only(only(ros).outputs) for ros, _ in steps]
    assert [o.token_ids for o in outs] == [[t] for t in tokens]  # every token, even while its text waits
    assert [o.text for o in outs if o.text] == ["日", "本"]
    assert "\ufffd" not in "".join(o.text for o in outs)


def test_a_request_ending_inside_a_character_ends_with_a_replacement(tokenizer):
    run = Run(tokenizer, CUMULATIVE)
    tokens = run.ids("ok 日")[:-1]
    out = only(only(run.stream(tokens)[-1][0]).outputs)
    assert out.text.startswith("ok") and out.text.endswith("\ufffd") and out.text == tokenizer.decode(tokens)


def test_a_multibyte_stop_string_matches_once_its_character_completes(tokenizer):
    run = Run(tokenizer, DELTA, stop=["本"])
    tokens = run.ids("日本語")
    steps = run.stream(tokens, finish_reason=None)
    ends = [i for i, (ros, _) in enumerate(steps) if ros and only(ros).finished]
    assert len(ends) == 1 and steps[ends[0]][1] == ["r"]
    assert tokenizer.decode(tokens[: ends[0] + 1]) == "日本"  # cut at the token that completed it
    assert "".join(only(only(ros).outputs).text for ros, _ in steps[: ends[0] + 1]) == "日"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    """vLLM's detokenizer case: ``stop="e"`` with ``min_tokens`` goes on past the early matches and
    stops at the first "e" in the text of a later output."""
    run = Run(tokenizer, CUMULATIVE, stop="e", min_tokens=5)
    tokens = run.ids(" the quick fox jumps over the lazy dog.")
    early_text = tokenizer.decode(tokens[:5])
    assert "e" in early_text  # " the quick fox jumps over": would stop at once without min_tokens
    steps = run.stream(tokens, finish_reason=None)
    stopped = [i for i, (ros, aborts) in enumerate(steps) if aborts == ["r"]]
    assert stopped == [5]  # " the" (the 6th output) holds the first searchable "e"
    out = only(only(steps[5][0]).outputs)
    assert out.finish_reason == "stop" and out.stop_reason == "e"
    assert out.text == early_text + " th" and out.token_ids == tokens[:6]


def test_a_stop_string_straddling_the_min_tokens_boundary_counts(tokenizer):
    run = Run(tokenizer, CUMULATIVE, stop="jumps over", min_tokens=4)
    tokens = run.ids(" the quick fox jumps over the lazy dog.")
    ros, aborts = run.step(*[EngineCoreOutput("r", tokens[:5])])
    out = only(only(ros).outputs)
    assert aborts == ["r"] and out.text == " the quick fox " and out.stop_reason == "jumps over"


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_adds_no_text_unless_asked(tokenizer, include):
    run = Run(tokenizer, DELTA, include_stop_str_in_output=include)
    the, quick, fox = run.ids(" the quick fox")
    outs = [only(only(ros).outputs) for ros, _ in (run.step(EngineCoreOutput("r", [the])),
                                                   run.step(EngineCoreOutput("r", [quick, fox], "stop", fox)))]
    assert [o.token_ids for o in outs] == [[the], [quick, fox]]  # the stop id stays in token_ids
    assert "".join(o.text for o in outs) == (" the quick fox" if include else " the quick")
    assert outs[-1].stop_reason == fox


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_is_left_out_even_when_special_tokens_are_shown(tokenizer, include):
    eos = tokenizer.eos_token_id
    run = Run(tokenizer, CUMULATIVE, skip_special_tokens=False, include_stop_str_in_output=include)
    the = run.ids(" the")[0]
    run.step(EngineCoreOutput("r", [the]))
    out = only(only(run.step(EngineCoreOutput("r", [eos], "stop"))[0]).outputs)
    assert out.token_ids == [the, eos]
    assert out.text == (" the" + tokenizer.eos_token if include else " the")


# ---- logprobs -----------------------------------------------------------------------------------


def test_sample_logprobs_hold_the_chosen_token_and_the_top_n(tokenizer):
    run = Run(tokenizer, CUMULATIVE, logprobs=2)
    t0, t1 = run.ids(" the fox")
    alt0, alt1 = run.ids(" dog cat")[0], run.ids(" cat")[0]
    run.step(EngineCoreOutput("r", [t0], new_logprobs=([t0, t0, alt0], [-0.5, -0.5, -1.5], 1)))
    last = EngineCoreOutput("r", [t1], "length", new_logprobs=([t1, alt0, alt1], [-3.0, -0.25, -1.0], 3))
    ro = only(run.step(last)[0])
    out = only(ro.outputs)
    first, second = out.logprobs
    assert first == {t0: Logprob(-0.5, 1, " the"), alt0: Logprob(-1.5, 2, tokenizer.decode([alt0]))}
    assert second == {t1: Logprob(-3.0, 3, " fox"), alt0: Logprob(-0.25, 1, tokenizer.decode([alt0])),
                      alt1: Logprob(-1.0, 2, tokenizer.decode([alt1]))}
    assert out.cumulative_logprob == pytest.approx(-3.5)


def test_delta_logprobs_cover_only_the_new_tokens(tokenizer):
    run = Run(tokenizer, DELTA, logprobs=0)
    tokens = run.ids(STORY)
    values = [-0.5, -1.0, -0.25, -2.0, -0.125]
    outs = []
    for i, (t, v) in enumerate(zip(tokens, values)):
        finish = "length" if i == len(tokens) - 1 else None
        outs.append(only(only(run.step(EngineCoreOutput("r", [t], finish, new_logprobs=([t], [v], 1)))[0]).outputs))
    assert [o.logprobs for o in outs] == [[{t: Logprob(v, 1, tokenizer.decode([t]))}] for t, v in zip(tokens, values)]
    assert [o.cumulative_logprob for o in outs] == pytest.approx([-0.5, -1.5, -1.75, -3.75, -3.875])


def test_prompt_logprobs_start_with_none_and_follow_the_prompt(tokenizer):
    run = Run(tokenizer, FINAL_ONLY, prompt_logprobs=1)
    prompt, alt = run.prompt_ids, run.ids(" dog")[0]
    rows = [([tok, alt], [-1.0 - i, -0.5], 2) for i, tok in enumerate(prompt[1:])]
    run.step(EngineCoreOutput("r", [], new_prompt_logprobs=rows))
    a, b = run.ids(" the fox")
    run.step(EngineCoreOutput("r", [a]))
    ro = only(run.step(EngineCoreOutput("r", [b], "length"))[0])
    plp = ro.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for i, tok in enumerate(prompt[1:], start=1):
        assert plp[i][tok] == Logprob(-float(i), 2, tokenizer.decode([tok]))
        assert plp[i][alt] == Logprob(-0.5, 1, " dog")


def test_delta_sends_the_prompt_logprobs_once(tokenizer):
    """As vLLM's: the first delta carries them all, every later one an empty list (not None, so a
    caller that extends a list with each delta's works); a request without them has None."""
    run = Run(tokenizer, DELTA, prompt_logprobs=1)
    prompt = run.prompt_ids
    rows = [([tok, tok], [-1.0, -1.0], 1) for tok in prompt[1:]]
    tokens = run.ids(STORY)
    first = only(run.step(EngineCoreOutput("r", [tokens[0]], new_prompt_logprobs=rows))[0])
    assert len(first.prompt_logprobs) == len(prompt)
    later = [only(ros) for ros, _ in run.stream(tokens[1:])]
    assert later and all(ro.prompt_logprobs == [] for ro in later)
    collected: list = []
    for ro in [first, *later]:
        collected.extend(ro.prompt_logprobs)
    assert collected == first.prompt_logprobs
    plain = Run(tokenizer, DELTA)
    outs = [only(ros) for ros, _ in plain.stream(plain.ids(STORY))]
    assert outs and all(ro.prompt_logprobs is None for ro in outs)


def test_without_detokenize_logprobs_carry_no_text(tokenizer):
    run = Run(tokenizer, FINAL_ONLY, detokenize=False, logprobs=1, prompt_logprobs=1)
    (the, fox), alt = run.ids(" the fox"), run.ids(" dog")[0]
    run.step(EngineCoreOutput("r", [], new_prompt_logprobs=[([t, alt], [-1.0, -0.5], 2) for t in run.prompt_ids[1:]]))
    run.step(EngineCoreOutput("r", [the], new_logprobs=([the, alt], [-0.5, -0.25], 2)))
    ro = only(run.step(EngineCoreOutput("r", [fox], "length", new_logprobs=([fox, fox], [-0.1, -0.1], 1)))[0])
    out = only(ro.outputs)
    assert out.text == "" and out.token_ids == [the, fox]
    entries = [*out.logprobs, *ro.prompt_logprobs[1:]]
    assert entries and all(lp.decoded_token is None for entry in entries for lp in entry.values())


@pytest.mark.parametrize("text", ["日本", "a 😀 b"])
def test_streamed_logprob_tokens_agree_with_the_streamed_text(tokenizer, text):
    """A chunk whose token ends inside a character carries no text and an empty logprob token; the
    chunk that completes the character carries it in both."""
    run = Run(tokenizer, DELTA, logprobs=1)
    tokens = run.ids(text)
    alt = run.ids(" dog")[0]
    outs = []
    for i, t in enumerate(tokens):
        finish = "length" if i == len(tokens) - 1 else None
        step = run.step(EngineCoreOutput("r", [t], finish, new_logprobs=([t, alt], [-0.5, -1.0], 1)))
        outs.append(only(only(step[0]).outputs))
    assert "".join(o.text for o in outs) == text
    for o in outs:
        assert "".join(entry[t].decoded_token for t, entry in zip(o.token_ids, o.logprobs)) == o.text
    assert any(o.text == "" for o in outs)  # some token really ended inside a character


# ---- aborts -------------------------------------------------------------------------------------


def test_abort_returns_the_unfinished_children_for_the_core(tokenizer):
    run = Run(tokenizer, DELTA, n=2)
    (a0, a1), (b0, _) = run.ids(" the fox"), run.ids(" a dog")
    two_children_step(run, a0, b0, finish0="length")
    core_ids, aborted = run.proc.abort_requests(["r", "never-added"])
    assert core_ids == ["1_r"] and [p.request_id for p in aborted] == ["r"]
    assert not run.proc.has_unfinished_requests()
    assert run.step(EngineCoreOutput("1_r", [a1])) == ([], [])
    assert run.finished_parents == []  # an abort from the caller is not a finish
    assert run.proc.abort_requests(["r"]) == ([], [])


def test_an_abort_from_the_core_finishes_the_request(tokenizer):
    run = Run(tokenizer, CUMULATIVE)
    the, quick = run.ids(" the quick")
    run.step(EngineCoreOutput("r", [the]))
    ros, aborts = run.step(EngineCoreOutput("r", [quick], "abort"))
    out = only(only(ros).outputs)
    assert (out.text, out.finish_reason, only(ros).finished, aborts) == (" the quick", "abort", True, [])
    assert len(run.finished_parents) == 1
