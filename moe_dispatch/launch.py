"""Public path of the world launchers: :mod:`moe_dispatch.testing.launch`."""

from .testing.launch import launch_ranks, retain_freed_memory, spawn_world

__all__ = ["launch_ranks", "retain_freed_memory", "spawn_world"]
