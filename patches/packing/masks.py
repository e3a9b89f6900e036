"""The samples of a batch of packed rows: read off the 4D block-diagonal causal mask (``segments``, two diagonals
only) or off LLaMA-Factory's sample numbers (``numbered_segments``), the 4D mask built from those numbers on their
device (``block_causal_mask``) and the check that a mask is exactly block-diagonal causal
(``block_causal_mismatch``). ``Segments`` gives the kernels their boundaries (``cu_seqlens``, ``state_bounds``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Segments:
    """The samples of a batch of packed rows ``[B, T]``, read off a 4D mask.

    ``spans``: ``(row, start, end, real)`` of every segment in order, where ``real`` says whether it is a
    sample (its tokens attend to themselves) or padding (one segment per run of padding);
    ``position``: each token's offset inside its segment, ``[B, T]``.
    """

    rows: int
    length: int
    spans: tuple[tuple[int, int, int, bool], ...]
    position: Any
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)  # index tensors, built once

    def heads(self, taps: int, device) -> tuple[Any, Any, Any]:
        """``(row, position, offset)`` of the first ``taps - 1`` tokens of every segment, as index tensors on
        ``device``: the only tokens whose causal window of ``taps`` would reach into the segment before."""
        key = ("heads", taps, str(device))
        if key not in self._on_device:
            import torch

            found = [
                (row, start + offset, offset)
                for row, start, end, _ in self.spans
                for offset in range(min(taps - 1, end - start))
            ]
            self._on_device[key] = tuple(
                torch.tensor(list(column), dtype=torch.long, device=device) for column in zip(*found, strict=True)
            )
        return self._on_device[key]

    def cu_seqlens_tensors(self, device, dtype=None, piece: int = 0, joined: bool = False) -> tuple[Any, Any]:
        """``cu_seqlens`` on ``device`` and on the CPU (FLA takes both, so it never reads them back); int64
        unless ``dtype`` (FlashAttention takes int32); the padding in pieces of ``piece`` tokens, or ``joined`` to
        the sample before it (``cu_seqlens``)."""
        key = ("cu_seqlens", str(device), str(dtype), piece, joined)
        if key not in self._on_device:
            import torch

            bounds = self.cu_seqlens(piece, joined)
            dtype = dtype or torch.long
            self._on_device[key] = (torch.tensor(bounds, dtype=dtype, device=device), torch.tensor(bounds, dtype=dtype))
        return self._on_device[key]

    def state_bounds(self, device) -> tuple[Any, Any]:
        """The ``cu_seqlens`` (on ``device``, on the CPU) FLA's DeltaNet kernels, the convolution and the chunk
        kernel, take for these rows: the padding joined to the sample before it, and (None, None) where that leaves
        one sequence (a batch of one row holding one sample: batch size 1 per device), which the kernels then run as
        they run an unpacked step. FLA's convolution took 1.59 ms forward+backward with ``cu_seqlens`` against 1.39
        without at the 27B width on an H100 (docs/lab/2026-12-06-packed-attention-alone.md), in each of 48 layers a
        step."""
        key = ("state", str(device))
        if key not in self._on_device:
            self._on_device[key] = (None, None) if self.one_sequence() else self.cu_seqlens_tensors(device, joined=True)
        return self._on_device[key]

    def one_sequence(self) -> bool:
        """Whether the DeltaNet kernels see one sequence here (one row of one sample, its padding joined to it)."""
        return len(self.cu_seqlens(joined=True)) == 2

    def longest(self, piece: int = 0) -> int:
        """The longest segment of ``cu_seqlens(piece)``."""
        bounds = self.cu_seqlens(piece)
        return max(end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True))

    def real_tokens(self, device) -> Any:
        """``[B * T]`` booleans: the tokens of samples (not padding), rows laid end to end."""
        key = ("real", str(device))
        if key not in self._on_device:
            import torch

            real = torch.zeros(self.rows * self.length, dtype=torch.bool)
            for row, start, end, is_real in self.spans:
                real[row * self.length + start : row * self.length + end] = is_real
            self._on_device[key] = real.to(device)
        return self._on_device[key]

    def samples_per_row(self) -> list[int]:
        return [sum(1 for r, _, _, real in self.spans if r == row and real) for row in range(self.rows)]

    def cu_seqlens(self, piece: int = 0, joined: bool = False) -> list[int]:
        """The segment boundaries of the rows laid end to end (FLA's varlen layout, batch 1); with ``piece``, every
        run of padding cut into segments of at most that many tokens (``PADDING_PIECE``, the attention kernels'
        bounds), the samples' boundaries unchanged; ``joined``, every run of padding that follows a sample in its
        row made part of that sample (the DeltaNet kernels' bounds, ``state_bounds``: no sample token reads a later
        token, so this changes only the padding's outputs, which no sample token and no loss term depends on; a loss
        over every position, such as an MoE router's auxiliary loss, would: LLaMA-Factory 0.9.5 turns that one on for
        ``qwen3_moe``, not for ``qwen3_5_moe``, ``model_utils/moe.py``). A row that opens with padding keeps it as a
        segment of its own, and every row starts a segment."""
        if piece < 0:
            raise ValueError(f"a padding piece of {piece} tokens; give 0 (uncut) or more")
        if piece and joined:
            raise ValueError("padding is either cut into pieces or joined to the sample before it, not both")
        bounds, after_sample = [], False
        for row, start, end, real in self.spans:
            if not (joined and not real and start and after_sample):
                bounds += [
                    row * self.length + at for at in range(start, end, piece if piece and not real else end - start)
                ]
            after_sample = real
        return bounds + [self.rows * self.length]


def numbered_segments(numbered) -> Segments:
    """Samples of packed rows from LLaMA-Factory's sample numbers ``[B, T]`` (1, 1, 2, 2, 2, 0 for padding: what
    its collator turns into the 4D mask): the same segments ``segments`` reads off that mask."""
    import torch

    numbered = numbered.cpu()
    start = torch.ones_like(numbered, dtype=torch.bool)
    start[:, 1:] = numbered[:, 1:] != numbered[:, :-1]
    return _segments_from(start, numbered != 0)


def _segments_from(start, real) -> Segments:
    """Segments from ``[B, T]`` booleans: where a segment starts, and whether each token belongs to a sample."""
    import torch

    rows, length = start.shape
    index = torch.arange(length, device=start.device).expand(rows, length)
    first = torch.where(start, index, torch.zeros_like(index)).cummax(-1).values
    spans = []
    start_cpu, real_cpu = start.cpu(), real.cpu()
    for row in range(rows):
        at = torch.nonzero(start_cpu[row]).flatten().tolist()
        for begin, end in zip(at, [*at[1:], length], strict=True):
            spans.append((row, begin, end, bool(real_cpu[row, begin])))
    return Segments(rows=rows, length=length, spans=tuple(spans), position=index - first)


def block_causal_mask(numbered, dtype) -> Any:
    """The 4D additive block-diagonal causal mask ``[B, 1, T, T]`` of sample numbers ``[B, T]``, built where
    ``numbered`` lives: LLaMA-Factory's own ``prepare_4d_attention_mask``, run under ``numbered``'s device as the
    default device (it makes its causal triangle and its zero with factory calls, which then land there too)."""
    import torch
    from llamafactory.data.collator import prepare_4d_attention_mask

    with torch.device(numbered.device):
        return prepare_4d_attention_mask(numbered, dtype)


def allowed_of(mask) -> Any:
    """Booleans (True = attend) of a 4D mask or of a view into one: additive (0 = attend) or boolean."""
    import torch

    return mask == 0 if torch.is_floating_point(mask) else mask.bool()


def diagonal_of(mask, offset: int = 0) -> Any:
    """``[B, T - |offset|]``: whether each token attends to itself (0) or to the one before it (-1); reads
    only that diagonal of the ``[B, 1, T, T]`` mask."""
    return allowed_of(mask[:, 0].diagonal(offset, -2, -1))


def segments(mask) -> Segments:
    """Samples of packed rows from their 4D block-diagonal causal mask ``[B, 1, T, T]`` (only two diagonals read).

    A token starts a sample when it attends to itself but not to the token before it; padding (a token that
    attends to nothing) makes one segment per run of padding.
    """
    import torch

    itself = diagonal_of(mask)  # [B, T]
    previous = torch.zeros_like(itself)
    previous[:, 1:] = diagonal_of(mask, -1)
    was_real = torch.zeros_like(itself)
    was_real[:, 1:] = itself[:, :-1]
    start = (itself & ~previous) | (~itself & was_real)
    start[:, 0] = True
    return _segments_from(start, itself)


def block_causal_mismatch(mask, found: Segments, block: int = 1024) -> int:
    """How many entries of the mask differ from the block-diagonal causal mask of ``found`` (0 when exact);
    compared ``block`` query rows at a time, so the check holds at most ``B x block x T`` booleans."""
    import torch

    length = found.length
    index = torch.arange(length, device=mask.device)
    first = index[None, :] - found.position.to(mask.device)  # [B, T]: the start of each token's segment
    real = diagonal_of(mask)
    wrong = 0
    for top in range(0, length, block):
        rows = index[top : top + block]
        starts = first[:, top : top + block, None]
        expected = (index[None, None, :] <= rows[None, :, None]) & (index[None, None, :] >= starts)
        expected &= real[:, top : top + block, None] & real[:, None, :]
        wrong += int((expected != allowed_of(mask[:, 0, top : top + block])).sum())
    return wrong
