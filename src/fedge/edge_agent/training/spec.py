"""Whether the station trains: the SuperNode its applied config asks the supervisor for.

The agent hands the result to :class:`~fedge.edge_agent.training.supervisor.SupernodeSupervisor`
at start and after every config it applies; ``None`` stops any SuperNode running.
"""

import logging
from collections import Counter
from collections.abc import Sequence

from fedge.edge_agent.settings import AgentSettings
from fedge.edge_agent.training.supervisor import SupernodeSpec
from fedge.protocols.app_signing import trusted_entities_yaml
from fedge.protocols.config import EdgeConfig
from fedge.protocols.signing import PublicKey

log = logging.getLogger(__name__)


def supernode_spec(
    settings: AgentSettings,
    config: EdgeConfig | None,
    counters: Counter[str],
    *,
    app_keys: Sequence[PublicKey],
) -> SupernodeSpec | None:
    """The SuperNode to run while ``config`` enables training; ``None`` otherwise.

    It runs only apps signed by ``app_keys``, the manager keys this agent trusts
    (issue 24): Flower's SuperNode verifies each app's signature before any of it runs."""
    policy = None if config is None else config.training
    if policy is None or not policy.enabled:
        return None
    if not settings.superlink:
        counters["training.no_superlink"] += 1
        log.error("training is enabled but agent.toml names no superlink; not training")
        return None
    tls = settings.tls()
    return SupernodeSpec(
        superlink=settings.superlink,
        edge=settings.edge,
        data_dir=settings.data_dir,
        holdout_percent=settings.holdout_percent,
        threads=policy.threads,
        max_seconds=policy.max_minutes * 60.0,
        # TLS to the SuperLink, signing with the station's own key (node auth).
        root_certificates=None if tls is None else tls.ca,
        auth_key=None if tls is None else tls.key,
        trusted_entities=trusted_entities_yaml(*app_keys),
        privacy_floor=settings.privacy_floor is not None,
    )
