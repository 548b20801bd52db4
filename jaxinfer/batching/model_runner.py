"""The model runner: the device side of a step. It holds the device state (weights, the donated KV
cache, the last step's sampled tokens) and the step functions, and runs a scheduled step
(``SchedulerOutput``) as one compiled executable per bucketed shape, delegating to an
``InputBuilder`` (host inputs), a ``CompilationManager`` (executables, warm-up) and a ``Swapper``
(swap preemption's copies). It knows nothing of requests.

The step (forward + sampling) is compiled once per bucket of (tokens, sequences, pages per
sequence); the KV cache is donated to it, so each step updates the cache in place.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.batching.compilation import CompilationManager, PlannedStep, first_steps, warmup_plan
from jaxinfer.batching.inputs import InputBuilder, Packing, pack_inputs, unpack_inputs
from jaxinfer.batching.resolve import ResolvedConfig
from jaxinfer.batching.step_io import ModelRunnerOutput, SchedulerOutput
from jaxinfer.batching.structured import bitmask_width
from jaxinfer.batching.swap import Swapper
from jaxinfer.models import sharding
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.decoder import forward
from jaxinfer.models import pooling as pooling_pass
from jaxinfer.models.layers import Ops
from jaxinfer.models.spec import Weights
from jaxinfer.paged.kv_cache import KVCache
from jaxinfer.sampling import SampleResult, VerifyResult, sample, verify

log = logging.getLogger(__name__)
# XLA's rematerialization pass budgets temporaries against device memory minus the step's inputs; with
# the KV pool sized to fill memory it saw no room and recomputed the QKV matmul three times per layer
# (8B batch-1 step on an H200: 5.73 -> 4.71 ms without it). The pool already leaves
# ``1 - kv_cache_memory_fraction`` of memory for temporaries.
_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "rematerialization"}


class ConstrainedSample:
    """The sampling half of a step with constrained requests (``ModelRunner.run_forward``).

    ``bitmask`` is the step's token bitmask ``[S, ceil(vocab/32)]`` (int32; bit ``t % 32`` of word
    ``t // 32`` allows token t), a view into the step's one host transfer buffer, which steps of the
    same shape reuse. The caller writes every row (all bits set where unconstrained) and then calls
    this object to dispatch the sampling. Reuse is safe because the engine writes it only after
    reading the tokens of every step dispatched before (their sampling, the buffer's last readers,
    has finished; on CPU the device may read the host buffer in place)."""

    def __init__(self, runner: "ModelRunner", logits, prev_tokens, sb, flags: dict, rows: int):
        self._runner, self._logits, self._prev, self._flags = runner, logits, prev_tokens, flags
        self.rows = rows
        width = bitmask_width(runner.config.vocab_size)
        # pack_inputs((sb, bitmask))'s layout, with the bitmask last: written in place, never copied
        self._head, head = pack_inputs(sb)
        self._packing = Packing(jax.tree.structure((sb, 0)), head.parts + (((rows, width), np.dtype(np.int32).str),))
        self._buf = runner._sample_buffer(self._packing)
        self.bitmask = self._buf[self._head.size:].reshape(rows, width)

    def __call__(self) -> SampleResult:
        self._buf[:self._head.size] = self._head
        args = (self._logits, self._prev, self._buf)
        runner = self._runner
        result, runner.last_tokens = runner.compiler.get(runner._sample, args, self._packing, self._flags)(*args)
        return result


def _as_last_tokens(tokens: jax.Array, prev_tokens: jax.Array) -> jax.Array:
    """A step's last sampled token per sequence, padded to the largest sequence bucket, where the next
    step reads them."""
    return jnp.zeros_like(prev_tokens).at[:tokens.shape[0]].set(tokens)


# ------------------------------------------------------------------------------ the step functions
# Module-level, with the model and its ops as one static argument (``StepSpec``): JAX caches a trace,
# its lowering and its executable by function and static arguments, so every engine of the same model,
# backend and shapes in a process shares them. As methods of each runner they were traced, lowered and
# compiled again for every engine (a notebook re-creating its ``LLM``, the test suite's many engines).


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What a step is compiled for besides its arguments' shapes and the per-step flags."""

    config: ModelConfig
    ops: Ops


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    step: Callable
    multi: Callable  # several decode steps in one executable (``num_scheduler_steps``)
    # A step with constrained requests runs as these two, so the host can fill its bitmask while the
    # device runs the forward pass (``ModelRunner.run_forward``).
    forward: Callable
    sample: Callable


