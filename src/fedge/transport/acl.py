"""Who may read and write which topics, as functions: the fleet's ACL (what
:meth:`FleetAccess.acl_text` gives Mosquitto) and MQTT topic-filter matching, for the
in-memory broker (memory.py)."""

from collections.abc import Callable

from fedge.protocols import topics
from fedge.transport.broker import FleetAccess

# identity (the client id), topic, "read" or "write" -> allowed
Acl = Callable[[str, str, str], bool]


def fleet_acl(access: FleetAccess) -> Acl:
    """The ACL :meth:`FleetAccess.acl_text` gives Mosquitto, as a function: the manager
    reads and writes the fleet; an edge reads its ``down/`` and writes its ``up/``
    topics; an operator reads the fleet; nobody else anything."""
    fleet_root = f"{topics.ROOT}/{access.fleet}/#"
    edges, operators = access.edge_names, access.operator_names

    def allowed(identity: str, topic: str, action: str) -> bool:
        if identity == access.manager_user:
            return matches(fleet_root, topic)
        if identity in edges:
            root = topics.edge_root(access.fleet, identity)
            mine = f"{root}/down/#" if action == "read" else f"{root}/up/#"
            return matches(mine, topic)
        return identity in operators and action == "read" and matches(fleet_root, topic)

    return allowed


def matches(topic_filter: str, topic: str) -> bool:
    """MQTT topic filter matching (``+`` one level, ``#`` the rest)."""
    parts, levels = topic_filter.split("/"), topic.split("/")
    for index, part in enumerate(parts):
        if part == "#":
            return True
        if index >= len(levels) or (part != "+" and part != levels[index]):
            return False
    return len(parts) == len(levels)
