"""The step protocol: hooks around forward and backward that drive the gather schedule and the reducer.

[Note: dataflow] Per unit (a wrapped block, or the root's remaining parameters) and per micro-step:
unshard (gather p → N) before forward and again before backward when p is I or G, reshard after each; the
whole-buffer gradient is reduced to g's layout and accumulated (nothing for N, intra reduce-scatter for I,
plus inter reduce-scatter for G). At the accumulation boundary (the backward run with gradient sync on) each
buffer's accumulated gradient goes to os's layout (t_syncg) right after its last reduction, still during
backward, and becomes the master shard's ``.grad``; the user's optimizer updates only that shard; the next
forward brings each unit's update back to p's layout (t_syncp) just ahead of the unit, on the gather lane.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_map_only

from paro_torch import _C
from paro_torch._comms import EngineComms
from paro_torch._engine.buffer_sync import BufferSync
from paro_torch._engine.flat_buffer import FlatBuffer
from paro_torch._engine.gathers import GatherSchedule
from paro_torch._engine.layout import N
from paro_torch._engine.reducer import OrderedReducer
from paro_torch._engine.units import TrainingState, Unit
from paro_torch.api import Precision

logger = logging.getLogger("paro_torch")


class Engine:
    """The training state of one ``ParoShardedModule``: its units, schedules and the hooks that run them."""

    def __init__(
        self,
        module: nn.Module,
        units: list[Unit],
        strategy: _C.Strategy,
        comms: EngineComms,
        precision: Precision,
        device: torch.device,
        broadcast_buffers: bool,
    ) -> None:
        self.module = module
        self.units = units
        self.strategy = strategy
        self.comms = comms
        self.groups = comms.groups
        self.precision = precision
        self.device = device
        self.flat_buffers: list[FlatBuffer] = [b for u in units for b in u.buffers]
        self.schedule = GatherSchedule(units, strategy, comms, device)
        self.reducer = OrderedReducer(units, comms, device)
        for b in self.flat_buffers:
            b.on_grad_ready = self.reducer.grad_ready
        self.buffer_sync = BufferSync(list(module.buffers()) if broadcast_buffers else [])
        self.param_names = {n for b in self.flat_buffers for s in b.slots for n in s.names}
        self._in_backward = False
        self._root_depth = 0
        """Entries into the root session now open (see [Note: the root session])."""
        self._root_grad = False
        # [Note: parameter sync] t_syncp (masters -> parameters) runs before the first forward after every
        # boundary backward, for every unit on every rank alike, whatever the optimizer did: fused and
        # raw-pointer optimizers update the masters without a trace, and a step skipped on one rank only must
        # not change which collectives run. It runs again before the first forward after the module switches
        # between train() and eval(), so that in-place edits of the masters around an evaluation reach compute:
        # an EMA swap, schedule-free's optimizer.eval()/train() (version counters cannot tell: DTensor ops and
        # ``p.data`` edits leave the masters' untouched). Evaluations run on every rank, as with FSDP and ZeRO-3.
        # An optimizer step after the first forward of a window would leave the parameters stale: it is detected
        # and reported at the next boundary (see _end_backward).
        self._sync_params_next = False
        self._synced_since_boundary = False
        self._late_step = False
        self._inputs_only = False
        """This backward accumulates into no parameter (see [Note: backward to the inputs])."""
        self._keep_gathered = False
        self._calls = 0
        """Forwards with grad since the last backward that reduced (see [Note: forwards before one backward])."""
        self._call = 0
        """The call whose leaves the current forward's views come from."""
        self._last_training: bool | None = None
        """The wrapped module's ``training`` at the last forward (see [Note: parameter sync])."""
        master_ids = {id(p) for b in self.flat_buffers if b.trainable for p in b.params}
        me = weakref.ref(self)

        def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            owner = me()
            if owner is not None and owner._synced_since_boundary and _optimizes(optimizer, master_ids):
                owner._late_step = True

        self._step_hook = register_optimizer_step_post_hook(after_step)
        weakref.finalize(self, self._step_hook.remove)  # a global hook: it must not outlive the module
        for u in units:
            if u.module is not module:
                u.module.register_forward_pre_hook(self._make_pre_forward(u), prepend=True, with_kwargs=True)
                u.module.register_forward_hook(self._make_post_forward(u))
        # the root's work runs in hooks on the wrapped module itself, so that calling it directly (Hugging Face's
        # ``model.generate`` reaches the inner model's forward through __getattr__) syncs and gathers it too
        module.register_forward_pre_hook(self._root_pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._root_post_forward)

    # ------------------------------------------------------------------------------------------- unit hooks
    @staticmethod
    def _in_autograd() -> bool:
        """True while autograd runs a backward (a forward now is a recomputation for activation checkpointing)."""
        return torch._C._current_graph_task_id() != -1

    def _make_pre_forward(self, unit: Unit) -> Callable[..., Any]:
        frozen = [b for b in unit.buffers if not b.trainable]

        def frozen_done() -> None:
            for b in frozen:
                b.reshard()

        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            self._unit_pre_forward(unit)
            if self.precision.cast_inputs:
                args, kwargs = cast_floats((args, kwargs), self.precision.param)
            if frozen and self.strategy.p != N and torch.is_grad_enabled():
                # frozen parameters have no gradient hook to free them after the unit's backward: free them
                # once the gradients of the unit's inputs are complete (as FSDP2's post-backward); units whose
                # inputs need no gradient are freed when backward ends
                needs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
                if needs:
                    torch.autograd.graph.register_multi_grad_hook(needs, lambda _: frozen_done(), mode="all")
            return args, kwargs

        return hook

    def _unit_pre_forward(self, unit: Unit) -> None:
        if self._in_autograd():  # recomputation: unshard if needed, no prefetch, stay unsharded
            self._unshard_for_backward(unit, prefetch=False)
            if torch.is_grad_enabled():  # the resharded unit's attributes fell back to the shards: views anew
                unit.set_views()
            return
        unit.state = TrainingState.FORWARD
        if self._root_grad:
            self.schedule.record_run(unit)
        self.schedule.acquire(unit, self._in_backward)
        if self._root_grad:
            unit.begin_call(self._call)
        unit.set_views()

    def _make_post_forward(self, unit: Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self._in_autograd():  # recomputation: backward is about to use the parameters
                return output
            if self.strategy.p != N:
                unit.reshard()
            unit.state = TrainingState.IDLE
            # reentrant checkpointing runs the unit without grad, and again in backward: it needs backward too
            if self._register_pre_backward(unit, output) or self._root_grad and not torch.is_grad_enabled():
                self.schedule.needs_bwd[unit.index] = 1
            return output

        return hook

    def _register_pre_backward(self, unit: Unit, output: Any) -> bool:
        """Hooks the unit's gather for backward on its outputs; returns whether any requires grad."""
        if not torch.is_grad_enabled():
            return False

        def hook(grad: torch.Tensor) -> torch.Tensor:
            self._start_backward()
            self._unshard_for_backward(unit, prefetch=True)
            return grad

        outputs = [t for t in tensors_in(output) if t.requires_grad]
        for t in outputs:
            t.register_hook(hook)
        return bool(outputs)

    def _unshard_for_backward(self, unit: Unit, prefetch: bool) -> None:
        """Gathers the unit for its backward once per backward (its pre-backward hook or a recomputation)."""
        self._start_backward()
        if unit.state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD) and not any(
            b.full_freed() for b in unit.buffers
        ):
            return  # gathered for this backward already (a unit run twice may need its frozen part again)
        unit.state = TrainingState.PRE_BACKWARD
        self.schedule.acquire(unit, backward=True, prefetch=prefetch)
        # a recomputation inside the unit's own __call__ (Hugging Face's checkpointed layers) passes no hook of
        # ours: the modules must see whole parameters again before it
        unit.set_views()

    # --------------------------------------------------------------------------------------------- backward
    def _start_backward(self) -> None:
        """At the first hook of a backward: agree on the units it gathers, queue the end-of-backward callback.

        [Note: backward to the inputs] A backward that accumulates into none of the parameters (``autograd.grad``
        to the inputs, ``backward(inputs=...)``: adversarial examples, gradient penalties) gathers the units it
        runs through and reduces nothing: no zeros, no boundary. With ``create_graph`` the units it gathered stay
        gathered, for the backward through its graph that follows, whose end reshards them. Autograd says which
        leaves a backward will accumulate into (``_will_engine_execute_node``); every rank runs the same backward.
        """
        if self._in_backward:
            return
        self._in_backward = True
        reached = {(id(b), c) for b in self.reducer.order for c, leaf in b.grad_leaves() if will_execute(leaf)}
        calls = sorted({c for _, c in reached}, reverse=True)  # the last call's backward runs first
        self._inputs_only = not reached
        self._keep_gathered = self._inputs_only and torch.is_grad_enabled()  # create_graph
        Variable._execution_engine.queue_callback(self._end_backward)
        later, self.schedule.ran_without_grad = self.schedule.ran_without_grad, set()
        if self.strategy.p != N:
            self.schedule.begin_backward(keep=self._inputs_only)
            if not self._inputs_only:
                self.reducer.set_sequence(self.schedule.reduce_order(), calls)
        if not self._inputs_only:  # see [Note: reduction order]
            self.reducer.absent([
                (b, c) for b in self.reducer.order for c in calls
                if (id(b), c) not in reached and self.reducer.unit_of(b).index not in later
            ])  # fmt: skip

    def _end_backward(self) -> None:
        """Runs once when autograd finishes: reduce unused buffers as zeros, agree on use at a boundary, reshard."""
        self._in_backward = False
        if self.strategy.p != N:
            self.schedule.end_pass()
        if self._inputs_only:  # see [Note: backward to the inputs]
            if not self._keep_gathered:
                self.reset_units()
            return
        sync = self.reducer.sync_gradients
        if sync:
            self.buffer_sync.note_changes()
        keys = self.schedule.run_keys if self.strategy.p == N else []  # see [Note: run order]
        flags = self.reducer.finish([*keys, *self.buffer_sync.changed, self._late_step])
        self.end_calls()
        self.reset_units()
        if not sync:
            return
        used, ordered = len(self.reducer.order), len(keys)
        values = flags.tolist()  # one device-to-host copy per boundary
        late = bool(values[-1])
        self.buffer_sync.agreed(values[used + ordered : -1])  # see [Note: buffer broadcast]
        self.reducer.after_boundary(values[:used])
        if any(values[used : used + ordered]):
            self.schedule.set_run_order(values[used : used + ordered])
            self.reducer.set_sequence(self.schedule.reduce_order())
        self._sync_params_next = True
        self._synced_since_boundary = False
        self._late_step = False
        if late:
            raise RuntimeError(
                "paro_torch: optimizer.step() ran after a forward that followed the last gradient sync, so that "
                "forward synced the parameters before the step and the steps since used stale parameters; call "
                "optimizer.step() (and zero_grad()) before the next forward of the model"
            )

    def settle(self) -> None:
        """Before ``_apply``: raises inside a forward or backward (work in flight); reshards every unit."""
        if self._root_depth or self._in_backward:
            raise RuntimeError(
                "ParoShardedModule: .to()/.cpu()/... inside a forward or backward; call it between steps"
            )
        self.reset_units()

    def retype(self, precision: Precision) -> None:
        """After ``settle`` and ``Module._apply``: every buffer in the new dtypes (see ``BufferStorage.retype``)."""
        self.precision = precision
        for b in self.flat_buffers:
            b.retype(precision)

    def end_calls(self) -> None:
        """The next forward is a first call (see [Note: forwards before one backward] in reducer.py)."""
        self._calls = 0
        for b in self.flat_buffers:
            b.end_calls()

    def reset_units(self) -> None:
        """Every unit idle and resharded (its modules' attributes back on the shards: no view of freed storage)."""
        for u in self.units:
            u.state = TrainingState.IDLE
            u.reshard()
            for b in u.buffers:
                b.grad_ready = False

    def _recover_from_failed_backward(self) -> None:
        """A forward after a backward that raised (autograd then skips its end callback): start clean.

        The gradients accumulated since the last boundary are dropped (the failed backward reduced some units'
        and not others'), on every rank alike when every rank failed alike; call ``zero_grad()`` and go on with
        the next batch, as after a failed backward in one process.
        """
        logger.warning(
            "paro_torch: the last backward did not finish (it raised); the gradients accumulated since the last "
            "optimizer step are dropped"
        )
        self._in_backward = False
        self.schedule.drop_pass()
        self.schedule.forget_forwards()
        self.reducer.drop()
        self.end_calls()
        self.reset_units()

    # --------------------------------------------------------------------------------------------- forward
    @contextlib.contextmanager
    def outermost_call(self) -> Iterator[None]:
        """A call from outside the model: starts clean, and cleans up if it raises."""
        if self._root_depth:  # a direct call of the module raised before its end
            self._abort_forward()
        try:
            yield
        except BaseException:
            self._abort_forward()
            raise

    # [Note: the root session] The root unit is gathered, and the parameters synced after an optimizer step,
    # from the first entry into the wrapped module to the matching exit: its forward hooks (so that calling it
    # directly works too) or ``generate`` (which may reach the model through modules without our hooks, as
    # PEFT's does). Entries nested in a session do nothing: Lightning runs ``training_step`` inside the wrapped
    # module's forward, and it calls the module again.
    def root_enter(self) -> None:
        self._root_depth += 1
        if self._root_depth > 1:
            return
        if self._in_backward and not self._in_autograd():
            self._recover_from_failed_backward()
        switched = self._last_training is not None and self.module.training != self._last_training
        self._last_training = self.module.training
        if self._sync_params_next or switched:  # see [Note: parameter sync]
            self._synced_since_boundary |= self._sync_params_next
            self._sync_params_next = False
            for u in self.units:
                u.needs_sync = any(b.trainable for b in u.buffers)
        root = self.units[-1]
        if self.module.training and torch.is_grad_enabled():
            self.buffer_sync.before_forward(self.schedule.lane, self.comms.gather_world)
        self._root_grad = torch.is_grad_enabled()
        if self._root_grad and not self._in_autograd():
            # leaves of its own per call (see [Note: forwards before one backward] in reducer.py), unless a call
            # ran a reentrant checkpoint: its backward is a forward of its own, made with the leaves current then
            self._call = self._calls if not self.schedule.ran_without_grad else 0
            self._calls += 1
        self.schedule.begin_forward()
        root.state = TrainingState.FORWARD
        if self._root_grad:
            self.schedule.record_run(root)
        self.schedule.acquire(root, self._in_backward)
        if self._root_grad:
            root.begin_call(self._call)
        root.set_views()

    def root_exit(self, out: Any) -> Any:
        if self.precision.output is not None:
            out = cast_floats(out, self.precision.output)
        self._root_depth -= 1
        if self._root_depth > 0:
            return out
        root = self.units[-1]
        self.schedule.end_pass()
        if self.strategy.p != N:
            root.reshard()
        root.state = TrainingState.IDLE
        if self._register_pre_backward(root, out):
            self.schedule.needs_bwd[root.index] = 1
        if self._root_grad and self.strategy.p != N:  # agree on the units backward gathers
            self.schedule.agree_after_forward()
        return out

    def _root_pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        self.root_enter()
        return cast_floats((args, kwargs), self.precision.param) if self.precision.cast_inputs else None

    def _root_post_forward(self, module: nn.Module, args: Any, out: Any) -> Any:
        return self.root_exit(out)

    def _abort_forward(self) -> None:
        """After a forward that raised: every unit idle and resharded.

        A unit that raised may still hold its gathered parameters, which the next sync would not refresh.
        """
        self._root_depth = 0
        self.schedule.drop_pass()
        self.reset_units()

    def in_root_session(self, generate: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate`` (Hugging Face) in a root session (see [Note: the root session]).

        With p = I, G every forward gathers parameters on every rank, so ranks must run as many forwards:
        ``synced_gpus`` defaults to True then (as Hugging Face does for FSDP and ZeRO-3).
        """
        if self.strategy.p != N and self.groups.world > 1:
            kwargs.setdefault("synced_gpus", True)
        with self.outermost_call():
            self.root_enter()
            out = generate(*args, **kwargs)
            self.root_exit(None)
        return out


def will_execute(leaf: torch.Tensor) -> bool:
    """Whether the backward now running accumulates into ``leaf`` (autograd's own plan)."""
    return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(leaf).node)


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """The tree with its floating-point tensors cast to ``dtype`` (as FSDP2 casts inputs and outputs)."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _optimizes(optimizer: torch.optim.Optimizer, master_ids: set[int]) -> bool:
    return any(id(p) in master_ids for group in optimizer.param_groups for p in group["params"])


def tensors_in(x: Any) -> Iterator[torch.Tensor]:
    """The tensors in a nest of lists, tuples, dicts and dataclasses (model outputs)."""
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors_in(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from tensors_in(y)
    elif hasattr(x, "__dataclass_fields__") or hasattr(x, "to_tuple"):
        yield from tensors_in(x.to_tuple() if hasattr(x, "to_tuple") else vars(x))
