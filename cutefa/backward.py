"""TRANSITION ONLY: the backward pass moved to :mod:`cutefa.api.backward`. This name is that module
itself (not a copy), so code that still imports ``cutefa.backward`` reads and replaces the same
attributes (``TAIL_SLOTS``, ``choose_bwd``). Deleted once nothing imports it."""

import sys

from cutefa.api import backward as _backward

sys.modules[__name__] = _backward
