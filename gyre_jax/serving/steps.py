"""The device programs of serving: prefill a prompt (fresh, or on top of a prefix; or several whole prompts at
once), insert it into a decode slot (or several), release a slot, and the one decode step of both KV layouts
(``decode_step``, or several in one program: ``decode_steps``), which reads and writes the slots' KV through a
layout (``DenseLayout`` here, ``paged_steps.PagedLayout``) and is otherwise one body. Pure functions over the
``kv_cache`` pytrees; ``dense.DenseSlots`` and ``paged.PagedEngine`` jit each once, with its donation and
shardings.

Parameters arrive as flat leaves plus a (static) treedef, merged with the model's ``graphdef`` inside the
program: flattening an ``nnx.State`` on every call would cost more host time than a tiny model's decode
step. The model is called only as ``model(tokens, positions, mask, cache) -> (logits, cache)`` (a prefill with
``head=False``: hidden states, unembedded only where a token is sampled), the mask from ``attention.cache_mask``
(dense or a ``MaskSpec``, per ``attention_impl``); a position outside the cache writes nothing, which is how
padding and slots that are not stepped stay untouched. Several whole prompts are prefilled packed side by side in
rows (``prefill_many``: each prompt from position 0, ``attention.segment_mask``, an ``attention.RowCache``), so
that short prompts do not each pay for a row of the longest one's bucket.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from gyre_jax.model.attention import BlockedCache, LayerCache, cache_mask, init_cache, init_row_cache, segment_mask
from gyre_jax.model.config import ModelConfig
from gyre_jax.serving import sampling
from gyre_jax.serving.kv_cache import DecodeState, Prefix, heads_first, widen


def _model(graphdef: nnx.GraphDef, leaves, treedef):
    """The model inside a jitted function, from parameters passed as flat leaves (cheap to dispatch) and their
    ``PyTreeDef``."""
    return nnx.merge(graphdef, treedef.unflatten(leaves))


def forward_and_sample(params, cache, positions, tokens, true_length, temperature, top_k, top_p, key, with_experts):
    """params: (graphdef, leaves, treedef); tokens, positions: [1, Tb] (padding rows at an out-of-cache
    position, so their writes drop). Returns the cache, the token sampled from position true_length - 1 with
    its log-prob, the advanced key, and (``with_experts``, static) the chunk's expert ids [Tb, L_moe, K] int16
    or None. Only that position's logits are computed (the unembedding of one hidden state, not Tb)."""
    model = _model(*params)
    mask = cache_mask(model.cfg, positions, cache[0].k.shape[1])  # dense [1, Tb, S] or a MaskSpec
    hidden, cache, experts = _step_model(model, tokens, positions, mask, cache, with_experts, head=False)
    last = last_logits(model, hidden, true_length)
    token, logprob, key = sampling.advance(last, key[None], temperature[None], top_k[None], top_p[None])
    return cache, token[0], logprob[0], key[0], experts


def last_logits(model, hidden: jax.Array, true_length: jax.Array) -> jax.Array:
    """A one-row prefill's hidden states [1, Tb, E] -> the logits [1, V] of position ``true_length - 1`` only (a
    prefill samples one token: unembedding the other Tb - 1 would cost Tb x the vocabulary's matmul for nothing)."""
    last = jax.lax.dynamic_index_in_dim(hidden[0], true_length - 1, axis=0, keepdims=True)  # [1, E]
    return model.head(last[None])[0]


def prefill(
    graphdef: nnx.GraphDef,
    cfg: ModelConfig,
    leaves,
    treedef,
    tokens,
    true_length,
    temperature,
    top_k,
    top_p,
    key,
    with_experts: bool = False,
) -> Prefix:
    """tokens: [1, Tb] padded; true_length: [] int32. Returns a Prefix whose cache is [1, Tb, K, D] (with
    ``with_experts``, static: and the tokens' expert ids, ``Prefix.experts``)."""
    tb = tokens.shape[1]
    idx = jnp.arange(tb, dtype=jnp.int32)
    positions = jnp.where(idx < true_length, idx, tb)[None, :]  # padding writes are dropped
    params = (graphdef, leaves, treedef)
    cache, token, logprob, key, experts = forward_and_sample(
        params, init_cache(cfg, 1, tb), positions, tokens, true_length, temperature, top_k, top_p, key, with_experts
    )
    return Prefix(cache=cache, length=true_length, token=token, logprob=logprob, key=key, experts=experts)


