"""Optimizers (SGD, Adam) that update (mirrored) variables the tf.distribute way."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import numpy as np

from mpistrat import devices as dev
from mpistrat.arrays import NATIVE_NUMERIC, as_array
from mpistrat.distribute import context, in_place
from mpistrat.distribute.values import DistributedValues, ReduceOp
from mpistrat.distribute.variables import BaseVariable, Variable
from mpistrat.train import kernels

__all__ = ["Optimizer", "SGD", "Adam", "get"]


def _check_positive(name: str, value: Any, allow_zero: bool = False) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'} and finite, got {value}")
    return value


def _strategy_of(var: Any) -> Any:
    return getattr(var, "_distribute_strategy", None) or context.get_strategy()


_ONE = np.ones((), np.int64)  # iterations' increment, of its dtype (read-only: shared by every optimizer)
_ONE.flags.writeable = False


def _add(copy: Any, delta: Any, j: int) -> None:
    copy.assign_add(delta)


def _project(copy: Any, _: Any, j: int) -> None:
    copy.assign(copy.constraint(copy.value()))


def _in_place(kernel: Callable[..., None], variables: tuple, grad: Any, *coefficients: float) -> bool:
    """``kernel(*arrays, grad, *coefficients)`` on the arrays of ``variables``' copies being updated, block by
    block, where they may be written in place (``in_place.run``) and the kernel gives the bits of the same
    rule assigned (``kernels.applies``), for gradients longer than a block (``kernels.worth``); whether it
    ran (if not, nothing changed: assign instead)."""
    if not kernels.worth(grad):
        return False
    return in_place.run(variables, lambda arrays: kernels.applies(arrays, grad, coefficients), kernel, grad,
                        *coefficients)


def _key(var: Any) -> Any:
    """How ``var``'s slots are filed: its identity, the same in a copy of the optimizer sent to another rank
    (a parameter server's variable), else the object."""
    return var._identity() if isinstance(var, BaseVariable) else id(var)


class Optimizer:
    """Base class: slot bookkeeping, gradient aggregation and the distributed apply.

    ``apply_gradients`` may be called inside ``strategy.run`` (replica
    context) or in cross-replica context. In replica context it optionally
    sums the gradients over all replicas with one fused ``all_reduce`` and
    then enters ``merge_call``; the update itself runs in cross-replica
    context through the strategy's update (``extended._update_each``:
    ``extended.update`` of each variable in turn, without its per-call checks),
    once per local copy of each variable, on that copy's device and array
    module (NumPy or CuPy); then each variable's constraint, if any. Slot
    variables (momentum, Adam's moments) and the step counter ``iterations``
    are variables created under the variables' strategy scope, so they are
    mirrored like the weights and can be checkpointed (``optimizer.variables``).
    """

    _slot_names: tuple[str, ...] = ()

    def __init__(self, learning_rate: float, name: str):
        self.learning_rate = _check_positive("learning_rate", learning_rate)
        self.name = name
        self._iterations: Any = None
        self._slots: dict[Any, dict[str, Any]] = {}
        self._built: list = []

    # -- state ----------------------------------------------------------------------
    @property
    def iterations(self) -> Any:
        """Number of updates applied so far (an int64 variable; created by ``build``)."""
        if self._iterations is None:
            raise RuntimeError(f"Optimizer {self.name} is not built yet: call build(var_list) under the strategy "
                               "scope, or apply_gradients once")
        return self._iterations

    @property
    def variables(self) -> list:
        """``iterations`` followed by the slot variables, in the order the variables were built."""
        out = [] if self._iterations is None else [self._iterations]
        for var in self._built:
            out.extend(self._slots[_key(var)][s] for s in self._slot_names)
        return out

    def get_slot(self, var: Any, slot_name: str) -> Any:
        """The slot variable ``slot_name`` of ``var``."""
        try:
            return self._slots[_key(var)][slot_name]
        except KeyError:
            raise KeyError(f"Optimizer {self.name} has no slot {slot_name!r} for variable "
                           f"{getattr(var, 'name', var)!r}; slots: {list(self._slot_names)}") from None

    def build(self, var_list: Iterable[Any]) -> None:
        """Create ``iterations`` and the slots of ``var_list`` (in cross-replica context; idempotent)."""
        var_list = list(var_list)
        if not var_list:
            raise ValueError(f"Optimizer {self.name}: build needs at least one variable")
        for v in var_list:
            if not getattr(v, "_is_variable", False):
                raise TypeError(f"Optimizer {self.name}: expected variables, got {type(v).__name__}")
        strategies = {id(_strategy_of(v)) for v in var_list}
        if len(strategies) != 1:
            raise ValueError(f"Optimizer {self.name}: the variables were created under different strategies")
        strategy = _strategy_of(var_list[0])
        new = [v for v in var_list if _key(v) not in self._slots]
        if self._iterations is not None and not new:
            return
        with strategy.scope():
            if self._iterations is None:
                self._iterations = Variable(np.int64(0), trainable=False, name=f"{self.name}/iterations")
            for v in new:
                self._slots[_key(v)] = {
                    s: Variable(np.zeros(v.shape, v.dtype), trainable=False, name=f"{self.name}/{v.name}/{s}")
                    for s in self._slot_names
                }
                self._built.append(v)

    # -- applying -------------------------------------------------------------------
    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]],
                        experimental_aggregate_gradients: bool = True) -> Any:
        """Apply ``(gradient, variable)`` pairs; returns ``iterations``.

        In replica context the gradients are summed over all replicas first
        (one fused all-reduce) unless ``experimental_aggregate_gradients`` is
        False, when they must already be aggregated. Pairs whose gradient is
        None are skipped.
        """
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            raise ValueError(f"Optimizer {self.name}: no gradients provided for any variable")
        var_list = [v for _, v in pairs]
        for v in var_list:
            if not getattr(v, "_is_variable", False):
                raise TypeError(f"Optimizer {self.name}: expected (gradient, variable) pairs, got a "
                                f"{type(v).__name__} in the variable position")
        grads = [g if (type(g) is np.ndarray and g.dtype in NATIVE_NUMERIC) or isinstance(g, DistributedValues)
                 else as_array(g, what=f"Optimizer {self.name}: gradient of {v.name}") for g, v in pairs]
        for g, v in zip(grads, var_list):
            if not isinstance(g, DistributedValues) and tuple(np.shape(g)) != tuple(v.shape):
                raise ValueError(f"Optimizer {self.name}: gradient of shape {tuple(np.shape(g))} does not match "
                                 f"variable {v.name} of shape {tuple(v.shape)}")
        replica_ctx = context.get_replica_context()
        if replica_ctx is None:  # cross-replica context
            return self._distributed_apply(context.get_strategy(), grads, var_list)
        if experimental_aggregate_gradients and replica_ctx.num_replicas_in_sync > 1:
            grads = replica_ctx.all_reduce(ReduceOp.SUM, grads)
        return replica_ctx.merge_call(lambda strategy, g: self._distributed_apply(strategy, g, var_list),
                                      args=(grads,))

    def _distributed_apply(self, strategy: Any, grads: list, var_list: list) -> Any:
        self.build(var_list)
        strategy.extended._require_updatable(var_list + [self._iterations])  # before any of them changes
        step = int(np.asarray(self._iterations.numpy())) + 1
        coefficients = self._coefficients(step)
        slots = [self._slots[_key(v)] for v in var_list]
        update_step, to_device = self._update_step, dev.to_device

        def update(copy: Any, grad: Any, j: int) -> None:
            update_step(copy, to_device(grad, copy.device), slots[j], coefficients)

        strategy.extended._update_each(var_list, update, grads)
        # As Keras: after every update, each variable's constraint projects it (assign does not apply it).
        constrained = [v for v in var_list if v.constraint is not None]
        if constrained:
            strategy.extended._update_each(constrained, _project, [None] * len(constrained))
        strategy.extended._update_each((self._iterations,), _add, (_ONE,))  # iterations.assign_add(1), leaner
        return self._iterations

    # -- the update rule, per copy --------------------------------------------------
    def _coefficients(self, step: int) -> dict:
        return {"lr": self.learning_rate}

    def _update_step(self, var: Any, grad: Any, slots: dict, coefficients: dict) -> None:
        raise NotImplementedError

    def get_config(self) -> dict:
        """The hyperparameters."""
        return {"name": self.name, "learning_rate": self.learning_rate}


