"""The op launcher every public op shares: key -> prepare -> cached launch -> full validation when
the compiled function refuses -> reference for CPU tensors.

An op builds a tuple key of cheap tensor attributes (what selects its kernels, configs and
workspaces) and asks its :class:`Launcher` for the prepared launch of that key. The first call of a
key runs the op's ``prepare`` (full validation with errors naming the argument, kernel selection,
workspace views) and caches the result; later calls go straight to the launch's caller, built by
:func:`bind` from the kernels' argument specs, and the TVM-FFI functions check dtypes, ranks,
shared extents, devices and alignment themselves. When one refuses an argument, ``prepare`` runs
again to raise a clear error. A launch prepared for CPU tensors runs the reference (validated at
every call: no compiled function checks anything there).

Hot path per call: one tuple key, one dict lookup, one generated caller: no dict or list is built
(docs/design/architecture.md#launcher). Torch-free: ops pass tensors through, the dispatcher's
layer uses :func:`check_scale` at construction.

NVTX: a launcher named after its op (``Launcher(..., op="paged_decode")``) opens the range
``cute_kernels.<op>`` (shapes in a range nested inside, :mod:`cute_kernels._nvtx`) around every
call when a profiler is attached: the callers it binds carry the range in their generated source,
and the reference path opens it too. Without a profiler the generated callers are those of an
unnamed launcher, so the hot path pays nothing.
"""

from __future__ import annotations

import contextlib
import inspect
import keyword
import os
import re
import weakref
from collections.abc import Callable
from typing import Any

from .. import _nvtx
from ..jit.spec import ScalarArg
from ..plans.args import FP32_MAX, fp32_note, positive_fp32

# ---------------------------------------------------------------------------------------------
# checked mode: CUTE_KERNELS_CHECK=1 validates the data of every call (docs/design/inputs.md#checked-mode)
# ---------------------------------------------------------------------------------------------

_checked = os.environ.get("CUTE_KERNELS_CHECK", "") not in ("", "0")
_caches: weakref.WeakSet = weakref.WeakSet()
_NO_ENTRIES: dict = {}  # the hot path's dict in checked mode: never filled, every call takes the slow path


def checked() -> bool:
    """Whether checked mode is on (``CUTE_KERNELS_CHECK=1`` at import, or :func:`set_checked`)."""
    return _checked


def set_checked(flag: bool) -> bool:
    """Turn checked mode on or off for every op; returns the previous state. On, every call goes
    through its op's data checks (which synchronize: the data is read on the host); off, the hot
    path is one dict lookup again."""
    global _checked
    previous, _checked = _checked, bool(flag)
    for cache in list(_caches):
        cache.entries = _NO_ENTRIES if _checked else cache.launches
    return previous


class LaunchCache:
    """Prepared launches by key, and the active tuning override (part of every key).

    ``entries`` is the dict the ops' hot paths read: ``launches`` itself, or, in checked mode, an
    empty dict, so that every call goes through :meth:`Launcher.lookup` and its data checks.
    Dropping launches when ``max_entries`` is reached is safe for captured CUDA graphs: the
    workspaces a launch binds belong to their :class:`~cute_kernels.ops._torch.DeviceBuffer`,
    which keeps every buffer it handed out (docs/design/inputs.md#workspaces)."""

    def __init__(self, max_entries: int = 4096):
        self.launches: dict[Any, Any] = {}  # launch key -> the op's prepared launch
        self.entries: dict[Any, Any] = _NO_ENTRIES if _checked else self.launches
        self.max_entries = max_entries
        self.override: dict[str, Any] = {}
        self.override_key: tuple = ()
        _caches.add(self)

    def get(self, key):
        return self.launches.get(key)

    def put(self, key, launch) -> None:
        if len(self.launches) >= self.max_entries:  # shapes churn: start over rather than grow forever
            self.launches.clear()
        self.launches[key] = launch

    def clear(self) -> None:
        self.launches.clear()

    def tuning_override(self, **fields: object) -> TuningOverride:
        return TuningOverride(self, fields)


class TuningOverride:
    """Context manager: ``fields`` override the op's tuning while active (nests)."""

    def __init__(self, cache: LaunchCache, fields: dict) -> None:
        self.cache, self.fields = cache, fields

    def __enter__(self):
        self.saved = dict(self.cache.override)
        self._set({**self.saved, **self.fields})
        return self

    def __exit__(self, *exc):
        self._set(self.saved)
        return False

    def _set(self, fields: dict) -> None:
        self.cache.override = fields
        self.cache.override_key = tuple(sorted(fields.items()))


