"""Cells over several processes: every process of a cell runs the cell's device programs in lockstep.

JAX's multi-controller model: every process holding devices of a mesh must run each program over that mesh, the
same programs in the same order on the same inputs. A cell whose devices span processes (whole hosts; cells
are equal, so then every process belongs to exactly one cell) has one *driver*, its first process, which runs the
cell exactly as a cell of one process is run (its serving loop and the leader's commands; for the core, the learner
and the checkpoints) and decides everything; its other processes are *peers*. Every device call the driver makes
on the cell goes through the cell's ``Lockstep`` (``call``): under one lock, the call is sent to every peer over its
own ``Channel`` (a direct TCP connection, driver -> peer) and then run here, so the order of calls on the driver is
the order sent. A peer's ``Replayer`` runs the calls in that order on its own objects of the same names (the
engine's program table, the gradient worker, the learner, the checkpointer): host values travel as values, device
arrays as ``Ref``s to the arrays an earlier call made on both sides. Nothing comes back and nothing waits: a
decode step costs the driver one message per peer (no round trip, nothing through process 0), and the processes
meet only in the programs' own collectives.

What goes through a ``Lockstep`` (``runtime.lockstep.driving(mesh)`` says whether this process drives it):
the serving engine's programs (``serving.programs.Programs.runner``) and its few host reads of arrays split over
processes (``LockstepEngine``), gradient micro-steps (``LockstepWorker``), the core's optimizer and gradient sums
(``LockstepLearner``, ``LockstepAccumulator``), checkpoints (``LockstepCheckpointer``: every process of the core
writes its shards), and every ``runtime.transfer`` touching the cell (weights, gradients, KV).
"""

from __future__ import annotations

import collections
import functools
import importlib
import itertools
import logging
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.model import lora
from gyre_jax.rl.accumulator import GradAccumulator
from gyre_jax.rl.learner import Learner
from gyre_jax.runtime.channel import Channel
from gyre_jax.runtime.watchdog import DistributedError

log = logging.getLogger(__name__)

RECENT_CALLS = 16  # calls each side remembers, to print when one fails (which side ran what, in which order)


class LockstepError(DistributedError):
    """A cell's processes are out of lockstep, or a call cannot be sent to them; the message says which."""


# -- messages (driver -> peer) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Ref:
    """A device array both sides hold: the ``index``-th array leaf of call ``call``'s result (or of an adopted
    tree: ``call`` is its name)."""

    call: int | str
    index: int


@dataclass(frozen=True)
class Value:
    """A host-side array (an uncommitted ``jax.Array`` on the driver, e.g. a sampling key): rebuilt as one."""

    array: np.ndarray


@dataclass(frozen=True)
class ObjectRef:
    """An object both sides hold under ``name`` (a cell, the factory, a bound engine)."""

    name: str


@dataclass(frozen=True)
class MeshSpec:
    devices: np.ndarray  # global device ids, in the mesh's shape
    axis_names: tuple[str, ...]


@dataclass(frozen=True)
class ShardingSpec:
    mesh: MeshSpec
    spec: PartitionSpec
    memory_kind: str | None = None


@dataclass(frozen=True)
class AbstractSpec:
    shape: tuple[int, ...]
    dtype: Any
    sharding: ShardingSpec | None


@dataclass(frozen=True)
class Call:
    """Run ``target``'s ``path`` (an object's dotted attribute path; integers index lists) or, with no target, the
    function ``path`` (``module:qualname``) on ``args``; register the result's array leaves as ``Ref(seq, i)`` and,
    with ``bind``, the result under that name. ``forget``: arrays the driver no longer holds."""

    seq: int
    target: str | None
    path: str
    args: tuple
    kwargs: dict
    bind: str | None = None
    forget: tuple = ()


@dataclass(frozen=True)
class Stop:
    """The cell is done: the peer's ``Replayer.run`` returns."""


def channel_name(cell: int, peer: int) -> str:
    return f"lockstep{cell}-{peer}"


