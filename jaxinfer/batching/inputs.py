"""A scheduled step (``SchedulerOutput``) as the compiled step's host inputs: padded to the smallest
buckets that hold it and packed into one int32 transfer buffer.

This runs every step on the host, between dispatches, so it is vectorized over requests and must
stay small next to the device step.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxinfer.batching.buckets import Buckets
from jaxinfer.batching.step_io import SchedulerOutput
from jaxinfer.paged.kv_cache import BatchMetadata
from jaxinfer.sampling import LogitTerms, SamplingBatch

TERM_SLOTS = 16  # the smallest bucket of a step's logit terms (``sampling.LogitTerms``)
_ALWAYS = np.iinfo(np.int32).max  # a bias's ``until``: every step


@dataclasses.dataclass(frozen=True)
class Packing:
    """Static layout of a step's host inputs in their one int32 transfer buffer."""
    treedef: object
    parts: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) of each leaf, in order


def pack_inputs(tree) -> tuple[np.ndarray, Packing]:
    """A step's host arrays (all 4-byte dtypes) as one int32 buffer.

    Each array sent to the device is a copy the step waits for: on an H200 the copies of a batch-1
    step started only once the previous step had finished, ~3 us apart, so six of them put a 25 us
    gap between steps. One buffer is one copy."""
    leaves, treedef = jax.tree.flatten(tree)
    assert all(x.dtype.itemsize == 4 for x in leaves), [x.dtype for x in leaves]
    buf = np.concatenate([np.ascontiguousarray(x).view(np.int32).ravel() for x in leaves])
    return buf, Packing(treedef, tuple((x.shape, x.dtype.str) for x in leaves))


def unpack_inputs(buf: jax.Array, packing: Packing):
    """``pack_inputs`` undone inside the step: slices of the buffer, floats bit-cast back."""
    leaves, offset = [], 0
    for shape, dtype in packing.parts:
        n = int(np.prod(shape))
        x = buf[offset:offset + n].reshape(shape)
        leaves.append(x if np.dtype(dtype) == np.int32 else jax.lax.bitcast_convert_type(x, np.dtype(dtype)))
        offset += n
    return jax.tree.unflatten(packing.treedef, leaves)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    tokens: np.ndarray  # [T]; -1 - r: row r of the last step's samples, read on device
    positions: np.ndarray  # [T]
    md: BatchMetadata
    sb: SamplingBatch
    flags: dict  # the static flags the step compiles for (``InputBuilder.flags``)


