"""kvcore's pytest plugin (entry point ``pytest11``): assertion rewriting for :mod:`kvcore.testing`.

pytest rewrites ``assert`` only in test modules and in modules registered before they are
imported; the conformance kit lives in the installed package, so without this an author's
failing kit test showed a bare ``AssertionError``.  pytest loads ``pytest11`` plugins before
any test module, so the kit is registered in time.  Nothing else is done here.
"""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("kvcore.testing")