# -- encoding ----------------------------------------------------------------------------------------------
def _mesh_spec(mesh: Mesh) -> MeshSpec:
    return MeshSpec(np.vectorize(lambda d: d.id)(mesh.devices), tuple(mesh.axis_names))


def _sharding_spec(s: Any) -> ShardingSpec:
    if not isinstance(s, NamedSharding):
        raise LockstepError(f"lockstep calls take NamedShardings only, got {type(s).__name__}")
    return ShardingSpec(_mesh_spec(s.mesh), s.spec, s.memory_kind)


@functools.lru_cache(maxsize=256)
def _mesh(ids: bytes, shape: tuple[int, ...], axis_names: tuple[str, ...]) -> Mesh:
    by_id = {d.id: d for d in jax.devices()}
    flat = np.frombuffer(ids, np.int64)
    return Mesh(np.array([by_id[int(i)] for i in flat], dtype=object).reshape(shape), axis_names)


def _decode_mesh(m: MeshSpec) -> Mesh:
    ids = np.asarray(m.devices, np.int64)
    return _mesh(ids.tobytes(), ids.shape, m.axis_names)


def _decode_sharding(s: ShardingSpec) -> NamedSharding:
    return NamedSharding(_decode_mesh(s.mesh), s.spec, memory_kind=s.memory_kind)


_ENCODED = (Ref, Value, ObjectRef, MeshSpec, ShardingSpec, AbstractSpec)


def _is_special(x: Any) -> bool:
    return isinstance(x, (Mesh, NamedSharding, jax.ShapeDtypeStruct))


