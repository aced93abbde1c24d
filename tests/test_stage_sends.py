"""What the stage runtime leaves to its loop after the compute thread sent a step's frame
itself (meshd.inference.stage.runtime): nothing of it twice, nothing else less."""

from __future__ import annotations

import pytest

from meshd.inference.stage.runtime import _not_sent_again, _token_frame
from meshd.inference.stage_events import (
    Finish,
    Hidden,
    Release,
    Sampled,
    SendActivation,
    SendToken,
    TokenRoute,
    Work,
)
from meshd.inference.transport.frames import finish_from_proto, finish_to_proto, token_frame
from meshd.wire import dataplane_pb2 as dp

pytestmark = pytest.mark.unit


def token_to(*nodes: str) -> SendToken:
    return SendToken(nodes, "p", "r", 7, 3, Finish.NONE, 0.2, b"")


def work(route: TokenRoute | None) -> Work:
    return Work("p", "r", 4, None, "h", True, None, 0.1, token_to=route)


def test_a_token_sent_to_the_first_stage_still_goes_to_an_origin_elsewhere() -> None:
    release = Release("p", "r")
    assert _not_sent_again([token_to("o", "a"), release], "a") == [token_to("o"), release]
    assert _not_sent_again([token_to("a"), release], "a") == [release]  # origin = first stage
    assert _not_sent_again([token_to("o")], "a") == [token_to("o")]


def test_hidden_states_sent_are_not_sent_again() -> None:
    activation = SendActivation("b", "p", "r", 4, "h", 0.1, None)
    assert _not_sent_again([activation], "b") == []


def test_the_compute_thread_sends_only_a_token_that_does_not_end_its_request() -> None:
    route = TokenRoute("a", 3, 5, frozenset({99}))
    node, frame = _token_frame(work(route), Sampled(7, b"", 0.25))  # type: ignore[misc]
    expected = dp.Frame(plan_id="p", request_id="r", token=dp.Token(token_id=7, index=3))
    expected.token.compute_s = 0.25
    assert node == "a" and frame == expected  # finish: FINISH_NONE
    assert _token_frame(work(route), Sampled(99, b"", 0.25)) is None  # eos: the loop's
    last = TokenRoute("a", 4, 5, frozenset({99}))
    assert _token_frame(work(last), Sampled(7, b"", 0.25)) is None  # the max_tokens-th
    assert _token_frame(work(None), Sampled(7, b"", 0.25)) is None  # not routed
    assert _token_frame(work(route), Hidden("h", 0.1)) is None


def test_a_token_frame_built_in_place_reads_back_the_same() -> None:
    """``token_frame`` sets the fields of the frame's own Token (the compute thread's hop);
    what a receiver reads must be what a Token built whole carries, zeros and finishes too."""
    for token_id, index, finish, logits in [
        (0, 0, Finish.NONE, b""),  # every field zero: still a token frame
        (7, 3, Finish.EOS, b""),
        (49151, 12, Finish.LENGTH, b"\x00\x00\x80\x3f"),
    ]:
        action = SendToken(("o",), "p", "r", token_id, index, finish, 0.25, logits)
        frame = token_frame(action)
        whole = dp.Token(
            token_id=token_id,
            index=index,
            finish=finish_to_proto(finish),
            compute_s=0.25,
            logits=logits,
        )
        assert frame == dp.Frame(plan_id="p", request_id="r", token=whole)
        read = dp.Frame.FromString(frame.SerializeToString())
        assert read.WhichOneof("body") == "token"
        assert finish_from_proto(read.token.finish) is finish
        assert (read.token.token_id, read.token.index, read.token.logits) == (
            token_id,
            index,
            logits,
        )
