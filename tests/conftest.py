"""Settings every test file shares: the report header says whether the compile tests check their
fixed sample of each family's variants or every variant (CUTEFA_FULL_COMPILE_TESTS=1)."""

from __future__ import annotations

from cpu_support import FULL_COMPILE_TESTS


def pytest_report_header(config):
    if FULL_COMPILE_TESTS:
        return "compile tests: every variant (CUTEFA_FULL_COMPILE_TESTS=1)"
    return "compile tests: a fixed sample of each family's variants (CUTEFA_FULL_COMPILE_TESTS=1: every variant)"
