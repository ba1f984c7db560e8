"""The nn.Module built from a spec: embed -> segments (each looped T times) -> norm -> head.

In a YOCO layout the global K,V is projected once from the normalised self-decoder output,
between the last self-decoder segment and the first cross-decoder segment. A cross-decoder loop
that does not share its K,V re-projects it from its own input at every iteration after the first.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from archlab.block import BlockSpec, BuildContext, MixerInput
from archlab.cache import Cache, State
from archlab.cost import Cost
from archlab.kv import KVRows, PagedKV, PageTable
from archlab.loss import linear_cross_entropy
from archlab.memory import check_room
from archlab.ops.attention import append_kv
from archlab.ops.common import float32_or_wider
from archlab.ops.dispatch import Kernels, trains_on
from archlab.plan import Plan, Step
from archlab.registry import RegistryError, named
from archlab.rope import Rotary
from archlab.spec import ModelSpec, ParScale, RoPE, YocoLayout, revalidated


class Layer(nn.Module):
    """Pre-norm residual layer: x + mixer(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, spec: ModelSpec, mixer: nn.Module):
        super().__init__()
        self.mixer_norm, self.mixer = spec.norm.build(spec.d_model), mixer
        self.ffn_norm, self.ffn = spec.norm.build(spec.d_model), spec.ffn.build(spec.d_model, spec.init_std)

    def forward(self, x: torch.Tensor, inp: MixerInput, aux_losses: list) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x), inp)
        return x + self.ffn(self.ffn_norm(x), aux_losses)


class GlobalKVProjection(nn.Module):
    """YOCO's one K,V for the whole cross-decoder: the model's norm, then K and V projections (RoPE on K
    when the cross-decoder uses RoPE)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        shape = spec.layout.global_kv
        self.heads, self.head_dim = shape.n_kv_heads, shape.head_dim
        self.norm = spec.norm.build(spec.d_model)
        self.k_proj = nn.Linear(spec.d_model, self.heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(spec.d_model, self.heads * self.head_dim, bias=False)
        position = spec.layout.cross_decoder.position
        self.rotary = Rotary(self.head_dim, position.theta) if isinstance(position, RoPE) else None

    def new_state(self, batch: int, capacity: int, dtype: torch.dtype) -> State:
        """A row per position for each sequence."""
        shape = (batch, capacity, self.heads, self.head_dim)
        return {"k": torch.zeros(shape, dtype=dtype), "v": torch.zeros(shape, dtype=dtype)}

    def new_pool(self, pages: int, page_size: int, dtype: torch.dtype) -> State:
        """A pool of pages, one more for the spare, heads first (``archlab.kv.PagedKV``)."""
        shape = (self.heads, pages + 1, page_size, self.head_dim)
        return {"k": torch.zeros(shape, dtype=dtype), "v": torch.zeros(shape, dtype=dtype)}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: State | None = None,
                page_table: PageTable | None = None) -> KVRows | PagedKV:
        """The K,V the cross-decoder reads; with a state (a pool when ``page_table`` is given), the new
        positions are written into it and the whole cache is returned."""
        batch, n, _ = x.shape
        h = self.norm(x)
        k = self.k_proj(h).view(batch, n, self.heads, self.head_dim)
        v = self.v_proj(h).view(batch, n, self.heads, self.head_dim)
        k = k if self.rotary is None else self.rotary(k, positions)
        if state is None:
            return KVRows(k, v, positions)
        if page_table is None:
            return KVRows(*append_kv(state, positions, k, v))
        page_table.write(positions, (state["k"], k), (state["v"], v))
        return PagedKV(state["k"], state["v"], page_table)


class StreamMix(nn.Module):
    """ParScale's output aggregation, as its reference code: per-token softmax weights over the P
    normalised streams from an MLP of all of them, smoothed towards uniform; their weighted sum."""

    def __init__(self, d_model: int, spec: ParScale):
        super().__init__()
        self.smoothing = spec.smoothing
        self.weigh = nn.Sequential(nn.Linear(spec.streams * d_model, d_model), nn.SiLU(), nn.Linear(d_model, spec.streams))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, P, N, D] -> [B, N, D]."""
        batch, streams, n, d = x.shape
        per_token = x.permute(0, 2, 1, 3)  # [B, N, P, D]
        weights = self.weigh(per_token.reshape(batch, n, streams * d)).to(float32_or_wider(x.dtype)).softmax(dim=-1)
        weights = weights * (1 - self.smoothing) + self.smoothing / streams
        return (weights.unsqueeze(-1) * per_token).sum(dim=2).to(x.dtype)


