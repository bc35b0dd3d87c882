"""A distill or nested fleet job's manifest is checked before anything is prepared (issue
32, item 7)."""

import pytest

from fedge.aggregator.fleet.manifest import parse_fleet_manifest
from fedge.aggregator.jobs.spec import ManifestError

JOB = """
[job]
name = "tiers"
rounds = 2

[task]
model = "inspect:1"

[strategy]
kind = "distill"
[strategy.params]
tiers = 2
{archs}

[federation]
backend = "fleet"
fleet = "plant-a"
edges = "all"
{distill}
"""
ARCHS = 'tier_archs = ["cnn-large", "cnn-small"]'
DISTILL = '[distill]\nproxy = "proxy"'


def manifest(archs: str = ARCHS, distill: str = DISTILL) -> str:
    return JOB.format(archs=archs, distill=distill)


def test_a_distill_job_parses_with_its_tiers_and_proxy() -> None:
    parsed = parse_fleet_manifest(manifest())
    assert parsed.kind == "distill"
    assert parsed.distill is not None and parsed.distill.proxy == "proxy"
    assert parsed.distill.max_images == 2000
    assert parsed.params["tier_archs"] == ["cnn-large", "cnn-small"]


@pytest.mark.parametrize(
    ("archs", "distill", "message"),
    [
        ("", DISTILL, "kind 'distill' needs one architecture per tier"),
        ('tier_archs = ["cnn-large"]', DISTILL, "2 tier\\(s\\), 1 architecture"),
        ('tier_archs = "cnn"', DISTILL, "non-empty list"),
        (ARCHS, "", "\\[distill\\] is missing"),
        (ARCHS, '[distill]\nproxy = ""', "distill.proxy"),
        (ARCHS, '[distill]\nproxy = "p"\nmax_images = 0', "max_images"),
        (ARCHS + "\nquorum_fraction = 7", DISTILL, "quorum"),
        (ARCHS + "\nwhatever = 1", DISTILL, "whatever"),
    ],
)
def test_bad_distill_manifests_name_the_field(archs: str, distill: str, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        parse_fleet_manifest(manifest(archs, distill))


def test_distill_table_only_for_distill() -> None:
    text = manifest().replace('kind = "distill"', 'kind = "tiered"').replace(ARCHS, "")
    with pytest.raises(ManifestError, match=r"only for strategy\.kind"):
        parse_fleet_manifest(text)


def test_a_nested_job_parses_with_its_tiers_and_no_proxy() -> None:
    parsed = parse_fleet_manifest(manifest(distill="").replace('"distill"', '"nested"'))
    assert parsed.kind == "nested" and parsed.distill is None
    assert parsed.params["tier_archs"] == ["cnn-large", "cnn-small"]


@pytest.mark.parametrize(
    ("archs", "distill", "message"),
    [
        ("", "", "kind 'nested' needs one architecture per tier"),
        ('tier_archs = ["cnn-large"]', "", "2 tier\\(s\\), 1 architecture"),
        (ARCHS, DISTILL, r'\[distill\] is only for strategy\.kind = "distill", not \'nested\''),
        (ARCHS + "\ndistill_epochs = 3", "", "distill_epochs: not a parameter of nested"),
    ],
)
def test_bad_nested_manifests_name_the_field(archs: str, distill: str, message: str) -> None:
    text = manifest(archs, distill).replace('kind = "distill"', 'kind = "nested"')
    with pytest.raises(ManifestError, match=message):
        parse_fleet_manifest(text)
