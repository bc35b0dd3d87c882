"""The console's security page: the signing key, its rotations and which stations follow
them, and the doctor's findings; for admins only."""

from pathlib import Path

from conftest import console_login, make_fleet_home

from fedge.console.security import security_page
from fedge.edge_manager.security import key_rotation


def test_an_admin_sees_the_key_its_rotation_and_the_doctors_findings(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path)
    try:
        first = fh.home.signing_key().public.key_id
        done = key_rotation.rotate(fh.home)
        client, _ = console_login(fh, "admin")
        assert '<a href="/security">Security</a>' in client.get("/").text
        page = client.get("/security")
        assert page.status_code == 200
        text = page.text
        assert done.new_key_id in text and first in text  # in use, and the rotation's link
        # No station has reported on the rotation yet: both are behind.
        assert "0 of 2; behind: st-01, st-02" in text
        view = security_page(fh.home)
        assert view.trust.key_id == done.new_key_id and view.key_age_days < 0.1
        assert view.findings, "the doctor always reports its checks"
        assert f"{view.errors} error(s), {view.warnings} warning(s)" in text
        for finding in view.findings:
            assert finding.check in text
    finally:
        fh.close()


def test_only_an_admin_reads_it(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path)
    try:
        for role in ("viewer", "operator"):
            client, _ = console_login(fh, role)
            assert 'href="/security"' not in client.get("/").text
            refused = client.get("/security")
            assert refused.status_code == 403 and "only an admin" in refused.text
    finally:
        fh.close()
