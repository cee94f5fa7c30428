"""The control plane: what every transport and the runtime use besides moving rows.

- :mod:`.plane`: :class:`ControlPlane`, one per Buffer: its host process group, the argument
  checks on it, the progress records, the text of a failed collective;
- :mod:`.agreement`: the argument checks' rows and verdicts (status codes, fields), and the
  agreement of ``Buffer()``'s own arguments through the store;
- :mod:`.progress`: which operation each rank has reached (progress marks), refusal texts,
  failure notes, and the diagnosis read from them;
- :mod:`.groups`: making, reusing and freeing process groups; a collective in flight;
- :mod:`.store`: torch.distributed's store, reached in bounded time.
"""

from .plane import ControlPlane

__all__ = ["ControlPlane"]
