"""The serving engine: JetStream's contract (prefill -> insert into a slot -> generate for all slots).

The engine owns the jitted model calls and the decode state's layout on its mesh; it knows nothing
about requests, queues or HTTP (that is ``serving.loop``). Shapes are fixed at construction
(``max_concurrent_decodes`` slots of ``max_seq_len`` cached tokens; prefill padded to buckets), so
serving never recompiles after warm-up, including across weight updates of the same layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.model.attention import LayerCache, cache_causal_mask, init_cache
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import Rules, logical_sharding
from gyre_jax.serving import sampling
from gyre_jax.serving.types import ContextTooLongError, SamplingParams

CACHE_AXES = ("batch", None, "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefix:
    """A prefilled prompt: its KV cache [1, S, K, D] per layer, its length and the first sampled token."""

    cache: list[LayerCache]
    length: jax.Array  # [] int32: tokens in the cache
    token: jax.Array  # [] int32: first generated token (not yet in the cache)
    logprob: jax.Array  # [] f32
    key: jax.Array  # [2] uint32: the request's sampling key, advanced past the first token


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """All slots' state. cache: per layer [slots, S, K, D]; the rest [slots] (keys [slots, 2])."""

    cache: list[LayerCache]
    tokens: jax.Array  # last sampled token per slot, fed to the next generate step
    lengths: jax.Array  # tokens already in the slot's cache (= position of ``tokens``)
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array


@dataclasses.dataclass
class ResultTokens:
    """Host copy of one generate step: tokens, log-probs and lengths per slot, [slots] each."""

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray


