"""Small device helpers shared by the SM100 kernels (tensor memory, register roles, views)."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cutlass_dsl import dsl_user_op

from ..jit.dtypes import cute_dtype
from ..roles.fragments import special_register


@dsl_user_op
def fresh_warp_index(*, loc=None, ip=None) -> Int32:
    """The warp index, read again from ``%tid.x`` (volatile): a value kept from before a role's
    ``setmaxnreg`` would be spilled by ptxas, a fresh read is not."""
    return cute.arch.make_warp_uniform(special_register("tid.x", loc=loc, ip=ip) // 32, loc=loc, ip=ip)


def last_mode(t, i):
    """(Traced.) ``t`` indexed at ``i`` in its last mode, every other mode kept."""
    return t[(None,) * (cute.rank(t) - 1) + (i,)]


def logical_view(layout_or_tensor, rows, cols):
    """(rows, cols, stage) view of a staged MMA-operand layout or tensor (swizzle kept): element
    (r, c) of an operand whose MMA modes are ((rows, k), 1, cols / k, stage)."""
    stages = cute.size(layout_or_tensor, mode=[3])
    return cute.composition(layout_or_tensor, cute.make_layout((rows, cols, stages)))


def set_registers(budget, role: str):
    """(Traced.) ``setmaxnreg`` of this warpgroup's role (plans/sm100.py ``RegisterBudget``)."""
    regs = budget.of(role)
    if regs < budget.launch:
        cute.arch.setmaxregister_decrease(regs)
    elif regs > budget.launch:
        cute.arch.setmaxregister_increase(regs)


def tmem_base(holder):
    """(Traced.) The TMEM address the allocating warp published in shared memory at ``holder``."""
    return cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=holder)


def config_dtypes(cfg):
    """(query, cache, MMA operand, output) CuTe types of an SM100 config's dtype names."""
    return (cute_dtype(cfg.q_dtype), cute_dtype(cfg.kv_dtype), cute_dtype(cfg.mma_dtype),
            cute_dtype(cfg.out_dtype))


def check_smem(struct_bytes: int, cfg) -> None:
    """The kernel's shared-memory struct within its plan's budget (which the config checked
    against the SM's limit): a plan that underestimates fails the compile, not the launch."""
    if struct_bytes > cfg.smem_bytes:
        raise ValueError(f"{cfg.kernel_id}: the kernel needs {struct_bytes} bytes of shared memory, its plan "
                         f"budgets {cfg.smem_bytes}")


def scalar(x):
    """(Traced.) A scale passed as a float or as a 1-element fp32 tensor."""
    if const_expr(isinstance(x, cute.Tensor)):
        return x[0]
    return Float32(x)
