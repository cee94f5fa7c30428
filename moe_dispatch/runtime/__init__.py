"""What runs a Buffer above its transport: :mod:`.arguments` (``Buffer()``'s arguments resolved
and agreed by every rank), :mod:`.transfers` (:class:`~.transfers.Transfers`: each operation's
plan, allocation, cross-rank check and transport call), :mod:`.queue` (the operation queue, its
events and receive hooks), :mod:`.calls` (one call's settings and routing) and :mod:`.autograd`
(dispatch and combine as each other's backward)."""
