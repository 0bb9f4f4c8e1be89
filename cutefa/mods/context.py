"""What a kernel template sees of a mod variant (:class:`cutefa.mods.variant.ModVariantSpec`): the
``mods`` entry of its jinja context, absent for every other spec (so their contexts and kernels stay
as they were; a template that fuses mods starts with ``{% set mods = mods if mods is defined else
none %}``)."""

from __future__ import annotations

from typing import Any

from cutefa.mods.kernel_source import FUNCTION, P_GRAD_FUNCTION, P_GRAD_SOURCE, tensor_params


def mods_context(spec: Any) -> dict[str, Any]:
    """``{"mods": {"source", "p_grad", "p_grad_function", "p_grad_source", "function", "tensors",
    "fake_tensors", "block_sparse", "base_name", "describe"}}`` of ``spec``'s mods; ``{}`` for a
    spec without mods."""
    mods = getattr(spec, "mods", None)
    if mods is None:
        return {}
    names = tensor_params(len(mods.tensors))
    backward = spec.direction == "bwd"
    return {
        "mods": {
            # the backward's also writes d score_mod / d score (when not 1), scaling P for dS
            "source": mods.grad_source if backward else mods.source,
            "p_grad": backward and mods.needs_grad,
            "p_grad_function": P_GRAD_FUNCTION,
            "p_grad_source": P_GRAD_SOURCE,
            "function": FUNCTION,
            "tensors": names,
            # (parameter, "Float32" | "Int32", rank, rank - 1) of each captured tensor, for fake_arguments
            "fake_tensors": [
                (n, "Float32" if kind == "f" else "Int32", rank, rank - 1)
                for n, (kind, rank) in zip(names, mods.kinds)
            ],
            "block_sparse": spec.block_sparse,
            "base_name": spec.base.name,
            "describe": mods.describe(),
        }
    }
