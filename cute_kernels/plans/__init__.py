"""Host-only plans: per kernel family the frozen config (compile key and call signature), its limits,
hardware constants and budgets. Modules here import neither the CuTe DSL nor torch."""
