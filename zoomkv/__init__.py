"""zoomkv: keep the whole KV cache, hold little of it on the accelerator, recall what each step needs.

The package face: importing ``zoomkv`` (or any part of it) registers every shipped method, so
``get_method`` and the adapter loader know them all. The layers are in docs/ARCHITECTURE.md.
"""


def _started_as_command() -> bool:
    """Whether this process is the ``zoomkv`` command: its console script, or ``python -m zoomkv`` (``.train``,
    ``.demo``, ...). Read from the command line alone: nothing here may import anything heavy."""
    import os
    import sys

    if sys.argv and os.path.basename(sys.argv[0]).removesuffix(".exe") == "zoomkv":
        return True
    args = iter(getattr(sys, "orig_argv", [])[1:])
    for arg in args:  # the interpreter's options, up to the script or module it runs
        if arg in ("-X", "-W"):
            next(args, None)  # an option's value, not the script
        elif arg == "-m" or (arg.startswith("-m") and len(arg) > 2):
            module = arg[2:] or next(args, "")
            return module.split(".")[0] == "zoomkv"
        elif arg == "-c" or not arg.startswith("-"):
            return False
    return False


# Importing the package imports torch and transformers: seconds, during which a Ctrl-C lands here, before the
# command line's own interrupt handling (zoomkv.cli) exists. The command says so in one line and exits 130,
# as it does later; a program that imports zoomkv gets its KeyboardInterrupt as ever.
try:
    from zoomkv.budget import Budget
    from zoomkv.errors import ZoomKVError
    from zoomkv.memory import CacheSpec, LayerMemory, MemoryReport, ZoomCache, attach
    from zoomkv.methods import get_method, list_methods, register_method
    from zoomkv.version import __version__
except KeyboardInterrupt:
    if not _started_as_command():
        raise
    import sys

    print("zoomkv: interrupted", file=sys.stderr)
    raise SystemExit(130) from None
except ImportError as err:  # a dependency outside the versions zoomkv works with (zoomkv.compat): one line
    from zoomkv.errors import UnsupportedDependency

    if not (isinstance(err, UnsupportedDependency) and _started_as_command()):
        raise
    import sys

    print(f"zoomkv: error: {err}", file=sys.stderr)
    raise SystemExit(2) from None


def _register_with_peft() -> None:
    """``PeftModel.from_pretrained(base, zoomkv_adapter_folder)`` works after ``import zoomkv``: zoomkv becomes
    a PEFT method (``zoomkv.adapters.peft_integration``) as soon as peft is imported, now if it already is,
    else through a one-shot import hook. ``import zoomkv`` itself never imports peft."""
    import importlib.abc
    import importlib.util
    import sys

    def register() -> None:
        if "zoomkv.adapters.peft_integration" in sys.modules:
            return  # being imported (it imports peft, then registers itself)
        try:
            import zoomkv.adapters.peft_integration  # noqa: F401  (registers on import)
        except Exception as err:  # never break the user's `import peft`
            import warnings

            warnings.warn(f"zoomkv could not register itself as a PEFT method: {err}", stacklevel=2)

    if "peft" in sys.modules:
        register()
        return

    class PeftImportHook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
            if name != "peft":
                return None
            # The real finders locate peft (without this hook, or it would find itself). A probe that only
            # looks (transformers' is_peft_available calls find_spec) leaves the hook in place for the import.
            index = sys.meta_path.index(self)
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(index, self)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            exec_module = spec.loader.exec_module

            def exec_then_register(module):  # type: ignore[no-untyped-def]
                if self in sys.meta_path:  # once: peft is being imported for real
                    sys.meta_path.remove(self)
                exec_module(module)
                register()

            spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, PeftImportHook())


_register_with_peft()

__all__ = [
    "__version__",
    "Budget",
    "ZoomKVError",
    "ZoomCache",
    "CacheSpec",
    "LayerMemory",
    "MemoryReport",
    "attach",
    "get_method",
    "list_methods",
    "register_method",
]