# -- the driver's side ---------------------------------------------------------------------------------------
class Lockstep:
    """The driver's end of a cell over several processes: ``call`` runs a device call here and on every peer.

    ``objects``: what both sides hold under the same names before any call (the cells, the cell factory ...).
    Thread-safe: every call takes ``lock`` for its send and its run here, so every process runs the cell's calls
    in one order."""

    def __init__(self, client: Any, cell: Any, objects: dict[str, Any] | None = None):
        self.cell = cell
        self.process = cell.processes[0]
        self.peers = tuple(cell.processes[1:])
        self.devices = frozenset(cell.devices)
        self.channels = [Channel(client, channel_name(cell.index, p)) for p in self.peers]
        self.lock = threading.RLock()
        self._seq = itertools.count()
        self._refs: dict[int, Ref] = {}  # id(array) -> its ref (while the array lives here)
        self._forgotten: collections.deque[Ref] = collections.deque()
        self._names: dict[int, str] = {}  # id(object) -> its name
        self.objects: dict[str, Any] = {}
        self.calls = 0
        self.recent: collections.deque[str] = collections.deque(maxlen=RECENT_CALLS)
        self._closed = False
        for name, obj in (objects or {}).items():
            self.register(name, obj)

    # objects and arrays both sides hold --------------------------------------------------------------------
    def register(self, name: str, obj: Any) -> None:
        """``obj`` is known to both sides as ``name`` (the peer registers its own under the same name)."""
        self.objects[name] = obj
        self._names[id(obj)] = name

    def adopt(self, name: str, tree: Any) -> Any:
        """The arrays of ``tree`` (computed by both sides together, e.g. published collectively) as ``Ref(name, i)``;
        the peer calls ``Replayer.adopt`` with its own tree under the same name."""
        self._track(name, tree)
        return tree

    def _track(self, call: int | str, tree: Any) -> None:
        for i, x in enumerate(a for a in jax.tree.leaves(tree) if isinstance(a, jax.Array)):
            ref = Ref(call, i)
            key = id(x)
            if self._refs.get(key) is not None:  # the same array again (a no-op move): its first ref stands,
                self._forgotten.append(ref)  # and the peer drops the second at the next call
                continue
            self._refs[key] = ref
            weakref.finalize(x, self._drop, key, ref)

    def _drop(self, key: int, ref: Ref) -> None:
        if self._refs.get(key) == ref:
            del self._refs[key]
        self._forgotten.append(ref)

    # encoding ------------------------------------------------------------------------------------------
    def _encode_leaf(self, x: Any) -> Any:
        name = self._names.get(id(x))
        if name is not None:
            return ObjectRef(name)
        if isinstance(x, jax.Array):
            ref = self._refs.get(id(x))
            if ref is not None:
                return ref
            if x.is_fully_addressable and not getattr(x, "committed", True):
                return Value(np.asarray(x))
            raise LockstepError(
                f"cell{self.cell.index}: a lockstep call got an array {x.shape} {x.dtype} on {x.sharding} that no "
                f"lockstep call made, so the cell's other processes {list(self.peers)} do not hold it: make it with "
                f"Lockstep.call (or adopt it on every process)"
            )
        if isinstance(x, NamedSharding):
            return _sharding_spec(x)
        if isinstance(x, Mesh):
            return _mesh_spec(x)
        if isinstance(x, jax.ShapeDtypeStruct):
            sharding = None if x.sharding is None else _sharding_spec(x.sharding)
            return AbstractSpec(tuple(x.shape), np.dtype(x.dtype), sharding)
        return x

    def encode(self, tree: Any) -> Any:
        return jax.tree.map(self._encode_leaf, tree, is_leaf=lambda x: _is_special(x) or id(x) in self._names)

    # calls -------------------------------------------------------------------------------------------
    def call(
        self,
        target: str | None,
        path: str,
        *args: Any,
        local: Callable[..., Any] | None = None,
        bind: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Runs ``target``'s ``path`` (or the function ``path``, ``module:qualname``, with no target) on ``args`` on
        every peer and here (``local``: what runs here instead, e.g. the unwrapped method); returns this process's
        result. ``bind``: the result is an object both sides then hold under that name."""
        with self.lock:
            if self._closed:
                raise LockstepError(f"cell{self.cell.index}'s lockstep is stopped: no more device calls on it")
            seq = next(self._seq)
            forget = []
            while self._forgotten:
                forget.append(self._forgotten.popleft())
            message = Call(seq, target, path, self.encode(args), self.encode(kwargs), bind, tuple(forget))
            for ch in self.channels:
                ch.send(message)
            self.calls += 1
            self.recent.append(describe_call(seq, target, path, threading.current_thread().name))
            fn = local if local is not None else resolve(self.objects, target, path)
            try:
                result = fn(*args, **kwargs)
            except Exception:
                log.error(
                    "cell%d: lockstep call #%d failed here after its peers %s were sent it (they run it too, so "
                    "the cell's processes may no longer run the same device programs); this process's last calls: %s",
                    self.cell.index,
                    seq,
                    list(self.peers),
                    "; ".join(self.recent),
                )
                raise
            self._track(seq, result)
            if bind is not None:
                self.register(bind, result)
                self._track(bind, held_arrays(result))
            return result

    def run_program(self, name: str) -> Callable[[Any, tuple], Any]:
        """A ``Programs.runner`` for the program table of the engine bound as ``name``."""

        engine = ObjectRef(name)

        def runner(program, args: tuple) -> Any:
            return self.call(
                None, f"{__name__}:run_program", engine, program.name, *args, local=lambda _e, _n, *a: program.run(*a)
            )

        return runner

    def read(self, tree: Any) -> Any:
        """``jax.device_get(tree)`` of arrays this process may hold only in part: those split over processes are
        first replicated over their mesh (one lockstep call), the rest read as they are."""
        split = [
            x
            for x in jax.tree.leaves(tree)
            if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated
        ]
        if split:
            tree = self.call(None, f"{__name__}:replicated", tree)
        return jax.device_get(tree)

    def stop(self) -> None:
        """Tells every peer the cell is done (once); later calls raise."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            for ch in self.channels:
                try:
                    ch.send(Stop())
                except Exception as exc:  # noqa: BLE001 - the peer may be gone already
                    log.warning("cell%d: could not tell a peer to stop: %s", self.cell.index, exc)


def describe_call(seq: int, target: str | None, path: str, thread: str = "") -> str:
    """One line of a side's recent calls: ``#seq target.path`` (and the driver's thread that made it)."""
    what = path if target is None else f"{target}.{path}"
    return f"#{seq} {what}" + (f" [{thread}]" if thread else "")


def resolve(objects: dict[str, Any], target: str | None, path: str) -> Callable[..., Any]:
    """The callable a ``Call`` names (see ``Call``)."""
    if target is None:
        module, _, qualname = path.partition(":")
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    obj = objects[target]
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def held_arrays(obj: Any, depth: int = 2) -> list[jax.Array]:
    """The arrays an object holds in its attributes (and theirs, ``depth`` levels down), in a fixed order: what a
    bound object made on each process when it was built (an engine's decode state), matched by position."""
    out: list[jax.Array] = []
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict) or isinstance(obj, type):
        return out
    for key in sorted(attrs):
        value = attrs[key]
        arrays = [x for x in jax.tree.leaves(value) if isinstance(x, jax.Array)]
        out.extend(arrays)
        if not arrays and depth > 0 and not isinstance(value, (Mesh, jax.sharding.Sharding)):
            out.extend(held_arrays(value, depth - 1))
    return out


