"""pytest plugin of the gyre-jax verifier: tells the trusted driver (``run_pytest.py``) each test's outcome over a
pipe, and watches the test process for the ways the code under test can fool its own tests.

Loaded with ``-p gyre_pytest_guard`` when pytest configures, so before collection, i.e. before any module of the
workspace is imported. The driver hands it two inherited descriptors (``GYRE_REPORT_FD``, ``GYRE_NONCE_FD``): it
reads the run's secret nonce from the second, closes both originals (duplicates that tests' subprocesses do not
inherit) and writes one JSON line per event to the first, each with the nonce and a sequence number:

    {"t": "start"} | {"t": "item", "id": nodeid} | {"t": "collect_error", "id": nodeid, "skipped": bool}
    | {"t": "test", "id": nodeid, "ok": bool, "why": str} | {"t": "tamper", "why": str}
    | {"t": "finish", "status": int}

The outcome of a test is this plugin's own reading of each phase's exception (``call.excinfo``), not pytest's
report: a report that says "passed" for a phase that raised is tampering. What it watches (a "tamper" line each):

- pytest, pluggy, this plugin, the standard library modules loaded before collection and the builtin types: any
  function, class or method replaced by code from outside the trusted files (the workspace, or code compiled at
  run time), and any of these modules replaced in ``sys.modules``; checked at each test's call and at the end.
- modules loaded later (site-packages, the standard library): an attribute whose code comes from the workspace.
- each test function: its code must come from the tests directory.
- every single comparison of an ``assert`` in the test files (``==`` ``!=`` ``<`` ``<=`` ``>`` ``>=`` ``in``
  ``not in``): a value whose class is not from a trusted file, and that equals, differs from, orders against
  or contains values it cannot (a fresh random string, a random integer, a new object), is an always-equal
  style object. The comparison's own result is returned unchanged.

In-process checks can be defeated by code that knows them (it runs with the tests' rights); docs/reliability.md
says what the driver's out-of-process design closes regardless, and what only this plugin detects.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import secrets
import sys
import sysconfig
import types

import pytest

_OPS = {
    ast.Eq: ("==", operator.eq),
    ast.NotEq: ("!=", operator.ne),
    ast.Lt: ("<", operator.lt),
    ast.LtE: ("<=", operator.le),
    ast.Gt: (">", operator.gt),
    ast.GtE: (">=", operator.ge),
    ast.In: ("in", lambda a, b: a in b),
    ast.NotIn: ("not in", lambda a, b: a not in b),
}
_BY_NAME = dict(_OPS.values())
_PLAIN = (int, float, complex, str, bytes, bool, type(None), range)
_CONTAINERS = (tuple, list, set, frozenset)
_BUILTIN_TYPES = (int, float, complex, str, bytes, bytearray, bool, tuple, list, dict, set, frozenset, object, type,
                  range, type(None), slice, property, staticmethod, classmethod, BaseException, Exception)  # fmt: skip
_PROTECTED_ROOTS = ("pytest", "_pytest", "pluggy", "gyre_pytest_guard", "builtins")
_HOOK_NAMES = ("excepthook", "displayhook", "breakpointhook", "unraisablehook")  # sys's: not the tests' verdict
_GUARD_NAME = "_gyre_guard_"
_MAX_PROBED = 8


def _trusted_dirs(tests: str, kit: str) -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs |= {os.path.dirname(os.path.dirname(pytest.__file__)), tests, kit}
    return tuple(sorted(os.path.realpath(d) + os.sep for d in dirs if d))


class Guard:
    """The plugin's state for one pytest session (see the module docstring)."""

    def __init__(self, report_fd: int, nonce: str, tests: str, workspace: str, kit: str) -> None:
        self.fd, self.nonce, self.seq = report_fd, nonce, 0
        self.tests = os.path.realpath(tests) + os.sep
        self.workspace = os.path.realpath(workspace) + os.sep if workspace else ""
        self.trusted = _trusted_dirs(tests, kit)
        self.phases: dict[str, list[str]] = {}  # nodeid -> what failed, per phase ("" when a phase passed)
        self.told: set[str] = set()
        self.rnd_str, self.rnd_int = "gyre-" + secrets.token_hex(8), secrets.randbelow(2**60) + 2**40
        self.snapshot: dict[tuple, object] = {}
        self.modules: dict[str, types.ModuleType] = {}

    # -- channel ----------------------------------------------------------------------------------------------
    def send(self, event: dict) -> None:
        self.seq += 1
        line = json.dumps({**event, "nonce": self.nonce, "seq": self.seq}) + "\n"
        try:
            os.write(self.fd, line.encode("utf-8", "replace"))
        except OSError:
            pass  # the driver reads what arrived; a closed channel shows as missing lines

    def tamper(self, why: str) -> None:
        if why not in self.told:
            self.told.add(why)
            self.send({"t": "tamper", "why": why[:500]})

    # -- where code comes from ------------------------------------------------------------------------------
    def origin_trusted(self, value: object) -> bool | None:
        """True if ``value``'s code comes from a trusted file, False if from the workspace or code compiled at run
        time, None when it has no Python code (a builtin, a plain object)."""
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            value = value.fget
        if isinstance(value, types.MethodType):
            value = value.__func__
        code = getattr(value, "__code__", None)
        if isinstance(code, types.CodeType):
            name = code.co_filename
            if name.startswith("<frozen "):
                return True
            return os.path.realpath(name).startswith(self.trusted) and not self._in_workspace(name)
        if isinstance(value, type):
            return self.type_trusted(value)
        return None

    def _in_workspace(self, filename: str) -> bool:
        return bool(self.workspace) and os.path.realpath(filename).startswith(self.workspace)

    def type_trusted(self, cls: type) -> bool:
        """False when any class of ``cls``'s MRO has a method whose code is not from a trusted file."""
        for klass in cls.__mro__:
            if klass in _BUILTIN_TYPES:
                continue
            for attr in vars(klass).values():
                if self.origin_trusted(attr) is False:
                    return False
        return True

    # -- integrity of the runner and the standard library ----------------------------------------------------
    def take_snapshot(self) -> None:
        stdlib = tuple(
            os.path.realpath(p) + os.sep for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
        )
        for name, module in list(sys.modules.items()):
            if not isinstance(module, types.ModuleType):
                continue
            file = getattr(module, "__file__", None) or ""
            protected = name.split(".")[0] in _PROTECTED_ROOTS or name in sys.builtin_module_names
            if not protected and not (file and os.path.realpath(file).startswith(stdlib)):
                continue
            self.modules[name] = module
            for key, value in list(vars(module).items()):
                if name == "sys" and key in _HOOK_NAMES or not callable(value):
                    continue
                self.snapshot[(name, key)] = value
                if isinstance(value, type) and value.__module__ == name and name.split(".")[0] in _PROTECTED_ROOTS:
                    for attr, member in list(vars(value).items()):
                        self.snapshot[(name, key, attr)] = member
        for cls in _BUILTIN_TYPES:
            for attr, member in list(vars(cls).items()):
                self.snapshot[("<type>", cls.__name__, attr)] = member

    def _current(self, key: tuple) -> object:
        if key[0] == "<type>":
            cls = next(c for c in _BUILTIN_TYPES if c.__name__ == key[1])
            return vars(cls).get(key[2])
        module = sys.modules.get(key[0])
        value = vars(module).get(key[1]) if isinstance(module, types.ModuleType) else None
        return vars(value).get(key[2]) if len(key) == 3 and isinstance(value, type) else value

    def check_integrity(self, full: bool = False) -> None:
        for name, module in self.modules.items():
            now = sys.modules.get(name)
            if now is not None and now is not module:
                self.tamper(f"module {name} was replaced in sys.modules (by {getattr(now, '__file__', now)!r})")
        for key, value in self.snapshot.items():
            now = self._current(key)
            if now is value:
                continue
            if key[0] == "<type>":
                self.tamper(f"the builtin type {key[1]}'s {key[2]} was changed")
            elif now is not None and self.origin_trusted(now) is False:
                self.tamper(f"{'.'.join(key)} was replaced by code from {_where(now)}")
        if full:
            self.check_later_modules()

    def check_later_modules(self) -> None:
        """Modules loaded after the snapshot from trusted files: none may hold a function from the workspace."""
        for name, module in list(sys.modules.items()):
            if name in self.modules or not isinstance(module, types.ModuleType):
                continue
            file = getattr(module, "__file__", None) or ""
            if not file or self._in_workspace(file) or not os.path.realpath(file).startswith(self.trusted):
                continue
            if os.path.realpath(file).startswith(self.tests):
                continue  # the test modules hold the agent's functions by design (from searching import find)
            for key, value in list(vars(module).items()):
                code = getattr(getattr(value, "__func__", value), "__code__", None)
                if isinstance(code, types.CodeType) and self._in_workspace(code.co_filename):
                    self.tamper(f"{name}.{key} was replaced by code from the workspace ({code.co_filename})")

    # -- comparisons in assert statements --------------------------------------------------------------------
    def foreign(self, value: object, out: list, depth: int = 0) -> None:
        """Appends to ``out`` the values in ``value`` (itself, or inside plain containers) of untrusted classes."""
        if len(out) >= _MAX_PROBED or depth > 3:
            return
        kind = type(value)
        if kind in _PLAIN:
            return
        if kind in _CONTAINERS or kind is dict:
            items = list(value.items()) if kind is dict else list(value)
            for item in items[:200]:
                for part in item if kind is dict else (item,):
                    self.foreign(part, out, depth + 1)
            return
        if not self.type_trusted(kind):
            out.append(value)

    def probe(self, op: str, left: object, right: object) -> None:
        found: list = []
        self.foreign(left, found)
        self.foreign(right, found)
        unrelated = (self.rnd_str, self.rnd_int, object())
        for value in found:
            name = f"{type(value).__module__}.{type(value).__qualname__}"
            for other in unrelated:
                what = type(other).__name__
                if _truthy(operator.eq, value, other) or not _truthy(operator.ne, value, other, default=True):
                    self.tamper(f"a value of type {name} compares equal to an unrelated {what}: an always-equal object")
                    return
                if _truthy(operator.lt, value, other) and _truthy(operator.ge, value, other):
                    self.tamper(f"a value of type {name} is both < and >= an unrelated {what}")
                    return
            if op in ("in", "not in") and value is right and _truthy(operator.contains, value, self.rnd_str):
                self.tamper(f"a container of type {name} claims to hold an unrelated random string")
                return