class Engine:
    """Prefill / insert / generate over a slot-based KV cache on one mesh (a cell)."""

    def __init__(
        self,
        cfg: ModelConfig,
        graphdef: nnx.GraphDef,
        mesh: Mesh,
        rules: Rules,
        *,
        max_concurrent_decodes: int,
        max_seq_len: int,
        max_prefill_length: int,
        prefill_buckets: Sequence[int],
    ):
        self.cfg = cfg
        self.graphdef = graphdef
        self._mesh = mesh
        self.rules = rules
        self._slots = max_concurrent_decodes
        self.max_seq_len = max_seq_len
        self._max_prefill_length = max_prefill_length
        self.prefill_buckets = tuple(sorted(b for b in prefill_buckets if b < max_seq_len)) + (max_seq_len,)
        cache_shape = (self._slots, max_seq_len, cfg.num_kv_heads, cfg.head_dim)
        cache_sharding = logical_sharding(CACHE_AXES, rules, mesh, cache_shape)
        slot_sharding = logical_sharding(("batch",), rules, mesh, (self._slots,))
        key_sharding = logical_sharding(("batch", None), rules, mesh, (self._slots, 2))
        self.decode_state_shardings = DecodeState(
            cache=[LayerCache(k=cache_sharding, v=cache_sharding) for _ in range(cfg.num_layers)],
            tokens=slot_sharding, lengths=slot_sharding, temperature=slot_sharding, top_k=slot_sharding,
            top_p=slot_sharding, keys=key_sharding,
        )
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._prefill_jit = jax.jit(self._prefill_impl)
        self._insert_jit = jax.jit(self._insert_impl, donate_argnums=(1,), out_shardings=self.decode_state_shardings)
        self._generate_jit = jax.jit(self._generate_impl, donate_argnums=(1,),
                                     out_shardings=(self.decode_state_shardings, self._replicated))

    # -- JetStream's engine properties ------------------------------------------------------------
    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill_length

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    # -- state ------------------------------------------------------------------------------------
    def init_decode_state(self) -> DecodeState:
        def make():
            return DecodeState(
                cache=init_cache(self.cfg, self._slots, self.max_seq_len),
                tokens=jnp.zeros((self._slots,), jnp.int32),
                lengths=jnp.zeros((self._slots,), jnp.int32),
                temperature=jnp.ones((self._slots,), jnp.float32),
                top_k=jnp.zeros((self._slots,), jnp.int32),
                top_p=jnp.ones((self._slots,), jnp.float32),
                keys=jnp.zeros((self._slots, 2), jnp.uint32),
            )

        return jax.jit(make, out_shardings=self.decode_state_shardings)()

    def _bucket(self, n: int) -> int:
        for b in self.prefill_buckets:
            if b >= n:
                return b
        raise ContextTooLongError(f"prompt chunk of {n} tokens exceeds the largest prefill bucket {self.prefill_buckets[-1]}")

    # -- prefill ----------------------------------------------------------------------------------
    def _prefill_impl(self, params, tokens, true_length, temperature, top_k, top_p, key):
        """tokens: [1, Tb] padded; true_length: [] int32. Returns a Prefix whose cache is [1, Tb, K, D]."""
        model = nnx.merge(self.graphdef, params)
        tb = tokens.shape[1]
        cache = init_cache(self.cfg, 1, tb)
        idx = jnp.arange(tb, dtype=jnp.int32)
        positions = jnp.where(idx < true_length, idx, tb)[None, :]  # padding writes are dropped
        mask = cache_causal_mask(positions, tb)
        logits, cache = model(tokens, positions, mask, cache)
        last = jax.lax.dynamic_index_in_dim(logits[0], true_length - 1, axis=0, keepdims=True)  # [1, V]
        key, use = sampling.split_keys(key[None])
        token, logprob = sampling.sample(last, use, temperature[None], top_k[None], top_p[None])
        return Prefix(cache=cache, length=true_length, token=token[0], logprob=logprob[0], key=key[0])

    def prefill(self, *, params: nnx.State, tokens: Sequence[int], sampling_params: SamplingParams, key: jax.Array) -> Prefix:
        """Prefills a whole prompt (padded to a length bucket) and samples the first token.

        Prefilling on top of an existing prefix (session prefix cache, chunked prefill) is not
        supported yet; it comes with the serving-engine work.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("cannot prefill an empty prompt")
        if n > self._max_prefill_length:
            raise ContextTooLongError(f"prompt of {n} tokens exceeds max_prefill_length={self._max_prefill_length}")
        if n >= self.max_seq_len:
            raise ContextTooLongError(f"prompt of {n} tokens leaves no room to generate within max_seq_len={self.max_seq_len}")
        bucket = self._bucket(n)
        padded = np.zeros((1, bucket), np.int32)
        padded[0, :n] = tokens
        sp = sampling_params
        return self._prefill_jit(params, jnp.asarray(padded), jnp.int32(n), jnp.float32(sp.temperature),
                                 jnp.int32(sp.top_k), jnp.float32(sp.top_p), key)

    # -- insert -----------------------------------------------------------------------------------
    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot, temperature, top_k, top_p) -> DecodeState:
        def put(dst, src):  # dst: [slots, S, K, D]; src: [1, Tb, K, D] written at [slot, 0:Tb]
            return jax.lax.dynamic_update_slice(dst, src.astype(dst.dtype), (slot, 0, 0, 0))

        cache = [LayerCache(k=put(s.k, p.k), v=put(s.v, p.v)) for s, p in zip(state.cache, prefix.cache)]
        return DecodeState(
            cache=cache,
            tokens=state.tokens.at[slot].set(prefix.token),
            lengths=state.lengths.at[slot].set(prefix.length),
            temperature=state.temperature.at[slot].set(temperature),
            top_k=state.top_k.at[slot].set(top_k),
            top_p=state.top_p.at[slot].set(top_p),
            keys=state.keys.at[slot].set(prefix.key),
        )

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, sampling_params: SamplingParams) -> DecodeState:
        """Places a prefilled prompt into decode slot ``slot`` (donates ``decode_state``)."""
        sp = sampling_params
        return self._insert_jit(prefix, decode_state, jnp.int32(slot), jnp.float32(sp.temperature),
                                jnp.int32(sp.top_k), jnp.float32(sp.top_p))

    # -- generate ---------------------------------------------------------------------------------
    def _generate_impl(self, params, state: DecodeState):
        model = nnx.merge(self.graphdef, params)
        positions = state.lengths[:, None]  # [slots, 1]
        mask = cache_causal_mask(positions, self.max_seq_len)
        logits, cache = model(state.tokens[:, None], positions, mask, state.cache)
        keys, use = sampling.split_keys(state.keys)
        tokens, logprobs = sampling.sample(logits[:, 0], use, state.temperature, state.top_k, state.top_p)
        lengths = jnp.minimum(state.lengths + 1, self.max_seq_len)
        new_state = DecodeState(cache=cache, tokens=tokens, lengths=lengths, temperature=state.temperature,
                                top_k=state.top_k, top_p=state.top_p, keys=keys)
        return new_state, (tokens, logprobs, lengths)

    def generate(self, params: nnx.State, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot: feeds each slot's last token, samples the next (donates the state)."""
        state, (tokens, logprobs, lengths) = self._generate_jit(params, decode_state)
        tokens, logprobs, lengths = jax.device_get((tokens, logprobs, lengths))
        return state, ResultTokens(tokens=np.asarray(tokens), logprobs=np.asarray(logprobs), lengths=np.asarray(lengths))

    def param_shardings(self, abstract_state):
        from gyre_jax.model.sharding import param_shardings

        return param_shardings(abstract_state, self.rules, self._mesh)