def run_program(engine: Any, name: str, *args: Any) -> Any:
    """Runs ``engine``'s program ``name`` here (a peer's part of its driver's program call)."""
    return find_program(engine, name).run(*args)


def find_program(engine: Any, name: str) -> Any:
    """``engine``'s program ``name``; one its driver made on demand (a page pool of a new size, ``init_pool_<n>``)
    is made here the same way."""
    for program in engine.programs.all:
        if program.name == name:
            return program
    pool = re.fullmatch(r"init_pool_(\d+)", name)
    if pool is not None:
        for part in (engine, *vars(engine).values()):
            for owner in (part, *getattr(part, "__dict__", {}).values()):
                if hasattr(owner, "init_pool_program"):
                    return owner.init_pool_program(int(pool.group(1)))
    raise LockstepError(f"the cell's engine has no program {name!r} here: its processes built different engines")


def replicated(tree: Any) -> Any:
    """``tree`` replicated over each leaf's mesh (so that any process of it can read it)."""

    def one(x):
        return jax.jit(lambda a: a, out_shardings=NamedSharding(x.sharding.mesh, PartitionSpec()))(x)

    return jax.tree.map(one, tree)


def copy_tree(tree: Any) -> Any:
    """A copy of every array of ``tree`` (new buffers, same shardings)."""
    return jax.tree.map(jax.numpy.copy, tree)


