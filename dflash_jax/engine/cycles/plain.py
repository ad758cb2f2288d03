"""The plain cycle: no drafts, the target decodes one token. With no drafter (block size 1) it is
plain autoregressive decoding, the baseline; in a drafter's engine (draft_tokens 0) it is auto
speculation's plain cycle: recorded as acceptance 0 (it drafted nothing), and the drafter's
context still takes the committed position's taps, at once or, with `EngineSpec.lazy_context`,
kept in `DecodeState.taps` until one row has a block of them (a plain cycle then costs what plain
decoding costs, near enough)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dflash_jax.engine.cycles.base import CycleKind, Settings, flush_taps, verify


@dataclasses.dataclass(frozen=True)
class Plain(CycleKind):
    """No drafts verified."""

    @classmethod
    def of(cls, settings: Settings) -> "Plain | None":
        return cls() if settings.drafts == 0 else None

    @property
    def num_drafts(self) -> int:
        return 0

    def draft_verify(self, tparams, dparams, spec, state):
        target_tokens, verified = verify(tparams, spec, state, state.anchor[:, None])
        return state, target_tokens, jnp.zeros_like(state.anchor), verified

    def acceptance_length(self, spec, num_accepted):
        # a drafter's plain cycle has no acceptance length (`SlotLedger.result` counts it apart)
        return jnp.zeros_like(num_accepted) if spec.uses_drafter else num_accepted + 1

    def keep_taps(self, dparams, spec, state, verified, n_new, active):
        if not spec.uses_drafter:
            return state.context_cache, state.taps, state.num_taps
        if not spec.lazy_context:
            return super().keep_taps(dparams, spec, state, verified, n_new, active)
        # A plain cycle's one position waits in `taps`; all rows' go in once one row has a block of them.
        taps, num_taps = state.taps, state.num_taps
        put = jax.vmap(lambda buf, new, at: jax.lax.dynamic_update_slice_in_dim(buf, new, at, axis=0))
        taps = jnp.where(active[:, None, None], put(taps, verified.tap_features.astype(taps.dtype), num_taps), taps)
        num_taps = num_taps + n_new
        return jax.lax.cond((num_taps >= taps.shape[1]).any(), functools.partial(flush_taps, dparams, spec),
                            lambda *a: a, state.context_cache, taps, num_taps)