@functools.cache
def step_functions(mesh=None, kv_quantized: bool = False) -> StepFunctions:
    """The jitted step functions, one set per mesh. Over a mesh (``models.sharding``) a step takes its
    inputs' shardings (weights and cache as placed, the rest replicated; jit refuses in_shardings with
    the static keyword flags) and pins its outputs': the cache comes back as it went in, so the next
    step finds it as compiled for (no recompilation, no resharding)."""
    step_kw, forward_kw, sample_kw = {}, {}, {}
    if mesh is not None:
        rep, kv = sharding.replicated(mesh), sharding.cache_sharding(mesh, kv_quantized)
        step_kw = dict(out_shardings=(rep, kv, rep))
        forward_kw, sample_kw = dict(out_shardings=(rep, kv)), dict(out_shardings=(rep, rep))
    flags = ("spec", "packing", "greedy_only", "num_logprobs", "logit_terms")
    return StepFunctions(
        step=jax.jit(_step_fn, static_argnames=flags, donate_argnums=(1,), compiler_options=_COMPILER_OPTIONS,
                     **step_kw),
        multi=jax.jit(_multi_fn, static_argnames=flags + ("num_steps",), donate_argnums=(1,),
                      compiler_options=_COMPILER_OPTIONS, **step_kw),
        forward=jax.jit(_forward_fn, static_argnames=("spec", "packing"), donate_argnums=(1,),
                        compiler_options=_COMPILER_OPTIONS, **forward_kw),
        sample=jax.jit(_sample_fn, static_argnames=flags, **sample_kw))


def _step_fn(weights, cache, prev_tokens, inputs, *, spec, packing, greedy_only, num_logprobs, logit_terms):
    tokens, positions, md, sb = unpack_inputs(inputs, packing)
    log.info("compiling step: tokens=%d seqs=%d pages=%d decode_only=%s greedy_only=%s logprobs=%s logit_terms=%s",
             tokens.shape[0], md.page_table.shape[0], md.page_table.shape[1], md.decode_only, greedy_only,
             num_logprobs, logit_terms)
    logits, cache = _forward_tokens(spec, weights, cache, prev_tokens, tokens, positions, md)
    kw = dict(greedy_only=greedy_only, num_logprobs=num_logprobs, logit_terms=logit_terms)
    if sb.proposals is not None:  # speculative: logits at every proposed position
        s = sb.proposals.shape[0]
        result = verify(logits.reshape(s, -1, logits.shape[-1]), sb, **kw)
        # the last token emitted: the next step's input where every proposal was accepted (where
        # one was not, the host discards what the next step computed for that sequence)
        last = jnp.take_along_axis(result.tokens, result.num_accepted[:, None], axis=1)[:, 0]
        return result, cache, _as_last_tokens(last, prev_tokens)
    result = sample(logits, sb, **kw)
    return result, cache, _as_last_tokens(result.tokens, prev_tokens)


