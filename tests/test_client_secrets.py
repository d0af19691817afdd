"""Client secrets (minting, expiry, the bound) and the two forms of a call's offer, as
pure functions; the HTTP and WebRTC paths run in tests/test_webrtc_calls.py."""

from __future__ import annotations

from http import HTTPStatus

import pytest
from websockets.datastructures import Headers

from gateway.server.http_requests import HttpError, HttpRequest, RequestReader
from gateway.webrtc.calls import CallError, hangup_call_id, parse_offer, takes_body
from gateway.webrtc.client_secrets import (
    DEFAULT_SECONDS,
    ClientSecrets,
    SecretError,
    is_ephemeral,
    parse_mint_request,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_a_secret_expires_after_its_seconds_and_is_then_unknown() -> None:
    clock = Clock()
    secrets = ClientSecrets(clock=clock)
    default = secrets.mint(parse_mint_request({}))
    short = secrets.mint(
        parse_mint_request({"expires_after": {"anchor": "created_at", "seconds": 10}})
    )
    assert is_ephemeral(default.value) and default.value != short.value
    assert default.expires_at == 1_000 + DEFAULT_SECONDS and short.expires_at == 1_010
    clock.now = 1_009.9
    assert secrets.find(short.value) == short
    clock.now = 1_010
    assert secrets.find(short.value) is None
    assert secrets.find(default.value) == default
    assert secrets.find("ek_never_minted") is None


def test_a_secret_carries_its_session_config() -> None:
    session = {"type": "realtime", "instructions": "Hi."}
    secret = ClientSecrets().mint(parse_mint_request({"session": session}))
    assert secret.session == session


def test_mint_requests_out_of_range_are_refused_with_the_parameter() -> None:
    for body, param in (
        ({"expires_after": {"seconds": 5}}, "expires_after.seconds"),
        ({"expires_after": {"seconds": 7201}}, "expires_after.seconds"),
        ({"expires_after": {"anchor": "now"}}, "expires_after.anchor"),
        ({"session": "text"}, "session"),
        ({"other": 1}, "other"),
    ):
        with pytest.raises(SecretError) as caught:
            parse_mint_request(body)
        assert caught.value.param == param, body
    with pytest.raises(SecretError):
        parse_mint_request([1])


def test_live_secrets_are_bounded_and_expired_ones_make_room() -> None:
    clock = Clock()
    secrets = ClientSecrets(max_kept=2, clock=clock)
    request = parse_mint_request({"expires_after": {"seconds": 10}})
    secrets.mint(request)
    secrets.mint(request)
    with pytest.raises(SecretError) as caught:
        secrets.mint(request)
    assert caught.value.code == "too_many_client_secrets"
    clock.now += 10
    secrets.mint(request)
    assert len(secrets) == 1


def request(content_type: str, body: bytes) -> HttpRequest:
    headers = Headers([("Content-Type", content_type)])
    return HttpRequest("POST", "/v1/realtime/calls", headers, body)


def test_the_sdp_form_and_the_unified_form() -> None:
    offer = parse_offer(request("application/sdp", b"v=0\r\n"))
    assert (offer.sdp, offer.session, offer.unified) == ("v=0\r\n", None, False)
    body = (
        b'--b\r\nContent-Disposition: form-data; name="sdp"\r\n\r\nv=0\r\n\r\n'
        b'--b\r\nContent-Disposition: form-data; name="session"\r\n\r\n'
        b'{"type": "realtime", "instructions": "x"}\r\n--b--\r\n'
    )
    unified = parse_offer(request("multipart/form-data; boundary=b", body))
    assert unified.unified and unified.sdp.startswith("v=0")
    assert unified.session == {"type": "realtime", "instructions": "x"}


def test_offers_that_cannot_be_read_are_refused() -> None:
    cases = (
        ("text/plain", b"v=0", HTTPStatus.UNSUPPORTED_MEDIA_TYPE),
        ("application/sdp", b"  ", HTTPStatus.BAD_REQUEST),
        ("application/sdp", b"\xff", HTTPStatus.BAD_REQUEST),
        ("multipart/form-data; boundary=b", b"--b--\r\n", HTTPStatus.BAD_REQUEST),
    )
    for kind, body, status in cases:
        with pytest.raises(CallError) as caught:
            parse_offer(request(kind, body))
        assert caught.value.status == status, (kind, body)
    bad_session = (
        b'--b\r\nContent-Disposition: form-data; name="sdp"\r\n\r\nv=0\r\n'
        b'--b\r\nContent-Disposition: form-data; name="session"\r\n\r\n[1]\r\n--b--\r\n'
    )
    with pytest.raises(CallError) as caught:
        parse_offer(request("multipart/form-data; boundary=b", bad_session))
    assert caught.value.param == "session"


def test_routes_that_take_a_body() -> None:
    assert takes_body("POST", "/v1/realtime/calls")
    assert takes_body("OPTIONS", "/v1/realtime/client_secrets")
    assert takes_body("POST", "/v1/realtime/calls/rtc_abc/hangup")
    assert not takes_body("POST", "/healthz") and not takes_body("PUT", "/v1/realtime/calls")
    assert hangup_call_id("/v1/realtime/calls/rtc_abc/hangup") == "rtc_abc"
    assert hangup_call_id("/v1/realtime/calls/../hangup") is None


def test_a_request_is_read_whole_and_bounded() -> None:
    reader = RequestReader(max_body_bytes=8)
    head = b"POST /v1/realtime/calls HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n"
    assert reader.feed(head + b"v=") is None
    whole = reader.feed(b"0\r\n")
    assert whole is not None and whole.body == b"v=0\r\n" and whole.path == "/v1/realtime/calls"
    with pytest.raises(HttpError) as caught:
        RequestReader(max_body_bytes=8).feed(head.replace(b"5", b"9"))
    assert caught.value.status == HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    truncated = RequestReader(max_body_bytes=8)
    truncated.feed(head)
    with pytest.raises(HttpError):
        truncated.feed(b"")


def test_ice_servers_from_the_profile_and_the_command_line() -> None:
    from gateway.cli import _overrides, _parser
    from gateway.config import GatewayConfig

    profile = GatewayConfig.model_validate(
        {
            "ice_servers": [
                {"urls": "stun:stun.example.org:3478"},
                {"urls": ["turn:turn.example.org:3478"], "username": "u", "credential": "c"},
            ]
        }
    )
    assert profile.ice_servers[0].urls == ("stun:stun.example.org:3478",)
    assert profile.ice_servers[1].username == "u"
    assert GatewayConfig().ice_servers == ()  # host candidates only
    args = _parser().parse_args(["--ice-server", "stun:a:1", "--ice-server", "stun:b:2"])
    config = GatewayConfig.model_validate(_overrides(args))
    assert [s.urls for s in config.ice_servers] == [("stun:a:1",), ("stun:b:2",)]
