"""Host-only plans: per kernel family, the frozen config (compile key and call signature), its
limits, the hardware facts, the tuning tables and the launch schedule.

Nothing under this package imports ``cutlass`` or ``torch`` at module level (a CPU test imports
every module with both absent), so the op, the dispatcher, the warm-up, the compile matrix and the
CLI read one set of numbers anywhere. A config's ``build()`` imports its kernel module when the
compiler asks for the kernel object; kernels never import plans: what a kernel needs from its plan
it reads from the config instance it is built with. See docs/design/architecture.md#plans-and-configs.
"""
