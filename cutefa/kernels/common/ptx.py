"""Inline PTX shared by the building blocks: one statement with no side effects."""

from cutlass._mlir.dialects import llvm


def pure_asm(result_type, operands: list, asm: str, constraints: str, *, loc=None, ip=None):
    """The result (an MLIR value of ``result_type``) of the inline PTX ``asm`` on ``operands`` (MLIR
    values; ``$0`` is the result, ``$1``... the operands, typed by ``constraints`` such as
    ``"=r,f,f"``). Marked free of side effects, so the compiler may merge, move or drop it like any
    arithmetic. Called from a ``dsl_user_op``, which passes its ``loc``/``ip`` and wraps the value in
    its DSL type."""
    return llvm.inline_asm(
        result_type,
        operands,
        asm,
        constraints,
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
