"""Why the fleet's SuperLink refused to activate a station's SuperNode (issue 27).

Flower 1.41 answers every failed ``ActivateNode`` alike: HTTP 412, ``[code: 2004] Failed
to activate SuperNode.``, whether the station's key is not registered (never enrolled,
revoked, renewed) or the node of that key is still active (a SuperNode killed less than
a minute ago: Flower keeps a node online for twice its heartbeat interval). The front
before the SuperLink (:mod:`fedge.aggregator.superlink.front`) knows which: it adds one of
these reasons to the refusal's public details (``"extra"``), which the SuperNode prints
under the code, and the agent's supervisor reads it back from the SuperNode's log
(:mod:`fedge.edge_agent.training.causes`). The marker is the contract; the prose after it
is for a person reading the log.
"""

KEY_NOT_REGISTERED = "fedge:key-not-registered"
NODE_STILL_ACTIVE = "fedge:node-still-active"

KEY_NOT_REGISTERED_DETAIL = (
    f"{KEY_NOT_REGISTERED}: this SuperNode's key is not registered on the fleet's SuperLink "
    "(the station is not enrolled, or its certificate was revoked or renewed)"
)


def still_active_detail(node_id: int, expires_within_s: float) -> str:
    """The reason for a node whose previous SuperNode is still counted online."""
    return (
        f"{NODE_STILL_ACTIVE}: node {node_id} of this key is still active on the SuperLink "
        f"(a SuperNode with this key is connected, or was stopped without leaving); it "
        f"expires within {expires_within_s:.0f} s"
    )
