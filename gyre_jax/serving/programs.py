"""An engine's device programs, compiled ahead of time: every program shape an engine runs is an entry of its own
``Programs`` table (a ``jax.stages.Compiled`` per program and argument layout), made by ``jit(...).lower(...)
.compile()`` the first time that shape is called or, before serving, by the engine's ``warmup``, which compiles
without running anything. The table is how an engine counts what it compiled (``Programs.count``), with public
JAX only, and how a test proves that serving after a warm-up compiles nothing.

A program is called like the jitted function it wraps (static arguments included); its key is the program's
name, its static arguments and the layout (shape, dtype, sharding of committed arrays) of its other arguments,
except those the engine declares ``fixed`` (its own state: one layout for the engine's life, so the hot decode
step does not hash hundreds of buffers). The parameters' layout is computed once per parameters object
(``FlatParams``), so new weights of the same layout reuse every entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


class Flattened:
    """Params given already flat: ``leaves`` and their static ``treedef`` (a ``PyTreeDef``) whose
    ``unflatten(leaves)`` is the model state inside a program (a LoRA cell's base and adapter leaves interleaved:
    ``model.lora.merged_leaves``)."""

    def __init__(self, leaves: list, treedef: Any):
        self.leaves, self.treedef = leaves, treedef


class FlatParams:
    """(leaves, treedef) of the params a program is called with, remembered for the last params seen: flattening
    an nnx.State on every call would cost more host time than a tiny model's decode step. ``Flattened`` params
    are taken as they are."""

    def __init__(self):
        self._last: tuple | None = None

    def __call__(self, params) -> tuple[list, Any]:
        if isinstance(params, Flattened):
            return params.leaves, params.treedef
        if self._last is None or self._last[0] is not params:
            leaves, treedef = jax.tree.flatten(params)
            self._last = (params, leaves, treedef)
        return self._last[1], self._last[2]


def _layout(x) -> tuple:
    """(shape, dtype, sharding) of an argument: the sharding only of a committed array or a ``ShapeDtypeStruct``
    that names one (an uncommitted array goes wherever the program wants it)."""
    sharding = getattr(x, "sharding", None) if getattr(x, "committed", True) else None
    return (tuple(np.shape(x)), np.dtype(x.dtype), sharding)


class Programs:
    """One engine's table of compiled programs (``add`` them, then call them).

    ``all``: the programs in the order added (the same on every process that builds the same engine). ``runner``:
    None, or ``runner(program, args)`` that every call goes through instead (a cell over several processes runs
    each call on all of them: ``runtime.lockstep``); it runs the call here with ``program.run(*args)``."""

    def __init__(self):
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self._params: tuple[Any, tuple] | None = None  # (the last leaves list seen, its layout)
        self.all: list[Program] = []
        self.runner = None

    def add(
        self, name: str, jitted, *, static: Sequence[int] = (), fixed: Sequence[int] = (), params: int | None = None
    ) -> Program:
        """Wraps ``jitted`` (a ``jax.jit`` with ``static`` argnums) as program ``name``: ``fixed`` argnums are not in
        its key (the engine's state), ``params`` the argnum of the parameters' leaves list (its layout is cached)."""
        program = Program(self, name, jitted, tuple(static), tuple(fixed), params, index=len(self.all))
        self.all.append(program)
        return program

    def count(self, name: str | None = None) -> int:
        """Shapes compiled so far (of program ``name``, or of all of them)."""
        return sum(1 for key in self._compiled if name is None or key[0] == name)

    def _params_layout(self, leaves) -> tuple:
        if self._params is None or self._params[0] is not leaves:
            self._params = (leaves, tuple(_layout(x) for x in leaves))
        return self._params[1]


class Program:
    """A program of a ``Programs`` table: call it as the jitted function; ``compile`` it ahead of time."""

    def __init__(
        self, table: Programs, name: str, jitted, static: tuple, fixed: tuple, params: int | None, index: int = 0
    ):
        self.table, self.name, self.jitted, self.index = table, name, jitted, index
        self._static, self._skip, self._params = static, set(static) | set(fixed), params

    def _key(self, args: Sequence) -> tuple:
        parts: list = [self.name]
        for i, a in enumerate(args):
            if i in self._static:
                parts.append(a)
            elif i == self._params:
                parts.append(self.table._params_layout(a))
            elif i not in self._skip:
                parts.append(tuple(_layout(x) for x in jax.tree.leaves(a)))
        return tuple(parts)

    def _entry(self, args: Sequence) -> tuple[jax.stages.Compiled, bool]:
        key = self._key(args)
        compiled = self.table._compiled.get(key)
        if compiled is not None:
            return compiled, False
        compiled = self.table._compiled[key] = self.jitted.lower(*args).compile()
        return compiled, True

    def __call__(self, *args):
        if self.table.runner is not None:
            return self.table.runner(self, args)
        return self.run(*args)

    def run(self, *args):
        """Runs the program here (what ``__call__`` does without a ``runner``)."""
        compiled, _ = self._entry(args)
        return compiled(*(a for i, a in enumerate(args) if i not in self._static))

    def compile(self, *args) -> bool:
        """Compiles the shape of ``args`` (arrays or ``jax.ShapeDtypeStruct``s; nothing runs); True if it was new."""
        return self._entry(args)[1]

    def out_info(self, *args):
        """The outputs (``ShapeDtypeStruct``s with shardings) of the shape of ``args``, compiling it if new."""
        return self._entry(args)[0].out_info
