"""A party that refused for its privacy budget is recognised whatever wraps its reason."""

from fedge.aggregator.rounds.replies import FAILURE_REASON_CHARS, Collected


def test_a_refusal_is_told_by_the_whole_reason_before_it_is_cut() -> None:
    # Flower's Ray backend puts hundreds of characters ahead of the exception's class.
    ray = (
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run()"
        " (pid=4242, actor_id=" + "f" * 200 + ", repr=<ClientAppActor object at 0x7f>)\n"
        '  File "/site-packages/flwr/simulation/ray_transport/ray_actor.py", line 60, in run\n'
    )
    reason = ray + "fedge.privacy.settings.BudgetExhaustedError: lifetime privacy budget exhausted"
    assert reason.index("BudgetExhaustedError") > FAILURE_REASON_CHARS
    collected = Collected({}, {}, {})
    collected.fail(1001, reason)
    collected.fail(1002, ray + "ValueError: something else")
    assert collected.exhausted == {1001}
    assert len(collected.failures[1001]) == FAILURE_REASON_CHARS
