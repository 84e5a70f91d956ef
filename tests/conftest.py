"""Suite-wide pytest configuration.

With pytest-xdist (``scripts/test.sh`` runs ``-n 2 --dist loadgroup``), every test marked
``engine`` (it starts the real Flower engine: Ray simulation, a SuperLink and SuperNodes) joins one
xdist group, so those tests run one after another on a single worker: never two engines at once on
a 2-core machine, never two SuperLinks competing for the same ports. The other worker takes the
unit and in-process tests meanwhile (the engine tests spend much of their time waiting on
processes: SuperLink start-up, heartbeats, Ray start-up).
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the group marker into the scheduling key
def pytest_collection_modifyitems(config, items):
    """Put every ``engine``-marked test into the xdist group ``engine`` (see the module docstring)."""
    for item in items:
        if item.get_closest_marker("engine") is not None:
            item.add_marker(pytest.mark.xdist_group("engine"))
