"""Helpers for tests and benchmarks: :mod:`.launch` (``spawn_world``, ``launch_ranks``) and
:mod:`.routing` (seeded routing presets)."""