class InputBuilder:
    def __init__(self, buckets: Buckets, num_pages: int, page_size: int, decode_max_seqs: int, max_logprobs: int,
                 greedy_in_step: bool):
        self.buckets = buckets
        self.page_size = page_size
        self.dropped_slot = num_pages * page_size  # past the pool: a write there is dropped (padding)
        self.decode_max_seqs = decode_max_seqs  # decode-only steps up to this many (padded) sequences
        self.max_logprobs = max_logprobs
        self.greedy_in_step = greedy_in_step

    def flags(self, greedy: bool, num_logprobs: int | None = None, logit_terms: bool = False) -> dict:
        """The static flags a step compiles for: whether every row is greedy (``None`` where the step
        decides: ``Backend.greedy_in_step``), the logprobs it returns and whether it applies the rows'
        logit terms (penalties, bias: ``sampling.LogitTerms``)."""
        return dict(greedy_only=None if self.greedy_in_step else greedy, num_logprobs=num_logprobs,
                    logit_terms=logit_terms)

    def build(self, out: SchedulerOutput) -> StepInputs:
        """Host arrays for one step. A verifying step (``out.num_speculative`` k > 0) feeds each row's
        proposals after its last token and takes logits at all of those positions, ``k + 1`` rows per
        request (a fixed count, so speculation adds one compiled variant per bucket, not one per
        proposal length)."""
        ps, b = self.page_size, self.buckets
        counts = np.asarray(out.num_tokens, np.int32)
        n_seqs, n_real = len(out), int(counts.sum())
        t_pad = Buckets.pick(b.tokens, n_real)
        s_pad = Buckets.pick(b.seqs, n_seqs)
        p_pad = Buckets.pick(b.pages, max(len(t) for t in out.page_tables))

        starts = np.asarray(out.starts, np.int32)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        page_table = np.zeros((s_pad, p_pad), np.int32)
        for i, table in enumerate(out.page_tables):
            page_table[i, :len(table)] = table
        seq_of = np.repeat(np.arange(n_seqs, dtype=np.int32), counts)
        pos = starts[seq_of] + np.arange(n_real, dtype=np.int32) - offsets[:-1][seq_of]

        tokens = np.zeros(t_pad, np.int32)
        tokens[:n_real] = out.token_ids
        positions = np.zeros(t_pad, np.int32)
        positions[:n_real] = pos
        slots = np.full(t_pad, self.dropped_slot, np.int32)
        slots[:n_real] = page_table[seq_of, pos // ps] * ps + pos % ps
        seq_lens = np.zeros(s_pad, np.int32)
        seq_lens[:n_seqs] = starts + counts
        query_start = np.full(s_pad + 1, n_real, np.int32)
        query_start[:n_seqs] = offsets[:-1]
        logits_idx = np.zeros(s_pad, np.int32)
        logits_idx[:n_seqs] = offsets[1:] - 1
        proposals = None
        k = out.num_speculative
        if k:
            # Rows j = 0..k of request i: its last known token's position, then each proposal's
            # (clamped to its last fed token where it proposed fewer; those rows go unused).
            num_props = np.fromiter((len(p) for p in out.proposals), np.int32, n_seqs)
            first = offsets[1:] - 1 - num_props
            rows = np.minimum(first[:, None] + np.arange(k + 1, dtype=np.int32)[None], (offsets[1:] - 1)[:, None])
            logits_idx = np.zeros((s_pad, k + 1), np.int32)
            logits_idx[:n_seqs] = rows
            logits_idx = logits_idx.reshape(-1)
            proposals = np.full((s_pad, k), -1, np.int32)
            for i, p in enumerate(out.proposals):
                proposals[i, :len(p)] = p
        md = BatchMetadata(slots, page_table, seq_lens, query_start, logits_idx,
                           decode_only=n_real == n_seqs and s_pad <= self.decode_max_seqs)

        def column(values, dtype, fill=0):
            col = np.full(s_pad, fill, dtype)
            col[:n_seqs] = values
            return col

        params = out.params
        terms = logit_terms(out, s_pad)
        sb = SamplingBatch(
            temperature=column([p.temperature for p in params], np.float32),
            top_k=column([p.top_k for p in params], np.int32),
            top_p=column([p.top_p for p in params], np.float32, 1.0),
            min_p=column([p.min_p for p in params], np.float32),
            seed=column([s & 0xFFFFFFFF for s in out.seeds], np.uint32),
            step=column(out.output_index, np.int32),
            presence_penalty=column([p.presence_penalty for p in params], np.float32),
            frequency_penalty=column([p.frequency_penalty for p in params], np.float32),
            repetition_penalty=column([p.repetition_penalty for p in params], np.float32, 1.0),
            terms=terms, proposals=proposals)
        flags = self.flags(all(p.temperature == 0 for p in params),
                           self.max_logprobs if any(p.logprobs is not None for p in params) else None,
                           bool(out.logit_terms))
        return StepInputs(tokens, positions, md, sb, flags)

    def placeholder(self, shape: tuple[int, int, int], decode_only: bool,
                    term_slots: int = TERM_SLOTS) -> StepInputs:
        """Inputs of the given ``(tokens, seqs, pages)`` shape that compute nothing: every slot is
        dropped (warm-up compiles a step for them without running it; followers of a multi-process
        run take the layout of the step they are sent from it)."""
        t, s, p = shape
        tokens = np.zeros(t, np.int32)
        md = BatchMetadata(np.full(t, self.dropped_slot, np.int32), np.zeros((s, p), np.int32), np.zeros(s, np.int32),
                           np.zeros(s + 1, np.int32), np.zeros(s, np.int32), decode_only=decode_only)
        return StepInputs(tokens, tokens, md, SamplingBatch.greedy(s, term_slots), {})


def logit_terms(out: SchedulerOutput, rows: int) -> LogitTerms:
    """The step's logit terms, one entry per (row, token) term (duplicates add up on device), padded
    to a power of two: each count of entries past 16 was its own step shape, a compile per request."""
    parts = []  # (row, tokens, counts, seen, bias, until) per group of entries
    for i, t in out.logit_terms.items():
        p = out.params[i]
        if len(t.generated):
            ids, c = np.unique(np.asarray(t.generated, np.int32), return_counts=True)
            parts.append((i, ids, c, float(p.repetition_penalty != 1.0), 0.0, 0))
        if len(t.prompt):
            parts.append((i, np.unique(np.asarray(t.prompt, np.int32)), 0, 1.0, 0.0, 0))
        if p.logit_bias:
            parts.append((i, np.fromiter(p.logit_bias, np.int32), 0, 0.0,
                          np.fromiter(p.logit_bias.values(), np.float32), _ALWAYS))
        if len(t.held):
            parts.append((i, np.asarray(t.held, np.int32), 0, 0.0, -np.inf, p.min_tokens))
    n = sum(len(ids) for _, ids, *_ in parts)
    k = max(TERM_SLOTS, 1 << (n - 1).bit_length())
    terms = LogitTerms.empty(rows, k)
    at = 0
    for row, ids, counts, seen, bias, until in parts:
        sl = slice(at, at + len(ids))
        terms.rows[sl], terms.tokens[sl], terms.counts[sl] = row, ids, counts
        terms.seen[sl], terms.bias[sl], terms.until[sl] = seen, bias, until
        at += len(ids)
    return terms
