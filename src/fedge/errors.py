"""The root of fedge's exception tree.

Every package has one base class that derives from :class:`FedgeError`::

    FedgeError
    ├── protocols.errors.ProtocolError     what arrived on the wire is not acceptable
    │   ├── DecodeError                     malformed, wrongly typed, unknown field, bad schema
    │   │   └── OversizedError              over the size limit, rejected before parsing
    │   ├── ValidationError                 well-formed but a value is out of range
    │   └── SignatureError                  forged, tampered or signed by an unpinned key
    ├── edge_manager.errors.ManagerError   registry, store and fleet operations
    ├── edge_agent.errors.AgentError       the device side (config, model swap, inference)
    ├── aggregator.job_dir.JobError        a job cannot start, resume or halt, or it failed
    │   └── superlink.SuperLinkError        the fleet's SuperLink process would not run
    ├── party.errors.PartyError            a party cannot train: its data or model family
    │   ├── StationDataError                kept images or labels missing, unsafe, unreadable
    │   └── FamilyError                     unknown model family, weights that do not fit
    └── privacy.settings.PrivacyError      a privacy setting or budget forbids what was asked
        └── BudgetExhaustedError            a round would spend past a job's or lifetime epsilon

Third-party errors are translated at the adapter that calls the library
(``raise ModelLoadError(...) from exc``); only the CLI turns errors into exit codes.
"""


class FedgeError(Exception):
    """Base of every error fedge raises on purpose."""
