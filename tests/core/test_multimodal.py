"""Images in the core: block keys carry each image's content hash and offset, the encoder cache
shares and evicts by hash, and the encoder budget decides where a prefill chunk ends."""

from jaxserve.core import KVCacheManager, Request, SamplingParams
from jaxserve.core.multimodal import (
    EncoderCacheManager,
    MultiModalFeatureSpec,
    PlaceholderRange,
    schedule_encoder_inputs,
)

IMG = 99  # placeholder token id
BS = 4


def feature(h: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(h, PlaceholderRange(offset, length))


def image_request(rid: str, image_hash: str, *, text_before=(1, 2, 3, 4, 5, 6), tail=(7, 8, 9, 10, 11)) -> Request:
    """Six text tokens, an image of six placeholders at offset 6, then five text tokens."""
    prompt = [*text_before, *[IMG] * 6, *tail]
    return Request(rid, prompt, SamplingParams(max_tokens=4), None, block_size=BS,
                   mm_features=[feature(image_hash, len(text_before), 6)])


def admit(mgr, req):
    blocks, n = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - n, n, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    return n


def test_different_images_share_only_the_text_before_them():
    a, b = image_request("a", "img-A"), image_request("b", "img-B")
    # Block 0 (tokens 0-3) is text only; block 1 (4-7) holds the image's first placeholders.
    assert a.block_hashes[0] == b.block_hashes[0]
    assert all(x != y for x, y in zip(a.block_hashes[1:], b.block_hashes[1:]))
    mgr = KVCacheManager(32, BS, 64)
    admit(mgr, a)
    assert mgr.get_computed_blocks(b)[1] == BS  # the text block only


def test_the_same_image_again_hits_its_blocks():
    mgr = KVCacheManager(32, BS, 64)
    admit(mgr, image_request("a", "img-A"))
    again = image_request("c", "img-A")
    assert mgr.get_computed_blocks(again)[1] == 16  # every full block (17 tokens, the last recomputed)


def test_the_same_image_at_another_offset_is_another_key():
    # Same tokens, but the image's placeholders are said to start one token later.
    a = image_request("a", "img-A")
    b = Request("b", list(a.prompt_token_ids), SamplingParams(max_tokens=4), None, block_size=BS,
                mm_features=[feature("img-A", 7, 5)])
    assert a.block_hashes[0] == b.block_hashes[0] and a.block_hashes[1] != b.block_hashes[1]


def test_text_only_hashes_are_unchanged():
    plain = Request("p", list(range(8)), SamplingParams(max_tokens=1), None, block_size=BS)
    assert plain.mm_features == [] and len(plain.block_hashes) == 2


def test_encoder_budget_cuts_the_chunk_before_an_image_it_cannot_encode():
    feats = [feature("x", 2, 6), feature("y", 10, 6)]
    cache = EncoderCacheManager(100)
    # Budget for one image: the chunk of 16 tokens reaches both, so it stops before the second.
    s = schedule_encoder_inputs("r", feats, 0, 16, 8, cache)
    assert s.to_encode == (0,) and s.num_new_tokens == 10 and s.encoder_budget_left == 2
    cache.allocate("r", feats[0])
    # Next step: the first image is cached, the second is encoded; a 3-token chunk ends inside it.
    s = schedule_encoder_inputs("r", feats, 10, 3, 8, cache)
    assert s.to_encode == (1,) and s.num_new_tokens == 3
    cache.allocate("r", feats[1])
    # The rest of that image comes from the cache: nothing more to encode.
    s = schedule_encoder_inputs("r", feats, 13, 5, 8, cache)
    assert s.to_encode == () and s.num_new_tokens == 5


def test_chunk_that_starts_at_an_image_with_no_budget_schedules_nothing():
    s = schedule_encoder_inputs("r", [feature("x", 0, 6)], 0, 8, 4, EncoderCacheManager(100))
    assert s.to_encode == () and s.num_new_tokens == 0


def test_encoder_cache_shares_by_hash_keeps_unreferenced_outputs_and_evicts_oldest():
    cache = EncoderCacheManager(10)
    a, b = feature("a", 0, 6), feature("b", 0, 4)
    assert cache.can_allocate(a, 100)
    cache.allocate("r1", a)
    assert cache.check_and_update_cache("r2", a)  # another request, same image: shared
    cache.free("r1", [a])
    cache.free("r2", [a])
    assert (cache.num_free_slots, cache.num_freeable_slots) == (4, 10)  # kept, evictable
    assert cache.get_freed_mm_hashes() == []
    assert cache.check_and_update_cache("r3", a)  # a repeated image reuses it
    assert not cache.can_allocate(feature("c", 0, 6), 100)  # 6 held by r3: no room
    cache.free("r3", [a])
    cache.allocate("r4", b)
    assert cache.can_allocate(feature("c", 0, 6), 100)  # evicts "a"
    assert cache.get_freed_mm_hashes() == ["a"] and not cache.check_and_update_cache("r5", a)


def test_a_step_counts_the_images_it_already_chose_against_the_cache():
    feats = [feature("x", 0, 6), feature("y", 6, 6)]
    s = schedule_encoder_inputs("r", feats, 0, 12, 100, EncoderCacheManager(10))
    assert s.to_encode == (0,) and s.num_new_tokens == 6  # both fit the budget, not the cache


# ---------------------------------------------------------------- the scheduler with images

def _sched(budget, *, tokens=64, cache=0, enable_caching=True):
    from tests.core.core_testing import make_scheduler
    return make_scheduler(num_blocks=64, block_size=BS, max_model_len=64, max_num_batched_tokens=tokens,
                          max_num_encoder_input_tokens=budget, encoder_cache_size=cache,
                          enable_caching=enable_caching)


def _no_tokens(so):
    from jaxserve.core import ModelRunnerOutput
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[] for _ in ids])


