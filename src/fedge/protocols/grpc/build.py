"""Regenerate the Python gRPC code from ``fedge.proto``.

Run as ``python -m fedge.protocols.grpc.build`` (``make setup`` does). Writes
``fedge_pb2.py``, ``fedge_pb2.pyi`` and ``fedge_pb2_grpc.py`` next to the proto.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

PROTO = Path(__file__).resolve().with_name("fedge.proto")
# The include root is ``src`` so the proto's path is ``fedge/protocols/grpc/fedge.proto``;
# protoc turns that into the absolute import ``from fedge.protocols.grpc import fedge_pb2``.
SRC_ROOT = PROTO.parents[3]


def protoc_args() -> list[str]:
    """The protoc command line, with paths taken from this file, never from the cwd."""
    # Well-known types (google/protobuf/*.proto) ship inside grpc_tools.
    wkt = resources.files("grpc_tools") / "_proto"
    return [
        "grpc_tools.protoc",
        f"-I{SRC_ROOT}",
        f"-I{wkt}",
        f"--python_out={SRC_ROOT}",
        f"--pyi_out={SRC_ROOT}",
        f"--grpc_python_out={SRC_ROOT}",
        str(PROTO),
    ]


# ruff's exclude in pyproject only covers the generated ``.py`` files; the stub
# would otherwise fail ``make lint`` on protoc's style, which we must not edit.
PYI_HEADER = "# ruff: noqa\n# fmt: off\n"


def _mark_stub_generated() -> None:
    pyi = PROTO.with_name("fedge_pb2.pyi")
    text = pyi.read_text()
    if not text.startswith(PYI_HEADER):
        pyi.write_text(PYI_HEADER + text)


def build() -> int:
    """Run protoc; returns its exit code (0 on success)."""
    from grpc_tools import protoc  # imported late: only needed at build time

    code = int(protoc.main(protoc_args()))
    if code == 0:
        _mark_stub_generated()
    return code


def main() -> None:
    code = build()
    if code != 0:
        print(f"protoc failed with exit code {code}", file=sys.stderr)
        raise SystemExit(code)
    print(f"generated gRPC code next to {PROTO}")


if __name__ == "__main__":
    main()
