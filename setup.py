"""Packaging: the metadata lives in setup.cfg; here only what setup.cfg cannot say.

The device profiles and the systemd units are folders at the repository's top (beside docs/ and tools/);
the wheel carries them inside the package, each mapped to a data-only subpackage, where an installed
flowedge finds them (flowedge/shipped.py keeps the same table)."""
from setuptools import find_packages, setup

DATA_PACKAGES = {"flowedge.device_profiles": "device_profiles", "flowedge.systemd.units": "systemd"}

setup(packages=find_packages(include=["flowedge*"]) + list(DATA_PACKAGES), package_dir=DATA_PACKAGES)