def prefill_extend(
    graphdef: nnx.GraphDef,
    max_seq_len: int,
    leaves,
    treedef,
    existing: Prefix,
    tokens,
    true_length,
    temperature,
    top_k,
    top_p,
    key,
    with_experts: bool = False,
) -> Prefix:
    """Prefills tokens [1, Tb] (true_length real) at positions existing.length ...; cache grows to [1, S]
    (``with_experts``: as ``prefill``)."""
    cache = [LayerCache(k=widen(c.k, max_seq_len), v=widen(c.v, max_seq_len)) for c in existing.cache]
    idx = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    positions = jnp.where(idx < true_length, existing.length + idx, max_seq_len)[None, :]
    params = (graphdef, leaves, treedef)
    cache, token, logprob, key, experts = forward_and_sample(
        params, cache, positions, tokens, true_length, temperature, top_k, top_p, key, with_experts
    )
    length = existing.length + true_length
    return Prefix(cache=cache, length=length, token=token, logprob=logprob, key=key, experts=experts)


def prefill_many(
    graphdef: nnx.GraphDef,
    cfg: ModelConfig,
    leaves,
    treedef,
    tokens,
    positions,
    segments,
    rows,
    offsets,
    true_lengths,
    temperature,
    top_k,
    top_p,
    keys,
    with_experts: bool = False,
) -> Prefix:
    """Several whole prompts packed in rows, one forward: tokens, positions, segments [R, L] (the prompts of a row
    side by side, each at positions 0.., segment ids distinct and non-zero per prompt, 0 = padding: a token attends
    to its own prompt only); rows, offsets, true_lengths [P] int32 (prompt i: tokens [offsets[i], offsets[i] +
    true_lengths[i]) of row rows[i]; length 0: a padding prompt, nothing kept); sampling [P] each, keys [P, 2].
    Returns a Prefix whose every field has a leading [P] axis (cache [P, L, K, D], zeros past each prompt; expert
    ids [P, L, L_moe, K], -1 past it); entry i equals ``prefill`` of prompt i alone, to float rounding (the same
    math over other operand shapes)."""
    r, width = tokens.shape
    model = _model(graphdef, leaves, treedef)
    mask = segment_mask(model.cfg, segments)
    hidden, cache, experts = _step_model(
        model, tokens, positions, mask, init_row_cache(cfg, r, width), with_experts, head=False
    )  # hidden: [R, L, E]
    last = hidden[rows, offsets + jnp.maximum(true_lengths - 1, 0)]  # [P, E]
    token, logprob, keys = sampling.advance(model.head(last[:, None])[:, 0], keys, temperature, top_k, top_p)
    take = functools.partial(_take_prompts, rows=rows, offsets=offsets, lengths=true_lengths)
    cache = [LayerCache(k=take(c.k, fill=0), v=take(c.v, fill=0)) for c in cache]
    if experts is not None:
        experts = take(experts.reshape(r, width, *experts.shape[1:]), fill=-1)
    return Prefix(cache=cache, length=true_lengths, token=token, logprob=logprob, key=keys, experts=experts)


def _take_prompts(x, *, rows, offsets, lengths, fill):
    """x: [R, L, ...] packed rows -> [P, L, ...]: prompt i's ``lengths[i]`` entries from ``offsets[i]`` of row
    ``rows[i]`` at the front, ``fill`` after them."""
    width = x.shape[1]
    idx = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, L]
    keep = idx < lengths[:, None]  # [P, L]
    out = x[rows[:, None], jnp.where(keep, offsets[:, None] + idx, 0)]  # [P, L, ...]
    return jnp.where(keep.reshape(*keep.shape, *(1,) * (x.ndim - 2)), out, jnp.asarray(fill, x.dtype))


def _put_blocks(cache, src, write):
    """Writes src [B, C, K, D] (a prefix's cache, sequence-major) over positions [0, C) of a ``BlockedCache``'s
    blocks [slots, K, n, D], each block's part by ``write(block, part [B, K, m, D])``."""
    out, first = [], 0
    for block in cache:
        n, m = block.shape[2], min(block.shape[2], src.shape[1] - first)
        out.append(block if m <= 0 else write(block, heads_first(src[:, first : first + m]).astype(block.dtype)))
        first += n
    return tuple(out)


