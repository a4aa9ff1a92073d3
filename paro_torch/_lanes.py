"""Where the engine's communication runs: a thread per lane on the CPU, a stream per lane on CUDA.

[Note: lanes] The engine issues gathers (and t_syncp) on one lane and reductions (and t_syncg) on another, each in
one fixed order on every rank (see [Note: communication lanes] in _engine/gathers.py). ``submit`` queues a call
and returns a handle whose ``result()`` orders the caller after it:

- CPU (``ThreadLane``): the call runs on a thread of its own; ``result()`` waits for it. Gloo collectives block
  their caller, so a thread is what lets them overlap computation.
- CUDA (``StreamLane``, FSDP2's pattern): the call runs at once on the calling thread, with a high-priority stream
  of the lane as the current stream; it first waits for what the caller's stream has queued (the inputs), so its
  collectives are issued synchronously in program order, the same on every rank, and NCCL enqueues them on the
  lane's stream; ``result()`` makes the caller's current stream wait on an event recorded after the call, and never
  blocks the CPU. Tensors passed to the call are recorded on the lane's stream, and tensors handed back to the
  compute stream (``hand_over``) on that stream, so that the caching allocator reuses none of them while another
  stream may still read them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")


class Handle(Protocol[T]):
    """A submitted call; ``result()`` orders the caller after it and returns its value."""

    def result(self) -> T: ...


class Lane(Protocol):
    """One ordered queue of communication (see [Note: lanes])."""

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Handle[T]: ...

    def hand_over(self, tensors: Iterable[torch.Tensor]) -> None: ...


class ThreadLane:
    """A lane on a thread of its own (CPU)."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        return self._pool.submit(fn, *args, **kwargs)

    def hand_over(self, tensors: Iterable[torch.Tensor]) -> None:
        pass  # one device, one stream: nothing to hand over


class _Issued:
    """A call issued on a lane's stream: ``result()`` makes the current stream wait for it."""

    def __init__(self, value: Any, event: torch.cuda.Event, device: torch.device) -> None:
        self._value, self._event, self._device = value, event, device

    def result(self) -> Any:
        torch.cuda.current_stream(self._device).wait_event(self._event)
        return self._value


class StreamLane:
    """A lane on a CUDA stream of its own, issued from the calling thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device, priority=-1)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> _Issued:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the inputs are ready
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            value = fn(*args, **kwargs)
            event = self.stream.record_event()
        return _Issued(value, event, self.device)

    def hand_over(self, tensors: Iterable[torch.Tensor]) -> None:
        current = torch.cuda.current_stream(self.device)
        for t in tensors:
            if t.untyped_storage().size() > 0:
                t.record_stream(current)


def make_lane(device: torch.device, name: str) -> Lane:
    """A stream lane for a CUDA device, a thread lane otherwise."""
    return StreamLane(device) if device.type == "cuda" else ThreadLane(name)
