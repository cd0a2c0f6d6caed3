"""Every failure of a POST gets one HTTP status: the client's failures 400,
the server's own 500 (guards/requests.py, answered_post)."""

import io
import json
from types import SimpleNamespace

import pytest

from mlx_lm_mla.guards import state as served
from mlx_lm_mla.guards.requests import (
    BadRequest,
    answered_post,
    bad_request_status,
    refused_parameters,
)


class Handler:
    """Records what a BaseHTTPRequestHandler would send."""

    stream_options = None  # set from the body before the parameters are checked

    def __init__(self):
        self.status, self.wfile = None, io.BytesIO()

    def send_response(self, status):
        self.status = status

    def _set_completion_headers(self, status_code=200):
        self.send_response(status_code)

    def send_header(self, name, value):
        pass

    def end_headers(self):
        pass

    def answer(self):
        body = json.loads(self.wfile.getvalue())
        assert list(body) == ["error"] and isinstance(
            body["error"], str
        )  # mlx-lm's shape
        return self.status, body["error"]


def post_raising(error):
    def do_POST(self):
        raise error

    handler = Handler()
    answered_post(do_POST)(handler)
    return handler.answer()


def test_a_field_the_server_refuses_is_a_client_error():
    assert post_raising(BadRequest("top_k must be at least 0")) == (
        400,
        "top_k must be at least 0",
    )


def test_a_body_that_is_not_utf8_is_a_client_error():
    status, error = post_raising(
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    )
    assert status == 400 and "not valid UTF-8" in error


@pytest.mark.parametrize(
    "error", [ValueError("a bug in the server"), KeyError("state")]
)
def test_any_other_failure_is_a_server_error(error):
    status, message = post_raising(error)
    assert status == 500 and type(error).__name__ in message


def test_a_refused_model_parameter_becomes_a_bad_request():
    def validate_model_parameters(self):
        raise ValueError("temperature must be a non-negative float")

    with pytest.raises(BadRequest, match="temperature must be"):
        refused_parameters(validate_model_parameters)(Handler())


def status_of_a_failed_generate(refused):
    """The status upstream's handler sets when ``generate()`` failed (404), for
    a request whose state says it was refused as the client's, or not."""
    handler = Handler()
    provider = SimpleNamespace(cli_args=None)
    handler.response_generator = SimpleNamespace(model_provider=provider)
    requests = served.of(provider).requests
    state = requests.open(object())
    requests.bind(handler, state)
    state.refused = refused
    bad_request_status(lambda self, status_code=200: self.send_response(status_code))(
        handler, 404
    )
    return handler.status


def test_a_request_refused_in_the_generation_loop_gets_400_not_404():
    assert status_of_a_failed_generate("prompt has no tokens") == 400


def test_any_other_failure_of_generate_keeps_upstreams_404():
    assert status_of_a_failed_generate(None) == 404
