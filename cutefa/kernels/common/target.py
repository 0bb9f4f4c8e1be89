"""What the target being compiled for has, asked while tracing (the same module compiles for
several targets: the sm80 family for sm_80, sm_86, sm_89 and sm_90a)."""

from cutlass.base_dsl import BaseDSL


def sm90_or_newer() -> bool:
    """Whether the target being compiled for is sm_90 or newer (programmatic dependent launch, the
    16-byte fp32 reductions)."""
    return BaseDSL._get_dsl().get_arch_enum().major >= 9