def _multi_fn(weights, cache, prev_tokens, inputs, *, spec, packing, greedy_only, num_logprobs, logit_terms,
              num_steps):
    """``num_steps`` decode steps of a decode-only batch in one executable (``num_scheduler_steps``):
    each iteration feeds every sequence one token, writes its K/V into the slot after the last
    (pages the scheduler reserved ahead), samples the next token (output index ``step + i``: the
    same key as a step of its own would use) and feeds it to the next. Returns the tokens (and
    logprobs, if asked) with a ``num_steps`` axis after the sequences'. The host's dispatch, input
    and output work is then paid once per ``num_steps`` tokens. Not with logit terms (penalty counts
    would change inside the run)."""
    assert not logit_terms
    tokens, positions, md, sb = unpack_inputs(inputs, packing)
    log.info("compiling %d-step decode: tokens=%d seqs=%d pages=%d decode_only=%s greedy_only=%s", num_steps,
             tokens.shape[0], md.page_table.shape[0], md.page_table.shape[1], md.decode_only, greedy_only)
    ps, n = cache.page_size, tokens.shape[0]
    live = md.slot_mapping < cache.num_pages * ps  # real tokens; padding keeps its dropped slot
    row = jnp.minimum(jnp.arange(n), md.page_table.shape[0] - 1)  # decode-only: token j is sequence j's
    fed = -1 - jnp.minimum(jnp.arange(n, dtype=jnp.int32), prev_tokens.shape[0] - 1)  # "row j's last sample"

    def one(i, carry):
        cache, prev, out = carry
        pos = positions + i
        slots = jnp.where(live, md.page_table[row, pos // ps] * ps + pos % ps, md.slot_mapping)
        md_i = dataclasses.replace(md, slot_mapping=slots, seq_lens=jnp.where(md.seq_lens > 0, md.seq_lens + i, 0))
        logits, cache = _forward_tokens(spec, weights, cache, prev, jnp.where(i == 0, tokens, fed), pos, md_i)
        result = sample(logits, dataclasses.replace(sb, step=sb.step + i), greedy_only=greedy_only,
                        num_logprobs=num_logprobs)
        out = jax.tree.map(lambda o, r: o.at[:, i].set(r), out, result)
        return cache, _as_last_tokens(result.tokens, prev), out

    rows = md.page_table.shape[0]
    out = jax.tree.map(lambda x: jnp.zeros((x.shape[0], num_steps, *x.shape[1:]), x.dtype),
                       jax.eval_shape(lambda: sample(jnp.zeros((rows, spec.config.vocab_size)), sb,
                                                     greedy_only=True, num_logprobs=num_logprobs)))
    cache, last, out = jax.lax.fori_loop(0, num_steps, one, (cache, prev_tokens, out))
    return out, cache, last


def _forward_tokens(spec, weights, cache, prev_tokens, tokens, positions, md):
    tokens = jnp.where(tokens < 0, prev_tokens[-tokens - 1], tokens)  # -1 - row: sampled by the last step
    return forward(weights, tokens, positions, cache, md, spec.config, spec.ops)


def _forward_fn(weights, cache, prev_tokens, inputs, *, spec, packing):
    tokens, positions, md = unpack_inputs(inputs, packing)
    log.info("compiling forward: tokens=%d seqs=%d pages=%d decode_only=%s", tokens.shape[0],
             md.page_table.shape[0], md.page_table.shape[1], md.decode_only)
    return _forward_tokens(spec, weights, cache, prev_tokens, tokens, positions, md)


def _sample_fn(logits, prev_tokens, inputs, *, spec, packing, greedy_only, num_logprobs, logit_terms):
    sb, bitmask = unpack_inputs(inputs, packing)
    result = sample(logits, sb, greedy_only=greedy_only, num_logprobs=num_logprobs, logit_terms=logit_terms,
                    bitmask=bitmask)
    return result, _as_last_tokens(result.tokens, prev_tokens)


class ModelRunner:
    def __init__(self, resolved: ResolvedConfig, config: ModelConfig, weights: Weights, cache: KVCache, ops: Ops,
                 mesh=None, on_dispatch: Callable | None = None):
        """``on_dispatch(inputs, shape, decode_only, flags, feeds_next)``: called with every step before it
        runs (process 0 of a multi-process run sends it to the others: ``multihost.send_step``)."""
        backend = resolved.backend
        self.config = config
        self.weights = weights
        self.cache = cache
        self._cache_layout = jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), cache)
        self.buckets = resolved.buckets
        self.num_scheduler_steps = resolved.num_scheduler_steps
        self._ops = ops
        self._copy_ahead = backend.copy_ahead
        self._on_dispatch = on_dispatch
        # Decode-only steps compile separately only where the backend has a kernel for them.
        decode_max_seqs = ops.decode_attention_max_seqs if ops.decode_attention is not None else 0
        self.inputs = InputBuilder(resolved.buckets, cache.num_pages, cache.page_size, decode_max_seqs,
                                   resolved.max_logprobs, backend.greedy_in_step and ops.defer_kv_write)
        self.compiler = CompilationManager(resolved.max_executables, StepSpec(config, ops))
        self._sample_buffers: dict[Packing, np.ndarray] = {}  # ConstrainedSample's, by layout
        # The last step's sampled tokens, padded to the largest sequence bucket, stay on device:
        # the next step reads its decode inputs from here instead of waiting for the host.
        self.last_tokens = jnp.zeros(resolved.buckets.seqs[-1], jnp.int32)
        if mesh is not None:
            self.last_tokens = jax.device_put(self.last_tokens, sharding.replicated(mesh))
        self._local = mesh is not None and jax.process_count() > 1  # results are read from process 0's copy
        self.swapper = Swapper(sharding.cache_sharding(mesh, cache.quantized) if mesh is not None else None)
        fns = step_functions(mesh, cache.quantized)
        self._step, self._multi, self._forward, self._sample = fns.step, fns.multi, fns.forward, fns.sample

    # ------------------------------------------------------------------------------- running

    def execute(self, out: SchedulerOutput) -> tuple[SampleResult | VerifyResult, int]:
        """Dispatch one step; returns its result, still on device (``fetch`` reads it), and how many
        decode steps it runs: ``out.num_steps``, or one while a background warm-up has yet to compile the
        multi-step executable (a server's first requests; the tokens then have no steps axis). Its
        last sampled tokens become ``last_tokens``, which the next step's device-fed inputs read.

        On an accelerator the copy of the sampled tokens to the host is queued now, behind the step,
        so the host finds them there once the step ends (``Backend.copy_ahead``)."""
        x = self.inputs.build(out)
        inputs, packing = pack_inputs((x.tokens, x.positions, x.md, x.sb))
        args = (self.weights, self.cache, self.last_tokens, inputs)
        steps, exe = 1, None
        if out.num_steps > 1:
            exe = self.compiler.get(self._multi, args, packing, dict(x.flags, num_steps=out.num_steps),
                                    only_if_ready=self.compiler.warming)
            steps = out.num_steps if exe is not None else 1
        if exe is None:
            if self._on_dispatch is not None:
                self._on_dispatch(inputs, (x.tokens.shape[0], *x.md.page_table.shape, x.sb.terms.rows.shape[0]),
                                  x.md.decode_only, x.flags, True)
            exe = self.compiler.get(self._step, args, packing, x.flags)
        result, self.cache, self.last_tokens = exe(*args)
        if self._local:
            result = jax.tree.map(lambda a: a.addressable_data(0), result)
        if self._copy_ahead:
            result.tokens.copy_to_host_async()
        return result, steps

    def run_forward(self, out: SchedulerOutput) -> ConstrainedSample:
        """Dispatch one step's forward pass only; returns its sampling half, dispatched once the host
        has written the step's token bitmask. Used by steps with constrained requests: the host fills
        the bitmask while the device runs the forward pass (one process only: structured outputs are
        refused over several)."""
        x = self.inputs.build(out)
        inputs, packing = pack_inputs((x.tokens, x.positions, x.md))
        args = (self.weights, self.cache, self.last_tokens, inputs)
        logits, self.cache = self.compiler.get(self._forward, args, packing, {})(*args)
        return ConstrainedSample(self, logits, self.last_tokens, x.sb, x.flags, x.md.page_table.shape[0])

    def embed(self, prompts: list[list[int]], num_tokens: int, num_seqs: int, pooling: str,
              normalize: bool) -> np.ndarray:
        """The pooled final hidden states ``[len(prompts), hidden]`` (float32) of one embedding pass
        (``models.pooling``) of ``num_tokens`` tokens and ``num_seqs`` sequences (buckets), over a
        scratch KV cache laid out as the engine's (dtype, sharding) and dropped after it. Reads only
        the weights, so it may run while a step is in flight; blocks until its vectors are read."""
        cache, page_size = self._scratch_cache(num_tokens, num_seqs)
        tokens, positions, md, segments = pooling_pass.pack(prompts, num_tokens, num_seqs, page_size, pooling)
        out, _ = pooling_pass.pooled(self.weights, cache, tokens, positions, md, segments, config=self.config,
                                     ops=self._ops, pooling=pooling, normalize=normalize)
        return np.asarray(out)[:len(prompts)]

    def prompt_logprobs(self, prompt: list[int], num_tokens: int, k: int):
        """The prompt's tokens' logprobs from one pass of ``num_tokens`` (a bucket) over a scratch cache
        (``models.pooling.token_logprobs``): ``(next token's logprob [n - 1], its rank [n - 1], top k
        logprobs and ids [n - 1, k] or None)``, position i scoring ``prompt[i + 1]``."""
        cache, page_size = self._scratch_cache(num_tokens, 1)
        tokens, positions, md, _ = pooling_pass.pack([prompt], num_tokens, 1, page_size, "mean")
        targets = np.zeros(num_tokens, np.int32)
        targets[:len(prompt) - 1] = prompt[1:]
        target, rank, top, _ = pooling_pass.token_logprobs(self.weights, cache, tokens, positions, md, targets,
                                                           config=self.config, ops=self._ops, k=k)
        n = len(prompt) - 1
        return (np.asarray(target)[:n], np.asarray(rank)[:n],
                None if top is None else (np.asarray(top[0])[:n], np.asarray(top[1])[:n]))

    def _scratch_cache(self, num_tokens: int, num_seqs: int):
        """A zeroed KV cache laid out as the engine's (dtype, sharding) with the pages one pass of
        ``num_tokens`` tokens in ``num_seqs`` prompts needs, and its page size."""
        treedef = jax.tree.structure(self.cache)
        layouts = jax.tree.leaves(self._cache_layout, is_leaf=lambda x: isinstance(x, tuple))
        page_size = layouts[0][0][2]
        pages = pooling_pass.scratch_pages(num_tokens, num_seqs, page_size)
        cache = jax.tree.unflatten(treedef, [jnp.zeros((shape[0], pages, *shape[2:]), dtype, device=sharding)
                                             for shape, dtype, sharding in layouts])
        return cache, page_size

    @staticmethod
    def fetch(result: SampleResult | VerifyResult, want_logprobs: bool) -> ModelRunnerOutput:
        """A dispatched step's result on the host (blocks until the device has it); the sampled tokens'
        logprobs only if a row asked for them."""
        return ModelRunnerOutput(
            np.asarray(result.tokens), isinstance(result, VerifyResult),
            np.asarray(result.logprobs) if want_logprobs else None,
            None if result.top_tokens is None else np.asarray(result.top_tokens),
            None if result.top_logprobs is None else np.asarray(result.top_logprobs))

    def run_sent(self, inputs: np.ndarray, shape: tuple[int, int, int, int], decode_only: bool, flags: dict,
                 feeds_next: bool) -> None:
        """Run a step another process dispatched (a follower of a multi-process run: ``multihost``)."""
        x = self.inputs.placeholder(shape[:3], decode_only, term_slots=shape[3])
        _, packing = pack_inputs((x.tokens, x.positions, x.md, x.sb))
        args = (self.weights, self.cache, self.last_tokens, inputs)
        _, self.cache, last = self.compiler.get(self._step, args, packing, flags)(*args)
        if feeds_next:
            self.last_tokens = last

    def reset(self) -> None:
        """After a failed step: a fresh (zeroed) KV pool if the step's donation took the old one with it,
        and no sampled tokens to feed the next step from (the scheduler recomputes what was in flight)."""
        if any(x.is_deleted() for x in jax.tree.leaves(self.cache)):
            leaves, treedef = jax.tree.flatten(self.cache)
            layouts = jax.tree.leaves(self._cache_layout, is_leaf=lambda x: isinstance(x, tuple))
            self.cache = jax.tree.unflatten(treedef, [jnp.zeros(shape, dtype, device=sharding)
                                                      for shape, dtype, sharding in layouts])
        self.last_tokens = jnp.zeros_like(self.last_tokens)

    def _sample_buffer(self, packing: Packing) -> np.ndarray:
        """The host transfer buffer of a sampling half with this layout, made once and reused: a new
        one per step cost a 1.5 MB fill and a 1.5 MB copy at 256 sequences (``ConstrainedSample``)."""
        buf = self._sample_buffers.get(packing)
        if buf is None:
            buf = self._sample_buffers[packing] = np.empty(sum(int(np.prod(s)) for s, _ in packing.parts), np.int32)
        return buf

    # ------------------------------------------------------------------------------- swapping

    def swap_out(self, pages: list[int]) -> list[np.ndarray]:
        return self.swapper.out(self.cache, pages)

    def swap_in(self, data: list[np.ndarray], pages: list[int]) -> None:
        self.cache = self.swapper.into(self.cache, data, pages)

    # ------------------------------------------------------------------------------- warm-up

    @property
    def num_compilations(self) -> int:
        return self.compiler.num_compilations

    def warmup_plan(self, shapes=None, greedy_only: bool = False) -> list[PlannedStep]:
        return warmup_plan(self.buckets, self.inputs.decode_max_seqs, self.inputs.greedy_in_step,
                           self.num_scheduler_steps, shapes, greedy_only)

    def warmup(self, shapes=None, greedy_only: bool = False, structured: bool = False,
               num_speculative: int = 0, background: bool = False) -> None:
        """Compile every step of ``warmup_plan`` ahead of time, without running any; ``structured``:
        also the forward and sampling halves that steps with constrained requests run as;
        ``num_speculative``: also each step's verifying variant. ``background``: only the steps a
        single request meets first now, the rest in a background thread (``CompilationManager``)."""
        plan = self.warmup_plan(shapes, greedy_only)
        single = [p for p in plan if p.steps == 1]  # the steps that have verifying and constrained variants
        count = len(plan) + (len(single) if num_speculative else 0) + (
            len({(p.shape, p.decode_only) for p in single}) + len({(p.shape[1], p.greedy) for p in single})
            if structured else 0)
        # Shapes, not the arrays: steps replace (and donate) the cache while the thread compiles.
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                             (self.cache, self.last_tokens))
        self.compiler.warmup(plan, first_steps(plan, self.buckets) if background else plan,
                             lambda p: self._warm_step(p, state, structured, num_speculative), count)

    def wait_warmup(self, stop: bool = False) -> None:
        self.compiler.wait(stop)

    def _warm_step(self, step: PlannedStep, state, structured: bool, num_speculative: int) -> None:
        """Compile one planned step (and, for a single step, its verifying and constrained variants if
        asked) for ``state``, the cache's and last tokens' shapes."""
        x = self.inputs.placeholder(step.shape, step.decode_only)
        flags = self.inputs.flags(step.greedy)
        flags["greedy_only"] = step.greedy
        weights, (cache, last) = self.weights, state
        inputs, packing = pack_inputs((x.tokens, x.positions, x.md, x.sb))
        if step.steps > 1:
            self.compiler.get(self._multi, (weights, cache, last, inputs), packing, dict(flags, num_steps=step.steps))
            return
        self.compiler.get(self._step, (weights, cache, last, inputs), packing, flags)
        s = step.shape[1]
        if num_speculative:
            md = dataclasses.replace(x.md, logits_indices=np.zeros(s * (num_speculative + 1), np.int32))
            sb = dataclasses.replace(x.sb, proposals=np.full((s, num_speculative), -1, np.int32))
            inputs, packing = pack_inputs((x.tokens, x.positions, md, sb))
            self.compiler.get(self._step, (weights, cache, last, inputs), packing, flags)
        if structured:
            inputs, packing = pack_inputs((x.tokens, x.positions, x.md))
            fwd = self.compiler.get(self._forward, (weights, cache, last, inputs), packing, {})
            inputs, packing = pack_inputs((x.sb, np.zeros((s, bitmask_width(self.config.vocab_size)), np.int32)))
            self.compiler.get(self._sample, (fwd.out_info[0], last, inputs), packing, flags)
