"""Build hook: ship the vLLM patch series (``patches/``) inside the ratebench package.

The series lives at the repository root, where maintainers edit it; a wheel (and so
any non-editable install) gets a copy at ``ratebench/patches/``, which
``ratebench.patching.find_patch_dir`` finds when no source checkout is around.
Everything else is in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithPatches(build_py):
    def run(self):
        super().run()
        source = ROOT / "patches"
        if not (source / "vllm-0.32.0" / "series").is_file():
            raise SystemExit(f"ratebench build: no patch series under {source}; build from a full source tree")
        target = Path(self.build_lib) / "ratebench" / "patches"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.orig", "*.rej"))


setup(cmdclass={"build_py": BuildPyWithPatches})
