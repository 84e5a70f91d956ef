"""Hypothesis profiles: ``fast`` (the default: 25 examples per property, derandomized so the
normal suite draws the same examples every run; a test may bound its own count with ``bounded``,
tests/test_schema.py) and ``deep`` (``HYPOTHESIS_PROFILE=deep``: a thousand random examples per
property, for a longer search)."""

import os

from hypothesis import settings

settings.register_profile("fast", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("deep", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))
