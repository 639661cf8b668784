"""One root exception per package: every exception class defined anywhere in hwspec,
device_model, vmm, guest_driver, userspace_runtime and virtaccel derives from its package's root,
the root is exported from the package, and docs/architecture.md ("Errors") names it.

Walks every module of each package (import included), so a stray exception class
added anywhere fails here, naming its module."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest

import device_model
import guest_driver
import hwspec
import userspace_runtime
import virtaccel
import vmm

ROOTS: dict[str, type[Exception]] = {
    "hwspec": hwspec.HwspecError,
    "device_model": device_model.DeviceModelError,
    "vmm": vmm.VmmError,
    "guest_driver": guest_driver.GuestDriverError,
    "userspace_runtime": userspace_runtime.UserspaceRuntimeError,
    "virtaccel": virtaccel.VirtaccelError,
}
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _modules(package: str) -> Iterator[ModuleType]:
    pkg = importlib.import_module(package)
    yield pkg

    def fail(name: str) -> None:
        raise ImportError(f"cannot walk {name}")

    for info in pkgutil.walk_packages(pkg.__path__, f"{package}.", onerror=fail):
        if info.name.rsplit(".", 1)[-1] != "__main__":   # runs a program when imported
            yield importlib.import_module(info.name)


def _classes_in(owner: object, module: str) -> Iterator[type]:
    """Classes defined in `module`: at module level and nested in its classes."""
    for value in vars(owner).values():
        if inspect.isclass(value) and value.__module__ == module:
            if value is not owner:
                yield value
                yield from _classes_in(value, module)


def exceptions(package: str) -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module in _modules(package):
        for cls in _classes_in(module, module.__name__):
            if issubclass(cls, BaseException):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [found[k] for k in sorted(found)]


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_every_exception_of_the_package_derives_from_its_root(package: str) -> None:
    root = ROOTS[package]
    classes = exceptions(package)
    assert root in classes, f"{package}: the root {root.__name__} is not defined in the package"
    stray = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, root)]
    assert stray == [], f"{package}: exceptions outside {root.__name__}: {stray}"


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_the_root_is_exported_and_belongs_to_no_other_package(package: str) -> None:
    root = ROOTS[package]
    pkg = importlib.import_module(package)
    assert getattr(pkg, root.__name__) is root and root.__name__ in pkg.__all__
    assert root.__module__.split(".")[0] == package
    others = [r.__name__ for p, r in ROOTS.items() if p != package and issubclass(root, r)]
    assert others == []


def test_the_roots_have_distinct_names() -> None:
    assert len({r.__name__ for r in ROOTS.values()}) == len(ROOTS)


def _errors_section() -> str:
    text = ARCHITECTURE.read_text()
    m = re.search(r"^## Errors\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, "docs/architecture.md has no '## Errors' section"
    return m.group(1)


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_architecture_doc_names_every_exception(package: str) -> None:
    section = _errors_section()
    missing = [c.__qualname__ for c in exceptions(package)
               if not c.__name__.startswith("_") and f"`{c.__qualname__}`" not in section]
    assert missing == [], f"docs/architecture.md 'Errors' does not name {missing} ({package})"
