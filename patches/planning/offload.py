"""Keep the inputs that checkpointed layers save for their backward in host memory, not on the device.

Facts this relies on (torch 2.14.1, read in its source):

- ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` saves the layer's tensor arguments with
  ``_CheckpointFrame.save_inputs`` (``torch/utils/checkpoint.py``) through ``torch._C._autograd._make_saved_tensor``,
  a ``SavedVariable``, which packs through the saved-tensor hooks on top of the stack at that moment; only then does
  it push its own hooks (``_checkpoint_hook``) for the tensors the layer's forward saves. So hooks of ours around the
  checkpoint call see exactly the layer's inputs, and the checkpoint's own recompute unpacks them
  (``_CheckpointFrame.get_inputs``) when the backward reaches the layer. transformers 5.6.0's
  ``GradientCheckpointingLayer.__call__`` passes the keyword arguments in a ``partial`` and the hidden states as the
  one positional tensor, so the one large tensor packed per layer is its hidden-states input.
- ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)``: ``pack`` returns any object, ``unpack`` must return a
  tensor with the original's content; the newest hooks on the stack are the only ones called
  (``torch/autograd/graph.py``). ``torch.autograd.graph.save_on_cpu`` does the same move but copies on the compute
  stream and fetches each tensor only when its backward asks for it: no overlap, no prefetch.
- torch's caching host allocator rounds every pinned allocation up to a power of two (``ATen/core/
  CachingHostAllocator.h``, ``allocate``: ``c10::llvm::PowerOf2Ceil(size)``; torch_npu's host allocator does the
  same), so a 640 MiB input would pin 1 GiB. The host copy is therefore held in chunks of ``CHUNK_BYTES`` (a power of
  two), which waste nothing but the last chunk's rounding.
- device-agnostic streams and events: ``torch.Stream(device)`` (a context manager that makes it current),
  ``torch.accelerator.current_stream()``, ``Stream.wait_stream`` / ``wait_event`` / ``record_event``,
  ``Event.query``; the same calls serve CUDA and torch_npu.

How the copies are ordered (``Offloader``):

- out (``pack``, in the forward): the side stream waits for the compute stream, copies the input's bytes into
  pinned host chunks (``non_blocking``) and records an event; the device tensor is held until that event has
  completed, so its memory cannot be handed to another tensor while the copy still reads it.
- back (``unpack``, in the backward): the copy into a device buffer is made on the side stream after the compute
  stream's work up to then (the buffer is allocated on the compute stream, which may have used that memory before),
  and the compute stream waits for its event before the recompute reads it. Each unpack starts the copy-back of the
  input packed just before (the layer the backward reaches next: layers run backward in reverse order), so that
  copy overlaps this layer's recompute and backward; a prefetched buffer is held until its copy has completed too.
- left alone: tensors not on the run's device, smaller than ``min_bytes``, not contiguous, or parameters; they are
  returned as they are. (The first layer's input is a leaf that requires grad when PEFT's
  ``enable_input_require_grads`` marks the embeddings' output: it is offloaded like the others.)

On CPU there is no device memory to save and no stream: ``Offloader("cpu")`` still copies each input out into host
chunks and back into a new buffer, in the same order with the same prefetch bookkeeping, so that tests drive the
whole data path; pinned memory, side streams and the overlap need an accelerator and are not exercised there.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

CHUNK_BYTES = 64 * 1024**2  # a power of two: the pinned allocator's rounding wastes nothing but the last chunk's
MIN_BYTES = 1024**2  # smaller inputs stay where they are


class _Held:
    """One input moved to host memory: its chunks, and its device copy while a copy-back is in flight."""

    __slots__ = ("shape", "dtype", "device", "nbytes", "chunks", "device_copy", "ready", "index", "__weakref__")

    def __init__(self, tensor, chunks: list, index: int) -> None:
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self.chunks, self.index = chunks, index
        self.device_copy = None
        self.ready = None


class Offloader:
    """Saved-tensor hooks that move checkpointed layers' inputs to host memory and bring them back ahead of use.

    ``device_type``: the run's device (``cuda``, ``npu``) or ``cpu`` (the copies run, nothing is saved). ``hooks()``
    is the context to wrap each checkpointed call in; ``stats`` counts what it did."""

    def __init__(self, device_type: str, *, min_bytes: int = MIN_BYTES, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.device_type = device_type
        self.min_bytes, self.chunk_bytes = min_bytes, chunk_bytes
        self.accelerated = device_type != "cpu"
        self.stream = None  # made at the first input, on its device (a rank's device is set after the patches)
        self._order: list[weakref.ref] = []  # this forward's inputs, in the order they were packed
        self._backward_started = False
        self._in_flight: list[tuple[Any, Any]] = []  # (event, device tensor) held until the copy completed
        self.stats = {"packed": 0, "packed_bytes": 0, "left_alone": 0, "prefetched": 0, "fetched_on_demand": 0}

    # --- the hooks ------------------------------------------------------------------------------------------

    def hooks(self):
        """The ``saved_tensors_hooks`` context for one checkpointed call."""
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor):
        if not self._eligible(tensor):
            self.stats["left_alone"] += 1
            return tensor
        if self._backward_started:  # a new forward: the last one's order is done with
            self._order, self._backward_started = [], False
        if self.accelerated and self.stream is None:
            import torch

            self.stream = torch.Stream(device=tensor.device)
        self._reap()
        held = _Held(tensor, [], len(self._order))
        flat = tensor.detach().reshape(-1).view(_uint8())
        with self._side():
            for start in range(0, held.nbytes, self.chunk_bytes):
                part = flat[start : start + self.chunk_bytes]
                host = _empty_host(part.numel(), pinned=self.accelerated)
                host.copy_(part, non_blocking=self.accelerated)
                held.chunks.append(host)
            if self.accelerated:
                self._in_flight.append((self.stream.record_event(), tensor))
        self._order.append(weakref.ref(held))
        self.stats["packed"] += 1
        self.stats["packed_bytes"] += held.nbytes
        return held

    def unpack(self, held):
        if not isinstance(held, _Held):
            return held
        self._backward_started = True
        self._reap()
        if held.device_copy is None:
            self.stats["fetched_on_demand"] += 1
            self._fetch(held)
        else:
            self.stats["prefetched"] += 1
        if self.accelerated:
            _current_stream().wait_event(held.ready)
        out, held.device_copy, held.ready = held.device_copy, None, None
        if 0 < held.index <= len(self._order):
            following = self._order[held.index - 1]()  # the input the backward reaches next
            if following is not None and following.device_copy is None:
                self._fetch(following)
        return out

    # --- the copies -----------------------------------------------------------------------------------------

    def _eligible(self, tensor) -> bool:
        return (
            tensor.device.type == self.device_type
            and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() >= self.min_bytes
            and not isinstance(tensor, _parameter())
        )

    def _fetch(self, held: _Held) -> None:
        """Start the copy back of ``held`` into a new device buffer (on the side stream where there is one)."""
        import torch

        buffer = torch.empty(held.nbytes, dtype=_uint8(), device=held.device)  # on the compute stream
        with self._side():
            start = 0
            for host in held.chunks:
                buffer[start : start + host.numel()].copy_(host, non_blocking=self.accelerated)
                start += host.numel()
            if self.accelerated:
                held.ready = self.stream.record_event()
                self._in_flight.append((held.ready, buffer))
        held.device_copy = buffer.view(held.dtype).view(held.shape)

    def _side(self):
        """The side stream made current after the compute stream's work so far; nothing on CPU."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(_current_stream())
        return self.stream

    def _reap(self) -> None:
        """Let go of the device tensors whose copies have completed."""
        self._in_flight = [(event, t) for event, t in self._in_flight if not event.query()]

    def synchronize(self) -> None:
        """Wait for every copy in flight (tests; the end of a step needs nothing of it)."""
        for event, _ in self._in_flight:
            event.synchronize()
        self._reap()


def _parameter():
    import torch

    return torch.nn.Parameter


def _uint8():
    import torch

    return torch.uint8


def _empty_host(numel: int, *, pinned: bool):
    import torch

    return torch.empty(numel, dtype=torch.uint8, pin_memory=pinned)


def _current_stream():
    import torch

    return torch.accelerator.current_stream()


class OffloadedCheckpoint:
    """A layer's ``_gradient_checkpointing_func``: ``checkpoint`` (non-reentrant) inside the offloader's hooks."""

    def __init__(self, checkpoint, offloader: Offloader) -> None:
        self.__wrapped__ = checkpoint
        self.offloader = offloader

    def __call__(self, function, *args, **kwargs):
        with self.offloader.hooks():
            return self.__wrapped__(function, *args, **kwargs)
