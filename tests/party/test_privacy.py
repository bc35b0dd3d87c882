"""A job's privacy settings: every bad value is a clear error before any training."""

import math

import pytest

from fedge.privacy.settings import (
    BUDGET_EXHAUSTED,
    BudgetExhaustedError,
    PrivacyError,
    PrivacyMode,
    PrivacySpec,
    is_budget_exhausted,
)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"epsilon": 0.0}, "privacy.epsilon must be > 0"),
        ({"epsilon": -8.0}, "privacy.epsilon must be > 0"),
        ({"epsilon": math.inf}, "privacy.epsilon must be > 0"),
        ({"epsilon": math.nan}, "privacy.epsilon must be > 0"),
        ({"delta": 1.0}, r"privacy.delta must be in \(0, 1\)"),
        ({"delta": 2.0}, r"privacy.delta must be in \(0, 1\)"),
        ({"delta": 0.0}, r"privacy.delta must be in \(0, 1\)"),
        ({"clipping_norm": 0.0}, "privacy.clipping_norm must be > 0"),
        ({"clipping_norm": -1.0}, "privacy.clipping_norm must be > 0"),
        ({"noise_multiplier": 0.0}, "privacy.noise_multiplier must be > 0"),
        ({"accountant": "gdp"}, "privacy.accountant must be one of"),
        ({"rounds_per_party": 0}, "privacy.rounds_per_party must be >= 1"),
        ({"mode": "local"}, "privacy.mode must be one of"),  # a str, not a PrivacyMode
        ({"mode": PrivacyMode.LOCAL}, "needs a target privacy.epsilon"),
        ({"mode": PrivacyMode.CENTRAL}, "'central' needs privacy.noise_multiplier"),
        ({"secagg_threshold": 0.0}, "a share in \\(0, 1\\] or a count >= 3"),
        ({"secagg_threshold": 1.5}, "a share in \\(0, 1\\] or a count >= 3"),
        ({"secagg_threshold": 3.5}, "as a count must be whole"),
        ({"secagg_clipping_range": 0.0}, "secagg_clipping_range must be > 0"),
        ({"secagg_quantization_range": 1}, "secagg_quantization_range must be >= 2"),
    ],
)
def test_every_bad_setting_is_refused_by_name(fields: dict[str, object], match: str) -> None:
    with pytest.raises(PrivacyError, match=match):
        PrivacySpec(**fields)  # type: ignore[arg-type]


def test_the_defaults_are_no_privacy_and_local_needs_a_target_or_sigma() -> None:
    spec = PrivacySpec()
    assert spec.mode is PrivacyMode.NONE
    assert not spec.enabled
    assert PrivacySpec(secagg=True).enabled
    assert PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=8.0).enabled
    assert PrivacySpec(mode=PrivacyMode.LOCAL, noise_multiplier=1.0).epsilon is None


def test_a_privacy_table_is_read_and_unknown_keys_are_refused() -> None:
    spec = PrivacySpec.from_table(
        {
            "mode": "local",
            "epsilon": 8,
            "delta": 1e-3,
            "clipping_norm": 1.5,
            "accountant": "prv",
            "rounds_per_party": 10,
            "secagg": True,
            "secagg_threshold": 3,
        }
    )
    assert spec == PrivacySpec(
        mode=PrivacyMode.LOCAL,
        epsilon=8.0,
        delta=1e-3,
        clipping_norm=1.5,
        accountant="prv",
        rounds_per_party=10,
        secagg=True,
        secagg_threshold=3.0,
    )
    assert PrivacySpec.from_table({}) == PrivacySpec()
    with pytest.raises(PrivacyError, match=r"unknown field 'privacy.epsilonn' \(known: "):
        PrivacySpec.from_table({"mode": "local", "epsilonn": 8})
    with pytest.raises(PrivacyError, match=r"privacy\.mode must be none, local or central"):
        PrivacySpec.from_table({"mode": "global"})
    with pytest.raises(PrivacyError, match=r"privacy\.accountant must be rdp or prv"):
        PrivacySpec.from_table({"accountant": "moments"})
    with pytest.raises(PrivacyError, match=r"privacy\.secagg must be true or false"):
        PrivacySpec.from_table({"secagg": "yes"})
    with pytest.raises(PrivacyError, match=r"privacy\.epsilon must be a number"):
        PrivacySpec.from_table({"mode": "local", "epsilon": "8"})
    with pytest.raises(PrivacyError, match=r"privacy\.rounds_per_party must be an integer"):
        PrivacySpec.from_table({"mode": "local", "epsilon": 8, "rounds_per_party": 2.5})
    with pytest.raises(PrivacyError, match=r"privacy\.epsilon must be > 0"):
        PrivacySpec.from_table({"mode": "local", "epsilon": 0})


