"""Fuzz every Peer, DataPlane and Local RPC of a real daemon (real servers, real mutual TLS,
a real model): a bounded run here; `python -m tests.support.rpc_fuzz` is the larger run."""

from __future__ import annotations

import pytest

from tests.support.rpc_fuzz import FUZZ_CONTEXT, FUZZ_DAEMON_ARGS, fuzz

pytestmark = pytest.mark.integration

CI_EXAMPLES = 300


def test_fuzzed_rpcs_are_answered_in_words_without_tracebacks(
    daemons, mesh_token, architecture_dir, tmp_path
) -> None:
    model = architecture_dir("mistral")
    daemon = daemons(
        [*FUZZ_DAEMON_ARGS, "--join", mesh_token, "--model", str(model), *FUZZ_CONTEXT]
    )
    daemon.wait_for(lambda s: bool(s.agreement.active_plan_id), 90, "a plan")

    report = fuzz(daemon, mesh_token, tmp_path / "fuzzer", CI_EXAMPLES)

    print(report.summary())
    assert report.tally.examples >= CI_EXAMPLES, report.summary()
    assert report.clean, report.summary()
    # The run went past the parsers: well-formed calls were served, Starts were computed.
    assert report.tally.codes["OK"] > 0 and report.tally.codes["INVALID_ARGUMENT"] > 0
    assert report.tally.link_replies["hello"] > 0, report.summary()
