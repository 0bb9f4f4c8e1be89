"""TRANSITION ONLY: the variant model moved to :mod:`cutefa.model.spec`; this module re-exports it
until every import names the new place."""

from cutefa.model.spec import *  # noqa: F403
from cutefa.model.spec import (  # noqa: F401
    _FAMILY_CC,
    _FAMILY_TARGET_CCS,
    _TARGET_CC,
    ARCHS,
    DEFAULT_TARGET,
    DIRECTIONS,
    DTYPES,
    HEAD_DIMS,
    TARGETS,
    TORCH_DTYPE_NAMES,
    VariantSpec,
    families_for_target,
    parse_name,
    target_cc,
    target_for_capability,
)