@pytest.mark.parametrize(
    "spec",
    [
        PrivacySpec(),
        PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=8.0, delta=1e-5, rounds_per_party=7),
        PrivacySpec(
            mode=PrivacyMode.LOCAL, noise_multiplier=1.1, clipping_norm=0.5, accountant="prv"
        ),
        PrivacySpec(mode=PrivacyMode.CENTRAL, noise_multiplier=0.7, epsilon=4.0),
    ],
)
def test_the_round_config_carries_the_spec_a_party_needs(spec: PrivacySpec) -> None:
    config = spec.to_config()
    assert all(key.startswith("dp-") for key in config)
    assert PrivacySpec.from_config(config) == spec
    # Training keys around it are ignored.
    assert PrivacySpec.from_config({**config, "lr": 0.1, "epochs": 2}) == spec


def test_a_config_without_privacy_is_no_privacy_and_bad_values_are_refused() -> None:
    assert PrivacySpec.from_config({"lr": 0.1}) == PrivacySpec()
    with pytest.raises(PrivacyError, match=r"config\['dp-mode'\] must be one of"):
        PrivacySpec.from_config({"dp-mode": "loud"})
    with pytest.raises(PrivacyError, match=r"config\['dp-accountant'\] must be rdp or prv"):
        PrivacySpec.from_config({"dp-accountant": "gdp"})
    with pytest.raises(PrivacyError, match="config:dp-epsilon must be a number"):
        PrivacySpec.from_config({"dp-mode": "local", "dp-epsilon": True})
    with pytest.raises(PrivacyError, match=r"privacy\.delta must be in"):
        PrivacySpec.from_config({"dp-mode": "local", "dp-epsilon": 8.0, "dp-delta": 1.0})


def test_secagg_needs_three_parties_and_a_threshold_they_can_meet() -> None:
    PrivacySpec().check_parties(1)  # no SecAgg+: any number
    share = PrivacySpec(secagg=True, secagg_threshold=0.5)
    share.check_parties(3)
    share.check_parties(10)
    # Two hide nothing from each other (issue 24): refused, as are fewer.
    for too_few in (2, 1, 0):
        with pytest.raises(PrivacyError, match=f"at least 3 parties per round.*got {too_few}"):
            share.check_parties(too_few)
    # A threshold counting 2 parties (or anything between a share and 3) is refused.
    for threshold in (2, 2.5, 1.5):
        with pytest.raises(PrivacyError, match="a count >= 3"):
            PrivacySpec(secagg=True, secagg_threshold=threshold)
    PrivacySpec(secagg=True, secagg_threshold=3)
    count = PrivacySpec(secagg=True, secagg_threshold=5)
    count.check_parties(5)
    with pytest.raises(PrivacyError, match=r"secagg_threshold \(5\) is more than the 4 parties"):
        count.check_parties(4)


def test_a_refusal_for_budget_is_recognised_in_a_reply_reason() -> None:
    assert issubclass(BudgetExhaustedError, PrivacyError)
    reason = f"{BUDGET_EXHAUSTED}: lifetime privacy budget exhausted"
    assert is_budget_exhausted(reason)
    assert not is_budget_exhausted("StationDataError: no labelled training images")


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ({"epsilon": 8.0}, "epsilon"),  # forgot mode = "local": would train without DP
        ({"mode": "none", "clipping_norm": 2.0}, "clipping_norm"),
        ({"mode": "central", "noise_multiplier": 1.0, "rounds_per_party": 3}, "rounds_per_party"),
        ({"mode": "local", "epsilon": 8.0, "secagg_threshold": 2}, "secagg_threshold"),
    ],
)
def test_a_setting_the_mode_ignores_is_refused(table: dict[str, object], field: str) -> None:
    with pytest.raises(PrivacyError, match=f"privacy.{field} has no effect"):
        PrivacySpec.from_table(table)


def test_the_quantization_range_is_whole() -> None:
    with pytest.raises(PrivacyError, match="whole number"):
        PrivacySpec.from_table({"secagg": True, "secagg_quantization_range": 4.5})
