"""The wheel holds the library alone: the tests beside the code (``*_test.py``) and their
shared helpers (``test_util.py``) stay out.

Everything else is in pyproject.toml; setuptools has no setting that leaves modules (rather
than data files) out of a package, hence this build step. The sdist keeps the tests.
"""

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithoutTests(build_py):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [
            (pkg, mod, path)
            for pkg, mod, path in modules
            if not (mod.endswith("_test") or mod == "test_util")
        ]


setup(cmdclass={"build_py": BuildPyWithoutTests})
