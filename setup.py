"""Generates the gRPC stubs from proto/ at build time (they are never committed).

They are generated before setup() runs, so that their package, specsplit.v1, is there when
setuptools looks for packages (pyproject.toml's packages.find; egg_info, build_py and editable
installs alike): generated later, during build_py, it was installed as data with a "Package
'specsplit.v1' is absent from the `packages` configuration" warning.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from setuptools import setup
from setuptools.warnings import InformationOnly

# An editable install of this flat layout (five top-level packages) goes through setuptools'
# import finder, which announces itself on every install with an "Editable installation." notice
# (InformationOnly: nothing to act on), shown by pip as a warning.
warnings.filterwarnings("ignore", "Editable installation", InformationOnly)

ROOT = Path(__file__).parent


def generate_stubs() -> None:
    from grpc_tools import protoc  # build-time dependency (pyproject build-system.requires)

    proto_root = ROOT / "proto"
    protos = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        f"--pyi_out={ROOT}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    (ROOT / "specsplit" / "v1" / "__init__.py").touch()


if (ROOT / "proto").is_dir():  # an sdist without proto/ ships the stubs it was built with
    generate_stubs()
setup()
