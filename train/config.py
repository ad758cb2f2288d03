"""Training configuration: YAML file + `key.sub=value` overrides over these defaults, and the new
drafter its `drafter` section describes (`new_drafter_config`).

Unknown keys are errors (a typo must not silently train with a default).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from dflash_jax.errors import DFlashError

if TYPE_CHECKING:
    from dflash_jax.drafter import DrafterConfig

DEFAULTS: dict[str, Any] = {
    "target": None,  # HF or converted target directory (required)
    "target_dtype": None,  # default: the checkpoint's
    "data": {
        "conversations": None,  # conversations JSONL (required)
        "generate_from": None,  # prompts JSONL: regenerate responses with the target first
        "generate_max_new_tokens": 256,
        "generate_batch_size": 8,
        "seq_len": 3072,
        "eval_holdout": 8,  # conversations held out: their prompts measure real tau
        "enable_thinking": False,
    },
    "drafter": {
        "init": None,  # an existing drafter (HF or converted) to continue from
        "num_hidden_layers": 5,
        "block_size": 16,
        "target_layer_ids": None,  # default: the reference rule; beside init: fine-tune it on these taps
        "mask_token_id": None,  # default: the first id past the tokenizer, else vocab_size - 1
        "intermediate_size": None,  # default: the target's
        # A DFlash2 drafter (dflash_jax.dflash2): a mapping of DFlash2Config fields (DFLASH2_DEFAULTS fill
        # the rest; {} is all defaults), or null for a plain DFlash drafter. Beside a plain DFlash
        # drafter.init it upgrades that drafter (its weights kept, the convolutions at the identity, the
        # selector at its init); a DFlash2 init keeps its own and refuses a different one here.
        "dflash2": None,
    },
    "train": {
        "output_dir": None,  # required
        "mesh": None,  # e.g. "data=4,model=2"; default: every device on `data`
        # true: the target's weights and the drafter's parameters are split over `data` as well
        # (gathered where used), for chips the model-split weights alone would fill. The Adam
        # moments are always split over `data`.
        "fsdp": False,
        "seed": 0,
        "global_batch": 8,
        "epochs": 6,
        "steps": None,  # default: epochs * conversations / global_batch
        "lr": 6e-4,
        "warmup_ratio": 0.04,
        "weight_decay": 0.01,
        "clip": 1.0,
        "num_anchors": 512,
        "gamma": None,  # default: 7 (B=16), 5 (B=10), 4 (B=8)
        # loss = ce_loss_weight x the vocabulary cross-entropy + selector_loss_weight x a DFlash2
        # drafter's selector cross-entropy (a plain DFlash drafter has none)
        "ce_loss_weight": 1.0,
        "selector_loss_weight": 1.0,
        "anchor_hardness": 0.0,  # > 0: favour anchors after tokens the target found hard
        "anchor_miss": 0.0,  # > 0: favour anchors where the drafter misses its first slot
        "compute_dtype": "bfloat16",
        # What each drafter layer's backward recomputes: "attention" (its scores; the projections'
        # outputs are kept), "layer" (everything but its input), "none" (nothing).
        "remat": "attention",
        "ce_chunk": 2048,
        "log_every": 10,
        "save_every": 200,
        "keep": 3,
        "eval_every": 500,
        "eval_max_new_tokens": 128,
        "eval_batch_size": 8,
        # What the final eval tau of this config, as written, should be (measured), and why; the
        # end-of-run verdict compares the run with it (train/verdict.py). None: no expectation.
        "expect_tau": None,
        "expect_note": None,
    },
}


# drafter.dflash2's keys and their defaults (dflash_jax.dflash2.DFlash2Config).
DFLASH2_DEFAULTS: dict[str, Any] = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,  # null: no soft cap
    "input_embedding_scale": 1.0,
}
# Merged key by key (an override of one key keeps the file's others), not a section of fixed keys:
# the section itself may be null.
_MAPPINGS = ("drafter.dflash2",)


class TrainConfigError(DFlashError):
    pass


_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)$")


def _coerce(value):
    """YAML 1.1 reads `6e-4` as a string; take it as the number it is."""
    if isinstance(value, str) and _FLOAT.match(value):
        return float(value)
    return value


def _parse_value(text: str):
    return _coerce(yaml.safe_load(text))


def _merge(base: dict, update: dict, where: str):
    for key, value in update.items():
        if key not in base:
            raise TrainConfigError(f"unknown config key '{where}{key}'; known: {', '.join(sorted(base))}")
        if f"{where}{key}" in _MAPPINGS:
            base[key] = {**base[key], **value} if isinstance(base[key], dict) and isinstance(value, dict) else value
        elif isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise TrainConfigError(f"config key {where}{key} must be a mapping")
            _merge(base[key], value, f"{where}{key}.")
        else:
            base[key] = _coerce(value)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> dict:
    config = copy.deepcopy(DEFAULTS)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise TrainConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise TrainConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(loaded, dict):
            raise TrainConfigError(f"{path} must hold a mapping")
        _merge(config, loaded, "")
        # Relative paths in a config file are relative to the working directory.
    for item in overrides:
        if "=" not in item:
            raise TrainConfigError(f"override {item!r} is not key=value")
        key, text = item.split("=", 1)
        node, parts = {}, key.split(".")
        cur = node
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = _parse_value(text)
        _merge(config, node, "")
    for key in ("target", "data.conversations", "train.output_dir"):
        value = config
        for p in key.split("."):
            value = value[p]
        if value in (None, ""):
            raise TrainConfigError(f"config needs {key}")
    t = config["train"]
    if t["compute_dtype"] not in ("float32", "bfloat16"):
        raise TrainConfigError(f"train.compute_dtype must be float32 or bfloat16, got {t['compute_dtype']!r}")
    if not isinstance(t["fsdp"], bool):
        raise TrainConfigError(f"train.fsdp must be true or false, got {t['fsdp']!r}")
    if t["remat"] not in ("none", "attention", "layer"):
        raise TrainConfigError(f"train.remat must be none, attention or layer, got {t['remat']!r}")
    for key in ("global_batch", "epochs", "num_anchors", "log_every", "save_every", "keep", "ce_chunk", "eval_every"):
        if not isinstance(t[key], int) or t[key] < 1:
            raise TrainConfigError(f"train.{key} must be a positive integer, got {t[key]!r}")
    for key in ("anchor_hardness", "anchor_miss"):
        if not isinstance(t[key], (int, float)) or isinstance(t[key], bool) or t[key] < 0:
            raise TrainConfigError(f"train.{key} must be a number >= 0, got {t[key]!r}")
    if t["expect_tau"] is not None and (not isinstance(t["expect_tau"], (int, float))
                                        or isinstance(t["expect_tau"], bool) or t["expect_tau"] < 1):
        raise TrainConfigError(f"train.expect_tau must be a number >= 1 (tau 1.0 = no draft accepted) or null, "
                               f"got {t['expect_tau']!r}")
    if t["expect_note"] is not None and not isinstance(t["expect_note"], str):
        raise TrainConfigError(f"train.expect_note must be text or null, got {t['expect_note']!r}")
    for key in ("ce_loss_weight", "selector_loss_weight"):
        if not isinstance(t[key], (int, float)) or isinstance(t[key], bool) or t[key] < 0:
            raise TrainConfigError(f"train.{key} must be a number >= 0, got {t[key]!r}")
    if config["drafter"]["block_size"] < 2:
        raise TrainConfigError("drafter.block_size must be >= 2")
    check_dflash2(config["drafter"]["dflash2"])
    return config


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_dflash2(section) -> None:
    """drafter.dflash2: null, or a mapping of DFlash2Config fields with values of their kinds.
    Raises TrainConfigError naming the key."""
    if section is None:
        return
    if not isinstance(section, dict):
        raise TrainConfigError(f"drafter.dflash2 must be a mapping of {', '.join(DFLASH2_DEFAULTS)} (or null for a "
                               f"plain DFlash drafter), got {section!r}")
    for key, value in section.items():
        where = f"drafter.dflash2.{key}"
        if key not in DFLASH2_DEFAULTS:
            raise TrainConfigError(f"unknown config key '{where}'; known: {', '.join(sorted(DFLASH2_DEFAULTS))}")
        if key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TrainConfigError(f"{where} must be a positive integer, got {value!r}")
        elif key == "final_logit_softcapping":
            if value is not None and (not _number(value) or value <= 0):
                raise TrainConfigError(f"{where} must be a number > 0, or null for no soft cap, got {value!r}")
        elif not _number(value) or value <= 0:
            raise TrainConfigError(f"{where} must be a number > 0, got {value!r}")


def dflash2_config(section, hidden_size: int, vocab_size: int):
    """The DFlash2Config of a drafter.dflash2 section (None: a plain DFlash drafter) for a drafter of
    that width and vocabulary, the section's missing keys at their defaults."""
    from dflash_jax.dflash2 import DFlash2Config

    if section is None:
        return None
    check_dflash2(section)
    v = {**DFLASH2_DEFAULTS, **section}
    if hidden_size % v["conv_group_size"]:
        raise TrainConfigError(f"drafter.dflash2.conv_group_size {v['conv_group_size']} does not divide the hidden "
                               f"size {hidden_size}")
    if v["selector_top_k"] > vocab_size:
        raise TrainConfigError(f"drafter.dflash2.selector_top_k {v['selector_top_k']} exceeds the vocabulary "
                               f"({vocab_size})")
    cap = v["final_logit_softcapping"]
    return DFlash2Config(**{k: int(v[k]) for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                     "selector_top_k")},
                         output_multiplier=float(v["output_multiplier"]),
                         final_logit_softcapping=None if cap is None else float(cap),
                         input_embedding_scale=float(v["input_embedding_scale"]))


