"""The root of fedge's exception tree.

Every package has one base class that derives from :class:`FedgeError` (bottom layer
first; ``tests/test_errors.py`` checks that every class a package defines is under it)::

    FedgeError
    ├── protocols.errors.ProtocolError       what arrived on the wire is not acceptable
    │   ├── DecodeError                       malformed, wrongly typed, unknown field, bad schema
    │   │   └── OversizedError                over the size limit, rejected before parsing
    │   ├── ValidationError                   well-formed but a value is out of range
    │   └── SignatureError                    forged, tampered or signed by an unpinned key
    ├── datasets.errors.DatasetError         a generated data set cannot be made or split
    │   └── tables.UnknownDataset             a data set name that is not one of DATASETS
    ├── transport.errors.TransportError      the broker or the network failed
    │   ├── BrokerError                       our local Mosquitto would not configure or start
    │   └── transport.grpc.client.*Error      Download/Upload/SyncError of the gRPC client
    ├── models.errors.ModelsError            a model cannot be built, distilled or exported
    │   ├── digits.ModelError                 unknown architecture, arrays that do not fit
    │   ├── inspection.ModelExportError       ONNX export failed or disagrees with torch
    │   ├── distill.ProxyError                an unusable proxy set (also a ValueError)
    │   └── distill.DistillExportError        the student's export failed or disagrees
    ├── students.errors.StudentError         a student cannot be made from its teacher
    │   ├── edge.TeacherError                 a teacher file or spec that cannot be read
    │   └── inspection.TeacherModelError      a model that cannot serve as the teacher
    ├── privacy.settings.PrivacyError        a privacy setting or budget forbids what was asked
    │   └── BudgetExhaustedError              a round would spend past a job's or lifetime epsilon
    ├── party.errors.PartyError              a party cannot train: its data or model family
    │   ├── StationDataError                  kept images or labels missing, unsafe, unreadable
    │   ├── FamilyError                       unknown model family, weights that do not fit
    │   ├── preprocess.ImageError             an unreadable or oversized image (a ValueError)
    │   ├── secagg.SecAggPartyError           a SecAgg+ message or reply that cannot be translated
    │   └── sim.party_inputs.PartyConfigError a simulated party's unusable run/node config
    ├── aggregator.errors.AggregatorError    a strategy, job or checkpoint cannot be used
    │   ├── strategies.factory.StrategyConfigError unknown strategy kind or parameter, a bad value
    │   ├── strategies.nested.NestingError   a tier architecture not a slice of the global model
    │   ├── jobs.spec.ManifestError           a job manifest missing, malformed, out of range
    │   ├── jobs.checkpoint.CheckpointError  a checkpoint cannot be written, read or applied
    │   └── jobs.directory.JobError           a job cannot start, resume or halt, or it failed
    │       ├── BusyError                     another process holds the job's lock
    │       └── superlink.SuperLinkError      the fleet's SuperLink process would not run
    ├── edge_manager.errors.ManagerError     registry, store, fleet, gate and rollout operations
    │   ├── UnknownEdgeError, UnknownModelError, RegistryError
    │   └── GatePolicyError, RolloutError, NoVerdictError, AlreadyRunningError, ...
    ├── edge_agent.errors.AgentError         the device side (config, model swap, inference)
    │   ├── SettingsError, DeployError, StorageError
    │   ├── InferenceError
    │   │   └── NotServingError               no model is serving yet
    │   └── evaluations.EvaluationFailed      a gate evaluation reported as failed
    ├── sim.errors.SimError                  a simulated federation cannot be set up or run
    │   ├── scenario.ScenarioError            a scenario file missing, malformed, out of range
    │   ├── server_app.ServerConfigError      the ServerApp's run config is unusable
    │   ├── report.ReportExistsError          a report is never overwritten
    │   └── profiles.SimulatedFailure         a simulated party missed its round (names kept:
    │       └── PartyUnavailableError,        error reasons from Flower's ClientApps are
    │           PartyDroppedOutError          recognised by class name)
    ├── console.errors.ConsoleError          the console cannot do something
    │   └── BadInput                          a form field malformed or tampered with
    ├── loop.errors.LoopError                continuous training cannot do what was asked
    │   └── policy.LoopPolicyError            an unusable loop policy
    ├── demo.errors.DemoError                the demo cannot run, or did not show its story
    │   └── StoryCheckFailed                  a chapter's figures missed the README's bound
    └── bench.testbed.BenchError             a benchmark could not set up, or a helper failed

Deliberately outside it: control-flow signals that never escape (``_Halted``), the
bench's simulated party crash (``bench.secagg_apps.PartyKilledError``) and a caller's bug
(``loop.pipeline.PipelineError``), which must end in a traceback, not a red line.

Third-party errors are translated at the adapter that calls the library
(``raise ModelLoadError(...) from exc``); only the CLI turns errors into exit codes.
"""


class FedgeError(Exception):
    """Base of every error fedge raises on purpose."""
