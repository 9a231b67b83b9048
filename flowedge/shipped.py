"""Where the data that ships beside the code lives: the device profiles and the systemd units.

In a checkout they are folders at the repository's top (`device_profiles/`, `systemd/`), beside `docs/`
and `tools/`, since they are read and edited as documents as much as code. The wheel carries them inside
the package (setup.py maps each folder to a data-only subpackage), so an installed flowedge finds them
there. The package's copy wins when both could exist: an install never reads a stray folder beside it.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent

# the folder at the checkout's top -> where the wheel puts it, relative to the package (setup.py)
INSTALLED = {"device_profiles": "device_profiles", "systemd": "systemd/units"}


def shipped_dir(top: str) -> Path:
    """The folder `top` (a key of INSTALLED): the installed package's copy, else the checkout's."""
    inside = PACKAGE / INSTALLED[top]
    return inside if inside.is_dir() else CHECKOUT / top
