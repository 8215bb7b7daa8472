"""A multilayer perceptron with hand-written forward and backward passes."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mpistrat import devices as dev
from mpistrat.distribute.variables import Variable

__all__ = ["MLP", "softmax_cross_entropy_sum"]


def _xp_of(x: Any) -> Any:
    return dev.array_module(dev.device_of(x))


def softmax_cross_entropy_sum(logits: Any, labels: Any) -> "tuple[Any, Any]":
    """Summed softmax cross-entropy of integer ``labels`` and its gradient w.r.t. ``logits``."""
    xp = _xp_of(logits)
    n = logits.shape[0]
    shifted = logits - logits.max(axis=1, keepdims=True) if n else logits
    exp = xp.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    rows = xp.arange(n)
    loss = (xp.log(total[:, 0]) - shifted[rows, labels]).sum()
    dlogits = exp / total
    dlogits[rows, labels] -= 1
    return loss, dlogits


class MLP:
    """Dense layers with ReLU between them and a softmax cross-entropy head.

    The weights are ``mpistrat.Variable``s created under the current
    strategy's scope (mirrored variables under Mirrored/MultiWorkerMirrored
    strategies). Inside ``strategy.run`` each replica reads its own copy, on
    its own device, and computes with that device's array module (NumPy on
    CPUs, CuPy on GPUs). Losses and gradients are *sums* over the replica's
    examples, so replicas' results can be added with one all-reduce and
    divided by the global count.

    Args:
      layer_sizes: ``[inputs, hidden..., classes]``, e.g. ``[64, 128, 10]``.
      seed: seed of the He-normal weight initialisation (NumPy, on the host;
        under a multi-worker strategy the chief's values are broadcast anyway).
      dtype: parameter dtype (``"float32"`` or ``"float64"``).
    """

    def __init__(self, layer_sizes: Sequence[int], seed: int = 0, dtype: Any = "float32", name: str = "mlp"):
        sizes = [int(s) for s in layer_sizes]
        if len(sizes) < 2 or any(s < 1 for s in sizes):
            raise ValueError(f"layer_sizes needs at least an input and an output size, all >= 1; got {list(layer_sizes)}")
        self.layer_sizes = sizes
        self.dtype = np.dtype(dtype)
        if self.dtype.kind != "f":
            raise ValueError(f"MLP parameters must be floating point, got dtype {self.dtype}")
        rng = np.random.default_rng(seed)
        self.variables: list = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            kernel = rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)
            self.variables.append(Variable(kernel.astype(self.dtype), name=f"{name}/dense_{i}/kernel"))
            self.variables.append(Variable(np.zeros(fan_out, self.dtype), name=f"{name}/dense_{i}/bias"))

    @property
    def trainable_variables(self) -> list:
        """The kernels and biases, layer by layer."""
        return list(self.variables)

    def _params(self) -> list:
        return [v.value() for v in self.variables]

    def forward(self, x: Any) -> "tuple[Any, list]":
        """Logits for the batch ``x`` and what ``backward`` needs."""
        params = self._params()
        h = x.astype(self.dtype, copy=False)
        acts = [h]
        last = len(params) // 2 - 1
        for i in range(0, len(params), 2):
            z = h @ params[i] + params[i + 1]
            h = z if i // 2 == last else _xp_of(z).maximum(z, 0)
            acts.append(h)
        return h, acts

    def backward(self, acts: list, dlogits: Any) -> list:
        """Gradients of the loss w.r.t. every variable, given the gradient w.r.t. the logits."""
        params = self._params()
        grads: list = [None] * len(params)
        dz = dlogits
        for i in range(len(params) - 2, -1, -2):
            h_in = acts[i // 2]
            grads[i] = h_in.T @ dz
            grads[i + 1] = dz.sum(axis=0)
            if i:
                dz = (dz @ params[i].T) * (h_in > 0)
        return grads

    def loss_and_gradients(self, x: Any, labels: Any) -> "tuple[Any, Any, list]":
        """Summed loss, number of correct predictions and summed gradients over the batch."""
        logits, acts = self.forward(x)
        labels = labels.astype(np.int64, copy=False)
        loss, dlogits = softmax_cross_entropy_sum(logits, labels)
        correct = (logits.argmax(axis=1) == labels).sum() if logits.shape[0] else _xp_of(logits).asarray(0)
        return loss, correct, self.backward(acts, dlogits)

    def predict(self, x: Any) -> Any:
        """Predicted class of every row of ``x``."""
        return self.forward(x)[0].argmax(axis=1)