def insert_many(prefixes: Prefix, state: DecodeState, slots, temperature, top_k, top_p) -> DecodeState:
    """Writes each row of ``prefix_many``'s result (cache [B, C, K, D]) over positions [0, C) of slot slots[i] and
    activates those slots; a row whose slot is out of range (a padding row) writes nothing."""

    def put(blocks, src):  # blocks: [slots, K, n, D] each; src: [B, C, K, D]
        return _put_blocks(blocks, src, lambda b, part: b.at[slots, :, : part.shape[2]].set(part, mode="drop"))

    def field(dst, src):
        return dst.at[slots].set(src.astype(dst.dtype), mode="drop")

    cache = [BlockedCache(k=put(s.k, p.k), v=put(s.v, p.v)) for s, p in zip(state.cache, prefixes.cache)]
    return DecodeState(
        cache=cache,
        tokens=field(state.tokens, prefixes.token),
        lengths=field(state.lengths, prefixes.length),
        active=field(state.active, jnp.ones_like(slots, dtype=bool)),
        temperature=field(state.temperature, temperature),
        top_k=field(state.top_k, top_k),
        top_p=field(state.top_p, top_p),
        keys=field(state.keys, prefixes.key),
    )


def insert(prefix: Prefix, state: DecodeState, slot, temperature, top_k, top_p) -> DecodeState:
    """Writes the prefix's cache [1, C, K, D] over positions [0, C) of slot ``slot`` and activates the slot."""

    def put(blocks, src):  # blocks: [slots, K, n, D] each; src: [1, C, K, D]
        return _put_blocks(blocks, src, lambda b, part: jax.lax.dynamic_update_slice(b, part, (slot, 0, 0, 0)))

    cache = [BlockedCache(k=put(s.k, p.k), v=put(s.v, p.v)) for s, p in zip(state.cache, prefix.cache)]
    return DecodeState(
        cache=cache,
        tokens=state.tokens.at[slot].set(prefix.token),
        lengths=state.lengths.at[slot].set(prefix.length),
        active=state.active.at[slot].set(True),
        temperature=state.temperature.at[slot].set(temperature),
        top_k=state.top_k.at[slot].set(top_k),
        top_p=state.top_p.at[slot].set(top_p),
        keys=state.keys.at[slot].set(prefix.key),
    )


def release(state: DecodeState, slot) -> DecodeState:
    return dataclasses.replace(state, active=state.active.at[slot].set(False))


def _step_model(model, tokens, positions, mask, cache, with_experts: bool, head: bool = True):
    """The forward of tokens [B, T]: (logits [B, T, V] or, ``head=False``, the final-normed hidden states
    [B, T, E]; cache; expert ids [B*T, L_moe, K] int16 or None). With ``with_experts`` (static) the ids are those
    each MoE layer selected for each input token (routing replay: ``rl.routing_replay``, docs/learner.md)."""
    if not with_experts:
        out, cache = model(tokens, positions, mask, cache, head=head)
        return out, cache, None
    out, cache, aux = model(tokens, positions, mask, cache, return_aux=True, head=head)
    return out, cache, jnp.transpose(aux.expert_ids, (1, 0, 2)).astype(jnp.int16)


class DenseLayout:
    """The dense KV layout of the decode step (``decode_step``): every slot's cache is the ``DecodeState``'s
    ``BlockedCache``, which the model reads over a window and writes in place; ``window`` is in tokens."""

    @staticmethod
    def read(state: DecodeState, num_slots: int, window: int):
        """(the cache the model runs on, the positions it attends over, a position whose write is dropped)."""
        return state.cache, window, state.cache[0].length

    @staticmethod
    def write(state: DecodeState, cache, positions, num_slots: int) -> DecodeState:
        return dataclasses.replace(state, cache=cache)