class Launcher(LaunchCache):
    """The skeleton of one op. ``prepare(*args)`` validates the op's arguments in full and returns
    its launch (an object whose ``reference`` attribute says CPU tensors run the reference);
    ``reference(*args)`` computes the result with :mod:`cute_kernels.reference`. An op's hot path
    is ``launch = launcher.entries.get(key)`` (one dict lookup), then the launch's caller inside
    ``try: ... except Exception: launcher.refused(args); raise``; a missing or reference launch
    goes through :meth:`lookup` and :meth:`run_reference`, where the argument tuple is built (off
    the hot path)."""

    def __init__(self, prepare: Callable[..., Any], reference: Callable[..., Any], max_entries: int = 4096,
                 check_data: Callable[..., Any] | None = None, *, op: str | None = None) -> None:
        super().__init__(max_entries)
        self.prepare, self.reference, self.op = prepare, reference, op
        self.check_data = check_data  # checked mode: the op's data checks, with prepare's arguments
        self._arg_names = tuple(inspect.signature(prepare).parameters)  # the reference path's NVTX detail

    def bind(self, params: tuple[str, ...], *steps: tuple) -> Callable[..., None]:
        """:func:`bind` with this launcher's NVTX range."""
        return bind(params, *steps, op=self.op)

    def range(self, **tensors: Any) -> contextlib.AbstractContextManager:
        """The op's NVTX ranges around work that no bound caller runs (a null context without a
        profiler or an op name)."""
        return _nvtx.op_range(self.op, **tensors) if self.op is not None else _nvtx.NULL_RANGE

    def lookup(self, key, args: tuple):
        """The launch of ``key`` (None: arguments that cannot form a key, validated here). In
        checked mode the call's data is validated too (every call comes here then)."""
        launch = self.launches.get(key)
        if launch is None:
            launch = self.prepare(*args)
            if key is not None:
                self.put(key, launch)
        if _checked and self.check_data is not None:
            self.check_data(*args)
        return launch

    def run_reference(self, args: tuple):
        """CPU tensors: validate (every call) and compute with the reference."""
        if self.op is not None and _nvtx.ENABLED:
            with _nvtx.op_range(self.op, **dict(zip(self._arg_names, args))):
                self.prepare(*args)
                return self.reference(*args)
        self.prepare(*args)
        return self.reference(*args)

    def refused(self, args: tuple) -> None:
        """A compiled function refused an argument the key leaves to it: validate in full, so that
        the error names the argument and what was expected (the caller re-raises otherwise)."""
        self.prepare(*args)


# ---------------------------------------------------------------------------------------------
# the binder: kernel argument specs -> one positional caller per launch
# ---------------------------------------------------------------------------------------------

_NAME = re.compile(r"^[A-Za-z_]\w*$")
_SOURCE = re.compile(r"^([A-Za-z_]\w*)(\.view\(1\)\??)?$")


def _identifier(name: str) -> str:
    if not _NAME.match(name) or keyword.iskeyword(name):
        raise ValueError(f"{name!r} is not an identifier")
    return name