def with_dflash2(cfg: dict, dcfg: DrafterConfig) -> DrafterConfig:
    """The drafter `drafter.init` loaded (dcfg) as training takes it: a plain DFlash drafter with
    drafter.dflash2 set becomes DFlash2 (`dflash_jax.training.upgrade_to_dflash2` fills its new
    parameters); a DFlash2 drafter keeps its own config, and a drafter.dflash2 that sets any key to
    another value is refused."""
    import dataclasses

    section = cfg["drafter"]["dflash2"]
    if section is None:
        return dcfg
    wanted = dflash2_config(section, dcfg.model.hidden_size, dcfg.model.vocab_size)
    if dcfg.dflash2 is None:
        return dataclasses.replace(dcfg, dflash2=wanted)
    clash = [k for k in section if getattr(wanted, k) != getattr(dcfg.dflash2, k)]
    if clash:
        key = clash[0]
        raise TrainConfigError(f"drafter.dflash2.{key} {section[key]!r} conflicts with drafter.init's DFlash2 drafter "
                               f"({key} {getattr(dcfg.dflash2, key)!r}); a DFlash2 init keeps its own config: drop "
                               "drafter.dflash2 or set it to the init's")
    return dcfg


def new_drafter_config(cfg: dict, tcfg, tokenizer, compute_dtype: str) -> DrafterConfig:
    """The new drafter the config's `drafter` section describes for the target `tcfg`: dense layers
    of the target's widths, in `compute_dtype` (DFlash2 with `drafter.dflash2` set); its mask token the config's, else the tokenizer's,
    else the first id the tokenizer never produces (the last id without one)."""
    from dflash_jax.drafter import DrafterConfig, default_target_layer_ids, dense_drafter_model

    d = cfg["drafter"]
    n = d["num_hidden_layers"]
    mask = d["mask_token_id"]
    if mask is None and tokenizer is not None and tokenizer.mask_token_id is not None:
        mask = tokenizer.mask_token_id
    if mask is None:  # the first id the tokenizer never produces, else the last id
        first_free = len(tokenizer) if tokenizer is not None else tcfg.vocab_size - 1
        mask = first_free if first_free < tcfg.vocab_size else tcfg.vocab_size - 1
    taps = tuple(d["target_layer_ids"]) if d["target_layer_ids"] else default_target_layer_ids(tcfg.num_hidden_layers, n)
    model = dense_drafter_model(tcfg, n, d["intermediate_size"], compute_dtype)
    return DrafterConfig(model=model, block_size=d["block_size"], mask_token_id=int(mask),
                         target_layer_ids=taps, num_target_layers=tcfg.num_hidden_layers,
                         dflash2=dflash2_config(d["dflash2"], model.hidden_size, model.vocab_size))
