"""A model's rope on the torch backend: cos/sin tables by position, grown on demand, and their application.

cos/sin per position are laid out so rope is ``x * cos + swap(x) * sin`` in three tensor ops. NEOX:
swap(x) = (x2, x1) and sin = (-sin, +sin). NORM: swap exchanges each (2i, 2i+1) pair and sin = (-sin,
+sin) interleaved. Angles are computed in float64 and rounded once, after YaRN's magnitude (1.0
without YaRN) multiplies them. Sliding-window blocks that rope with their own base have their own
tables (``cos_swa`` / ``sin_swa``).
"""

from __future__ import annotations

import numpy as np
import torch

# Positions covered up front; the tables double from there as positions grow, up to the model's max_pos.
FIRST_POSITIONS = 4096


class RopeTables:
    def __init__(self, inv: np.ndarray, inv_swa: np.ndarray | None, *, neox: bool, mscale: float, max_pos: int,
                 device: torch.device) -> None:
        """Tables grow on demand (doubling) up to `max_pos`: a huge -c must not allocate gigabytes up
        front. An entry depends only on its position, so growth changes no bits."""
        self.inv, self.inv_swa = inv, inv_swa
        self.neox, self.mscale, self.max_pos, self.device = neox, mscale, max_pos, device
        self.cos = self.sin = torch.empty(0, device=device)
        self.cos_swa: torch.Tensor | None = None
        self.sin_swa: torch.Tensor | None = None
        self.ensure(min(max_pos, FIRST_POSITIONS))

    def ensure(self, n_pos: int) -> None:
        """Make the tables cover positions [0, n_pos)."""
        have = self.cos.shape[0]
        if n_pos <= have:
            return
        size = min(self.max_pos, max(n_pos, 2 * have))
        self.cos, self.sin = self._table(self.inv, size)
        if self.inv_swa is not None:
            self.cos_swa, self.sin_swa = self._table(self.inv_swa, size)

    def _table(self, inv: np.ndarray, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ang = np.arange(size, dtype=np.float64)[:, None] * inv[None, :]
        cos, sin = np.cos(ang) * self.mscale, np.sin(ang) * self.mscale
        if self.neox:
            cos_full = np.concatenate([cos, cos], axis=1)
            sin_full = np.concatenate([-sin, sin], axis=1)
        else:
            cos_full = np.repeat(cos, 2, axis=1)
            sin_full = np.stack([-sin, sin], axis=2).reshape(size, -1)
        return (torch.from_numpy(cos_full.astype(np.float32)).to(self.device),
                torch.from_numpy(sin_full.astype(np.float32)).to(self.device))

    def tile(self, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        """The Tile rope fields (cos, sin and the sliding blocks' when some slide) of positions `pos`."""
        out = {"cos": self.cos[pos].unsqueeze(1), "sin": self.sin[pos].unsqueeze(1)}
        if self.cos_swa is not None and self.sin_swa is not None:
            out |= {"cos_swa": self.cos_swa[pos].unsqueeze(1), "sin_swa": self.sin_swa[pos].unsqueeze(1)}
        return out

    def rotate_keys(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys [..., hd] roped at positions p, re-roped to p + delta (a context shift): one rotation for all,
        since angles add per frequency; YaRN's magnitude is in the keys already, so cos and sin are unscaled."""
        ang = float(delta) * self.inv
        cos, sin = np.cos(ang), np.sin(ang)
        if self.neox:
            cos_full, sin_full = np.concatenate([cos, cos]), np.concatenate([-sin, sin])
        else:
            cos_full, sin_full = np.repeat(cos, 2), np.stack([-sin, sin], axis=1).reshape(-1)
        return self.apply(k, torch.from_numpy(cos_full.astype(np.float32)).to(self.device),
                          torch.from_numpy(sin_full.astype(np.float32)).to(self.device))

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [M, heads, hd]; cos/sin: [M, 1, n_rot]. Dims >= n_rot pass through."""
        n_rot = cos.shape[-1]
        xr = x[..., :n_rot] if n_rot < x.shape[-1] else x
        if self.neox:
            half = n_rot // 2
            swapped = torch.cat((xr[..., half:], xr[..., :half]), dim=-1)
        else:
            swapped = xr.unflatten(-1, (n_rot // 2, 2)).flip(-1).flatten(-2)
        if x.dtype == torch.float32:
            out = torch.addcmul(xr * cos, swapped, sin)
        else:
            out = torch.addcmul(xr.float() * cos, swapped.float(), sin).to(x.dtype)
        return torch.cat((out, x[..., n_rot:]), dim=-1) if n_rot < x.shape[-1] else out
