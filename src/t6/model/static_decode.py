"""Fixed-shape decoding: a decode step whose shapes and memory never change, replayed as a CUDA graph.

One token at a time, a GPU waits on the host: Python, the dispatcher and a kernel launch per operation
cost ~1 ms per layer and token on an H100, against ~0.1 ms of GPU work. A CUDA graph replays a whole
step's kernels with one call, but only for a step whose shapes and memory never change. `StaticDecoder`
makes such a step:

- the caches are allocated once at full length (`max_len`) and kept for later generations;
- each step writes its token in place at the position held in a device tensor, which the step itself
  advances, and attends over a fixed-length view of the caches (`KVCache.static_len`): a power-of-two
  bucket of the context (`bucket`), the positions after the newest masked;
- nothing is read back to the host.

`FixedStep` makes such a step fast once per bucket, at its first call: optionally compiled
(`compile=True`: each block by inductor, one graph for all blocks, FlexAttention for the attention over the
bucket where a mechanism has no fused decode operator), then on CUDA captured
with `torch.cuda.CUDAGraph` and replayed for every later token of the bucket (as gpt-fast and vLLM
do): the host's work per token is copying the new tokens in and one `replay()`, no dynamo guards (which
cost 177-638 us per call of a compiled medium step, measured with a backend that runs nothing). Each
of these falls back at its first failure (t6.model.fallback: "flex_decode", "decode_compile",
"decode_graph"): the step then runs eagerly, with the same tokens. The prompt is prefilled eagerly
and only its last position reaches the LM head (`T6.prefill`).

    decoder = StaticDecoder(model, batch_size=4)
    logits = decoder.prefill(idx, key_mask)        # [B, vocab] at the last prompt position
    logits = decoder.step(tokens, position)        # tokens [B, 1] at the Python int `position`
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from t6.model.attention.base import StackedLinear
from t6.model.fallback import enabled, fell_back

if TYPE_CHECKING:
    from t6.model.attention import KVCache
    from t6.model.t6 import T6

MIN_BUCKET = 256  # the shortest cache view a step runs at: shorter contexts share its graph
# generate(decode="auto") replays graphs on CUDA from this many new tokens on: capturing a bucket's step
# costs about two eager steps (one run, one capture), which a graph's replay saves back within a few tokens.
GRAPH_MIN_NEW_TOKENS = 8
UNLIMITED = 1 << 16  # dynamo's recompile limits while a step compiles: one graph per bucket is the design


def auto_decoder(device_type: str, new_tokens: int) -> str:
    """What generate(decode="auto") runs: "static" (a fixed-shape step replayed as a CUDA graph) on CUDA from
    GRAPH_MIN_NEW_TOKENS new tokens on, "eager" otherwise (on the CPU the eager step is the fastest). Never
    "compiled" (inductor): tens of seconds per cache bucket, which no single generation earns back."""
    return "static" if device_type == "cuda" and new_tokens >= GRAPH_MIN_NEW_TOKENS else "eager"


def bucket(length: int, max_len: int, least: int = MIN_BUCKET) -> int:
    """The cache length a step with `length` cached tokens (the new one included) runs at: the next
    power of two, at least `least`, at most max_len."""
    if not 0 < length <= max_len:
        raise ValueError(f"a decode step over {length} cached tokens does not fit a cache of {max_len} positions")
    return min(max_len, max(least, 1 << (length - 1).bit_length()))


def unlimited_recompiles():
    """Dynamo's recompile limits lifted, for the compile of one more bucket (only the limits this torch has)."""
    config = torch._dynamo.config
    limits = [name for name in ("recompile_limit", "accumulated_recompile_limit") if hasattr(config, name)]
    return config.patch(**dict.fromkeys(limits, UNLIMITED))


class CudaGraphs:
    """How `FixedStep` captures a step on CUDA (on `device`, default the current one). `warmup()` is where the
    step first runs, on the stream every capture of this object then records on (torch.cuda.graph captures on a
    side stream): what a first call sets up for its stream or device, a cuBLAS workspace, a Triton kernel's
    compile and first launch, exists before any capture. capture(run) records run() without executing it and
    returns the replay, which returns the step's output tensor (the graph's own memory, rewritten by the next
    replay). The graphs of one decoder share one memory pool: they never run at once.

    A capture that fails (an operation the capture forbids: a host sync, a cudaFree, a module load) leaves the
    process as it found it: the thread's current stream (torch.cuda.graph leaves its capture stream current
    when ending the capture raises) and the device's random generator, which a capture switches into capture
    mode and only a capture that ends well switches back (until then every random op, torch.randint too, raises
    "Offset increment outside graph capture encountered unexpectedly")."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device("cuda" if device is None else device)
        self.pool = None  # made at the first capture
        self.stream: torch.cuda.Stream | None = None  # made at the first warm-up

    def capture_stream(self) -> torch.cuda.Stream:
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        return self.stream

    @contextlib.contextmanager
    def warmup(self):
        stream = self.capture_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def __call__(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream()
            generator = torch.cuda.default_generators[torch.cuda.current_device()]
            saved = generator.clone_state()  # a new state object, out of capture mode
            try:
                with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream()):
                    out = run()
            except BaseException:
                torch.cuda.set_stream(current)
                generator.graphsafe_set_state(saved)
                raise

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


def compile_step(fn: Callable, backend="inductor") -> Callable:
    """fn compiled as a fixed-shape step compiles: whole (fullgraph), for fixed shapes (one graph per cache bucket)."""
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)


def decode_layer(block, x: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One block of a fixed-shape decode step: x [B, 1, d] -> [B, 1, d]. What `StaticDecoder(compile=True)` compiles,
    once for every block (their code is one, their parameters the graph's inputs): a compile a block long, not a
    model long, whose kernels the step's capture records for every layer."""
    return block.layers(x, pos, cache)  # [B, 1, d]


