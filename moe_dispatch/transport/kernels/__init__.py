"""``Buffer(transport="kernels")``: the ``moe_dispatch._C`` kernels. :mod:`.transport` holds
:class:`KernelTransport`, the front door; the other modules are the layers below it."""

from .transport import KernelPlan, KernelTransport

__all__ = ["KernelPlan", "KernelTransport"]
