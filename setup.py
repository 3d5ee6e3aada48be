"""The build step pyproject.toml leaves to setuptools: build the C library with build.sh and
ship it, with the header its bindings are read from, inside the utensil_ffi package.

The wheel is platform-specific (py3-none-<platform>): the package holds a native library but no
CPython extension, so one wheel serves every Python 3 on a platform.
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent


class build_py_with_library(build_py):
    """build_py, then ./build.sh, then the .so and the header copied into the package."""

    def run(self):
        super().run()
        build_dir = Path(os.environ.get("BUILD_DIR", "build"))
        if not build_dir.is_absolute():
            build_dir = ROOT / build_dir
        env = dict(os.environ, BUILD_DIR=str(build_dir))
        subprocess.run(["bash", str(ROOT / "build.sh"), "lib"], cwd=ROOT, env=env, check=True)
        dest = Path(self.build_lib) / "utensil_ffi"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build_dir / "libutensil.so", dest / "libutensil.so")
        shutil.copy2(ROOT / "native" / "utensil.h", dest / "utensil.h")


class BinaryDistribution(Distribution):
    """A distribution with a native library: installed to platlib (the wheel's root), which
    auditwheel requires to make it a manylinux wheel."""

    def has_ext_modules(self):
        return True


class bdist_wheel_platform(bdist_wheel):
    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(distclass=BinaryDistribution,
      cmdclass={"build_py": build_py_with_library, "bdist_wheel": bdist_wheel_platform})