class SGD(Optimizer):
    """Gradient descent with optional (Nesterov) momentum, as ``keras.optimizers.SGD``.

    ``velocity = momentum * velocity - lr * g``; ``w += velocity``
    (Nesterov: ``w += momentum * velocity - lr * g``). Without momentum: ``w -= lr * g``.
    """

    def __init__(self, learning_rate: float = 0.01, momentum: float = 0.0, nesterov: bool = False, name: str = "SGD"):
        super().__init__(learning_rate, name)
        self.momentum = _check_positive("momentum", momentum, allow_zero=True)
        if self.momentum >= 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        self.nesterov = bool(nesterov)
        self._slot_names = ("momentum",) if self.momentum else ()

    def _update_step(self, var: Any, grad: Any, slots: dict, coefficients: dict) -> None:
        lr = coefficients["lr"]
        if not self.momentum:
            if not _in_place(kernels.sgd, (var,), grad, lr):
                var.assign_sub(lr * grad)
            return
        velocity = slots["momentum"]
        if _in_place(kernels.nesterov if self.nesterov else kernels.momentum, (var, velocity), grad, lr,
                     self.momentum):
            return
        # The new values before any assignment: an error computing them (np.seterr "raise") changes nothing.
        new_velocity = self.momentum * velocity.value() - lr * grad
        step = self.momentum * new_velocity - lr * grad if self.nesterov else new_velocity
        velocity.assign(new_velocity)
        var.assign_add(step)

    def get_config(self) -> dict:
        return {**super().get_config(), "momentum": self.momentum, "nesterov": self.nesterov}


