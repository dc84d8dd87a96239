"""EAGLE-style drafter for speculative rollout: one target-architecture decoder layer on top of
the target's own hidden states, embedding and LM head (see model.py for the alignment and the
file formats, loss.py for the objective)."""

from tlt_jax.drafter.loss import (LossConfig, accept_lengths, chain_drafts, drafter_loss,
                                  loss_terms, prepare_pairs, smooth_l1)
from tlt_jax.drafter.model import (DrafterLoadError, check_drafter_params, drafter_cache,
                                   drafter_forward, drafter_param_shapes, eagle_state_dict,
                                   export_eagle, init_drafter, load_drafter, save_drafter)

__all__ = [
    "LossConfig", "accept_lengths", "chain_drafts", "drafter_loss", "loss_terms",
    "prepare_pairs", "smooth_l1", "DrafterLoadError", "check_drafter_params", "drafter_cache",
    "drafter_forward", "drafter_param_shapes", "eagle_state_dict", "export_eagle",
    "init_drafter", "load_drafter", "save_drafter",
]
