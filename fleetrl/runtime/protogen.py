"""Generate the Python gRPC stubs in fleetrl/proto from protos/.

`python -m fleetrl.runtime.protogen` regenerates them; `--check` exits 1 when
the committed stubs differ from what the .proto files produce (CI runs it
through a test). protoc writes imports as `from fleetrl.v1 import x_pb2`; they
are rewritten to `fleetrl.proto.fleetrl.v1` so the stubs import without any
sys.path changes.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "fleetrl" / "proto"
_IMPORT_RE = re.compile(r"^from fleetrl\.v1 import", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto under protos/ into out_dir; return the files written."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    written = []
    for path in sorted(out_dir.rglob("*.py*")):
        if path.suffix in (".py", ".pyi"):
            path.write_text(_IMPORT_RE.sub("from fleetrl.proto.fleetrl.v1 import", path.read_text()))
            written.append(path)
    for pkg in (out_dir, out_dir / "fleetrl", out_dir / "fleetrl" / "v1"):
        (pkg / "__init__.py").touch()
    return written


def stale_files() -> list[str]:
    """Stub files whose committed text differs from freshly generated text."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.relative_to(tmp): p.read_text() for p in generate(Path(tmp))}
    committed = {p.relative_to(OUT_DIR): p.read_text() for p in OUT_DIR.rglob("*_pb2*.py*")
                 if p.suffix in (".py", ".pyi")}  # not __pycache__'s .pyc (a `python -I` child writes them)
    names = set(fresh) | set(committed)
    return sorted(str(n) for n in names if fresh.get(n) != committed.get(n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: fleetrl/proto/{name}", file=sys.stderr)
        return 1 if stale else 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for path in generate(OUT_DIR):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
