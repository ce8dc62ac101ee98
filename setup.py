"""Package discovery, which pyproject.toml cannot express alone: every package under jaxserve/ and
pallas_kernels/ is found (a new subpackage cannot be left out of the wheel), and server/ installs
as ``jaxserve_server`` with its subpackages (a top-level ``server`` would collide). Namespace
discovery also finds the folders of data files without ``__init__.py`` (pallas_kernels.csrc, the
cpu kernel's C++ source; jaxserve.bench.targets, the GPU target descriptions)."""

from setuptools import find_namespace_packages, setup

NOT_PACKAGES = ["*.__pycache__", "__pycache__"]
packages = find_namespace_packages(include=["jaxserve", "jaxserve.*", "pallas_kernels", "pallas_kernels.*"],
                                   exclude=NOT_PACKAGES)
server = ["jaxserve_server", *(f"jaxserve_server.{p}" for p in find_namespace_packages("server", exclude=NOT_PACKAGES))]
setup(packages=packages + server, package_dir={"jaxserve_server": "server"})
