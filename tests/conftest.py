"""Hypothesis profiles: the normal suite's bounded examples (each test's own count), and
``HYPOTHESIS_PROFILE=deep`` for a longer search (``bounded`` in tests/test_schema.py takes its count)."""

import os

from hypothesis import settings

settings.register_profile("deep", max_examples=3000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
