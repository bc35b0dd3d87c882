"""Contract types live in neutral modules, not in the adapters that implement them.

Issue 26, item 4: the MQTT session's values and Protocol are in ``transport/session.py``
and paho is imported only by its adapter, ``transport/mqtt.py``; the station's gRPC
client names what it gets back from ``transport/grpc/contract.py``, never from the
server module. Read from the source (ast, like tests/test_layers.py), following every
``fedge`` import transitively, at the top of a file or inside a function.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
TRANSPORT = SRC / "fedge" / "transport"


def imported(path: Path) -> set[str]:
    """The modules ``path`` imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def source_of(module: str) -> Path | None:
    """The file of a ``fedge`` module (None: a name imported from a module, or not ours)."""
    base = SRC.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def reachable(module: str) -> set[str]:
    """Every module ``module`` imports, directly or through the ``fedge`` modules it imports."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        path = source_of(todo.pop())
        if path is None:
            continue
        for name in imported(path) - seen:
            seen.add(name)
            if name.split(".")[0] == "fedge":
                todo.append(name)
    return seen


def test_the_session_protocol_does_not_reach_paho() -> None:
    reached = reachable("fedge.transport.session")
    assert not {m for m in reached if m.split(".")[0] == "paho"}, "session.py reaches paho"
    assert "fedge.transport.mqtt" not in reached, "session.py reaches the paho adapter"


def test_only_the_mqtt_adapter_imports_paho_in_transport() -> None:
    importers = {
        path.relative_to(TRANSPORT).as_posix()
        for path in TRANSPORT.rglob("*.py")
        if any(m.split(".")[0] == "paho" for m in imported(path))
    }
    assert importers == {"mqtt.py"}


def test_the_grpc_client_does_not_reach_the_server_module() -> None:
    reached = reachable("fedge.transport.grpc.client")
    assert "fedge.transport.grpc.contract" in reached  # it does name the contract
    assert "fedge.transport.grpc.server" not in reached, "client.py reaches the server module"
