"""The test process of ``gyre-score unittest``: runs the task's tests against the agent's code and
reports each test's outcome to the scorer, which never imports that code itself.

``python -I -B -X pycache_prefix=EMPTY -m gyre_core.scoring.unittest_runner TESTS WORKSPACE FD [ID ...]``

Why each part:

* ``-I``: no ``PYTHON*`` variable, no user site, and neither the working folder nor a script's
  folder first on ``sys.path``, so nothing of the workspace is imported at start
  (``sitecustomize``, ``usercustomize``, a planted ``unittest/``); ``.pth`` files are read only in
  site folders, never the workspace. ``-B`` and an empty ``pycache_prefix``: no bytecode is written,
  and none the agent left in ``__pycache__`` is read.
* ``sys.path`` gets the tests' folder and then the workspace *after* the standard library and
  *before* the installed packages: the tests import the task's code, the task's code may shadow an
  installed package (a repository under test), but nothing shadows the standard library or the
  task's tests; and no sourceless ``.pyc`` is importable.
* The tests' modules are imported from their sources as read at start (:class:`_TestsFromMemory`),
  not from the folder, which the agent's code (the same user) could rewrite while they run.
* The report is one JSON line on descriptor ``FD`` with the token the scorer wrote on standard
  input (read, then standard input is closed, before any test module is imported), and the
  functions that write it are bound before the agent's code runs. A report needs the runner to
  reach its end: a test process that the agent's code exits or kills reports nothing, and then no
  test is seen passing.
* What the agent's code could patch in this process to turn a failure into a pass (the
  ``unittest`` classes, ``builtins``) is snapshotted before the tests are loaded and compared after
  they ran; a change is reported, and the scorer counts it as a failure.

Code written to attack this very process (reading the token from its memory) is beyond what one
process can guard against itself; that is why the report carries a fresh token and the scorer
refuses a second line.
"""

from __future__ import annotations

import builtins
import importlib.machinery as machinery
import json
import os
import sys
import unittest
import unittest.case
import unittest.loader
import unittest.result
import unittest.suite
from typing import Any

_write = os.write
_dumps = json.dumps
_exit = os._exit


class _TestsFromMemory:
    """Imports the tests' modules from the sources read before any of the agent's code ran, so
    code that rewrites a test file on disk while the tests run changes nothing."""

    def __init__(self, folder: str) -> None:
        self.sources: dict[str, tuple[str, bytes, bool]] = {}
        for top, dirs, files in os.walk(folder):
            dirs.sort()
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                path = os.path.join(top, f)
                parts = os.path.relpath(path, folder)[:-3].split(os.sep)
                package = parts[-1] == "__init__"
                name = ".".join(parts[:-1] if package else parts)
                with open(path, "rb") as fh:
                    self.sources[name] = (path, fh.read(), package)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.sources:
            return None
        import importlib.util

        origin, _, package = self.sources[fullname]
        spec = importlib.util.spec_from_loader(fullname, self, origin=origin, is_package=package)
        if spec is not None:
            spec.has_location = True
            if package:
                spec.submodule_search_locations = [os.path.dirname(origin)]
        return spec

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        origin, source, _ = self.sources[module.__name__]
        exec(compile(source, origin, "exec", dont_inherit=True), module.__dict__)  # noqa: S102 - the task's own tests