# -- the peer's side ------------------------------------------------------------------------------------
class Replayer:
    """A peer of a cell over several processes: runs the driver's calls in the order sent until ``Stop``.

    ``objects``: this process's objects under the names the driver uses (the same cells, factory ...)."""

    def __init__(self, client: Any, cell: Any, process: int, objects: dict[str, Any]):
        self.cell = cell
        self.process = process
        self.objects = dict(objects)
        self.arrays: dict[Ref, jax.Array] = {}
        self.failed: dict[int, str] = {}  # call seq -> why it failed here
        self.channel = Channel(client, channel_name(cell.index, process))
        self.calls = 0
        self.recent: collections.deque[str] = collections.deque(maxlen=RECENT_CALLS)

    def adopt(self, name: str, tree: Any) -> Any:
        for i, x in enumerate(a for a in jax.tree.leaves(tree) if isinstance(a, jax.Array)):
            self.arrays[Ref(name, i)] = x
        return tree

    def _decode_leaf(self, x: Any) -> Any:
        if isinstance(x, Ref):
            try:
                return self.arrays[x]
            except KeyError:
                why = self.failed.get(x.call) if isinstance(x.call, int) else None
                raise LockstepError(
                    f"process {self.process} (cell{self.cell.index}): the driver's call uses an array this process "
                    f"does not hold ({x}"
                    + (f"; the call that made it failed here: {why}" if why else "")
                    + "): the cell's processes are out of lockstep"
                ) from None
        if isinstance(x, Value):
            return jax.numpy.asarray(x.array)
        if isinstance(x, ObjectRef):
            return self.objects[x.name]
        if isinstance(x, ShardingSpec):
            return _decode_sharding(x)
        if isinstance(x, MeshSpec):
            return _decode_mesh(x)
        if isinstance(x, AbstractSpec):
            return jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=None if x.sharding is None else _decode_sharding(x.sharding)
            )
        return x

    def decode(self, tree: Any) -> Any:
        return jax.tree.map(self._decode_leaf, tree, is_leaf=lambda x: isinstance(x, _ENCODED))

    def handle(self, call: Call) -> None:
        for ref in call.forget:
            self.arrays.pop(ref, None)
        args, kwargs = self.decode(call.args), self.decode(call.kwargs)
        fn = resolve(self.objects, call.target, call.path)
        self.calls += 1
        self.recent.append(describe_call(call.seq, call.target, call.path))
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the driver's own run of it most likely failed the same way
            self.failed[call.seq] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log.warning(
                "process %d: lockstep call #%d %s failed: %r; this process's last calls: %s",
                self.process,
                call.seq,
                call.path,
                exc,
                "; ".join(self.recent),
            )
            return
        for i, x in enumerate(a for a in jax.tree.leaves(result) if isinstance(a, jax.Array)):
            self.arrays[Ref(call.seq, i)] = x
        if call.bind is not None:
            self.objects[call.bind] = result
            self.adopt(call.bind, held_arrays(result))

    def run(self) -> None:
        """Runs calls until the driver's ``Stop``."""
        while True:
            try:
                message = self.channel.recv()
            except TimeoutError:
                continue
            except Exception as exc:  # noqa: BLE001 - the driver is gone: the watchdog says so
                log.error(
                    "process %d: cell%d's last calls here: %s", self.process, self.cell.index, "; ".join(self.recent)
                )
                raise DistributedError(
                    f"process {self.process} lost its cell's driver (process {self.cell.processes[0]}): "
                    f"{type(exc).__name__}: {str(exc)[:200]}; restart all processes to resume from the last checkpoint"
                ) from None
            if isinstance(message, Stop):
                return
            self.handle(message)


# -- this process's cell ------------------------------------------------------------------------------------
_DRIVING: list[Lockstep] = []  # the lockstep of the cell over several processes this process drives (at most one)


def drive(client: Any, cell: Any, objects: dict[str, Any]) -> Lockstep:
    """This process drives ``cell`` (its first process; the cell spans processes): its ``Lockstep``."""
    if _DRIVING:
        raise LockstepError(f"process already drives cell{_DRIVING[0].cell.index}: a process drives one cell")
    group = Lockstep(client, cell, objects)
    _DRIVING.append(group)
    return group


def driving(*meshes: Any) -> Lockstep | None:
    """The ``Lockstep`` of this process's cell if it drives one whose devices any of ``meshes`` (Meshes, Cells,
    device collections) touch; else None."""
    if not _DRIVING:
        return None
    group = _DRIVING[0]
    for m in meshes:
        devices = m.devices.flat if isinstance(m, Mesh) else getattr(m, "devices", m)
        if group.devices.intersection(devices):
            return group
    return None


def stop_all() -> None:
    """Tells the peers of the cell this process drives that it is done (``runtime.shutdown``)."""
    for group in _DRIVING:
        group.stop()


# -- the pieces a driver runs through its lockstep -----------------------------------------------------------
class LockstepEngine:
    """A serving engine of a cell over several processes, as its driver's loop sees it: the engine itself (its
    programs run in lockstep through ``Programs.runner``), but host reads of arrays split over processes go
    through ``Lockstep.read``."""

    def __init__(self, group: Lockstep, engine: Any, name: str):
        self._group, self._engine, self._name = group, engine, name
        engine.programs.runner = group.run_program(name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._engine, attr)

    def keys(self) -> np.ndarray:
        return np.asarray(self._group.read(self._engine.state.keys))


