"""setuptools build hook: every build of kvtierd generates its gRPC stubs.

The metadata lives in ``pyproject.toml``; this file only swaps in a ``build_py``
that runs ``tools/gen_stubs.py`` (grpcio-tools is a build requirement, pinned in
``[build-system].requires``). Because it runs from ``build_py``, a wheel built
from a checkout, from a git URL or from the sdist (which carries ``proto/`` and
``tools/``, never generated code) all hold ``kvtierd_client/_proto``:

* a wheel: the stubs are written into ``build_lib`` after the sources are
  copied, so stale stubs of a checkout are never what ships;
* an editable install (``pip install -e .``, ``make install``): they are written
  into the source tree, where the editable finder imports them from.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "tools"))

from gen_stubs import STUB_PACKAGE, generate  # noqa: E402


class BuildPyWithStubs(build_py):
    """``build_py``, then the stubs into the package ``STUB_PACKAGE``."""

    def run(self) -> None:
        super().run()
        written = generate(self._stub_dir(), HERE / "proto")
        self._generated = [str(path) for path in written]

    def _stub_dir(self) -> Path:
        parent, _, name = STUB_PACKAGE.rpartition(".")
        if self.editable_mode:
            return HERE / self.get_package_dir(parent) / name
        return Path(self.build_lib, *parent.split("."), name)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        return outputs + getattr(self, "_generated", [])


setup(cmdclass={"build_py": BuildPyWithStubs})