class FixedStep:
    """fn(*args), whose tensors live at fixed addresses (marked static for dynamo) and whose caches are in
    fixed-shape mode, made fast once per key (the caches' bucket) at its first call:

    1. compiled (fn's compiled form, `compile_step`), where given: attention over the bucket through
       FlexAttention; where that fails, with SDPA's masked attention ("flex_decode"); where that fails, fn
       eager ("decode_compile");
    2. capture: how the step becomes one replayable call (`CudaGraphs` on CUDA), tried after the step has
       run once in its `warmup()` (lazy initialization and compilation happen outside the capture); where
       it fails, the step runs uncaptured ("decode_graph"). None: the step is called directly.

    A call returns fn's output; with a capture, the graph's own memory (consume it before the next call)."""

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        args: tuple,
        caches: list[KVCache],
        compiled: Callable[..., torch.Tensor] | None = None,
        capture: Callable | None = None,
    ):
        self.fn, self.args, self.caches, self.capture, self.compiled = fn, args, caches, capture, compiled
        self.runs: dict[object, Callable[[], torch.Tensor]] = {}  # by key: the step as it runs from then on
        self.captured: set = set()  # the keys whose step replays a capture (a CUDA graph)

    def __call__(self, key) -> torch.Tensor:
        run = self.runs.get(key)
        if run is not None:
            return run()
        capturing = self.capture is not None and enabled("decode_graph")
        with contextlib.ExitStack() as warmup:
            if capturing:
                try:
                    warmup.enter_context(self.capture.warmup())
                except Exception as err:
                    fell_back("decode_graph", err)
                    capturing = False
            run, out = self.first_call()
        if capturing:
            try:
                run = self.capture(run)  # records the step: nothing runs, out stays this call's result
                self.captured.add(key)
            except Exception as err:
                fell_back("decode_graph", err)
        self.runs[key] = run
        return out

    def first_call(self) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
        """(the step as it will run, its output now): the first of compiled with FlexAttention, compiled with
        SDPA, eager that works. A failed attempt computes nothing the next needs (compiling fails before it runs;
        the step's writes are the same values at the same places)."""
        snapshot = [t.clone() for t in self.args if isinstance(t, torch.Tensor)]  # what a step may advance (pos)
        attempts = []
        if self.compiled is not None and enabled("decode_compile"):
            attempts = [("flex_decode", True), ("decode_compile", False)]
        for name, flex in attempts:
            if name == "flex_decode" and not enabled("flex_decode"):
                continue
            self.set_flex(flex)
            run = self.call(self.compiled)
            try:
                with unlimited_recompiles():
                    return run, run()
            except Exception as err:
                fell_back(name, err)
                for t, saved in zip((t for t in self.args if isinstance(t, torch.Tensor)), snapshot):
                    t.copy_(saved)
        self.set_flex(False)
        run = self.call(self.fn)
        return run, run()

    def forget(self) -> None:
        """Every bucket's step made again at its next call (the model's modules changed)."""
        self.runs.clear()
        self.captured.clear()

    def call(self, fn: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        args = self.args
        return lambda: fn(*args)

    def set_flex(self, flex: bool) -> None:
        for cache in self.caches:
            cache.flex_decode = flex


class StaticDecoder:
    """Fixed-shape greedy or sampled decoding for one batch size: the caches (max_len positions, default
    the model's block_size, in `dtype`), a key mask, and the step (`FixedStep`: its blocks compiled if `compile`,
    one graph for all of them (`decode_layer`), the step around them eager; captured as a CUDA graph on CUDA).
    The step's inputs (tokens, position, caches, mask) live at fixed addresses, so a CUDA graph reads and writes
    them in place.
    backend: torch.compile's, a name or a callable ("inductor"; tests use "eager" or "aot_eager", which
    check the same graph without generating code). capture: `FixedStep`'s (default: `CudaGraphs` on CUDA,
    none elsewhere)."""

    def __init__(
        self,
        model: T6,
        batch_size: int,
        max_len: int | None = None,
        dtype: torch.dtype | None = None,
        compile: bool = False,
        backend="inductor",
        capture: Callable | None = None,
    ):
        self.model, self.batch_size = model, batch_size
        self.max_len = max_len or model.cfg.block_size
        if self.max_len > model.cfg.block_size:
            raise ValueError(f"max_len={self.max_len} exceeds the model's block_size {model.cfg.block_size}")
        device = model.embed.weight.device
        self.caches = model.build_kv_caches(batch_size, self.max_len, dtype, device)
        self.key_mask = torch.ones(batch_size, self.max_len, dtype=torch.bool, device=device)  # [B, max_len]
        self.tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # [B, 1]
        self.pos = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.next_position: int | None = None  # the position self.pos holds (each step advances it)
        self.stack_projections()
        for t in (self.key_mask, self.tokens, self.pos, *(t for c in self.caches for t in c.tensors.values())):
            torch._dynamo.mark_static_address(t)  # a CUDA graph reads and writes it where it is
        if capture is None and device.type == "cuda":
            capture = CudaGraphs(device)
        self.layer = compile_step(decode_layer, backend) if compile else None  # every block's, compiled once
        compiled = functools.partial(self.advance, layer=self.layer) if compile else None
        self.run = FixedStep(self.advance, (self.tokens, self.pos, self.caches), self.caches, compiled, capture)

    def advance(
        self, tokens: torch.Tensor, pos: torch.Tensor, caches: list[KVCache], layer: Callable | None = None
    ) -> torch.Tensor:
        """The step: tokens [B, 1] at pos [1] -> logits [B, vocab], then pos + 1 (in place). layer: what runs each
        block (`decode_layer` compiled), or None: the blocks themselves."""
        logits = self.model.decode_step(tokens, pos, caches, layer)  # [B, vocab]
        pos.add_(1)
        return logits

    def projection_groups(self) -> list[dict[str, tuple]]:
        """Per layer, the projections its step applies as one matmul each (`Attention.stackable`, SwiGLU's)."""
        return [{**block.attn.stackable(), **block.ffn.stackable()} for block in self.model.blocks]

    def stack_projections(self) -> None:
        """Each layer's stackable projections as StackedLinear in its cache (`KVCache.stacked`), where the step's
        attention and feed-forward find them: fewer, larger kernels per step (Q, K and V one matmul, W_gate and
        W_up one). Their weights are copies, rewritten in place at each prefill (`prefill`)."""
        for cache, groups in zip(self.caches, self.projection_groups()):
            cache.stacked = {name: StackedLinear(modules) for name, modules in groups.items()}
        for t in (s.weight for c in self.caches for s in c.stacked.values()):
            torch._dynamo.mark_static_address(t)

    @torch.no_grad()
    def prefill(self, idx: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Write the prompts idx [B, T0] at positions 0..T0-1 -> logits [B, vocab] at the last one, eagerly.
        key_mask: None, or bool [B, T0] marking the real tokens of left-padded prompts (T6.check_prompt_mask).

        First the stacked projections take the weights as they are now (trained since the last generation, or
        loaded): copied in place, where the captured steps read them; where the model's projections themselves
        changed (a hook or a LoRA adapter wraps one: it runs as a module from then on), they are stacked anew and
        every bucket's step is made again (compiled and captured afresh)."""
        B, T0 = idx.shape
        if B != self.batch_size:
            raise ValueError(f"{B} prompts, but this decoder was built for batch_size={self.batch_size}")
        installed = [{name: s.modules for name, s in c.stacked.items()} for c in self.caches]
        if installed != self.projection_groups():
            self.stack_projections()
            self.run.forget()
        for stacked in (s for c in self.caches for s in c.stacked.values()):
            stacked.refresh()
        self.key_mask.fill_(True)
        if key_mask is not None:
            self.key_mask[:, :T0] = key_mask
        for cache in self.caches:
            cache.static_len = None
            cache.key_mask = None if key_mask is None else self.key_mask  # unpadded: SDPA's causal kernel
        logits = self.model.prefill(idx, self.caches)  # [B, vocab]
        for cache in self.caches:
            cache.key_mask = self.key_mask  # every step masks (the positions after the newest)
        return logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """tokens [B, 1] at `position` (a Python int: the host knows it, nothing is read back) -> logits
        [B, vocab]. On CUDA the logits live in the graph's memory until the next step: sample first."""
        length = bucket(position + 1, self.max_len)
        if self.caches[0].static_len != length:
            for cache in self.caches:
                cache.static_len = length
        self.tokens.copy_(tokens)
        if position != self.next_position:
            self.pos.fill_(position)  # a new generation; the steps of one advance it themselves
            self.next_position = None
        logits = self.run(length)  # [B, vocab]
        self.next_position = position + 1
        return logits