def _build_mixer(block: BlockSpec, ctx: BuildContext) -> nn.Module:
    """A block's module, refused now (rather than mid-generation) if it lacks what the model calls."""
    module = block.build(ctx)
    lacks = ("is not an nn.Module" if not isinstance(module, nn.Module)
             else "has no forward method" if type(module).forward is nn.Module.forward
             else "has no new_state method" if not callable(getattr(module, "new_state", None)) else None)
    if lacks:
        raise RegistryError(f"{named(block)}: its build() returned {type(module).__name__}, which {lacks}; a block's module"
                            " is an nn.Module with forward(x, inp) and new_state(batch, capacity, dtype), its inference state")
    return module


def _check_tokens(name: str, tokens: object) -> None:
    """Token ids as forward takes them, a [batch, length] integer tensor, or a TypeError or
    ValueError naming them (from their shape and dtype alone: no read from the device)."""
    if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"{name} must be a tensor of integer token ids, got {getattr(tokens, 'dtype', type(tokens).__name__)}")
    if tokens.dim() != 2 or tokens.shape[1] == 0:
        raise ValueError(f"{name} must be [batch, length] with a length of at least 1, got shape {tuple(tokens.shape)}")


class Model(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        spec = self.spec = revalidated(spec)  # one varied by model_copy(update=...) skipped validation
        self.plan = Plan.of(spec)
        self.embed = nn.Embedding(spec.vocab_size, spec.d_model)
        contexts = spec.build_contexts()
        self.layers = nn.ModuleList(
            Layer(spec, _build_mixer(spec.block_at(i), contexts[self.plan.half_of(i)])) for i in range(spec.n_layers)
        )
        self.global_kv = GlobalKVProjection(spec) if isinstance(spec.layout, YocoLayout) else None
        self.streams = spec.streams
        self.stream_mix = StreamMix(spec.d_model, spec.parscale) if spec.parscale else None
        self.norm = spec.norm.build(spec.d_model)
        self.head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        if self.head.weight.device.type != "meta":  # shapes alone: drawing nothing is much faster there
            self.apply(self._init)
        if spec.tie_embeddings:
            self.head.weight = self.embed.weight

    def compile_layers(self) -> None:
        """``torch.compile`` each layer: layers of a kind share compiled code, so this costs a layer
        or two to compile, not the unrolled model (as torchtitan does). The blocks' kernels are
        chosen first, for the device the model is on: choosing imports them, which a trace cannot
        follow, and each layer's graph would be split there."""
        self.choose_kernels()
        for layer in self.layers:
            layer.compile()

    def choose_kernels(self) -> None:
        """Choose every block's kernels for the device the model is on, now: one that cannot run
        there fails here, not in the middle of a pass."""
        device = next(self.parameters()).device
        for kernels in self.block_kernels():
            kernels(device)

    def untrainable_kernels(self, device_type: str) -> list[tuple[str, str]]:
        """(block, backend) of each kernel choice that has no backward pass on ``device_type``
        (FlexAttention runs forward on any device, backward on CUDA only)."""
        chosen = {(k.block, k.backend(device_type)) for k in self.block_kernels()}
        return sorted((block, backend) for block, backend in chosen if not trains_on(backend, device_type))

    def block_kernels(self) -> Iterator[Kernels]:
        """Every block's choice of kernels (each block keeps its own as ``kernels``)."""
        return (m.kernels for m in self.modules() if isinstance(getattr(m, "kernels", None), Kernels))

    def _init(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.spec.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, return_aux: bool = False, targets: torch.Tensor | None = None):
        """Logits [batch, length, vocab]; with ``targets`` [batch, length] (``IGNORE``: not
        counted), the mean cross-entropy instead, computed without holding the logits
        (``archlab.loss``). With ``return_aux``, also the summed auxiliary losses (MoE load
        balancing; 0 without MoE)."""
        _check_tokens("input_ids", input_ids)
        if targets is not None:
            _check_tokens("targets", targets)
            if targets.shape != input_ids.shape:
                raise ValueError(f"targets must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(targets.shape)}")
        aux: list[torch.Tensor] = []
        x = self.hidden(input_ids, aux)
        out = self.head(x) if targets is None else linear_cross_entropy(x.flatten(0, 1), self.head.weight, targets.flatten())
        if not return_aux:
            return out
        return out, torch.stack(aux).sum() if aux else out.new_zeros(())

    def hidden(self, input_ids: torch.Tensor, aux: list | None = None) -> torch.Tensor:
        """The hidden states the head reads [batch, length, d_model], of whole sequences from
        position 0; MoE layers append their auxiliary losses to ``aux``."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]  # the same for every row
        return self.final(self.run(self.embed_streams(input_ids), positions, self.plan.steps, aux=aux, causal=True))

    # -- one walker for training and inference -----------------------------------------------

    def embed_streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.streams_of(self.embed(input_ids))

    def streams_of(self, rows: torch.Tensor) -> torch.Tensor:
        """One row per (sequence, stream), stream fastest: how ParScale folds streams into the batch."""
        return rows.repeat_interleave(self.streams, dim=0) if self.streams > 1 else rows

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden states the head reads: normalised, then (ParScale) the streams mixed."""
        x = self.norm(x)
        return self.stream_mix(x.view(-1, self.streams, *x.shape[1:])) if self.stream_mix else x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.final(x))

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        steps: tuple[Step, ...],
        cache: Cache | None = None,
        aux: list | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        """Apply ``steps`` (all the plan's, or the prefill's) to hidden states x [rows, N, D] at
        ``positions`` [rows or 1, N]; with a cache, read and extend its state. ``causal``: the
        tokens are a whole sequence from position 0, so attention may use a plain causal mask."""
        aux = [] if aux is None else aux
        main_kv = loop_kv = None
        memos: dict[int, dict] = {}
        for step in steps:
            seg = self.plan.segments[step.segment]
            if step.project:
                state, page_table = (cache.global_kv[step], cache.page_table) if cache else (None, None)
                loop_kv = self.global_kv(x, positions, state, page_table)
                if main_kv is None:  # the first projection is the one global K,V
                    main_kv = loop_kv
                continue
            if step.iteration == 0:  # a new segment: the one global K,V, fresh K,V memos
                loop_kv = main_kv
                memos = {i: {} for i in seg.layers if self.plan.shared(step, i)}
            for i in seg.layers:
                state = cache.layers.get(self.plan.state_key(step, i)) if cache else None
                # a list of its own per call: a compiled layer guards on the list's length, and one list growing
                # through the pass had an MoE layer compiled again at every call, up to torch's limit
                made: list[torch.Tensor] = []
                x = self.layers[i](x, MixerInput(positions, state, loop_kv, memos.get(i), causal), made)
                aux += made
        return x


MAX_PARAMETERS = 2**53  # far past any machine's memory; a size past 2**63 torch cannot even lay out (a TypeError on meta)


def build_model(spec: ModelSpec, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Model:
    """Build the model for a validated spec (``device="meta"`` builds paper-scale shapes for free)."""
    spec = revalidated(spec)  # before its size is worked out from it
    dtype_made = torch.get_default_dtype()  # built in it, then cast
    params = Cost(spec).params_total
    if params > MAX_PARAMETERS:
        raise MemoryError(f"{spec.name} has {params:.3g} parameters, past 2**53, which no machine holds: is a size in it mistyped?")
    check_room(params * dtype_made.itemsize, device or "cpu", f"its weights in {str(dtype_made).removeprefix('torch.')}")
    with torch.device(device or "cpu"):
        model = Model(spec)
    return model if dtype is None else model.to(dtype)
