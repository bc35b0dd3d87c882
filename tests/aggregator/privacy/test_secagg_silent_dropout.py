"""SecAgg+ on real processes with a SuperNode SIGKILLed mid-round (issue 25 item 6).

fedge's SuperLink (``flower-superlink`` behind its front, plain HTTP), four real
``flower-supernode`` processes running the SecAgg+ benchmark's ClientApp, and a ServerApp
that runs :func:`fedge.aggregator.privacy.secagg.run_secagg` submitted with ``flwr run``
(:mod:`fedge.bench.secagg_silent`). Round 1 is clean. In round 2 partition 1 takes part in
the key stages, then signals through a file and hangs before its masked vector; the
harness SIGKILLs its SuperNode and every process under it. Nothing is ever sent for it.

Flower's SuperLink would call the node unavailable only once its heartbeat expires
(37.5-60 s after the kill); the masked-vector stage waits 30 s on our clock, so the round
must end on our timeout, name the node a dropout for that reason, and unmask the weighted
mean of the other three within SecAgg+'s quantisation bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedge.bench.secagg_silent import (
    DROPPED,
    TIMEOUT_REASON,
    SilentSettings,
    round_bound_s,
    run_silent_dropout,
    silent_verdict,
)

pytestmark = pytest.mark.integration

# Slack for one pull of the SuperLink after the timeout, on a loaded 2-core machine.
PULL_SLACK_S = 10.0


def test_a_supernode_killed_mid_round_costs_our_timeout_and_the_round_is_exact(
    tmp_path: Path,
) -> None:
    settings = SilentSettings(parties=4, params=2_000, collect_timeout_s=30.0)
    result = run_silent_dropout(tmp_path / "silent", settings)

    assert result["killed"], "the dropped partition never signalled: nothing was killed"
    assert result["clean_on_time"] == [0, 1, 2, 3]
    # The dead node is a dropout, failed for our stage timeout (not Flower's heartbeat).
    assert result["failed"] == [DROPPED] and result["late"] == []
    assert sorted(result["on_time"]) == [0, 2, 3]
    reason = result["failures"][str(DROPPED)]
    assert reason.startswith(f"{TIMEOUT_REASON} 30.0 s"), reason
    # The masked-vector stage waited for it until our timeout, and no longer.
    waited = result["silent_stages_s"]["collect_masked_vectors"]
    assert 30.0 <= waited <= 30.0 + PULL_SLACK_S, result["silent_stages_s"]
    # The round ended within its stated bound.
    bound_s = round_bound_s(result["clean_stages_s"], 30.0)
    assert result["silent_round_s"] <= bound_s, (result["silent_round_s"], bound_s)
    # The unmasked model is the survivors' weighted mean, to the quantisation bound.
    assert 0 <= result["max_abs_error"] <= result["error_bound"] < 1e-3
    assert silent_verdict(result, settings)["silent_dropouts_survived"] == 1