def bind(params: tuple[str, ...], *steps: tuple, op: str | None = None) -> Callable[..., None]:
    """One function ``call(*params)`` that calls each step's compiled function with its arguments
    in its signature's order. A step is ``(fn, signature, sources, constants)``: an argument is
    the constant ``constants[name]`` bound now (workspace views, ``sm_scale``...) when there is
    one, else the per-call parameter ``sources.get(name, name)``: a parameter name, optionally
    with ``.view(1)`` (a 1-element tensor of another rank passed to a rank-1 argument) or
    ``.view(1)?`` (the same when it is not 1-D already: a rank the launch key leaves open). A per-call
    fp32 scalar named ``*_scale`` is checked on the way (a positive float finite in fp32 passes at the
    cost of one type test; anything else goes through :func:`check_scale`, which returns it as a
    float or raises naming it).

    The caller is generated source compiled once per launch key, so a call builds no dict or list:
    the launch's per-call host cost is that of a hand-written positional call. With ``op`` and a
    profiler attached (:data:`cute_kernels._nvtx.ENABLED`), the steps run inside the op's NVTX
    ranges, the parameters described in the nested one."""
    params = tuple(_identifier(p) for p in params)
    env: dict = {"_fmax": FP32_MAX, "_scale": _float_scale}
    ranged = op is not None and _nvtx.ENABLED
    lines = []
    for i, (fn, signature, sources, constants) in enumerate(steps):
        env[f"_fn{i}"] = fn
        args = []
        for a in signature:
            if constants is not None and a.name in constants:  # bound now: workspace views, sm_scale...
                const = f"_c{i}_{_identifier(a.name)}"
                env[const] = constants[a.name]
                args.append(const)
                continue
            src = (sources or {}).get(a.name, a.name)
            m = _SOURCE.match(src)
            if not (m and m.group(1) in params):
                raise KeyError(f"kernel argument {a.name!r} is neither a call parameter nor a bound constant")
            p, how = m.group(1), m.group(2)
            if how == ".view(1)":  # a 1-element tensor of another rank, known at prepare time
                src = f"{p}.view(1)"
            elif how == ".view(1)?":  # a 1-element tensor whose rank the key leaves open
                src = f"({p} if {p}.ndim == 1 else {p}.view(1))"
            elif isinstance(a, ScalarArg) and a.dtype == "fp32" and a.name.endswith("_scale"):
                src = f"({p} if type({p}) is float and 0.0 < {p} <= _fmax else _scale({p!r}, {p}))"
            args.append(src)
        lines.append(f"    _fn{i}({', '.join(args)})")
    if ranged:
        env["_range"], env["_op"] = _nvtx.op_range, op
        described = ", ".join(f"{p}={p}" for p in params)
        lines = [f"    with _range(_op, {described}):"] + ["    " + line for line in lines]
    source = f"def call({', '.join(params)}):\n" + "\n".join(lines) + "\n"
    exec(compile(source, "<cute_kernels launch>", "exec"), env)  # noqa: S102 - source built from identifiers
    return env["call"]


# ---------------------------------------------------------------------------------------------
# the one scale validator
# ---------------------------------------------------------------------------------------------


def _is_tensor(value) -> bool:
    return hasattr(value, "numel") and hasattr(value, "dtype") and hasattr(value, "dim")


def check_scale(name: str, value, *, device=None, tensors: bool = True, num_q_heads: int | None = None,
                num_kv_heads: int | None = None) -> bool:
    """Validate a dequantization scale without reading its value on the device; True if it is a
    tensor. Accepted: a positive float (or int) finite as an fp32 (:func:`plans.args.positive_fp32`); with ``tensors``, an fp32 tensor with one
    element (0-d or any shape: the ops pass it as a 1-element view) on ``device``; with
    ``num_q_heads``, also a contiguous fp32 ``[Hkv]`` tensor, ``num_q_heads % Hkv == 0`` (and
    ``Hkv == num_kv_heads`` when given): per KV head. Raises ``TypeError``/``ValueError`` naming
    the argument."""
    if _is_tensor(value):
        if not tensors:
            raise ValueError(f"{name} must be a positive finite float, got a tensor")
        dtype = str(value.dtype).replace("torch.", "")
        if dtype != "float32":
            raise TypeError(f"{name} must be a float or a float32 tensor, got dtype {dtype}")
        n = value.numel()
        if n == 0:  # no value to read (and no KV-head count it could be per)
            raise ValueError(f"{name} must be a float or a tensor holding one value (or one per KV head), got shape "
                             f"{tuple(value.shape)}")
        if n != 1:
            per_head = (num_q_heads is not None and value.dim() == 1 and num_q_heads % n == 0
                        and (num_kv_heads is None or n == num_kv_heads))
            if not per_head:
                kinds = ("a 1-element tensor or a per-KV-head [num_kv_heads] tensor (num_q_heads % num_kv_heads "
                         "== 0)" if num_q_heads is not None else "a 1-element tensor")
                raise ValueError(f"{name} must be a float or {kinds}, got shape {tuple(value.shape)}")
            if value.stride(0) != 1:
                raise ValueError(f"{name} must be contiguous, got stride {value.stride()}")
        if device is not None and value.device != device:
            raise ValueError(f"{name} must be on {device}, got {value.device}")
        return True
    if not positive_fp32(value):  # finite as the kernels' fp32 scalar too
        kinds = " or a float32 tensor" if tensors else ""
        raise ValueError(f"{name} must be a positive finite float{kinds}, got {value!r}{fp32_note(value)}")
    return False


def _float_scale(name: str, value) -> float:
    check_scale(name, value, tensors=False)
    return float(value)
