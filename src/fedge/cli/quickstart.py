"""``fedge quickstart``: a starter model and sample part images for the walkthrough."""

from pathlib import Path
from typing import Annotated

import typer

from fedge.cli.common import console, friendly_errors


@friendly_errors
def quickstart(
    out: Annotated[Path, typer.Option(help="Directory to write into.")] = Path("starter"),
    images: Annotated[int, typer.Option(help="Sample part images to generate.")] = 20,
    images_only: Annotated[
        bool,
        typer.Option("--images-only", help="Only the images (no torch needed, no model)."),
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed of the model's initial weights.")] = 0,
) -> None:
    """Write a starter inspection model (inspect.onnx + inspect.npz) and sample part images.

    The model is a small CNN trained on generated scratch/clean surfaces (about 10 s on
    2 cores; it needs torch: pip install 'fedge[train]'). The images are generated
    brushed-metal parts, half scratched, named part_00000.png ..., with their true classes
    in truth.csv; --images-only writes just those and works on an inference-only install.

    Example: fedge quickstart --out starter --images 20
    """
    from fedge.demo.quickstart import write_sample_parts

    if images < 1:
        raise typer.BadParameter("must be >= 1", param_hint="--images")
    if not images_only:
        from fedge.demo.quickstart import train_starter_model

        with console.status("training the starter CNN on generated surfaces (torch)…"):
            model = train_starter_model(out / "inspect.onnx", seed=seed)
        console.print(
            f"model    {model.onnx_path} (weights {model.weights_path.name}): held-out "
            f"accuracy {model.held_out_accuracy:.3f} on {model.held_out_images} generated "
            f"images; trained in {model.train_seconds:.0f} s",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    parts = write_sample_parts(out / "parts", images)
    console.print(
        f"images   {len(parts.images)} in {parts.directory} "
        f"({parts.images[0].name} ...; true classes in {parts.truth_csv.name})",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
