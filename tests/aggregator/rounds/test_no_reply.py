"""A missing reply says how long was really waited, and whether the message was taken
(issue 27: "no reply within 120s" was once said 58 s after the round began)."""

from fedge.aggregator.rounds.replies import no_reply_reason


def test_a_missing_reply_carries_the_time_really_waited() -> None:
    assert no_reply_reason(121.4, 120.0) == "no reply within the 120 s allowed (waited 121 s)"
    early = no_reply_reason(58.2, 120.0)
    assert early == "no reply after 58 s of the 120 s allowed" and "within" not in early


def test_a_message_the_superlink_did_not_take_says_so() -> None:
    reason = no_reply_reason(3.0, 120.0, delivered=False)
    assert reason.startswith("not delivered") and "120" not in reason and "3 s" in reason