class LockstepWorker:
    """A gradient worker of a cell over several processes (its driver's): ``micro_step`` runs in lockstep; the
    peer's worker is ``name`` (an object, or an attribute path of one: ``learner.worker``)."""

    def __init__(self, group: Lockstep, worker: Any, target: str, path: str = ""):
        self._group, self._worker, self._target, self._path = group, worker, target, path
        self.name = worker.name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._worker, attr)

    def _method(self, name: str) -> str:
        return f"{self._path}.{name}" if self._path else name

    def micro_step(self, params: Any, mb: Any, kind: str = "rl", ref_params: Any = None) -> tuple[Any, dict]:
        return self._group.call(
            self._target, self._method("micro_step"), params, mb, kind, ref_params, local=self._worker.micro_step
        )

    def snapshot(self, params: Any, slot: str = "params") -> Any:
        params = lora.source_of(params)  # peers receive trees (a packed adapter's layout does not cross processes)
        return self._group.call(self._target, self._method("snapshot"), params, slot, local=self._worker.snapshot)


class LockstepAccumulator(GradAccumulator):
    """The core's gradient sum when the core spans processes: each add is a lockstep call."""

    def __init__(self, group: Lockstep, shardings: Any, num_slots: int, ordered: bool = True):
        super().__init__(shardings, num_slots, ordered=ordered)
        self._group = group

    def _accumulate_locked(self, grads: Any) -> None:
        if self._total is None:
            self._total = self._group.call(None, "gyre_jax.rl.accumulator:_start_sum", grads)
        else:
            self._total = self._group.call(None, "gyre_jax.rl.accumulator:_add_into", self._total, grads)


class LockstepLearner(Learner):
    """The core's learner when the core cell spans processes (its driver, process 0): its device calls (the train
    state's init, each micro-step, the gradient sum, the optimizer step) run in lockstep on the core's processes,
    whose peers hold a plain ``Learner`` built the same way, registered as ``learner``."""

    def __init__(self, group: Lockstep, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.group = group
        group.register("learner", self)
        self.worker = LockstepWorker(group, self.worker, "learner", "worker")
        apply = self._apply
        self._apply = lambda *a: group.call("learner", "_apply", *a, local=apply)

    def init_state(self, params: Any, step: int = 0) -> Any:
        return self.group.call("learner", "init_state", params, step, local=super().init_state)

    def abstract_state(self) -> Any:
        shapes = jax.eval_shape(lambda p: Learner.init_state(self, p), self._abstract_params)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

    def new_accumulator(self, num_slots: int) -> GradAccumulator:
        return LockstepAccumulator(self.group, self.param_shardings, num_slots, ordered=self.ordered_accumulation)


@dataclass
class LockstepCheckpointer:
    """A ``checkpoint.Checkpointer`` of the core when it spans processes: every process of the core holds one
    (bound as ``name``) and writes its own shards; ``save`` and ``restore`` run in lockstep."""

    group: Lockstep
    inner: Any
    name: str
    directory: Any = field(init=False)

    def __post_init__(self):
        self.directory = self.inner.directory

    def __getattr__(self, attr: str) -> Any:  # latest_step, all_steps, saved_paths ...: host reads, here alone
        return getattr(self.inner, attr)

    def save(self, step: int, state: Any, meta: dict) -> None:
        self.group.call(self.name, "save", step, state, meta)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        return self.group.call(self.name, "restore", step, abstract_state)

    def close(self) -> None:
        self.group.call(self.name, "close")


def checkpointer(group: Lockstep, name: str, directory: Any, max_to_keep: int, processes: Sequence[int]) -> Any:
    """A ``LockstepCheckpointer`` over ``Checkpointer(directory, max_to_keep, processes=processes)``, made on every
    process of the cell (orbax coordinates the processes that write)."""
    inner = group.call(
        None,
        "gyre_jax.checkpoint:Checkpointer",
        directory,
        max_to_keep,
        processes=tuple(processes),
        bind=name,
    )
    return LockstepCheckpointer(group, inner, name)
