"""Makes the flex dispatcher backend "custom" work in Megatron-Core and Megatron-Bridge without an
explicit ``import moe_dispatch.megatron``.

The wheel (and an editable install) puts ``moe_dispatch-autoload.pth`` into site-packages; Python
runs it at start-up, and it calls :func:`install` unless ``MOE_DISPATCH_AUTOLOAD=0``. ``import
moe_dispatch.megatron`` calls :func:`install` too, so without the start-up hook the explicit import
works as before. :func:`install` puts a finder on ``sys.meta_path`` that does nothing until one of
two modules is imported, and then wraps, right after the module has run and before anyone can bind
the names:

- ``MoELayer.__init__`` (``megatron.core.transformer.moe.moe_layer``): a layer whose config names
  ``moe_flex_dispatcher_backend="custom"`` imports ``moe_dispatch.megatron`` (which patches
  Megatron-Core: ``moe_dispatch.megatron.backend``) and is built by
  ``backend.build_moe_layer`` (config checks, delayed expert wgrads). Other layers run
  Megatron's code alone.
- Bridge's ``apply_flex_dispatcher_backend`` and ``validate_flex_dispatcher_backend``
  (``megatron.bridge.training.flex_dispatcher_backend``): for "custom" they run
  ``backend.bridge_apply`` / ``backend.bridge_validate``; other names reach Bridge's own code, which
  skips names it does not know with only a log line.

This module imports only the standard library: Python's start-up is not slowed, and every import
after it costs one string comparison.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading

BACKEND_NAME = "custom"
ENV_VAR = "MOE_DISPATCH_AUTOLOAD"
MOE_LAYER_MODULE = "megatron.core.transformer.moe.moe_layer"
BRIDGE_MODULE = "megatron.bridge.training.flex_dispatcher_backend"
PATCHED_FLAG = "_moe_dispatch_patched"

_LOCK = threading.Lock()


def names_backend(config) -> bool:
    """Whether ``config`` (a ``TransformerConfig``) names the "custom" flex backend, whatever its
    dispatcher type (``moe_dispatch.megatron.validate_config`` rejects a type other than "flex")."""
    return getattr(config, "moe_flex_dispatcher_backend", None) == BACKEND_NAME


def wrap(owner, name: str, make_wrapper) -> bool:
    """Replaces ``owner.name`` by ``make_wrapper(original)`` once (idempotent: a wrapper carries
    ``PATCHED_FLAG`` and the original as ``__wrapped_original__``). Returns whether it wrapped now."""
    original = getattr(owner, name)
    if getattr(original, PATCHED_FLAG, False):
        return False
    wrapper = functools.update_wrapper(make_wrapper(original), original)
    setattr(wrapper, PATCHED_FLAG, True)
    wrapper.__wrapped_original__ = original
    setattr(owner, name, wrapper)
    return True


def _moe_layer_init(original):
    def __init__(self, *args, **kwargs):
        config = kwargs["config"] if "config" in kwargs else args[0] if args else None
        if not names_backend(config):
            return original(self, *args, **kwargs)
        from .megatron import backend  # installs the backend on first use

        return backend.build_moe_layer(original, self, args, kwargs)

    return __init__


def _bridge_apply(original):
    def apply_flex_dispatcher_backend(model_config, moe_flex_dispatcher_backend=None, *args, **kwargs):
        if moe_flex_dispatcher_backend != BACKEND_NAME:
            return original(model_config, moe_flex_dispatcher_backend, *args, **kwargs)
        from .megatron import backend

        return backend.bridge_apply(model_config)

    return apply_flex_dispatcher_backend


def _bridge_validate(original):
    def validate_flex_dispatcher_backend(model_config, *args, **kwargs):
        if not names_backend(model_config):
            return original(model_config, *args, **kwargs)
        from .megatron import backend

        return backend.bridge_validate(model_config)

    return validate_flex_dispatcher_backend


def _rebind(old, new, prefix: str) -> None:
    """Points every imported ``prefix*`` module attribute bound to ``old`` at ``new`` (for modules
    that imported a function by name before it was wrapped)."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefix):
            continue
        for attr, value in list(vars(module).items()):
            if value is old:
                setattr(module, attr, new)


def _patch_module(module) -> None:
    """Wraps what this hook wraps in ``module`` (one of the two watched modules)."""
    if module.__name__ == MOE_LAYER_MODULE:
        wrap(module.MoELayer, "__init__", _moe_layer_init)
        return
    for name, make in (
        ("apply_flex_dispatcher_backend", _bridge_apply),
        ("validate_flex_dispatcher_backend", _bridge_validate),
    ):
        original = getattr(module, name, None)
        if callable(original) and wrap(module, name, make):
            _rebind(original, getattr(module, name), prefix="megatron.bridge")


class _PatchAfterExec(importlib.abc.Loader):
    """A watched module's own loader, then :func:`_patch_module` (the module is in sys.modules)."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __getattr__(self, name):  # get_source, get_filename, is_package, ...: the module's own loader
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _patch_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the two watched modules as the path finder does, with a loader that patches them."""

    def find_spec(self, name, path, target=None):
        if name != MOE_LAYER_MODULE and name != BRIDGE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchAfterExec(spec.loader)
        return spec


_FINDER = _Finder()


def install() -> None:
    """Puts the finder on ``sys.meta_path`` (first) and patches the watched modules already
    imported. Idempotent, thread-safe, never raises into the importer: a failure is reported as a
    ``RuntimeWarning`` (then ``import moe_dispatch.megatron`` still works, or says why not)."""
    with _LOCK:
        try:
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            for name in (MOE_LAYER_MODULE, BRIDGE_MODULE):
                if sys.modules.get(name) is not None:
                    _patch_module(sys.modules[name])
        except Exception as err:  # noqa: BLE001 - runs at interpreter start-up: never break it
            import warnings

            warnings.warn(
                f"moe_dispatch could not install its Megatron import hook ({type(err).__name__}: {err}); the flex "
                "backend 'custom' needs an explicit `import moe_dispatch.megatron`",
                RuntimeWarning,
                stacklevel=2,
            )


def install_at_startup() -> None:
    """What ``moe_dispatch-autoload.pth`` runs: :func:`install` unless ``MOE_DISPATCH_AUTOLOAD=0``."""
    if os.environ.get(ENV_VAR, "1").strip() != "0":
        install()
