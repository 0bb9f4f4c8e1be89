"""cutefa.identity's import reading: the import statements it takes without parsing whole modules
are those the full parse finds, in every module a fingerprint or the render digest reads."""

from __future__ import annotations

import ast
from collections import Counter

import pytest

from cutefa import identity

FILES = sorted(
    [*identity.REPO_ROOT.joinpath("generated").rglob("*.py"), *identity.PACKAGE_DIR.rglob("*.py")]
)


def _full_parse(source: str) -> Counter:
    nodes = (n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return Counter(ast.dump(n, include_attributes=False) for n in nodes)


def test_every_module_is_read():
    assert len(FILES) > 300  # the generated modules and the package


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(identity.REPO_ROOT).as_posix())
def test_import_statements_are_the_full_parse(path):
    source = path.read_text()
    got = Counter(ast.dump(n, include_attributes=False) for n in identity.import_statements(source))
    assert got == _full_parse(source)


def test_strings_and_continuations():
    source = '''"""A docstring line that looks like one:
from cutefa.kernels.sm90 import nothing
"""
import os, sys
from cutefa.kernels.common import (
    a,
    b,  # a comment ) with a parenthesis
)
from cutefa.kernels.sm80 \\
    import parts


def f():
    if True:
        from cutefa.kernels.sm90.parts import x
x = "import re"
'''
    got = Counter(ast.dump(n, include_attributes=False) for n in identity.import_statements(source))
    # the docstring's line parses alone, so it is read as an import: only a superset of the full parse
    # for such a line; the generated modules and the package have none (the test above)
    full = _full_parse(source)
    assert full - got == Counter()
    assert sum(got.values()) == sum(full.values()) + 1
