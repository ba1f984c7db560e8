"""How the hidden state turns from layer to layer along the unrolled forward pass (the paper's
Figure 8; ``archlab layers``).

Each layer application, every loop iteration included, is measured by the angular distance
between the hidden state it reads and the one it writes, arccos(cos(x_in, x_out)) / pi, averaged
over every token of every sequence: 0 is a layer that leaves the direction as it was, 0.5 one
that turns it orthogonal. A loop whose iterations turn it less and less is nearing a fixed point;
a jump where the cross-decoder begins says the two halves do different work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

import torch
import torch.nn.functional as F

from archlab.files import save_figure_whole
from archlab.memory import ACTIVATIONS, Watched
from archlab.model import Model
from archlab.table import Decimals
from archlab.train.evaluate import Loaded


@dataclass(frozen=True)
class Application:
    """One layer applied once in the forward pass, in forward order."""

    depth: int  # 1-based place in the unrolled pass
    half: str  # "self_decoder", "cross_decoder", or "layers" for a plain stack
    segment: int  # the plan's segment
    iteration: int  # 1-based loop iteration (1 outside a loop)
    times: int  # the segment's iterations
    layer: int
    block: str


def applications(model: Model) -> list[Application]:
    """Every layer application of the model's forward pass, in the order the walker makes them."""
    plan, spec = model.plan, model.spec
    return [Application(depth, spec.halves[plan.segments[step.segment].half][0].removeprefix("layout."), step.segment,
                        step.iteration + 1, plan.segments[step.segment].times, i, spec.block_at(i).type)
            for depth, (step, i) in enumerate(plan.applications(), 1)]


def angular_distances(model: Model, inputs: torch.Tensor, autocast=nullcontext(), batch: int = 8) -> list[float]:
    """For each layer application in forward order, the angular distance between its input and
    output hidden states, averaged over every token of ``inputs`` [sequences, length] (``batch``
    sequences at a time, on the model's device)."""
    order = applications(model)
    device = next(model.parameters()).device
    turned, tokens = torch.zeros(len(order), dtype=torch.float64), torch.zeros(len(order), dtype=torch.float64)
    seen: list[tuple[torch.Tensor, int]] = []

    def measure(layer, args, output):
        cosine = F.cosine_similarity(args[0].float(), output.float(), dim=-1).clamp(-1.0, 1.0)
        seen.append((torch.arccos(cosine).sum().double(), cosine.numel()))

    hooks = [layer.register_forward_hook(measure) for layer in model.layers]
    try:
        with torch.no_grad(), autocast:
            for n, rows in enumerate(inputs.split(batch)):
                seen.clear()
                with Watched(device, ACTIVATIONS) if n == 0 else nullcontext():  # the others repeat the first batch's
                    model.hidden(rows.to(device))
                if len(seen) != len(order):
                    raise RuntimeError(f"the forward pass applied {len(seen)} layers where its plan has {len(order)}")
                turned += torch.stack([angle for angle, _ in seen]).cpu()
                tokens += torch.tensor([count for _, count in seen], dtype=torch.float64)
    finally:
        for hook in hooks:
            hook.remove()
    return (turned / tokens / math.pi).tolist()


@dataclass(frozen=True)
class Measured:
    application: Application
    distance: float

    def row(self, run: str) -> dict:
        a = self.application
        return {"run": run, "depth": a.depth, "half": a.half, "iteration": a.iteration, "layer": a.layer, "block": a.block,
                "distance": Decimals(self.distance, 4)}


def measure(run: Path, seq_len: int | None, sequences: int, device: torch.device, data: str | None = None,
            batch: int = 8, say: Callable[[str], None] | None = None) -> list[Measured]:
    """Each layer application of the run's latest checkpoint, measured on ``sequences`` windows of
    ``seq_len`` tokens (the length it trained on if None) of its held-out split (or of all of
    ``data``; fresh sequences on a recall task), ``batch`` at a time; ``say`` is told before text
    is tokenized."""
    loaded = Loaded.of(run, data, say)
    length = seq_len or loaded.config.seq_len
    windows = loaded.sequences([length], sequences)[length]
    model, autocast = loaded.on(device)
    return [Measured(a, d) for a, d in zip(applications(model), angular_distances(model, windows.inputs, autocast, batch))]


def summary(run: str, measured: list[Measured]) -> list[str]:
    """What the paper reads from the figure, in words: each loop's mean distance by iteration, and
    the step in distance where the cross-decoder begins."""
    lines = []
    for looped in _loops(measured).values():
        layers = sorted({m.application.layer for m in looped[0]})
        lines.append(f"{run}: {looped[0][0].application.half} layers {layers[0]}-{layers[-1]} looped, mean distance by"
                     " iteration: " + ", ".join(f"{fmean([m.distance for m in once]):.4f}" for once in looped))
    entering = next((i for i, m in enumerate(measured) if m.application.half == "cross_decoder"), 0)
    if entering:
        before, first = measured[entering - 1].distance, measured[entering].distance
        lines.append(f"{run}: entering the cross_decoder, the distance goes from {before:.4f} to {first:.4f}")
    return lines


def _loops(measured: list[Measured]) -> dict[int, list[list[Measured]]]:
    """For each looped segment, its applications grouped by iteration."""
    found: dict[int, list[list[Measured]]] = {}
    for m in measured:
        a = m.application
        if a.times > 1:
            iterations = found.setdefault(a.segment, [[] for _ in range(a.times)])
            iterations[a.iteration - 1].append(m)
    return found


def plot(runs: dict[str, list[Measured]], path: Path) -> None:
    """Angular distance against depth in the unrolled pass, a line per run; a dashed line (the
    run's colour) where its cross-decoder begins; loop iterations shaded where every run has the
    same plan."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for run, measured in runs.items():
        (line,) = ax.plot([m.application.depth for m in measured], [m.distance for m in measured], marker="o", markersize=4,
                          label=run)
        cross = next((m.application.depth for m in measured if m.application.half == "cross_decoder"), None)
        if cross is not None:
            ax.axvline(cross - 0.5, color=line.get_color(), linestyle="--", linewidth=1)
    if len({tuple(m.application for m in measured) for measured in runs.values()}) == 1:
        for looped in _loops(next(iter(runs.values()))).values():
            for t, once in enumerate(looped, 1):
                first, last = once[0].application.depth, once[-1].application.depth
                ax.axvspan(first - 0.5, last + 0.5, color="grey", alpha=0.12 if t % 2 else 0.05, linewidth=0)
                ax.text((first + last) / 2, 1.0, f"loop {t}", transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                        fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer application in the unrolled forward pass")
    ax.set_ylabel("angular distance, input to output")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title("how far each layer turns the hidden state", pad=16)
    ax.legend()
    fig.tight_layout()
    save_figure_whole(fig, path, dpi=110)
