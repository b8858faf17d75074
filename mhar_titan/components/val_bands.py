"""Validation CE by where a token sits: its position in its document and its document's length, from the same
validation passes (the per-token CE of the batch the validator already ran), so the pair can ask where MHAR helps:
early tokens or late ones, short documents or long ones.

A window of packed documents starts inside a document that began in an earlier window: the positions of its first
segment are not known (`unknown`), nor is the length of a document cut by either edge of the window (`cut`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

POSITION_EDGES = (0, 64, 256, 1024, 4096)
LENGTH_EDGES = (0, 256, 1024, 4096)


def _names(edges: tuple[int, ...]) -> list[str]:
    return [f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:], strict=False)] + [f"{edges[-1]}+"]


POSITION_BANDS = (*_names(POSITION_EDGES), "unknown")
LENGTH_BANDS = (*_names(LENGTH_EDGES), "cut")
BANDS = {"position": POSITION_BANDS, "doc_length": LENGTH_BANDS}


def _band(values: torch.Tensor, edges: tuple[int, ...]) -> torch.Tensor:
    """The band index of each value (the last band open-ended)."""
    return torch.bucketize(values, torch.tensor(edges[1:], device=values.device), right=True)


def token_bands(inputs: torch.Tensor, eos_id: int) -> dict[str, torch.Tensor]:
    """{"position", "doc_length"}: each input token's band index ([B, T]), the last index of each kind its unknown
    one. A document starts after an eos; the label at an eos (across the boundary) is ignored anyway."""
    b, t = inputs.shape
    index = torch.arange(t, device=inputs.device).expand(b, t)
    eos = inputs == eos_id
    begins = torch.zeros_like(eos)
    begins[:, 1:] = eos[:, :-1]
    start = torch.where(begins, index, torch.zeros_like(index)).cummax(dim=1).values
    known_start = start > 0  # the row's first segment began in an earlier window
    position = torch.where(known_start, _band(index - start, POSITION_EDGES), len(POSITION_EDGES))
    far = torch.full_like(index, t)
    end = torch.where(eos, index, far).flip(1).cummin(dim=1).values.flip(1)  # the next eos at or after each token
    whole = known_start & (end < t)
    length = torch.where(whole, _band(end - start + 1, LENGTH_EDGES), len(LENGTH_EDGES))
    return {"position": position, "doc_length": length}


def band_sums(
    logits: torch.Tensor, labels: torch.Tensor, inputs: torch.Tensor, eos_id: int, ignore_index: int
) -> torch.Tensor:
    """[2, bands of both kinds] float64: each band's CE sum (row 0) and valid tokens (row 1), positions first;
    labels of `ignore_index` count nowhere."""
    valid = labels != ignore_index
    rows = []
    for r in range(logits.shape[0]):  # a row at a time: one float32 copy of a row's logits, not the batch's
        rows.append(F.cross_entropy(logits[r].float(), labels[r], ignore_index=ignore_index, reduction="none"))
    ce = torch.stack(rows).double()
    out = []
    for kind, bands in token_bands(inputs, eos_id).items():
        n = len(BANDS[kind])
        ce_sum = torch.zeros(n, dtype=torch.float64, device=ce.device).index_add_(0, bands[valid], ce[valid])
        tokens = torch.zeros(n, dtype=torch.float64, device=ce.device).index_add_(
            0, bands[valid], torch.ones_like(ce[valid])
        )
        out.append(torch.stack([ce_sum, tokens]))
    return torch.cat(out, dim=1)


def split(sums: list[list[float]]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Per-batch [2, bands] rows as {kind: {band: {"ce_sum": [...], "tokens": [...]}}}, batch by batch."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    col = 0
    for kind, bands in BANDS.items():
        out[kind] = {}
        for band in bands:
            out[kind][band] = {
                "ce_sum": [row[0][col] for row in sums],
                "tokens": [int(row[1][col]) for row in sums],
            }
            col += 1
    return out
