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
  blocks the CPU.

[Note: memory across streams] The caching allocator reuses a freed block only for the stream it was allocated on,
at once, so a block one stream frees while another still reads or writes it is unsafe. Without ``record_stream``
(whose frees wait for the allocator's event polling, as FSDP2 found): what a lane call makes for the caller
(gathered parameters) is allocated on the caller's stream (``for_caller``), so the caller frees it in its own
order after it waited for the call; what the caller passes in (gradients) is held by the handle until the caller's
stream has waited for the call (``result()``, or the next call on a lane with ``in_flight=1``, which bounds the
reductions in flight as FSDP2 bounds its reduce-scatters); temporaries of the call are the lane stream's own.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable
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


class ThreadLane:
    """A lane on a thread of its own (CPU)."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        return self._pool.submit(fn, *args, **kwargs)


class _Issued:
    """A call issued on a lane's stream: ``result()`` makes the current stream wait for it and lets go of its inputs."""

    def __init__(self, value: Any, event: torch.cuda.Event, device: torch.device, inputs: list[torch.Tensor]) -> None:
        self._value, self._event, self._device = value, event, device
        self._inputs, self._waited = inputs, False

    def release(self) -> None:
        """The caller's stream waits for the call; its inputs may be freed from here on."""
        if not self._waited:
            torch.cuda.current_stream(self._device).wait_event(self._event)
            self._inputs, self._waited = [], True

    def result(self) -> Any:
        self.release()
        return self._value

    def __del__(self) -> None:
        if self._inputs:  # dropped unwaited: its inputs must outlive the call
            with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone
                self.release()


_callers = threading.local()
"""The caller streams of the StreamLane calls running on this thread (innermost last)."""


def for_caller() -> contextlib.AbstractContextManager:
    """Inside a lane call, tensors made here belong to the stream that submitted it (CUDA); elsewhere a no-op."""
    stack = getattr(_callers, "stack", None)
    return torch.cuda.stream(stack[-1]) if stack else contextlib.nullcontext()


class StreamLane:
    """A lane on a CUDA stream of its own, issued from the calling thread.

    ``in_flight``: at most this many calls not yet waited for; another makes the caller's stream wait for the oldest
    (a wait on the device, not the CPU).
    """

    def __init__(self, device: torch.device, in_flight: int | None = None) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device, priority=-1)
        self._in_flight = in_flight
        self._issued: collections.deque[_Issued] = collections.deque()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> _Issued:
        if self._in_flight is not None:
            while len(self._issued) >= self._in_flight:
                self._issued.popleft().release()
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)  # the inputs are ready
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.device.type == "cuda"]
        stack = _callers.__dict__.setdefault("stack", [])
        stack.append(caller)
        try:
            with torch.cuda.stream(self.stream):
                value = fn(*args, **kwargs)
                event = self.stream.record_event()
        finally:
            stack.pop()
        issued = _Issued(value, event, self.device, inputs)
        if self._in_flight is not None:
            self._issued.append(issued)
        return issued


def make_lane(device: torch.device, name: str, in_flight: int | None = None) -> Lane:
    """A stream lane for a CUDA device (``in_flight``: see ``StreamLane``), a thread lane otherwise.

    CPU lanes take no bound: a caller blocked on its own lane can deadlock against a peer rank that needs its
    gathers first (ranks whose graphs differ).
    """
    return StreamLane(device, in_flight) if device.type == "cuda" else ThreadLane(name)
