"""The station's decision to send an image (issue 30): its own signed config decides."""

import pytest

from fedge.edge_agent.viewing.policy import ImageFacts, decide, viewing_on
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ValidationError
from fedge.protocols.pki import Role
from fedge.protocols.viewing import MAX_IMAGE_BYTES, Refusal

ON = ImageFacts(caller=Role.MANAGER, revoked=False, viewing_on=True, known=True, kept_bytes=1234)


def facts(**change: object) -> ImageFacts:
    return ImageFacts(**{**ON.__dict__, **change})


def test_the_manager_gets_a_kept_image_while_the_policy_is_on() -> None:
    assert decide(ON) is None


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"viewing_on": False}, Refusal.POLICY_OFF),
        ({"revoked": True}, Refusal.REVOKED),
        ({"caller": Role.OPERATOR}, Refusal.NOT_MANAGER),
        ({"caller": Role.EDGE}, Refusal.NOT_MANAGER),
        ({"caller": None}, Refusal.NOT_MANAGER),
        ({"known": False, "kept_bytes": None}, Refusal.UNKNOWN),
        ({"kept_bytes": None}, Refusal.PRUNED),
        ({"kept_bytes": MAX_IMAGE_BYTES + 1}, Refusal.TOO_LARGE),
    ],
)
def test_every_other_case_is_refused_with_its_reason(
    change: dict[str, object], refusal: Refusal
) -> None:
    assert decide(facts(**change)) is refusal


def test_a_refused_caller_or_policy_learns_nothing_about_the_prediction() -> None:
    # Off: an unknown and a kept prediction get the same answer.
    assert decide(facts(viewing_on=False, known=False, kept_bytes=None)) is Refusal.POLICY_OFF
    assert decide(facts(caller=Role.EDGE, known=False)) is Refusal.NOT_MANAGER


def test_viewing_is_on_only_where_the_applied_config_says_so() -> None:
    base = EdgeConfig(fleet="f", edge="st-01", version=3)
    assert not viewing_on(None)
    assert not viewing_on(base)
    assert viewing_on(EdgeConfig(fleet="f", edge="st-01", version=4, operator_viewing=True))


def test_off_is_the_field_left_out_never_false() -> None:
    with pytest.raises(ValidationError, match="operator_viewing"):
        EdgeConfig(fleet="f", edge="st-01", version=1, operator_viewing=False)


def test_a_revoked_certificate_learns_nothing_whatever_else_holds() -> None:
    revoked = facts(revoked=True, caller=Role.OPERATOR, viewing_on=False, known=False)
    assert decide(revoked) is Refusal.REVOKED
