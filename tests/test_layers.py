"""Dependencies point one way: no package imports a package above it.

Layers, bottom to top (issue "One-way layers"): protocols and datasets -> transport -> models,
monitoring and privacy -> party and aggregator -> edge_manager and edge_agent -> sim,
federation and console (so the demo, bench and cli can all start it) -> loop (continuous
training) and students (distilled edge models, published) -> demo -> bench -> cli. Every
``import fedge.X`` in ``src/fedge`` -- at the top of a file or inside a function -- is
checked. ``KNOWN_DEBT`` listed the upward imports there were when this test was written;
it may only shrink, and is empty now.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "fedge"
LAYER = {
    "__init__": 0,
    "errors": 0,
    "toml_table": 0,
    "pidlock": 0,
    "schema_store": 0,
    "protocols": 1,
    "datasets": 1,
    "transport": 2,
    "models": 3,
    "monitoring": 3,
    "privacy": 3,
    "party": 4,
    "aggregator": 4,
    "edge_manager": 5,
    "edge_agent": 5,
    "sim": 6,
    "federation": 6,
    "console": 6,
    "loop": 7,
    "students": 7,
    "demo": 8,
    "bench": 9,
    "cli": 10,
}
# Empty since the issue "One-way layers": a new upward import fails this test.
KNOWN_DEBT: set[tuple[str, str]] = set()


def upward_imports() -> set[tuple[str, str]]:
    found = set()
    for path in ROOT.rglob("*.py"):
        if path.name.startswith("fedge_pb2"):
            continue
        relative = path.relative_to(ROOT)
        package = relative.parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] != "fedge" or len(parts) < 2 or parts[1] == package:
                    continue
                target = parts[1]
                assert target in LAYER, f"{relative}: fedge.{target} has no layer in this test"
                if LAYER[target] >= LAYER[package] and LAYER[target] > 0:
                    found.add((str(relative), target))
    return found


def test_every_package_has_a_layer() -> None:
    packages = {p.name.removesuffix(".py") for p in ROOT.iterdir() if not p.name.startswith(".")}
    packages -= {"py.typed", "__pycache__"}
    assert packages <= set(LAYER), sorted(packages - set(LAYER))


def test_no_new_upward_import() -> None:
    found = upward_imports()
    assert found - KNOWN_DEBT == set(), "upward imports (move the code down, or invert it)"
    assert KNOWN_DEBT - found == set(), "paid-off debt: remove these from KNOWN_DEBT"


def test_the_aggregator_and_the_party_never_import_the_simulator() -> None:
    """The aggregator knows federations and tasks; simulated ones are sim's, on top."""
    for relative, _target in upward_imports():
        assert not relative.startswith(("aggregator/", "party/", "federation/")), relative


# The simulator sits on top of the aggregator, the party code and the data sets; only the
# programs that run it (the demo, the benchmarks, the CLI) may import it (issue 26, item 5).
SIM_DRIVERS = ("demo/", "bench/", "cli/")


def sim_importers() -> set[str]:
    found = set()
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("sim/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            if any(m == "fedge.sim" or m.startswith("fedge.sim.") for m in modules):
                found.add(relative)
    return found


def test_only_the_programs_on_top_import_the_simulator() -> None:
    outside = {m for m in sim_importers() if not m.startswith(SIM_DRIVERS)}
    assert outside == set(), "move what they need below the simulator (e.g. fedge.datasets)"


def test_the_sim_import_check_sees_an_import() -> None:
    """The check is not vacuous: the CLI's sim commands do import the simulator."""
    assert "cli/sim.py" in sim_importers()
