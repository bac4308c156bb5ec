"""Regenerate the committed protobuf/gRPC modules from expert.proto: `python -m swarm.proto.regen`.

protoc names the generated modules after the .proto's path relative to its include root, and the
gRPC module imports the message module by that path. Generating from a staging dir laid out as
swarm/proto/expert.proto makes that import `from swarm.proto import expert_pb2`, which is where the
package lives. tests/test_proto.py checks that regenerating changes nothing.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("expert.proto",)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generated_names() -> list[str]:
    return [Path(p).stem + s for p in PROTO_FILES for s in GENERATED_SUFFIXES]


def generate(out_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc (from grpcio-tools) on PROTO_FILES, writing the generated modules into out_dir."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "src"
        pkg = stage / "swarm" / "proto"
        pkg.mkdir(parents=True)
        for name in PROTO_FILES:
            shutil.copyfile(PROTO_DIR / name, pkg / name)
        gen = Path(tmp) / "gen"
        gen.mkdir()
        args = [
            "grpc_tools.protoc",
            f"-I{stage}",
            f"--python_out={gen}",
            f"--pyi_out={gen}",
            f"--grpc_python_out={gen}",
            *(f"swarm/proto/{name}" for name in PROTO_FILES),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc} (args: {' '.join(args)})")
        written = []
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in generated_names():
            shutil.copyfile(gen / "swarm" / "proto" / name, out_dir / name)
            written.append(out_dir / name)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR):
        print(path)
