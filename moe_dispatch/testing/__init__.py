"""Helpers for tests and benchmarks: :mod:`.launch` (``spawn_world``, ``launch_ranks``),
:mod:`.loopback` (the kernels' loopback harnesses ``Loopback`` and ``InternodeLoopback``),
:mod:`.routing` (seeded routing presets), :mod:`.cases` (dispatch/combine cases checked against
the oracle), :mod:`.models` (the Megatron-Core configuration of small MoE models) and
:mod:`.resources` (what a process holds, for leak checks)."""
