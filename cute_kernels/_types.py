"""Type aliases of the public API (torch side): what ``kv_cache``, the scales and ``rope`` accept."""

from __future__ import annotations

from typing import TypeAlias, Union

from torch import Tensor

#: one ``[P, 2, Hkv, page, D]`` (HND) / ``[P, 2, page, Hkv, D]`` (NHD) tensor, or ``(k_cache, v_cache)``
KVCache: TypeAlias = Union[Tensor, tuple[Tensor, Tensor]]
#: a positive float, or a 1-element fp32 device tensor (read on the device, so graph replays see updates)
Scale: TypeAlias = Union[float, Tensor]
#: ``(cos_sin_cache [max_pos, rot_dim], positions [T])`` for fused NeoX rotary embedding
Rope: TypeAlias = tuple[Tensor, Tensor]

__all__ = ["KVCache", "Rope", "Scale"]
