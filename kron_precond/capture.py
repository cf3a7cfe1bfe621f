"""Activation and output-gradient capture: the module hooks of methods that need them.

A forward hook on each registered module has the layer's method compute what the module's
input rows add to its statistics, and registers a tensor hook on the output. When a backward
reaches the output, the hook adds those terms (once per call) and hands the output-gradient
rows on. So the statistics hold the calls that fed a gradient: a forward no backward follows
adds nothing, and a call that activation checkpointing reruns in the backward adds nothing
more (the backward reaches the first run's output, never the rerun's). A backward that
reaches a call's output without reaching the weight (``torch.autograd.grad`` with respect to
the inputs, as an adversarial attack takes) counts as one that does. A module returning a tuple
(``nn.MultiheadAttention``) is waited on through its first tensor; one returning anything else
has no hook to wait on: its rows count in the forward. A tensor hook (rather
than a module full-backward hook) keeps working when an in-place activation follows the
module. Hooks do nothing in ``eval()`` mode, under ``no_grad``, or on steps whose statistics
are not gathered.

Output gradients are rescaled so that, for the usual mean losses, the factors depend on
neither the batch size nor the sequence length: ``δ = grad · n · accumulation_steps`` with
``n`` the rows of the call for Linear-like modules (per-token means), the batch size for
convolutions (per-sample means) and the tokens of the call for routed experts; see
``KFACAdapter.gradient_scale``, :mod:`kron_precond.experts` and docs/API.md.

Under ``torch.compile(model)`` the observation runs outside the compiled graph
(``torch.compiler.disable``): inductor cannot compile a graph that writes our statistics
and registers a tensor hook on one of its own intermediates ("Node addmm_N was invalid, but
is output"). The model's graph is then split at each registered module, and the tensor
hook sees the output gradient in eager autograd, exactly as without compile.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from kron_precond.autocast import autocast_disabled
from kron_precond.compiled import run_eagerly
from kron_precond.distributed.sharded import is_dtensor
from kron_precond.modules import user_stacklevel


class ActivationCapture:
    """Hooks on the registered modules of one preconditioner.

    Args:
        layers: objects with ``module``, ``adapter`` (the module's rows per unit, see
            :mod:`kron_precond.modules`), ``slot`` (the unit's key in them) and ``method``
            (``observe_activations`` / ``observe_output_grads``). Layers of one module (the
            experts of a fused experts module) share one hook.
        accumulation_steps: backward passes per optimizer step.
        loss_scale: returns the current loss scale to divide out of output gradients, or
            ``None`` (no mixed-precision scaler).
        before_write: called before the first write of a step's statistics (so that a
            reduction still reading last step's buffers can finish first).
        before_observe: called with the layer before its statistics are written (the engine
            moves the layer's state to where its parameters now are).
        output_grads: also capture output gradients; ``False`` for methods that read
            activations only (their hook on a call's output only adds the call's activation
            terms). A callable ``layer -> bool`` names the layers that read them. Which modules
            may read them is decided at construction; set to ``False`` later, none does.
    """

    def __init__(self, layers: Sequence, *, accumulation_steps: int,
                 loss_scale: Callable[[], float | torch.Tensor | None],
                 before_write: Callable[[], None],
                 before_observe: Callable[[Any], None] = lambda layer: None,
                 output_grads: bool | Callable[[Any], bool] = True) -> None:
        self.output_grads = output_grads
        self.accumulation_steps = accumulation_steps
        self._loss_scale = loss_scale
        self._before_write = before_write
        self._before_observe = before_observe
        self.collecting = False
        # a registered module ran forward in eval() mode with grad enabled while collecting: its
        # rows stay out (a validation pass must not enter the statistics), and an owner that saw
        # no training forward on the step can say why
        self.eval_forward = False
        # a replica of a registered module ran forward in training mode (nn.DataParallel): the
        # owner can say why no statistics came
        self.replica_forward = False
        self._warned_float16 = False
        self._warned_repeated_pass = False
        by_module: dict[int, tuple[nn.Module, object, dict[int, object]]] = {}
        for layer in layers:
            by_module.setdefault(id(layer.module), (layer.module, layer.adapter, {}))[2][layer.slot] = layer
        # Two hooks per module. The one that reads the call (and hooks its output's gradient)
        # runs ahead of the module's other forward hooks: a hook that returns another output (a
        # scale, a cast, noise) hands later hooks its own tensor, the output gradients read must
        # be those of what the module computed, and FSDP2's hook after the forward swaps the
        # gathered weights out. The second runs after them and hooks the output again, so that
        # the tensor hooks they put on it (FSDP2's, which gathers the weights again for the
        # backward) run before the call is acted on (_PairedGradient).
        self._handles = []
        for module, adapter, units in by_module.values():
            observe, wait = self._forward_hooks(module, adapter, units, self._reads_output_grads(units))
            self._handles.append(module.register_forward_hook(observe, with_kwargs=True, prepend=True))
            # always_call: a hook of the user's that raises in between still leaves the queue as it was
            self._handles.append(module.register_forward_hook(wait, with_kwargs=True, always_call=True))

    def _reads_output_grads(self, units: dict) -> bool:
        if callable(self.output_grads):
            return any(self.output_grads(layer) for layer in units.values())
        return bool(self.output_grads)

    def _forward_hooks(self, module: nn.Module, adapter, units: dict,
                       output_grads: bool) -> tuple[ForwardHook, ForwardHook]:
        """(the hook that reads a call, the hook that then waits for its output's gradient)."""
        waiting: list[tuple[weakref.ref, _PairedGradient, int]] = []  # this call's, if any

        @run_eagerly(FULLGRAPH_REASON)  # see the module docstring
        def observe(module: nn.Module, inputs, kwargs, output):
            with torch.no_grad(), autocast_disabled():
                observed = adapter.forward_rows(inputs, kwargs, output)
            if observed is None:
                return
            rows, context = observed
            # The call's terms are computed now (its rows are not kept) and added when a backward
            # reaches its output: a forward no backward follows (a metric, a head whose loss is not
            # taken) adds nothing, and a call activation checkpointing runs again in the backward
            # adds nothing more (the backward reaches the first call's output, never the rerun's).
            # A module returning a tuple (nn.MultiheadAttention's (output, weights)) is waited on
            # through its first tensor; one returning anything else has nowhere to wait: its rows
            # count at once.
            waited = _first_tensor(output)
            if waited is not None and not waited.requires_grad:
                return  # no backward can reach the weight through this call
            # output gradients are read from the module's output itself (a tensor) only
            reads_grads = output_grads and bool(self.output_grads) and waited is output
            self._before_write()
            calls: dict = {}
            staged: dict = {}
            with torch.no_grad(), autocast_disabled():
                for slot, unit_rows in rows:
                    layer = units.get(slot)
                    if layer is None:
                        continue
                    self._before_observe(layer)
                    if waited is not None:
                        staged[slot] = layer.method.activation_terms(unit_rows)
                    else:  # whatever the method returns comes back with this call's output gradient
                        calls[slot] = layer.method.observe_activations(unit_rows)
            if waited is not None:
                # the routing context is kept until the backward only where it is read then
                kept = context if reads_grads else None
                # a forward inside a backward is a reentrant checkpoint's recompute: its call belongs
                # to that backward pass, not to the nested one the region's backward runs as
                pass_of_call = graph_task()
                # the gradient nodes of the parameters this call used, taken now: the graph holds
                # them (FSDP2 frees the gathered copy the call used, which a later lookup would miss)
                nodes = _gradient_nodes(module)
                passes = [0]  # the passes that read this call's output gradient
                pair = _PairedGradient(lambda grad: self._reached(adapter, units, grad, kept, staged, calls,
                                                                  reads_grads, pass_of_call, nodes, passes))
                on_output_grad(waited, pair.own)  # before a later hook changes the output in place
                # (weakly: an entry a KeyboardInterrupt between the two hooks leaves keeps no graph;
                # the version tells whether a hook in between changed the output in place)
                waiting.append((weakref.ref(waited), pair, _hooked(waited)._version))

        @run_eagerly(FULLGRAPH_REASON)
        def wait(module: nn.Module, inputs, kwargs, output) -> None:
            # this call's entry: the last one queued (a call of the module made by one of its own
            # forward hooks, in between, has taken its own already)
            if waiting:
                ref, pair, version = waiting.pop()
                waited = ref()
                if waited is not None:
                    pair.same_node = _hooked(waited)._version == version
                    on_output_grad(waited, pair.after_others)

        # A deep copy of the model (an EMA or SWA average, a teacher) copies this function
        # along with the module's hooks: only the module it was placed on may feed the
        # statistics. A weak reference, so the hook does not keep its own module alive.
        placed_on = weakref.ref(module)

        def hook(module: nn.Module, inputs, kwargs, output):
            if self.collecting and torch.is_grad_enabled():
                if module is not placed_on():
                    # a replica sharing the module's hooks (nn.DataParallel's replicate copies
                    # modules shallowly; a deep copy's hooks are inert): its rows stay out
                    self.replica_forward = self.replica_forward or module.training
                elif module.training:
                    observe(module, inputs, kwargs, output)
                else:
                    self.eval_forward = True

        return ForwardHook(hook), ForwardHook(wait)

    def _reached(self, adapter, units: dict, grad: torch.Tensor, context, staged: dict, calls: dict,
                 reads_grads: bool, pass_of_call: int = -1, nodes: list | None = None,
                 passes: list[int] | None = None) -> None:
        """A backward reached a call's output: its activation terms are added (once, however
        many backwards pass through the call), then its output gradient is read. A pass that
        writes no gradient of the module's parameters (``torch.autograd.grad`` or
        ``backward(inputs=...)`` with respect to the input: a gradient penalty) is skipped: its
        output gradient is not the loss's, and the call's rows wait for a pass that writes them."""
        writes = _writes_gradient(nodes) if nodes else None
        if writes is False:
            return
        if staged:
            self._before_write()
            with torch.no_grad(), autocast_disabled(grad.device.type):  # backward inside an autocast region
                for slot, terms in staged.items():
                    layer = units[slot]
                    self._before_observe(layer)
                    # whatever the method returns comes back with this call's output gradient
                    calls[slot] = layer.method.add_activation_terms(terms)
            staged.clear()
        if reads_grads:
            if passes is not None and writes:  # a pass known to write the weights' .grad: a backward
                passes[0] += 1
                if passes[0] == 2 and not self._warned_repeated_pass:
                    self._warn_repeated_pass(units)
            _backward.pass_of_call = pass_of_call if pass_of_call >= 0 else graph_task()
            try:
                self._observe_output_grads(adapter, units, grad, context, calls)
            finally:
                _backward.pass_of_call = -1

    def _warn_repeated_pass(self, units: dict) -> None:
        """Once: a second backward pass reached a call's output (``backward(retain_graph=True)``
        once per loss over one forward). Each pass's output gradient is read on its own, so the
        statistics get ``δ₁δ₁ᵀ + δ₂δ₂ᵀ``, not the summed losses' ``(δ₁ + δ₂)(δ₁ + δ₂)ᵀ``."""
        self._warned_repeated_pass = True
        name = next(iter(units.values())).name
        warnings.warn(f"kron_precond: a backward reached the output of layer {name!r} (and maybe others) a "
                      f"second time since its forward (backward(retain_graph=True) once per loss over one "
                      f"forward): each pass's output gradient enters the statistics on its own (d1 d1^T + d2 d2^T, "
                      f"where one backward of the summed losses gives (d1 + d2)(d1 + d2)^T), so the curvature and the "
                      f"step differ from the summed loss's. Sum the losses and call backward once",
                      UserWarning, stacklevel=user_stacklevel())

    def _observe_output_grads(self, adapter, units: dict, grad: torch.Tensor, context, calls: dict) -> None:
        with torch.no_grad(), autocast_disabled(grad.device.type):  # backward inside an autocast region
            loss_scale = self._loss_scale()
            if loss_scale is None and grad.dtype == torch.float16 and not self._warned_float16:
                # float16 gradients are nearly always a GradScaler's scaled ones: its scale would stay
                # in the output-gradient statistics, mixed across every scale it goes through
                self._warned_float16 = True
                warnings.warn("output gradients arrive in float16 and no grad_scaler was given: if a "
                              "torch.amp.GradScaler scales the loss, pass it as grad_scaler= so that its scale is "
                              "divided out of the output-gradient statistics (ignore this if the loss is not "
                              "scaled)", UserWarning, stacklevel=2)
            scales = {}
            for slot, rows, scale in adapter.backward_rows(grad.detach(), context):
                layer = units.get(slot)
                if layer is None:
                    continue
                scales[slot] = scale
                if loss_scale is not None:
                    dtype = getattr(layer.method, "statistics_dtype", None) or layer.method.factor_dtype
                    rows = rows.to(dtype) / loss_scale
                scale = float(scale * self.accumulation_steps)
                call = calls.get(slot)
                if call is None:
                    layer.method.observe_output_grads(rows, scale)
                else:
                    layer.method.observe_output_grads(rows, scale, call)
            if scales:
                # a method that scales a step's rows by the step's count, not each call's, counts
                # the call for the units it gave no rows too (an expert it sent no token): the
                # loss averages over the call's every row
                default = max(scales.values())
                for slot, layer in units.items():
                    count_call = getattr(layer.method, "count_output_call", None)
                    if count_call is not None and slot not in scales:
                        count_call(default)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _gradient_nodes(module: nn.Module) -> list:
    """The autograd nodes that write the gradients of ``module``'s trainable parameters (the
    tensors its call uses now); empty where they cannot be told (sharded DTensor parameters at
    the hook, not the gathered ones the call used: a module resharded by a forward hook that
    ran ahead of the library's), and no pass is skipped."""
    params = [p for p in module._parameters.values() if p is not None and p.requires_grad]
    if any(is_dtensor(p) for p in params):
        return []
    try:
        return [torch.autograd.graph.get_gradient_edge(p).node for p in params]
    except (RuntimeError, AttributeError):  # (a torch without get_gradient_edge: every pass reads)
        return []


def _writes_gradient(nodes: list) -> bool | None:
    """Whether the running backward pass runs any of ``nodes`` (writes a gradient of the
    module's parameters: one a call leaves unused, as a gain taken only sometimes, never does);
    ``None`` where the engine cannot tell (``torch.autograd.grad`` with respect to the weights,
    which computes their gradients without writing ``.grad``; no engine to ask): read as one."""
    try:
        return any(torch._C._will_engine_execute_node(node) for node in nodes)
    except (RuntimeError, AttributeError):
        return None


# The backward pass (autograd graph task) the output gradients being read belong to, per
# thread (devices' backwards run on threads of their own): see backward_pass().
_backward = threading.local()


def graph_task() -> int:
    """The running backward's autograd graph task id; ``-1`` outside a backward."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if current is None else int(current())


def backward_pass() -> int:
    """The backward pass whose output gradients a method is reading: the autograd graph task
    of the backward that reached the call, or, for a call a reentrant activation checkpoint
    recomputed inside a backward, that backward's (its region's backward runs as a nested
    one). ``-1`` outside a read. One pass is one micro-batch of the step, however many calls
    of a module it reaches."""
    return getattr(_backward, "pass_of_call", -1)


class _PairedGradient:
    """Two tensor hooks on one call's output, and ``reached`` called once per backward pass that
    reaches what the module computed, with that gradient. ``own`` is put on when the call is
    read, ahead of the module's other forward hooks: it gets the gradient of what the module
    computed, also where a later hook changes the output in place. ``after_others`` is put on
    after those hooks, so that the tensor hooks they put on the output (FSDP2's, which gathers
    the weights again for the backward) run before ``reached`` does.

    Where nothing changed the output in between (``same_node``: both hang on one autograd node),
    ``after_others`` fires right after ``own`` in every pass, and acts on ``own``'s gradient.
    Where a hook changed it in place, ``after_others`` hangs on the node of the change, which a
    pass runs before ``own``'s (or alone: a gradient with respect to the changed output, which
    does not reach the module's), so ``own`` acts at once (also in a pass that reaches it alone:
    a term taken before the change). No autograd node is held here: a node holds its hooks, and
    a reference back would make a cycle that keeps each call's graph alive."""

    __slots__ = ("_reached", "_grad", "same_node")

    def __init__(self, reached: Callable[[torch.Tensor], None]) -> None:
        self._reached = reached
        self._grad: torch.Tensor | None = None
        self.same_node = False  # set by the second forward hook; until then ``own`` acts alone

    def own(self, grad: torch.Tensor) -> None:
        if self.same_node:
            self._grad = grad
        else:
            self._reached(grad)

    def after_others(self, grad: torch.Tensor) -> None:
        if self._grad is not None:
            grad, self._grad = self._grad, None
            self._reached(grad)


def _hooked(output: torch.Tensor) -> torch.Tensor:
    """The tensor :func:`on_output_grad` hangs a hook on for ``output``: it, or its base (a
    contiguous base that requires grad)."""
    base = output._base
    if base is None or not base.requires_grad or not base.is_contiguous():
        return output
    return base


class ForwardHook:
    """The forward hook placed on one registered module. The model keeps it among its hooks,
    so it travels with the model: pickled (``torch.save(model)``) or deep-copied, it becomes an
    inert hook (the statistics it fed belong to this process's optimizer, which is not copied),
    so the model can be saved whole and its copies feed no statistics."""

    __slots__ = ("_hook",)

    def __init__(self, hook: Callable[..., None]) -> None:
        self._hook = hook
        if not ForwardHook.__dict__.get("_calls_eagerly"):
            # Dynamo compiles none of it: one code object serves every registered module, and
            # compiling what is left around the eager statistics recompiled it per module, input
            # dtype and width until the recompile limit. Wrapped on first use, not at import
            # (compiled.py: torch._dynamo loaded after TensorFlow aborts the process).
            ForwardHook.__call__ = run_eagerly(FULLGRAPH_REASON)(ForwardHook.__dict__["__call__"])  # type: ignore
            ForwardHook._calls_eagerly = True  # type: ignore[attr-defined]

    def __call__(self, module: nn.Module, inputs, *rest) -> None:
        # (kwargs, output) as registered; (output,) alone when torch calls a hook removed by an
        # earlier hook of the same call (an optimizer freed there): its with_kwargs flag went
        # with it, and it still runs once from the hook list torch took before
        kwargs, output = rest if len(rest) == 2 else ({}, rest[0])
        self._hook(module, inputs, kwargs, output)

    def __reduce__(self):
        return InertHook, ()


class InertHook:
    """What a :class:`ForwardHook` becomes in a saved or copied model: it does nothing."""

    def __call__(self, *args: Any) -> None:
        return None


# What dynamo's error says when a model compiled with fullgraph=True after the hooks were placed
# reaches one (a model compiled so before construction is refused then: refuse_fullgraph).
FULLGRAPH_REASON = ("kron_precond's statistics hooks (WhitenedMuon, KronPreconditioner) observe each registered "
                    "module outside the compiled graph, a graph break per module: compile the model without "
                    "fullgraph=True, or leave the module out with skip_layers")


def _fullgraph(module: nn.Module) -> bool:
    """Whether ``module`` is compiled with ``fullgraph=True``: by ``module.compile(...)`` (its
    compiled call's dynamo context holds the setting) or wrapped by ``torch.compile(module, ...)``."""
    contexts = [getattr(module, "dynamo_ctx", None)]
    compiled = getattr(module, "_compiled_call_impl", None)
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            contexts.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return any(getattr(c, "fullgraph", False) is True for c in contexts)


def refuse_fullgraph(root: nn.Module, hooked: Sequence[nn.Module], who: str) -> None:
    """``ValueError`` naming a submodule of ``root`` compiled with ``fullgraph=True`` that holds a
    module the hooks observe: the observation runs outside the compiled graph (module
    docstring), a graph break that ``fullgraph`` forbids, so the first forward would fail."""
    ids = {id(m) for m in hooked}
    for name, module in root.named_modules():
        if _fullgraph(module) and any(id(m) in ids for m in module.modules()):
            raise ValueError(f"{who}: {name or type(root).__name__} is compiled with fullgraph=True, and the "
                             f"statistics hooks of the modules inside it need a graph break each (the observation "
                             f"runs outside the compiled graph). Compile it without fullgraph (torchtitan: "
                             f"--compile.no-enable), or leave its modules out with skip_layers")


class AbandonedIterations:
    """Tells, at ``zero_grad()``, whether the iteration since the previous one was abandoned: a
    backward wrote gradients and no ``step()`` came (a ``GradScaler`` skipped it:
    ``scaler.step(optimizer)`` calls nothing on an overflow). Its statistics must then be
    dropped. A backward shows in the gradients of ``params()``: it creates a tensor or
    accumulates into one in place, which changes its version; a second ``zero_grad`` with no
    backward in between (after the forward, say) shows nothing. A DTensor gradient (FSDP2)
    is accumulated into its local shard in place (``grad._local_tensor += ...``), which
    leaves the DTensor's own version as it was: the local shard's version is read too."""

    def __init__(self, params: Callable[[], Sequence[torch.Tensor]]) -> None:
        self._params = params
        # construction counts as a zero_grad(): a first iteration a GradScaler skips (its first
        # scales overflow most often) is told at the first zero_grad as any other
        self.zeroed()

    def _marks(self) -> list:
        return [None if p.grad is None else _grad_mark(p.grad) for p in self._params()]

    def stepped(self) -> None:
        self._stepped = True

    def abandoned(self) -> bool:
        """Called before zeroing."""
        return not self._stepped and self._at_zero is not None and self._marks() != self._at_zero

    def zeroed(self) -> None:
        """Called after zeroing."""
        self._stepped = False
        self._at_zero = self._marks()


def _grad_mark(grad: torch.Tensor) -> tuple[int, ...]:
    """What a backward changes in a gradient: the tensor (a new one) and its version (an
    accumulation in place); of a DTensor, also its local shard's version (FSDP2 accumulates
    into the shard, the DTensor's own version stays)."""
    if is_dtensor(grad):
        local = grad._local_tensor  # what FSDP2 adds into (to_local() returns an alias sharing its version)
        return (id(grad), grad._version, id(local), local._version)
    return (id(grad), grad._version)


def _first_tensor(output: Any) -> torch.Tensor | None:
    """The tensor a backward through a module call is waited on at: the output, or, of a tuple
    or list output, its first tensor that requires grad (else its first tensor); ``None`` for
    anything else."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        tensors = [t for t in output if isinstance(t, torch.Tensor)]
        return next((t for t in tensors if t.requires_grad), tensors[0] if tensors else None)
    return None


def weakly(method: Callable[..., Any], default: Any = None) -> Callable[..., Any]:
    """``method`` called through a weak reference to its object (``default`` once it is freed):
    for callbacks the model's hooks reach, which must not keep their owner alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return default if bound is None else bound(*args)
    return call


def on_output_grad(output: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """Call ``hook`` with the gradient of ``output`` -- as it was when the module returned it.

    A hook on ``output`` itself is lost when ``output`` is a view (Linear on a >2-D input,
    GPT-2 ``Conv1D``) that is then modified in place: autograd rebases the view and its
    hooks never fire (the layer would silently never be preconditioned). The view's base
    keeps its hooks through such changes and its gradient is taken before them, so the
    hook goes on the base (when contiguous, the view's strides index its gradient
    directly) and reads the view's elements out of it.
    """
    base = _hooked(output)
    if base is output:
        output.register_hook(hook)
        return
    size, stride = output.size(), output.stride()
    offset = output.storage_offset() - base.storage_offset()

    def read_view(grad: torch.Tensor) -> None:
        # the base's gradient can itself be a view at a storage offset (a slice of a torch.cat's
        # or torch.stack's gradient, when the output is not its first piece): as_strided counts
        # from the start of the storage, so the view's offset is added to the gradient's own
        grad = grad.contiguous()
        hook(grad.as_strided(size, stride, grad.storage_offset() + offset))
    base.register_hook(read_view)


def grad_scaler_scale(grad_scaler) -> Callable[[], float | torch.Tensor | None]:
    """A function returning the loss scale to divide out of output gradients (``None``: none).

    ``grad_scaler``: ``None``; a ``torch.amp.GradScaler``, whose scale tensor is read
    directly (no host sync; ``None`` before its first ``scale()`` and while disabled); or a
    callable returning the current scale, a float or a tensor (kfac-pytorch's
    ``grad_scaler=scaler.get_scale``). Anything else raises ``TypeError``.
    """
    if grad_scaler is None:
        return lambda: None
    if isinstance(grad_scaler, torch.amp.GradScaler):
        return lambda: grad_scaler._scale if grad_scaler.is_enabled() else None
    if callable(grad_scaler):
        return grad_scaler
    raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, a callable returning the current loss "
                    f"scale, or None; got {type(grad_scaler).__name__} {grad_scaler!r}")
