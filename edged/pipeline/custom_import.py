"""Custom step modules imported from their version folder, with the listed files they vendor.

A custom step's module is imported as a submodule of a package private to its version folder
(``edged_pipeline_custom_<hash>``), so it can import other files of that folder *relatively*
(``from . import helper``, ``from .vendor import somelib``): a helper module or a vendored
pure-Python package. Only source files (``.py``) listed under ``[[files]]`` are imported, and the
bytes executed are the bytes whose sha256 was checked, so nothing unverified runs; everything else
(an absolute ``import somelib``) comes from the daemon's own environment, as for any module.
Nothing is installed at load: a device never runs pip (no network, no signature over what it
would fetch, no reproducible release). Extension modules (``.so``) cannot be vendored this way.

The package and its modules stay in ``sys.modules`` while the pipeline is served (a step's code
may import lazily at run time); compiling the folder again starts them afresh.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["VendoredImportError", "import_step_module", "open_folder", "package_for"]

MAX_MODULE_BYTES = 16 * 1024 * 1024  # bound what one module file may make us read


class VendoredImportError(ImportError):
    """A module of the version folder that may not be imported (unlisted, changed, outside the folder)."""


class _Folder:
    def __init__(self, folder: Path, listed: Mapping[str, str]) -> None:
        self.folder = folder
        self.listed = dict(listed)  # relative posix path -> sha256
        # The steps' own module files: importable even when not listed, for compiling without the
        # daemon's file check (which refuses an unlisted one before this runs); checked when listed.
        self.entries: set[str] = set()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers only for the private package names it registered; everything else falls through."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._roots: dict[str, _Folder] = {}

    def register(self, root: str, folder: _Folder) -> None:
        with self._lock:
            self._roots[root] = folder
        for name in [n for n in sys.modules if n == root or n.startswith(root + ".")]:
            sys.modules.pop(name, None)  # a recompile starts the modules afresh

    def add_entry(self, root: str, rel: str) -> None:
        with self._lock:
            self._roots[root].entries.add(rel)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        root, _, rest = fullname.partition(".")
        with self._lock:
            entry = self._roots.get(root)
        if entry is None:
            return None
        if not rest:
            spec = importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            spec.submodule_search_locations = []
            return spec
        base = rest.replace(".", "/")
        for rel, package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
            if rel in entry.listed or rel in entry.entries:
                path_ = (entry.folder / rel).resolve()
                if not path_.is_relative_to(entry.folder.resolve()):
                    raise VendoredImportError(f"{rel!r} is outside the version folder", name=fullname)
                spec = importlib.machinery.ModuleSpec(fullname, self, origin=str(path_), is_package=package,
                                                      loader_state=(rel, entry.listed.get(rel)))
                spec.has_location = True
                if package:
                    spec.submodule_search_locations = []
                return spec
        if (entry.folder / f"{base}.py").exists() or (entry.folder / base).is_dir():
            raise VendoredImportError(f"{base} is in the version folder but its files are not listed under "
                                      "[[files]] with their sha256", name=fullname)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        spec = module.__spec__
        if spec is None or spec.loader_state is None:
            return  # the private package itself: empty
        rel, sha = spec.loader_state
        assert spec.origin is not None
        with open(spec.origin, "rb") as f:
            source = f.read(MAX_MODULE_BYTES + 1)
        if len(source) > MAX_MODULE_BYTES:
            raise VendoredImportError(f"{rel!r} is larger than {MAX_MODULE_BYTES} bytes", name=spec.name)
        if sha is not None and hashlib.sha256(source).hexdigest() != sha:
            raise VendoredImportError(f"{rel!r} does not match its listed sha256", name=spec.name)
        exec(compile(source, spec.origin, "exec"), module.__dict__)


_FINDER = _Finder()
_INSTALL_LOCK = threading.Lock()


def package_for(folder: Path) -> str:
    """The private package name of a version folder (stable for one folder)."""
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    return f"edged_pipeline_custom_{digest}"


def open_folder(folder: Path, listed: Mapping[str, str]) -> str:
    """Start a compile of ``folder``'s custom modules afresh (its listed files -> sha256); the
    private package name they are imported under."""
    with _INSTALL_LOCK:
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
    root = package_for(folder)
    _FINDER.register(root, _Folder(folder, listed))
    return root


def import_step_module(root: str, module_name: str) -> ModuleType:
    """Import a step's ``module_name`` (``<module_name>.py`` of the folder opened as ``root``); its
    relative imports reach the folder's listed ``.py`` files only."""
    _FINDER.add_entry(root, f"{module_name}.py")
    name = f"{root}.{module_name}"
    __import__(name)
    return sys.modules[name]
