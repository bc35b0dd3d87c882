"""Read an ONNX model's input/output spec and metadata with ONNX Runtime (the adapter)."""

from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from fedge.edge_manager.errors import RegistryError
from fedge.protocols.manifest import TensorSpec

_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}


@dataclass(frozen=True)
class OnnxSpec:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    metadata: dict[str, str]


def _dims(shape: list[int | str | None]) -> tuple[int | str, ...]:
    return tuple(d if isinstance(d, int | str) else "?" for d in shape)


def read_spec(path: Path) -> OnnxSpec:
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own untyped errors for bad files
        raise RegistryError(f"{path} is not a loadable ONNX model: {exc}") from None

    def specs(args: list[ort.NodeArg]) -> tuple[TensorSpec, ...]:
        result = []
        for arg in args:
            dtype = _ORT_TYPES.get(arg.type)
            if dtype is None:
                raise RegistryError(f"{path}: tensor {arg.name!r} has unsupported type {arg.type}")
            result.append(TensorSpec(arg.name, dtype, _dims(arg.shape)))
        return tuple(result)

    meta = session.get_modelmeta().custom_metadata_map
    return OnnxSpec(specs(session.get_inputs()), specs(session.get_outputs()), dict(meta))