class Adam(Optimizer):
    """Adam, as ``keras.optimizers.Adam``: bias-corrected step size, epsilon added to ``sqrt(v)``.

    ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``;
    ``w -= lr * sqrt(1-b2^t) / (1-b1^t) * m / (sqrt(v) + epsilon)``.
    """

    _slot_names = ("m", "v")

    def __init__(self, learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, name: str = "Adam"):
        super().__init__(learning_rate, name)
        for label, beta in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0 <= float(beta) < 1:
                raise ValueError(f"{label} must be in [0, 1), got {beta}")
        self.beta_1, self.beta_2 = float(beta_1), float(beta_2)
        self.epsilon = _check_positive("epsilon", epsilon)

    def _coefficients(self, step: int) -> dict:
        lr_t = self.learning_rate * math.sqrt(1 - self.beta_2 ** step) / (1 - self.beta_1 ** step)
        return {"lr": lr_t}

    def _update_step(self, var: Any, grad: Any, slots: dict, coefficients: dict) -> None:
        m, v = slots["m"], slots["v"]
        if _in_place(kernels.adam, (var, m, v), grad, coefficients["lr"], self.beta_1, self.beta_2, self.epsilon):
            return
        xp = dev.array_module(var.device)
        new_m = self.beta_1 * m.value() + (1 - self.beta_1) * grad
        new_v = self.beta_2 * v.value() + (1 - self.beta_2) * (grad * grad)
        step = coefficients["lr"] * new_m / (xp.sqrt(new_v) + self.epsilon)  # before any assignment, as SGD
        m.assign(new_m)
        v.assign(new_v)
        var.assign_sub(step)

    def get_config(self) -> dict:
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon}


def get(name: str, learning_rate: float, **kwargs: Any) -> Optimizer:
    """An optimizer by name: ``"sgd"`` (momentum 0.9 unless given) or ``"adam"``."""
    key = str(name).lower()
    if key == "sgd":
        kwargs.setdefault("momentum", 0.9)
        return SGD(learning_rate, **kwargs)
    if key == "adam":
        return Adam(learning_rate, **kwargs)
    raise ValueError(f"Unknown optimizer {name!r}; expected 'sgd' or 'adam'")
