"""Settings for the whole test run.

Hypothesis draws the same examples on every run by default (derandomized, no example
database): `make test` must pass every time, and a property test that fails on one random
draw in N would fail CI that often while saying nothing about the change under test. To hunt
for new counterexamples, run `HYPOTHESIS_PROFILE=explore make test` (fresh draws each run);
a failure it finds becomes a deterministic test.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
