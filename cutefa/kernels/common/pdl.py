"""Programmatic dependent launch (PDL, sm_90 and newer) between two kernels of one module.

A kernel launched with ``use_pdl=True`` may start before the kernel ahead of it on the stream has
finished: as soon as every CTA of that one has executed ``griddepcontrol.launch_dependents`` (or
exited). Its launch and prologue then overlap the first kernel's tail. It must execute
``griddepcontrol.wait`` before it reads anything the first kernel writes: the wait returns once that
grid has completed and its memory is visible, so a wait at the top of the dependent kernel keeps
the pair exactly as ordered as two plain launches.

The sm80 family also compiles for sm_80, sm_86 and sm_89, which have neither instruction: there the
helpers emit nothing and :func:`supported` is False, so the launch is a plain one. Chosen while
tracing, from the target being compiled for.
"""

import cutlass.cute as cute

from cutefa.kernels.common.target import sm90_or_newer


def supported() -> bool:
    """Whether the target being compiled for has programmatic dependent launch (sm_90 and newer):
    the value for a dependent kernel's ``launch(use_pdl=...)``."""
    return sm90_or_newer()


def launch_dependents():
    """In the first kernel: let the next kernel on the stream (launched with ``use_pdl``) start
    its CTAs now. Correctness never depends on where this is called."""
    if supported():
        cute.arch.griddepcontrol_launch_dependents()


def wait_primary():
    """In the dependent kernel, before its first read of what the kernel ahead of it writes: wait
    until that grid has completed and its writes are visible (no wait without PDL)."""
    if supported():
        cute.arch.griddepcontrol_wait()