class _Outcomes(unittest.result.TestResult):
    """Each test's outcome by its id: ``passed`` only through ``addSuccess`` with nothing else; the
    guarded objects are compared after every test, so a patch undone before the end is seen too."""

    def __init__(self, before: list[dict[str, Any]]) -> None:
        super().__init__()
        self.outcomes: dict[str, str] = {}
        self.before = before
        self.tampered: list[str] = []

    def stopTest(self, test: Any) -> None:  # noqa: N802 - unittest's names
        super().stopTest(test)
        if not self.tampered:
            self.tampered = _changes(self.before)

    def _set(self, test: Any, outcome: str) -> None:
        tid = test.id()
        if outcome == "passed" and tid in self.outcomes:
            return  # a sub-test failed first: the test is not passed
        self.outcomes[tid] = outcome

    def addSuccess(self, test: Any) -> None:  # noqa: N802 - unittest's names
        super().addSuccess(test)
        self._set(test, "passed")

    def addFailure(self, test: Any, err: Any) -> None:  # noqa: N802
        super().addFailure(test, err)
        self._set(test, "failed")

    def addError(self, test: Any, err: Any) -> None:  # noqa: N802
        super().addError(test, err)
        self._set(test, "error")

    def addSkip(self, test: Any, reason: str) -> None:  # noqa: N802
        super().addSkip(test, reason)
        self._set(test, "skipped")

    def addExpectedFailure(self, test: Any, err: Any) -> None:  # noqa: N802
        super().addExpectedFailure(test, err)
        self._set(test, "expected_failure")

    def addUnexpectedSuccess(self, test: Any) -> None:  # noqa: N802
        super().addUnexpectedSuccess(test)
        self._set(test, "unexpected_success")

    def addSubTest(self, test: Any, subtest: Any, err: Any) -> None:  # noqa: N802
        super().addSubTest(test, subtest, err)
        if err is not None:
            self.outcomes[test.id()] = "failed"


_GUARDED: tuple[Any, ...] = (builtins, unittest, unittest.case, unittest.result, unittest.suite, unittest.loader,
                             unittest.case.TestCase, unittest.result.TestResult, unittest.suite.TestSuite,
                             unittest.suite.BaseTestSuite, unittest.loader.TestLoader, unittest.case._Outcome,
                             _Outcomes, _TestsFromMemory)
"""What the agent's code could patch to make a failure pass; each one's attributes are compared."""


def _snapshot() -> list[dict[str, Any]]:
    return [dict(vars(obj)) for obj in _GUARDED]


def _changes(before: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    for obj, was in zip(_GUARDED, before):
        now = vars(obj)
        name = getattr(obj, "__name__", repr(obj))
        for key in sorted(set(was) | set(now), key=str):
            if key in ("__warningregistry__", "_") or (key in was and key in now and was[key] is now[key]):
                continue
            out.append(f"{name}.{key}")
    modules = {"unittest": unittest, "unittest.case": unittest.case, "unittest.result": unittest.result,
               "builtins": builtins}
    out += [f"sys.modules[{k!r}]" for k, m in modules.items() if sys.modules.get(k) is not m]
    return out


def _no_sourceless_bytecode() -> None:
    """Only source files and extension modules are importable from ``sys.path``'s folders."""
    details = [(machinery.ExtensionFileLoader, machinery.EXTENSION_SUFFIXES),
               (machinery.SourceFileLoader, machinery.SOURCE_SUFFIXES)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if "FileFinder" not in getattr(h, "__qualname__", "")]
    sys.path_hooks.append(machinery.FileFinder.path_hook(*details))
    sys.path_importer_cache.clear()


def _place(tests: str, workspace: str) -> None:
    at = next((i for i, p in enumerate(sys.path) if "site-packages" in p or "dist-packages" in p), len(sys.path))
    sys.path[at:at] = [tests, workspace]


def main(argv: list[str]) -> None:
    tests, workspace, fd, ids = argv[0], argv[1], int(argv[2]), argv[3:]
    token = sys.stdin.readline().strip()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(workspace)
    _no_sourceless_bytecode()
    sys.meta_path.insert(0, _TestsFromMemory(tests))
    _place(tests, workspace)
    before = _snapshot()
    result = _Outcomes(before)
    loader = unittest.TestLoader()
    suite = loader.loadTestsFromNames(ids) if ids else loader.discover(tests, pattern="test*.py", top_level_dir=tests)
    suite.run(result)
    report = {"token": token, "tests": result.outcomes, "tampered": result.tampered or _changes(before),
              "load_errors": len(loader.errors)}
    _write(fd, (_dumps(report) + "\n").encode())
    _exit(0)  # no atexit handler or finaliser of the agent's code runs after the report


if __name__ == "__main__":
    main(sys.argv[1:])
