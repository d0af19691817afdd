"""Request types against the documented behaviour of the seed, one test per method."""

from __future__ import annotations

import pytest

from engine.runtime.request import (
    UNSUPPORTED_FIELDS,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)


def test_status_is_finished_only_after_preempted() -> None:
    assert not RequestStatus.is_finished(RequestStatus.WAITING)
    assert not RequestStatus.is_finished(RequestStatus.RUNNING)
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    assert RequestStatus.is_finished(RequestStatus.FINISHED_STOPPED)
    assert RequestStatus.is_finished(RequestStatus.FINISHED_LENGTH_CAPPED)
    assert RequestStatus.is_finished(RequestStatus.FINISHED_ABORTED)


def test_status_get_finish_reason() -> None:
    assert RequestStatus.get_finish_reason(RequestStatus.FINISHED_STOPPED) == "stop"
    assert RequestStatus.get_finish_reason(RequestStatus.FINISHED_LENGTH_CAPPED) == "length"
    assert RequestStatus.get_finish_reason(RequestStatus.FINISHED_ABORTED) == "abort"
    assert RequestStatus.get_finish_reason(RequestStatus.RUNNING) is None


def test_sampling_params_defaults() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (256, 0.7, 0.9, 0)
    assert (p.min_p, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.logits_processors is None and p.seed is None


def test_sampling_params_post_init_normalises_lists() -> None:
    p = SamplingParams(stop=None, stop_token_ids=None)
    assert p.stop == [] and p.stop_token_ids == []
    q = SamplingParams(stop="END", stop_token_ids=(3, 4))
    assert q.stop == ["END"] and q.stop_token_ids == [3, 4]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("max_tokens", 0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", float("nan")),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("logits_processors", [42]),
    ],
)
def test_sampling_params_rejects_invalid_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def _request(rid: str = "r", **kw: object) -> Request:
    return Request(request_id=rid, prompt=[1, 2, 3], sampling_params=SamplingParams(), **kw)


SET_UNSUPPORTED = {
    "block_table": [0, 1],
    "shared_prefix_blocks": 2,
    "images": ["cat.png"],
    "videos": ["clip.mp4"],
    "pixel_values": object(),
    "image_grid_thw": (1, 2, 2),
    "attention_mask": [1, 1, 1],
    "multimodal_kwargs": {"fps": 2},
    "is_multimodal": True,
}


def test_every_unsupported_field_is_tried() -> None:
    assert set(SET_UNSUPPORTED) == set(UNSUPPORTED_FIELDS)


@pytest.mark.parametrize(("field", "value"), sorted(SET_UNSUPPORTED.items()))
def test_request_rejects_unsupported_fields_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"Request\.{field} is not supported"):
        _request(**{field: value})


def test_request_accepts_unsupported_fields_left_at_their_defaults() -> None:
    r = _request(images=None, block_table=None, shared_prefix_blocks=0, is_multimodal=False)
    assert r.images is None and not r.is_multimodal


def test_request_token_prompt_fills_prompt_fields() -> None:
    r = _request()
    assert r.prompt_token_ids == [1, 2, 3] and r.num_prompt_tokens == 3
    assert r.status == RequestStatus.WAITING and r.cached_tokens == 0
    assert r.prompt_cache is None and r.remaining_tokens is None and r.cache_hit_type is None


def test_request_num_output_tokens_and_num_tokens() -> None:
    r = _request()
    r.output_token_ids.extend([7, 8])
    assert r.num_output_tokens == 2
    assert r.num_tokens == 5


def test_request_max_tokens_reads_sampling_params() -> None:
    r = Request("r", [1], SamplingParams(max_tokens=9))
    assert r.max_tokens == 9


def test_request_is_finished_follows_status() -> None:
    r = _request()
    assert not r.is_finished()
    r.status = RequestStatus.FINISHED_ABORTED
    assert r.is_finished()


def test_request_get_finish_reason_prefers_explicit_reason() -> None:
    r = _request()
    assert r.get_finish_reason() is None
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.get_finish_reason() == "length"
    r.finish_reason = "stop"
    assert r.get_finish_reason() == "stop"


def test_request_append_output_token_counts_computed() -> None:
    r = _request()
    r.append_output_token(5)
    assert r.output_token_ids == [5] and r.num_computed_tokens == 1


def test_request_set_finished_derives_reason() -> None:
    r = _request()
    r.set_finished(RequestStatus.FINISHED_ABORTED)
    assert r.finish_reason == "abort" and r.is_finished()
    r2 = _request()
    r2.set_finished(RequestStatus.FINISHED_STOPPED, "stop")
    assert r2.get_finish_reason() == "stop"


def test_request_lt_orders_by_priority_then_arrival() -> None:
    a = _request("a", priority=0, arrival_time=2.0)
    b = _request("b", priority=1, arrival_time=1.0)
    c = _request("c", priority=0, arrival_time=1.0)
    assert sorted([a, b, c]) == [c, a, b]


def test_request_hash_and_eq_by_request_id() -> None:
    a = _request("same", priority=0)
    b = _request("same", priority=5)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != _request("other") and a != "same"


def test_request_output_usage_openai_shape() -> None:
    out = RequestOutput("r", prompt_tokens=10, completion_tokens=4)
    assert out.usage() == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
