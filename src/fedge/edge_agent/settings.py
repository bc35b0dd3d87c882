"""agent.toml, read once at start-up into a typed object.

fleet = "plant-a"
edge = "st-01"
data_dir = "/var/lib/fedge/st-01"
broker_host = "10.0.0.5"
broker_port = 8883
ca_file = "/etc/fedge/st-01/ca.crt"          # the fleet CA (mutual TLS to broker, gRPC,
cert_file = "/etc/fedge/st-01/agent.crt"     # SuperLink); written by `fedge agent enroll`,
key_file = "/etc/fedge/st-01/agent.key"      # the key made on the device, 0600
# insecure = true + password = "..." (or password_file): plain TCP, development only
grpc_target = "10.0.0.5:50551"    # default; a deployment may name another
manager_public_key = "base64..."  # pinned Ed25519 key of the manager
manager_root_key = "base64..."    # the fleet's offline root key, if it has one: then a
                                  # key rotation must carry its signature (issue 24)
desired_stale_after_days = 14.0   # report (and log) the desired state stale when no
                                  # signed refresh came for this long (a freeze attack)
watch_dir = "/var/lib/fedge/st-01/inbox"   # optional
http_port = 8470                  # optional local API on 127.0.0.1, 0 = off; it also
                                  # answers /metrics, /healthz and /readyz (issue 27)
heartbeat_s = 2.5                 # the birth repeated (MQTT QoS 0, or gRPC): the manager
                                  # marks a station silent for 7 s lost; 0 = off on MQTT
superlink = "10.0.0.5:9092"       # the fleet's Flower SuperLink (stations that train)
image_port = 8471                 # optional: serve kept images to the manager's certificate
image_host = "10.0.0.21"          # over mutual TLS, only while the station's signed config
                                  # allows operator viewing (issue 30); 0 = off (default).
                                  # image_address: host:port the manager reaches it at
                                  # (default image_host:image_port)

# Where MQTT is blocked: records over gRPC (ReportUpload) with report_via = "grpc", which
# also polls configs, deployments and labels over gRPC (DesiredSync) all the time; with
# "mqtt" they are polled once MQTT has been down grpc_fallback_after_s (0 = never).
report_via = "mqtt"
grpc_fallback_after_s = 60.0
grpc_poll_interval_s = 5.0

# ONNX Runtime's accelerators, in order, each where this machine's build offers it; the
# CPU is always last (`fedge agent status`'s execution_provider says which one serves).
execution_providers = ["CUDAExecutionProvider"]

# The station's training set: scored images kept on the device with their labels
# (they never leave it). Oldest first out once any limit is reached; 0 keeps none.
# The inbox's done/ and failed/ folders are pruned to keep_images files and keep_days
# too (at least 100 files and a day), checked every minute.
keep_images = 5000
keep_bytes = 536870912            # 512 MiB
keep_days = 30.0
holdout_percent = 20              # share kept for local evaluation, never trained on

# A long outage: telemetry is not recorded while the outbox holds this many batches or
# more (predictions and labels always are; the station's disk is their only limit).
telemetry_backlog_limit = 2000

# A newly deployed model's probation (fedge.edge_agent.deploy.probation_verdict): its first
# probation_images images or probation_s seconds, whichever comes first. It is rolled
# back to the previous model if more than probation_max_error_rate of its images fail,
# its p95 latency is over the manifest's latency budget, a score is NaN, or its defect
# scores stop varying (std < probation_min_spread) where the previous model's varied.
# Fewer than probation_min_images images by the end of the time: it passes. A model
# the agent was restarted with more than probation_max_restarts times while it was on
# probation (a crash in inference) is rolled back at the next start.
probation_images = 50
probation_s = 600.0
probation_min_images = 10
probation_max_error_rate = 0.05
probation_min_spread = 0.001
probation_max_restarts = 3

# The station's privacy floor (issue 24): the least privacy it trains with, whatever a
# job or the manager says. The agent writes it into the station's privacy ledger at every
# start; the manager's signed budget can only tighten it. Without this table the default
# floor applies (delta 1 / (10 x keep_images)); `privacy_floor = "none"` opts out
# (rounds without DP-SGD are then accepted), which `fedge edge show` reports.
[privacy_floor]
mode = "local"                    # DP-SGD on the station; the only floor there is
job_epsilon = 8.0                 # the most one job may spend here
lifetime_epsilon = 16.0           # the most every job together may spend here
delta = 2e-05
min_noise_multiplier = 0.5
evaluations_per_job = 16          # evaluations of the server's weights per job (noised)
evaluation_noise = 20.0           # std of the noise on an evaluation's correct count
"""

import tomllib
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from fedge.edge_agent.deploy.probation_verdict import ProbationPolicy
from fedge.edge_agent.errors import SettingsError
from fedge.party.station_store import Retention
from fedge.privacy.floor import NO_FLOOR, PrivacyFloor, default_floor
from fedge.privacy.settings import PrivacyError
from fedge.protocols import validate
from fedge.protocols.errors import ProtocolError
from fedge.protocols.pki import TlsFiles
from fedge.protocols.signing import PublicKey
from fedge.protocols.viewing import check_address
from fedge.transport.session import MqttSettings


