"""One description of a kernel's arguments and compile key, free of the DSL and of torch.

A kernel config (a frozen dataclass deriving :class:`KernelConfig`, defined in a host-only plan
module under :mod:`cute_kernels.plans`) returns its signature as a tuple of :class:`TensorArg`
and :class:`ScalarArg`. The compiler turns that signature into fake CuTe tensors
(:mod:`cute_kernels.jit.fake`); the op launcher turns it into the positional argument list of the
compiled function (:mod:`cute_kernels.ops._launch`). Both come from the same tuple, so they
cannot drift apart.

Extents named by the same string are one symbolic integer: TVM-FFI then checks at call time that
the tensors agree on them (e.g. the head dim of Q and of the output).

Nothing here imports ``cutlass`` or ``torch``: plans, the registry, the dispatcher and the CLI's
``matrix``/``plan`` commands use it on machines without either.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Union

Extent = Union[int, str]

# bits per element of the dtype names configs carry (the DSL types are in jit/dtypes.py)
DTYPE_BITS = {"bf16": 16, "fp16": 16, "fp32": 32, "fp8_e4m3": 8, "int32": 32, "int64": 64, "uint8": 8}

# Targets this package compiles for. Arch-specific kernels name their own subset; arch-neutral
# ones (merge) compile for every target the DSL knows from SM80 on.
ALL_TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_103a", "sm_120a", "sm_121a")
COMPILE_TARGETS = ("sm_90a", "sm_100a", "sm_103a")


def normalize_target(arch) -> str:
    """``"sm_90"``, ``"sm90a"``, ``90``, ``(9, 0)`` -> ``"sm_90a"`` (the arch-specific variant
    for the archs that have one, since WGMMA and tcgen05 need it)."""
    if isinstance(arch, tuple):
        arch = f"{arch[0]}{arch[1]}"
    a = str(arch).lower().replace("sm_", "").replace("sm", "").rstrip("af")
    for target in ALL_TARGETS:
        if target[3:].rstrip("a") == a:
            return target
    raise ValueError(f"compile target {arch!r} is not supported; expected one of {ALL_TARGETS}")


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument: last dim unit-stride, every other stride dynamic.

    ``align`` is the byte alignment promised for the data pointer and for every dynamic
    stride (in bytes); the op validates it before the call, and TVM-FFI re-checks it.
    ``static_strides`` pins strides known at compile time (None = dynamic), outermost first.
    """

    name: str
    dtype: str
    shape: tuple[Extent, ...]
    align: int = 16
    static_strides: tuple[int | None, ...] | None = None

    @property
    def elem_bits(self) -> int:
        return DTYPE_BITS[self.dtype]

    @property
    def stride_divisibility(self) -> int:
        return max(1, self.align * 8 // self.elem_bits)


@dataclass(frozen=True)
class ScalarArg:
    """A scalar runtime argument (Int32 / Float32 ...)."""

    name: str
    dtype: str


Arg = Union[TensorArg, ScalarArg]


# dataclass field metadata: the field enters a config's label only when it is not its default
LABEL_IF_SET = {"label": "if_set"}


class KernelConfig:
    """Base of every kernel's frozen config dataclass (see :mod:`cute_kernels.plans`).

    A subclass is a ``@dataclass(frozen=True)`` whose fields are exactly what changes code
    generation; the instance itself is the compile key. It provides:

    - ``kernel_id``: the registered id (``"common.merge_states"``, ``"sm90.decode"``...);
    - ``targets``: the compile targets it supports;
    - ``evidence``: per target, ``(display name, PTX regex)`` pairs that prove it uses the
      hardware it claims (``cute-kernels compile`` prints the names with their counts);
    - ``signature()``: the runtime arguments, in order;
    - ``build()``: the kernel object (a class with a ``@cute.jit __call__``) to compile; the
      plan imports the kernel module inside ``build()`` only, so that plans stay host-only.
    """

    kernel_id: ClassVar[str]
    targets: ClassVar[tuple[str, ...]] = COMPILE_TARGETS
    evidence: ClassVar[dict[str, tuple[tuple[str, str], ...]]] = {}

    def signature(self) -> tuple[Arg, ...]:  # pragma: no cover - abstract
        raise NotImplementedError

    def build(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.signature())

    def label(self) -> str:
        """``kernel_id[field=value,...]`` over the dataclass fields (the compile key). A field
        declared with ``metadata=LABEL_IF_SET`` appears only when it differs from its default, so
        that a flag added to a config later leaves every existing variant's label (and its PTX
        digest entry) as it was."""
        fields: tuple[dataclasses.Field, ...] = dataclasses.fields(self) if dataclasses.is_dataclass(self) else ()
        names: list[str] = [f.name for f in fields
                 if not (f.metadata.get("label") == "if_set" and getattr(self, f.name) == self.label_default(f))]
        return self.kernel_id + "[" + ",".join(f"{k}={getattr(self, k)}" for k in names) + "]"

    def label_default(self, f: dataclasses.Field) -> Any:
        """The value of a ``LABEL_IF_SET`` field that :meth:`label` leaves out: its declared default,
        unless the config resolves that default from its other fields (then it says so here)."""
        return f.default


def call_arguments(signature: tuple[Arg, ...], values: dict) -> list:
    """Positional arguments of the compiled function, picked from ``values`` by name (tests and
    one-off launches; the ops bind once per launch key, see :mod:`cute_kernels.ops._launch`)."""
    missing = [a.name for a in signature if a.name not in values]
    if missing:
        raise KeyError(f"missing kernel arguments: {missing}")
    return [values[a.name] for a in signature]


def bind_arguments(names: tuple[str, ...], args: tuple) -> dict:
    """``{name: value}`` of a kernel's ``@cute.jit __call__(self, *args)``: the config's argument
    names in signature order, then ``"stream"``. One kernel class then serves every argument list
    its config derives (a variant takes only the arguments it uses: each costs host time per call)."""
    if len(args) != len(names) + 1:
        raise TypeError(f"expected the arguments {names} and a stream, got {len(args)} values")
    return dict(zip((*names, "stream"), args))


_FIELD_TYPES = {"bool": bool, "int": int, "str": str}


def check_override(config_cls: type, override: dict, *, fixed=(), extra=(), kernel: str | None = None) -> None:
    """A tuning override's fields, checked against the config they replace fields of: each one
    a field of ``config_cls`` or one of ``extra`` (keys its plan reads itself), none of ``fixed``
    (what the call decides: dtypes, shapes, options), of the field's declared type (a ``bool``
    field takes True/False only: ``"no"`` would be true). ``ValueError`` / ``TypeError`` naming
    the field, before any config is built (a ``TypeError`` from the dataclass otherwise). ``kernel``:
    what the errors name (default: the config's kernel id)."""
    types = {f.name: str(f.type) for f in dataclasses.fields(config_cls)}
    kernel = kernel or getattr(config_cls, "kernel_id", config_cls.__name__)
    for name, value in override.items():
        if name in fixed or (name not in types and name not in extra):
            tunable = ", ".join(sorted((set(types) - set(fixed)) | set(extra)))
            why = " (the call's arguments decide it)" if name in fixed else ""
            raise ValueError(f"tuning_override: {name!r} is not a tuning field of {kernel}{why}; its fields: {tunable}")
        want = _FIELD_TYPES.get(types.get(name, ""))
        if want is not None and not (type(value) is want or (want is int and type(value) is not bool
                                                             and isinstance(value, int))):
            article = "an" if want is int else "a"
            raise TypeError(f"tuning_override: {kernel}'s {name} must be {article} {want.__name__}, got {value!r}")