def _truthy(op, a: object, b: object, default: bool = False) -> bool:
    """``bool(op(a, b))``; ``default`` when it raises (a value that refuses the probe is no always-equal object)."""
    try:
        return bool(op(a, b))
    except Exception:  # noqa: BLE001
        return default


def _where(value: object) -> str:
    func = getattr(value, "__func__", value)
    code = getattr(func, "__code__", None)
    return code.co_filename if isinstance(code, types.CodeType) else type(value).__name__


_STATE: dict[str, Guard] = {}  # the session's guard (one per test process); compare() finds it here


def compare(op: str, left: object, right: object) -> object:
    """``left <op> right``, as the assert would compute it; the values are probed for always-equal objects."""
    result = _BY_NAME[op](left, right)
    guard = _STATE.get("guard")
    if guard is not None:
        try:
            guard.probe(op, left, right)
        except Exception:  # noqa: BLE001 - the probe never changes a test's verdict
            pass
    return result


class _CompareGuard(ast.NodeTransformer):
    """Rewrites each single comparison at the top of an ``assert`` (through ``and``/``or``/``not``) into
    ``_gyre_guard_.compare(op, left, right)``."""

    def visit_Assert(self, node: ast.Assert) -> ast.Assert:
        node.test = self.wrap(node.test)
        return node

    def wrap(self, expr: ast.expr) -> ast.expr:
        if isinstance(expr, ast.Compare) and len(expr.ops) == 1 and type(expr.ops[0]) in _OPS:
            func = ast.Attribute(value=ast.Name(id=_GUARD_NAME, ctx=ast.Load()), attr="compare", ctx=ast.Load())
            op = ast.Constant(value=_OPS[type(expr.ops[0])][0])
            return ast.copy_location(ast.Call(func=func, args=[op, expr.left, expr.comparators[0]], keywords=[]), expr)
        if isinstance(expr, ast.BoolOp):
            expr.values = [self.wrap(v) for v in expr.values]
        elif isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
            expr.operand = self.wrap(expr.operand)
        return expr