@dataclass(frozen=True)
class AgentSettings:
    fleet: str
    edge: str
    data_dir: Path
    broker_host: str
    broker_port: int
    grpc_target: str
    manager_public_key: str
    # The fleet's offline root key, pinned at enrollment when the fleet has one: a key
    # rotation is then followed only with its signature too (protocols/rotation.py).
    manager_root_key: str | None = None
    # Desired documents carry an expiry the manager refreshes (protocols/freshness.py):
    # no refresh for this long and the station reports its desired state stale.
    desired_stale_after_days: float = 14.0
    # Mutual TLS (issue 13): the fleet CA, this station's certificate and its key (made on
    # the device by `fedge agent enroll`). Relative paths are from agent.toml's folder.
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    # Where the certificate is renewed (the manager's enrollment endpoint, https://...).
    enroll_url: str = ""
    # Plain TCP with a password, for development only; never the default.
    insecure: bool = False
    password: str = field(default="", repr=False)
    watch_dir: Path | None = None
    http_port: int = 0
    image_size: int = 32
    flush_interval_s: float = 0.2
    # "mqtt", or "grpc" for sites where MQTT is blocked (records go over ReportUpload).
    report_via: str = "mqtt"
    # The accelerators ONNX Runtime may serve with, in order of preference (issue 25), each
    # used where this machine's ONNX Runtime build offers it; the CPU is always last.
    execution_providers: tuple[str, ...] = ("CUDAExecutionProvider",)
    # Desired documents (and status reports) over gRPC once MQTT has been down this long
    # (issue 9); 0 = never. report_via = "grpc" polls them all the time.
    grpc_fallback_after_s: float = 60.0
    grpc_poll_interval_s: float = 5.0
    # The birth repeated this often, so the manager sees a cut within seconds (issue 27,
    # edge_manager/fleet/liveness.py); 0: not over MQTT (its will still says lost).
    heartbeat_s: float = 2.5
    superlink: str = ""
    # Kept images served on demand to the manager's certificate (edge_agent/viewing/):
    # 0 = off. image_address is what the birth tells the manager (host:port).
    image_port: int = 0
    image_host: str = "127.0.0.1"
    image_address: str = ""
    keep_images: int = 5000
    keep_bytes: int = 512 * 2**20
    keep_days: float = 30.0
    holdout_percent: int = 20
    # During a long outage telemetry stops being recorded once the outbox holds this
    # many batches; predictions and labels are always kept (they are the data).
    telemetry_backlog_limit: int = 2000
    # A new model's probation after activation (see fedge.edge_agent.deploy.probation_verdict).
    probation_images: int = 50
    probation_s: float = 600.0
    probation_min_images: int = 10
    probation_max_error_rate: float = 0.05
    probation_min_spread: float = 0.001
    probation_max_restarts: int = 3
    # The station's own privacy floor; None: its operator opted out (privacy_floor = "none").
    privacy_floor: PrivacyFloor | None = field(default_factory=PrivacyFloor)

    def tls(self) -> TlsFiles | None:
        """The station's TLS files, or None in development (``insecure = true``)."""
        if self.insecure:
            return None
        if self.ca_file is None or self.cert_file is None or self.key_file is None:
            raise SettingsError(
                "ca_file, cert_file and key_file are required (mutual TLS); enrol with "
                "`fedge agent enroll`, or set insecure = true for a development broker"
            )
        return TlsFiles(ca=self.ca_file, cert=self.cert_file, key=self.key_file)

    def public_key(self) -> PublicKey:
        return PublicKey.from_text(self.manager_public_key)

    def root_key(self) -> PublicKey | None:
        return None if self.manager_root_key is None else PublicKey.from_text(self.manager_root_key)

    def probation_policy(self) -> ProbationPolicy:
        return ProbationPolicy(
            images=self.probation_images,
            seconds=self.probation_s,
            min_images=self.probation_min_images,
            max_error_rate=self.probation_max_error_rate,
            min_spread=self.probation_min_spread,
            max_restarts=self.probation_max_restarts,
        )

    def retention(self) -> Retention:
        """What the station keeps of what it scores, for training (its own images)."""
        return Retention(
            max_images=self.keep_images,
            max_bytes=self.keep_bytes,
            max_age_s=self.keep_days * 86400.0,
            holdout_percent=self.holdout_percent,
        )

    def mqtt(self) -> MqttSettings:
        return MqttSettings(
            host=self.broker_host,
            port=self.broker_port,
            client_id=self.edge,
            # Under TLS the broker takes the name from the certificate.
            username=self.edge if self.insecure else None,
            password=self.password if self.insecure else None,
            tls=self.tls(),
            # Clean start: desired documents are retained, so a reconnecting edge gets
            # exactly the latest of each; a persistent session would also replay every
            # version it missed. Up-going records do not need the broker's session: the
            # outbox resends whatever was not acknowledged.
            clean_start=True,
            session_expiry_s=0,
        )


