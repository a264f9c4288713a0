"""Loaded by every Python process of a local engine (scripts/engine.sh puts this directory on
PYTHONPATH), the workers vLLM spawns included.

On CPUs with AMX (Sapphire Rapids and later), Linux lets a process use the AMX tile registers
only after it asks (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); the first AMX instruction of one that
did not is killed with SIGILL. vLLM's CPU attention picks its AMX kernel on such CPUs but never
asks: a worker that reaches attention before oneDNN has asked for it (with LoRA on, the first
forward pass does) dies on its first request. torch asks when told to.
"""

try:
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
except Exception:  # noqa: S110 - no torch, or no AMX: nothing to ask for
    pass