def guard_module(tree: ast.Module) -> None:
    """Adds ``import gyre_pytest_guard as _gyre_guard_`` and wraps the asserts' comparisons (``_CompareGuard``)."""
    _CompareGuard().visit(tree)
    at = 0
    for i, stmt in enumerate(tree.body):
        is_doc = i == 0 and isinstance(stmt, ast.Expr) and isinstance(getattr(stmt, "value", None), ast.Constant)
        if is_doc or (isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__"):
            at = i + 1
        else:
            break
    tree.body.insert(
        at, ast.Import(names=[ast.alias(name="gyre_pytest_guard", asname=_GUARD_NAME)], lineno=1, col_offset=0)
    )
    ast.fix_missing_locations(tree)


def _install_compare_guard(tests: str) -> None:
    """Makes pytest's assertion rewriting of the test files also apply ``guard_module`` (and never reuse a cached
    rewrite, which would lack it)."""
    from _pytest.assertion import rewrite

    original = rewrite.rewrite_asserts
    prefix = os.path.realpath(tests) + os.sep

    def rewrite_asserts(mod, source, module_path=None, config=None):
        if module_path and os.path.realpath(str(module_path)).startswith(prefix):
            guard_module(mod)
        return original(mod, source, module_path, config)

    rewrite.rewrite_asserts = rewrite_asserts
    rewrite._read_pyc = lambda *args, **kwargs: None


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        data = os.read(fd, 4096)
        if not data:
            break
        chunks.append(data)
    os.close(fd)
    return b"".join(chunks).decode("ascii", "replace").strip()


# -- pytest hooks ---------------------------------------------------------------------------------------------
def pytest_configure(config) -> None:
    report = os.environ.pop("GYRE_REPORT_FD", "")
    nonce_fd = os.environ.pop("GYRE_NONCE_FD", "")
    if not report or not nonce_fd:
        return  # not run by the driver (e.g. a suite author running the tests by hand)
    nonce = _read_all(int(nonce_fd))
    fd = os.dup(int(report))  # not inheritable: the tests' subprocesses never get the channel
    os.close(int(report))
    tests = os.environ.get("GYRE_TESTS", str(config.rootpath))
    guard = Guard(fd, nonce, tests, os.environ.get("GYRE_WORKSPACE", ""), os.path.dirname(os.path.abspath(__file__)))
    _install_compare_guard(tests)
    guard.take_snapshot()
    _STATE["guard"] = guard
    guard.send({"t": "start", "python": sys.version.split()[0], "pytest": pytest.__version__})


def pytest_collectreport(report) -> None:
    guard = _STATE.get("guard")
    if guard is not None and (report.failed or report.skipped):  # a module that failed to import or skipped itself
        guard.send({"t": "collect_error", "id": report.nodeid, "skipped": bool(report.skipped)})


def pytest_collection_finish(session) -> None:
    guard = _STATE.get("guard")
    if guard is None:
        return
    for item in session.items:
        guard.send({"t": "item", "id": item.nodeid})
    guard.check_integrity()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    guard = _STATE.get("guard")
    if guard is None:
        return report
    excinfo = call.excinfo
    why = "" if excinfo is None else f"{call.when}: {excinfo.typename}"
    guard.phases.setdefault(item.nodeid, []).append(why)
    if report.outcome == "passed" and excinfo is not None:
        guard.tamper(f"{item.nodeid}: pytest's report says {call.when} passed, but it raised {excinfo.typename}")
    if call.when == "call":
        func = getattr(item, "obj", None)
        code = getattr(func, "__code__", None)
        if isinstance(code, types.CodeType) and not os.path.realpath(code.co_filename).startswith(guard.tests):
            guard.tamper(f"{item.nodeid}: the test function was replaced by code from {code.co_filename}")
        guard.check_integrity()
    if call.when == "teardown":
        phases = guard.phases.get(item.nodeid, [])
        ok = len(phases) == 3 and not any(phases)
        guard.send({"t": "test", "id": item.nodeid, "ok": ok, "why": "; ".join(p for p in phases if p)})
    return report


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    guard = _STATE.get("guard")
    if guard is None:
        return
    guard.check_integrity(full=True)
    guard.send({"t": "finish", "status": int(exitstatus)})