def load_settings(path: Path) -> AgentSettings:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"{path} not found; create it with `fedge edge enroll`") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path} is not valid TOML: {exc}") from None
    if "password_file" in data:
        secret = Path(data.pop("password_file"))
        try:
            data["password"] = secret.read_text().strip()
        except OSError as exc:
            raise SettingsError(f"cannot read password_file {secret}: {exc}") from None
    known = {f.name for f in fields(AgentSettings)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SettingsError(f"{path}: unknown setting(s) {', '.join(unknown)}")
    required = [
        f.name
        for f in fields(AgentSettings)
        if f.default is MISSING and f.default_factory is MISSING
    ]
    missing = [name for name in required if name not in data]
    if missing:
        raise SettingsError(
            f"{path}: missing setting(s) {', '.join(missing)}; "
            "`fedge edge enroll` writes a complete agent.toml"
        )
    data["privacy_floor"] = _privacy_floor(path, data)
    if "execution_providers" in data:
        data["execution_providers"] = _providers(path, data["execution_providers"])
    for key in ("data_dir", "watch_dir", "ca_file", "cert_file", "key_file"):
        if key in data:
            data[key] = (path.parent / data[key]).resolve()
    try:
        settings = AgentSettings(**data)
        validate.identifier(settings.fleet, "fleet")
        validate.identifier(settings.edge, "edge")
        settings.public_key()
        settings.root_key()
        if not settings.desired_stale_after_days > 0:
            raise SettingsError(f"{path}: desired_stale_after_days must be > 0")
        settings.probation_policy()
        _check_credentials(settings, path)
        if settings.report_via not in ("mqtt", "grpc"):
            raise SettingsError(f"{path}: report_via must be 'mqtt' or 'grpc'")
        if not 0 <= settings.image_port < 65536:
            raise SettingsError(f"{path}: image_port must be a port in 0..65535 (0 = off)")
        if settings.image_port and settings.insecure:
            raise SettingsError(
                f"{path}: image_port needs mutual TLS (the fleet's certificates); an "
                "insecure station serves no images"
            )
        if settings.image_address:
            check_address(settings.image_address)
        if not 0 <= settings.heartbeat_s <= 3600:
            raise SettingsError(f"{path}: heartbeat_s must be seconds in 0..3600 (0 = off)")
        if settings.grpc_fallback_after_s < 0 or settings.grpc_poll_interval_s <= 0:
            raise SettingsError(
                f"{path}: grpc_fallback_after_s must be >= 0 (0 = never) "
                "and grpc_poll_interval_s > 0"
            )
    except TypeError as exc:
        raise SettingsError(f"{path}: {exc}") from None
    except ProtocolError as exc:
        raise SettingsError(f"{path}: {exc}") from None
    return settings


KNOWN_PROVIDERS = frozenset(
    {
        "TensorrtExecutionProvider",
        "CUDAExecutionProvider",
        "ROCMExecutionProvider",
        "OpenVINOExecutionProvider",
        "DmlExecutionProvider",
        "CoreMLExecutionProvider",
        "CPUExecutionProvider",
    }
)


def _providers(path: Path, value: object) -> tuple[str, ...]:
    """agent.toml's ``execution_providers``: a list of ONNX Runtime provider names."""
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise SettingsError(
            f"{path}: execution_providers must be a list of ONNX Runtime provider names, "
            f'e.g. ["TensorrtExecutionProvider", "CUDAExecutionProvider"]'
        )
    unknown = sorted(set(value) - KNOWN_PROVIDERS)
    if unknown:
        raise SettingsError(
            f"{path}: unknown execution provider(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(KNOWN_PROVIDERS))})"
        )
    return tuple(value)


def _privacy_floor(path: Path, data: dict[str, object]) -> PrivacyFloor | None:
    """agent.toml's ``[privacy_floor]`` table, ``"none"`` (opted out), or the default floor
    for the station's keep_images when it says nothing."""
    value = data.get("privacy_floor")
    if value is None:
        keep = data.get("keep_images", 5000)
        return default_floor(keep if isinstance(keep, int) and not isinstance(keep, bool) else 5000)
    if value == NO_FLOOR:
        return None
    if not isinstance(value, dict):
        raise SettingsError(
            f'{path}: privacy_floor must be a [privacy_floor] table or "none" (opted out), '
            f"got {value!r}"
        )
    try:
        return PrivacyFloor.from_table(value)
    except PrivacyError as exc:
        raise SettingsError(f"{path}: {exc}") from None


def _check_credentials(settings: AgentSettings, path: Path) -> None:
    if settings.insecure:
        if not settings.password:
            raise SettingsError(f"{path}: insecure = true needs a password (or password_file)")
        return
    if settings.password:
        raise SettingsError(
            f"{path}: a password is only used with insecure = true; under mutual TLS the "
            "station is its certificate (remove the password)"
        )
    files = settings.tls()
    assert files is not None
    for what, file in (("ca_file", files.ca), ("cert_file", files.cert), ("key_file", files.key)):
        if not file.is_file():
            raise SettingsError(f"{path}: {what} {file} does not exist")