def test_scheduler_encodes_each_image_once_and_chunks_through_it():
    sched = _sched(6, tokens=8)
    req = image_request("a", "img-A")  # image at 6..12, 17 tokens
    sched.add_request(req)
    so = sched.schedule()
    # 8 tokens reach the image: it is encoded whole, the chunk ends inside it (token 8 of 6..12).
    assert so.num_scheduled_tokens == {"a": 8} and so.scheduled_encoder_inputs == {"a": [0]}
    assert so.scheduled_new_reqs[0].mm_features == req.mm_features
    sched.update_from_output(so, _no_tokens(so))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 8} and so.scheduled_encoder_inputs == {}  # from the cache
    enc = sched.encoder_cache_manager
    assert enc.cached["img-A"] == set() and "img-A" in enc.freeable  # done with: kept, evictable


def test_no_encoder_budget_for_the_image_cuts_the_chunk_before_it():
    sched = _sched(6, tokens=32)
    a, b = image_request("a", "img-A"), image_request("b", "img-B", text_before=(31, 32, 33, 34, 35, 36))
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    # a takes the whole budget; b runs its text up to its image, whose encoding waits a step.
    assert so.num_scheduled_tokens == {"a": 17, "b": 6} and so.scheduled_encoder_inputs == {"a": [0]}
    sched.update_from_output(so, _no_tokens(so))
    so = sched.schedule()
    assert so.scheduled_encoder_inputs == {"b": [0]} and so.num_scheduled_tokens["b"] == 11


def test_a_request_whose_first_token_is_an_image_waits_for_budget():
    sched = _sched(6, tokens=64)
    sched.add_request(image_request("a", "img-A"))
    sched.add_request(image_request("b", "img-B", text_before=()))
    so = sched.schedule()
    assert set(so.num_scheduled_tokens) == {"a"} and sched.waiting_reason == "encoder_budget"
    assert sched.encoder_cache_manager.cached.keys() == {"img-A"}  # b holds nothing while it waits


def test_preemption_recomputes_kv_and_keeps_the_encoder_output():
    from jaxserve.core import RequestStatus
    sched = _sched(12, tokens=64, enable_caching=False)  # no prefix hit: every token is recomputed
    a = image_request("a", "img-A")
    sched.add_request(a)
    so = sched.schedule()
    assert so.scheduled_encoder_inputs == {"a": [0]}
    sched.update_from_output(so, _no_tokens(so))
    sched._preempt(sched.running.pop(), 0.0)  # as the scheduler does when blocks run out
    assert a.status is RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    so = sched.schedule()
    # a resumes: its 17 tokens are recomputed, its image is not re-encoded (the cache kept it).
    assert so.num_scheduled_tokens == {"a": 17} and so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert so.scheduled_encoder_inputs == {} and so.free_encoder_mm_hashes == []
    assert "img-A" in sched.encoder_cache_manager.freeable  # used by the resumed step, then released


def test_an_evicted_output_is_named_to_the_runner():
    sched = _sched(6, tokens=64)
    sched.add_request(image_request("a", "img-A"))
    so = sched.schedule()
    sched.update_from_output(so, _no_tokens(so))
    sched.add_request(image_request("c", "img-C", text_before=(41, 42, 43, 44, 45, 46)))
    so = sched.schedule()  # the cache holds 6 tokens: A (unreferenced now) makes way for C
    assert so.scheduled_encoder_inputs == {"c": [0]} and so.free_encoder_mm_hashes == ["img-A"]
