"""Hypothesis profiles: ``ci`` (the default: bounded and derandomized, for the normal suite) and ``deep``
(``HYPOTHESIS_PROFILE=deep python -m pytest tests/test_gates.py``: a longer search)."""

import os

from hypothesis import settings

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("deep", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
