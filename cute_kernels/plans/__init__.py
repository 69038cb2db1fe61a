"""Host-only plans: per kernel family the frozen config dataclass (compile key and call signature),
its limits, the hardware constants it is sized by, and the launch schedule. Nothing here imports
torch, and nothing here imports a kernel module at import time."""
