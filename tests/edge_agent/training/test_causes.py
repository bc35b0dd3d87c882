"""Which cause a SuperNode's log shows (issue 27): pure, on log text as Flower 1.41 writes it."""

import errno

from fedge.edge_agent.training.causes import (
    SupernodeCause,
    current_section,
    diagnose,
    with_probe,
)
from fedge.protocols.node_refusal import KEY_NOT_REGISTERED_DETAIL, still_active_detail
from fedge.transport.causes import LinkCause

LINK = "10.0.0.5:9092"
REFUSED = (
    "ERROR :     Exit Code: 305\nFailed to initialize the connection to the SuperLink.\n"
    "[code: 2004] Failed to activate SuperNode.\n"
)


def cause(section: str) -> SupernodeCause | None:
    found = diagnose(section, LINK)
    return None if found is None else found.cause


def test_the_fronts_reason_tells_a_still_active_node_from_an_unknown_key() -> None:
    active = diagnose(REFUSED + still_active_detail(7, 60) + "\n", LINK)
    assert active is not None and active.cause is SupernodeCause.NODE_STILL_ACTIVE
    assert active.waits_it_out and "within 60 s" in active.message
    unknown = diagnose(REFUSED + KEY_NOT_REGISTERED_DETAIL + "\n", LINK)
    assert unknown is not None and unknown.cause is SupernodeCause.KEY_NOT_REGISTERED
    assert not unknown.waits_it_out and "revoked" in unknown.message
    for found in (active, unknown):
        assert "TLS" not in found.message and "network" not in found.message


def test_a_bare_refusal_names_both_possibilities() -> None:
    found = diagnose(REFUSED, LINK)
    assert found is not None and found.cause is SupernodeCause.ACTIVATION_REFUSED
    assert "still counted active" in found.message and "not registered" in found.message
    assert "TLS" not in found.message


def test_a_certificate_that_does_not_verify_is_tls() -> None:
    section = (
        "Exit Code: 305\nFailed to initialize the connection to the SuperLink.\n"
        "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local "
        "issuer certificate (_ssl.c:1006)\nThe SuperNode could not connect.\n\nFor more "
    )
    found = diagnose(section, LINK)
    assert found is not None and found.cause is SupernodeCause.TLS
    assert found.link is LinkCause.SERVER_UNTRUSTED and LINK in found.message


def test_retrying_is_a_fault_until_a_later_success() -> None:
    failing = "INFO : Starting\nWARNING : Connection attempt failed, retrying in 1.23 seconds\n"
    assert cause(failing) is SupernodeCause.RETRYING
    recovered = failing + "INFO : Connection successful after 3.10 seconds and 2 tries.\n"
    assert cause(recovered) is None
    assert cause(recovered + failing) is SupernodeCause.RETRYING
    assert cause("INFO : SuperNode ID: 42\n") is None
    assert cause("") is None


def test_a_401_while_running_is_the_key_being_unregistered() -> None:
    section = "SuperNode ID: 42\nClient error '401 Unauthorized' for url '.../pull-messages'\n"
    assert cause(section) is SupernodeCause.KEY_UNAUTHORIZED


def test_a_401_from_the_supernodes_own_runtime_api_is_not_the_key() -> None:
    # Flower 1.41's lines when a ClientApp's task token lapses (make demo, load 35).
    lapsed = (
        "SuperNode ID: 42\n"
        "ERROR :     [/v1/runtime/send-task-heartbeat][ApiError:1008] Runtime task-token "
        "authentication failed.\n"
        "ERROR :     Failed to push task output: Client error '401 Unauthorized' for url "
        "'http://127.0.0.1:27488/v1/runtime/push-task-output'\n"
        "httpx.HTTPStatusError: Client error '401 Unauthorized' for url "
        "'http://127.0.0.1:27488/v1/runtime/send-task-heartbeat'\n"
    )
    assert cause(lapsed) is None
    unregistered = "Client error '401 Unauthorized' for url '.../pull-messages'\n"
    assert cause(lapsed + unregistered) is SupernodeCause.KEY_UNAUTHORIZED


def test_the_probe_names_the_network_fault_behind_retrying() -> None:
    retrying = diagnose("Connection attempt failed, retrying in 2.00 seconds\n", LINK)
    assert retrying is not None
    refused = with_probe(retrying, ConnectionRefusedError(errno.ECONNREFUSED, "refused"), LINK)
    assert refused.cause is SupernodeCause.NETWORK and refused.link is LinkCause.PORT_CLOSED
    assert "nothing listens" in refused.message
    unreachable = with_probe(retrying, OSError(errno.ENETUNREACH, "Network is unreachable"), LINK)
    assert (
        unreachable.link is LinkCause.UNREACHABLE and "certificate" not in unreachable.message[:60]
    )
    fine = with_probe(retrying, None, LINK)
    assert fine.cause is SupernodeCause.RETRYING and "succeeds now" in fine.message


def test_only_the_current_start_counts() -> None:
    log = f"--- t0: flower-supernode\n{REFUSED}\n--- t1: flower-supernode\nSuperNode ID: 9\n"
    assert current_section(log) == "t1: flower-supernode\nSuperNode ID: 9\n"
    assert cause(current_section(log)) is None
