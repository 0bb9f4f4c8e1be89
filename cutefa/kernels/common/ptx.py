"""Inline PTX shared by the building blocks: one statement, either free of side effects
(:func:`pure_asm`) or kept where it is written (:func:`effect_asm`)."""

from cutlass._mlir.dialects import llvm


def _inline_asm(result_type, operands: list, asm: str, constraints: str, side_effects: bool, loc, ip):
    return llvm.inline_asm(
        result_type,
        operands,
        asm,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def pure_asm(result_type, operands: list, asm: str, constraints: str, *, loc=None, ip=None):
    """The result (an MLIR value of ``result_type``) of the inline PTX ``asm`` on ``operands`` (MLIR
    values; ``$0`` is the result, ``$1``... the operands, typed by ``constraints`` such as
    ``"=r,f,f"``). Marked free of side effects, so the compiler may merge, move or drop it like any
    arithmetic. Called from a ``dsl_user_op``, which passes its ``loc``/``ip`` and wraps the value in
    its DSL type."""
    return _inline_asm(result_type, operands, asm, constraints, False, loc, ip)


def effect_asm(result_type, operands: list, asm: str, constraints: str, *, loc=None, ip=None):
    """The inline PTX ``asm`` on ``operands`` as :func:`pure_asm`, but marked with side effects: the
    compiler keeps it, once, where it is written (a store, a reduction, or a value pinned at this
    point). ``result_type`` None: a statement with no result (``$0``... are then the operands);
    ``~{memory}`` in ``constraints`` also orders it against memory accesses."""
    return _inline_asm(result_type, operands, asm, constraints, True, loc, ip)
