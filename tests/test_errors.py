"""One error base per package (the tree drawn in ``fedge.errors``'s docstring).

Every module under ``src/fedge`` is imported, and every exception class it defines must
derive from its package's base in ``PACKAGE_BASE``. The few that do not are listed below,
each with the reason; a listed class that is gone fails too, so the lists stay true.
"""

import importlib
import inspect
from pathlib import Path

import typer

from fedge.aggregator.errors import AggregatorError
from fedge.bench.testbed import BenchError
from fedge.cli.common import friendly_errors
from fedge.console.errors import ConsoleError
from fedge.datasets.errors import DatasetError
from fedge.demo.errors import DemoError
from fedge.edge_agent.errors import AgentError
from fedge.edge_manager.errors import ManagerError
from fedge.errors import FedgeError
from fedge.loop.errors import LoopError
from fedge.models.errors import ModelsError
from fedge.party.errors import PartyError
from fedge.privacy.settings import PrivacyError
from fedge.protocols.errors import ProtocolError
from fedge.sim.errors import SimError
from fedge.students.errors import StudentError
from fedge.transport.errors import TransportError

ROOT = Path(__file__).resolve().parents[1] / "src" / "fedge"

PACKAGE_BASE: dict[str, type[Exception]] = {
    "aggregator": AggregatorError,
    "bench": BenchError,
    "console": ConsoleError,
    "datasets": DatasetError,
    "demo": DemoError,
    "edge_agent": AgentError,
    "edge_manager": ManagerError,
    "loop": LoopError,
    "models": ModelsError,
    "party": PartyError,
    "privacy": PrivacyError,
    "protocols": ProtocolError,
    "sim": SimError,
    "students": StudentError,
    "transport": TransportError,
}

# Defined in one package, but an error of another package's branch by design.
OTHER_BRANCH: dict[str, type[Exception]] = {
    # The simulated party's ClientApp refuses its inputs the way every party does.
    "fedge.sim.party_inputs.PartyConfigError": PartyError,
    # A caller's identity (certificate or token) refused by the gRPC services: a refusal
    # of what arrived, as a forged message is.
    "fedge.transport.grpc.identity.Refused": ProtocolError,
}

# Not errors fedge raises to a user, so deliberately outside FedgeError.
NOT_FEDGE_ERRORS = {
    # Control flow: unwinds a running job's loop when a halt is requested; never escapes.
    "fedge.aggregator.jobs.runner._Halted",
    # A deliberately simulated crash inside a SecAgg+ party (a test and bench knob): it
    # must look like any crash to Flower, not like a fedge error.
    "fedge.bench.secagg_apps.PartyKilledError",
    # A bug in the caller (an event that cannot happen in the run's state): it must end
    # in a traceback, never in the CLI's one red line that FedgeError gets.
    "fedge.loop.pipeline.PipelineError",
}


def modules() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name.startswith("fedge_pb2"):
            continue
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in ``fedge``, by qualified name."""
    found: dict[str, type[BaseException]] = {}
    for name in modules():
        module = importlib.import_module(name)
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__ == name:
                found[f"{name}.{value.__qualname__}"] = value
    return found


def test_every_package_has_one_error_base() -> None:
    classes = exception_classes()
    wrong = {}
    for name, cls in classes.items():
        if name in NOT_FEDGE_ERRORS:
            assert not issubclass(cls, FedgeError), f"{name} is a FedgeError: unlist it"
            continue
        if name in OTHER_BRANCH:
            base = OTHER_BRANCH[name]
        elif name == "fedge.errors.FedgeError":
            continue
        else:
            package = name.split(".")[1]
            assert package in PACKAGE_BASE, f"{name}: fedge.{package} has no error base here"
            base = PACKAGE_BASE[package]
        if not issubclass(cls, base):
            wrong[name] = f"derives from {[b.__name__ for b in cls.__mro__[1:]]}, not {base}"
    assert wrong == {}
    listed = NOT_FEDGE_ERRORS | set(OTHER_BRANCH)
    assert listed - set(classes) == set(), "listed classes that are gone: unlist them"


def test_every_package_base_is_a_fedge_error_of_its_own_package() -> None:
    for package, base in PACKAGE_BASE.items():
        assert base.__module__.startswith(f"fedge.{package}."), (package, base)
        assert FedgeError in base.__bases__, f"{base} must derive from FedgeError directly"


def test_the_cli_turns_every_package_error_into_one_red_line() -> None:
    """``friendly_errors`` catches FedgeError: every package base reaches it."""
    for base in PACKAGE_BASE.values():

        @friendly_errors
        def command(error: type[Exception] = base) -> None:
            raise error("what is wrong, what to do")

        try:
            command()
        except typer.Exit as exit_:
            assert exit_.exit_code == 1
        else:
            raise AssertionError(f"{base} did not reach friendly_errors")
