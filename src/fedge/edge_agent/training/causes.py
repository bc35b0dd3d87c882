"""Why a station's SuperNode is not on the fleet's SuperLink, read from its log (issue 27).

Pure: :func:`diagnose` takes the log of the SuperNode's current start (Flower 1.41 writes
it; the supervisor keeps it) and names one cause, with what to do, or None when nothing
is wrong. What Flower's SuperNode does in each case (``flwr/supernode/
fleet_http_connection.py`` and ``flwr/supercore/retry/http_retry.py``):

- **refused activation** (HTTP 412): it exits with ``Exit Code: 305`` and ``[code: 2004]
  Failed to activate SuperNode.``, the same for a key the SuperLink does not know (never
  enrolled, revoked, renewed) and for a node still active (its previous SuperNode killed
  less than a minute ago). The fleet's front tells the two apart in the refusal's public
  details (:mod:`fedge.protocols.node_refusal`), printed under the code; without them
  (an older manager) both are named.
- **TLS** (a SuperLink certificate not from the station's CA, or not naming the address):
  it gives up at once (an error whose text mentions a certificate) and exits 305 with the
  SSL error under ``Failed to initialize the connection to the SuperLink.``.
- **a key unregistered while it runs** (revocation): the SuperLink answers 401, and the
  SuperNode stops itself (SIGINT), after which it is restarted and refused as above.
- **the network** (refused, unreachable, timed out): it never exits; it retries forever,
  logging only ``Connection attempt failed, retrying in N seconds`` (the error itself at
  DEBUG). :data:`SupernodeCause.RETRYING` says so, and the supervisor probes the address
  itself to name the network fault (:func:`fedge.transport.causes.classify`).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from fedge.protocols.node_refusal import KEY_NOT_REGISTERED, NODE_STILL_ACTIVE
from fedge.transport.causes import LinkCause, classify, explain

SECTION_MARK = "\n--- "  # the supervisor writes "--- <time>: <command>" before each start
_INIT_FAILED = "Failed to initialize the connection to the SuperLink."
_RETRYING = "Connection attempt failed, retrying"
_CONNECTED = re.compile(r"SuperNode ID: \d+|Connection successful after")
_ACTIVATION_REFUSED = "[code: 2004]"
_UNAUTHORIZED = re.compile(r"401 Unauthorized|Invalid SuperNode authentication")
# The SuperNode's own API to its ClientApp processes: a 401 there is a task token Flower
# dropped (the task's heartbeat lapsed on a loaded machine), not the SuperLink refusing
# the station's key; seen in `make demo` at load 35.
_LOCAL_RUNTIME = "/v1/runtime/"
NODE_ONLINE_S = 60  # Flower keeps a silent node online for 2 x its 30 s heartbeat interval


class SupernodeCause(enum.Enum):
    NODE_STILL_ACTIVE = "node-still-active"
    KEY_NOT_REGISTERED = "key-not-registered"
    ACTIVATION_REFUSED = "activation-refused"  # one of the two above; the front did not say
    KEY_UNAUTHORIZED = "key-unauthorized"  # 401 while running: the key was unregistered
    TLS = "tls"
    NETWORK = "network"  # Flower gave up on a network error (not its default)
    RETRYING = "retrying"  # connection attempts keep failing; Flower does not say why


@dataclass(frozen=True)
class Diagnosis:
    cause: SupernodeCause
    message: str  # what failed and what to do, for a log line
    link: LinkCause | None = None  # the socket/TLS cause, where one was named
    waits_it_out: bool = False  # resolves itself: retry soon, log as a warning


def current_section(log_tail: str) -> str:
    """The part of a SuperNode log written since its last start."""
    return log_tail.rsplit(SECTION_MARK, 1)[-1]


def diagnose(section: str, superlink: str) -> Diagnosis | None:
    """The cause the log of one SuperNode start (``section``) shows; None: no fault
    shown (connected, or still starting). ``superlink``: the address it connects to."""
    if NODE_STILL_ACTIVE in section:
        return Diagnosis(
            SupernodeCause.NODE_STILL_ACTIVE,
            f"the SuperLink at {superlink} still counts this station's previous SuperNode as "
            f"active (stopped without leaving, e.g. killed); Flower releases it within "
            f"{NODE_ONLINE_S} s of its last heartbeat and the station rejoins then on its own "
            "(nothing to do)",
            waits_it_out=True,
        )
    if KEY_NOT_REGISTERED in section:
        return Diagnosis(
            SupernodeCause.KEY_NOT_REGISTERED,
            f"the SuperLink at {superlink} does not know this station's key: the station is "
            "not enrolled, or its certificate was revoked or renewed (the manager registers "
            "the key of each station's newest valid certificate within seconds: check "
            "`fedge edge list` there, and enroll a revoked station again)",
        )
    if _ACTIVATION_REFUSED in section:
        return Diagnosis(
            SupernodeCause.ACTIVATION_REFUSED,
            f"the SuperLink at {superlink} refused to activate this station's node: either "
            f"its previous SuperNode is still counted active (killed less than {NODE_ONLINE_S}"
            " s ago: it rejoins on its own) or its key is not registered (not enrolled, "
            "revoked or renewed: `fedge edge list` on the manager)",
            waits_it_out=True,
        )
    if _INIT_FAILED in section:
        error = section.split(_INIT_FAILED, 1)[1].strip().split("\n\n", 1)[0]
        link = classify(error)
        if link.is_tls:
            return Diagnosis(SupernodeCause.TLS, explain(link, "the SuperLink", superlink), link)
        if link is not LinkCause.UNKNOWN:
            return Diagnosis(
                SupernodeCause.NETWORK, explain(link, "the SuperLink", superlink), link
            )
    linkside = "\n".join(line for line in section.split("\n") if _LOCAL_RUNTIME not in line)
    if _UNAUTHORIZED.search(linkside) and not _connected_after(linkside, _UNAUTHORIZED):
        return Diagnosis(
            SupernodeCause.KEY_UNAUTHORIZED,
            f"the SuperLink at {superlink} stopped accepting this station's key (401): it "
            "was unregistered, as for a revoked or renewed certificate; the SuperNode is "
            "restarted and says more if it is refused again",
        )
    if _RETRYING in section and not _connected_after(section, re.compile(re.escape(_RETRYING))):
        return Diagnosis(
            SupernodeCause.RETRYING,
            f"the SuperNode cannot reach the SuperLink at {superlink} and keeps retrying",
        )
    return None


def _connected_after(section: str, fault: re.Pattern[str]) -> bool:
    """Whether the SuperNode connected after the last line matching ``fault``."""
    ends = [match.end() for match in fault.finditer(section)]
    if not ends:
        return True
    return _CONNECTED.search(section, ends[-1]) is not None


def with_probe(
    diagnosis: Diagnosis, probe_error: BaseException | None, superlink: str
) -> Diagnosis:
    """A RETRYING diagnosis made precise by what the supervisor's own connection attempt
    to ``superlink`` raised (None: it connected, so the fault is past or intermittent)."""
    if diagnosis.cause is not SupernodeCause.RETRYING:
        return diagnosis
    if probe_error is None:
        return Diagnosis(
            SupernodeCause.RETRYING,
            f"{diagnosis.message}, though a connection from this station to it succeeds now "
            "(an intermittent link, or the SuperLink restarting)",
        )
    link = classify(probe_error)
    cause = SupernodeCause.TLS if link.is_tls else SupernodeCause.NETWORK
    return Diagnosis(cause, f"{explain(link, 'the SuperLink', superlink)} ({probe_error})", link)
