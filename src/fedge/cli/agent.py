"""``fedge agent``: run the edge agent; label and score on the device."""

import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from fedge.cli.common import console, friendly_errors, print_json, setup_logging
from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.images import decode_image
from fedge.edge_agent.local_api import add_label, serve_local_api
from fedge.edge_agent.settings import load_settings
from fedge.edge_agent.watcher import watch

app = typer.Typer(help="The edge agent.", no_args_is_help=True)

ConfigOption = Annotated[Path, typer.Option("--config", help="agent.toml")]


@app.command()
@friendly_errors
def run(
    config: ConfigOption,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Connect, apply configs, take deployments, score images, report.

    Example: fedge agent run --config /etc/fedge/agent.toml
    """
    setup_logging(verbose)
    settings = load_settings(config)
    agent = EdgeAgent(settings)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    agent.start()
    if settings.http_port:
        serve_local_api(agent, settings.http_port)
    if settings.watch_dir is not None:
        inbox = settings.watch_dir
        threading.Thread(target=watch, args=(agent, inbox, stop), daemon=True).start()
    console.print(f"agent {settings.edge} running (serving {agent.serving or 'nothing yet'})")
    stop.wait()
    agent.stop()


@app.command()
@friendly_errors
def label(
    prediction_id: str,
    label_value: Annotated[str, typer.Argument(metavar="LABEL")],
    config: ConfigOption,
    who: str = "operator",
) -> None:
    """Store an operator label on the device (kept for local training, reported up).

    Example: fedge agent label p-1f3a... scratch --config agent.toml
    """
    agent = EdgeAgent(load_settings(config))
    try:
        console.print(add_label(agent, prediction_id, label_value, who))
    finally:
        agent.store.close()


@app.command()
@friendly_errors
def score(image: Path, config: ConfigOption) -> None:
    """Score one image with the active model, offline, and record the prediction.

    Example: fedge agent score part-0042.png --config agent.toml
    """
    settings = load_settings(config)
    agent = EdgeAgent(settings)
    try:
        scored = agent.score(decode_image(image, settings.image_size), source=f"cli:{image.name}")
        print_json(
            {
                "prediction_id": scored.record.prediction_id,
                "decision": scored.record.decision,
                "scores": scored.record.scores,
            }
        )
    finally:
        agent.store.close()
