"""What the station serves now: the model, the config in force, and the session it says so in.

One :class:`ServingState` per agent, handed to the parts that read or change it (issue
26: they used to reach the agent through lambdas). The scorer reads the model and the
config once per call; the deployments and the local rollback swap the model
(:meth:`ServingState.install`); the station's configs commit a config
(:meth:`ServingState.commit`); the publisher reads the config's batch size and report
interval and the session number its batches are sealed under; statuses and births name
the model served (:attr:`ServingState.ref`) and the config version applied.

Locking is the agent's, as before: :attr:`ServingState.lock` is held by whoever changes
what serves, around the store transaction that makes the change survive a restart and
the change itself, so no config is applied between a rollback's choice and its swap.
Readers take no lock: each read is one attribute, a consistent value (a caller that
needs the model and the config together reads each once and keeps them). The lock is
never held while calling into paho, gRPC or ONNX Runtime.
"""

import threading

from fedge.edge_agent.config.decisions import ThresholdsInForce, thresholds_in_force
from fedge.edge_agent.inference.runtime import LoadedModel
from fedge.protocols.config import EdgeConfig


class ServingState:
    def __init__(
        self,
        lock: threading.Lock,
        *,
        config: EdgeConfig | None = None,
        model: LoadedModel | None = None,
        session: int = -1,
    ) -> None:
        self.lock = lock
        self._model = model
        self._config = config
        # The MQTT session number: taken anew by every connection attempt's will (on
        # paho's network thread), carried by births, goodbyes and sealed batches. -1:
        # no session yet.
        self.session = session

    @property
    def model(self) -> LoadedModel | None:
        """The model serving now (None: none deployed yet)."""
        return self._model

    @property
    def config(self) -> EdgeConfig | None:
        """The config in force (None: none applied yet)."""
        return self._config

    @property
    def ref(self) -> str:
        """``name:version`` of the model serving now ("" when none serves)."""
        model = self._model
        return "" if model is None else model.ref

    @property
    def applied_version(self) -> int:
        """The version of the config in force (0: none applied yet)."""
        config = self._config
        return 0 if config is None else config.version

    def thresholds(self) -> ThresholdsInForce:
        """The thresholds in force for the serving model, and where they come from."""
        model, config = self._model, self._config
        return thresholds_in_force(config, None if model is None else model.manifest)

    def install(self, model: LoadedModel | None, config: EdgeConfig | None = None) -> None:
        """``model`` serves from now on, and ``config`` is in force unless None (a local
        rollback's: the config set for the model it goes back to). Called under
        :attr:`lock`, after the store transaction that makes the swap survive a restart
        (at start-up, before any other thread runs, without it)."""
        self._model = model
        if config is not None:
            self._config = config

    def commit(self, config: EdgeConfig) -> None:
        """``config`` is in force from now on. Called under :attr:`lock`, after the store
        transaction that keeps it."""
        self._config = config