def decode_step(
    layout,
    graphdef: nnx.GraphDef,
    leaves,
    treedef,
    state,
    window: int,
    num_slots: int,
    with_experts: bool = False,
):
    """One decode step for slots [0, num_slots) over ``window`` (both static; the window in the ``layout``'s unit)
    of a state of either KV layout (``DecodeState`` with ``DenseLayout``, ``paged_steps.PagedState`` with
    ``paged_steps.PagedLayout``: the layout says where the model reads and writes the slots' KV, the rest is this
    body): each stepped slot whose next position is inside the window feeds its pending token and samples the next;
    attention reads [num_slots, window] keys; the other slots are left as they are. Returns the new state, ints
    [3, slots] (tokens, valid, lengths) and log-probs [slots] (two arrays: two host copies); with ``with_experts``
    (static, MoE models) a fourth output, expert ids [slots, L_moe, K] int16: the experts each MoE layer selected
    for each stepped slot's input token (its pending token: the one sampled by the step before), -1 for slots not
    stepped."""
    model = _model(graphdef, leaves, treedef)
    slots, k = state.tokens.shape[0], num_slots
    cache, span, past = layout.read(state, k, window)
    lengths = state.lengths[:k]
    ok = state.active[:k] & (lengths < span)  # stepped slots whose next position is inside the window
    positions = jnp.where(ok, lengths, past)[:, None]  # [k, 1]; the others write nothing
    mask = cache_mask(model.cfg, positions, span)  # the step attends over [:k] x [0, span) of the cache
    logits, cache, experts = _step_model(model, state.tokens[:k, None], positions, mask, cache, with_experts)
    tokens, logprobs, keys = sampling.advance(
        logits[:, 0], state.keys[:k], state.temperature[:k], state.top_k[:k], state.top_p[:k]
    )
    tokens = jnp.where(ok, tokens, state.tokens[:k])  # a slot that sampled nothing keeps its pending token and key
    keys = jnp.where(ok[:, None], keys, state.keys[:k])
    lengths = jnp.where(ok, lengths + 1, lengths)

    def head(full, part):  # writes part: [k, ...] over full: [slots, ...]
        return jax.lax.dynamic_update_slice(full, part, (0,) * full.ndim)

    state = dataclasses.replace(
        layout.write(state, cache, positions, k),
        tokens=head(state.tokens, tokens),
        lengths=head(state.lengths, lengths),
        keys=head(state.keys, keys),
    )
    pad = slots - k
    ints = jnp.stack([state.tokens, jnp.pad(ok, (0, pad)).astype(jnp.int32), state.lengths])
    if experts is None:
        return state, ints, jnp.pad(logprobs, (0, pad))
    experts = jnp.pad(jnp.where(ok[:, None, None], experts, -1), ((0, pad), (0, 0), (0, 0)), constant_values=-1)
    return state, ints, jnp.pad(logprobs, (0, pad)), experts


def decode_steps(
    layout,
    graphdef: nnx.GraphDef,
    leaves,
    treedef,
    state,
    window: int,
    num_slots: int,
    num_steps: int,
    count: jax.Array,
    with_experts: bool = False,
):
    """Up to ``num_steps`` (static) ``decode_step``s in one program: the first ``count`` (int32 scalar, traced:
    1..num_steps, one compile for every count) run, in a ``lax.fori_loop``, giving the same tokens, log-probs, keys
    and cache as that many ``decode_step`` calls, for one dispatch. Every step attends over ``window``: a slot whose
    cache fills it stops being stepped (``valid`` False from then on). Returns the state and ``decode_step``'s
    outputs stacked on a leading [num_steps] axis (ints [n, 3, slots], log-probs [n, slots], experts [n, slots,
    L_moe, K]); rows at and past ``count`` are zeros (``valid`` False)."""

    def step(st):
        return decode_step(layout, graphdef, leaves, treedef, st, window, num_slots, with_experts)

    return run_steps(step, state, num_steps, count)


def run_steps(step, state, num_steps: int, count: jax.Array):
    """``step``: state -> (state, *outputs). Runs it ``count`` (traced, <= num_steps) times; returns the final state
    and each output stacked on a leading [num_steps] axis, zeros past ``count``."""
    shapes = jax.eval_shape(step, state)[1:]
    outs = tuple(jnp.zeros((num_steps, *o.shape), o.dtype) for o in shapes)

    def body(i, carry):
        st, acc = carry
        st, *out = step(st)
        return st, tuple(jax.lax.dynamic_update_index_in_dim(a, o, i, axis=0) for a, o in zip(acc, out))

    state, outs = jax.lax.fori_loop(0, jnp.minimum(count, num_steps), body, (state, outs))
    return (state, *outs)
