"""A training step replayed as one CUDA graph: calibration's KL step without the host's launch cost.

A KL step of calibration launches ~30k operators (~190 ECs, forward and backward), so on a GPU it is bound by
the host: 0.44 s a step at 8 sequences of 512 tokens on an H200, 0.25 s replayed (20 steps, with their scoring
passes; BENCHMARKS §2). GraphedStep captures `loss_fn(*inputs)`, which computes a loss and runs its backward into
the `.grad` of `params`, once with torch.cuda.graph (after two warm-up calls on a side stream), then copies each
call's inputs into the captured buffers and replays.

The captured backward writes the gradients into the graph's own memory, so between calls they must stay as they
are (never set to None): the caller clips them and steps its optimizer eagerly. Inputs keep one shape (tensors,
or tuples of them, nested). Disabled, or where capture fails (a forward that syncs with the host), each call
runs eagerly after setting the gradients to None.
"""

from __future__ import annotations

from typing import Callable

import torch
from tqdm.auto import tqdm


def _copy_into(static, new) -> None:
    """Copy the tensors of `new` into the same-shaped tensors of `static` (tuples nest)."""
    if isinstance(static, torch.Tensor):
        static.copy_(new)
    else:
        for a, b in zip(static, new, strict=True):
            _copy_into(a, b)


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else tuple(_clone(y) for y in x)


class GraphedStep:
    def __init__(self, loss_fn: Callable[..., torch.Tensor], params: list[torch.nn.Parameter], enabled: bool):
        self.loss_fn, self.params, self.enabled = loss_fn, params, enabled
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: tuple = ()
        self.static_loss: torch.Tensor | None = None

    def _zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def __call__(self, *inputs) -> torch.Tensor:
        """Run loss_fn(*inputs) (its backward sets the params' .grad); return its loss (a tensor, no host sync)."""
        if self.enabled and self.graph is None:
            self._capture(inputs)
        if not self.enabled:
            self._zero_grad()
            return self.loss_fn(*inputs)
        _copy_into(self.static_inputs, inputs)
        self.graph.replay()
        return self.static_loss

    def _capture(self, inputs: tuple) -> None:
        self.static_inputs = _clone(inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: cuBLAS workspaces, the autograd engine's streams
                    self._zero_grad()
                    self.loss_fn(*self.static_inputs)
            torch.cuda.current_stream().wait_stream(side)
            self._zero_grad()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.static_loss = self.loss_fn(*self.static_inputs)
            self.graph = graph
        except RuntimeError as e:  # capture is an optimisation: fall back to the eager step
            torch.cuda.synchronize()
            self.enabled, self.graph, self.static_inputs = False, None, ()
            tqdm.write(f"calibration: CUDA graph capture failed ({str(e).splitlines()[0][:120]}); running eagerly")
